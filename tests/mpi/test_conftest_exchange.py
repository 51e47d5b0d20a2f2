"""The per-test outcome exchange of conftest.py keeps the ranks in step when a fixture fails.

A job of 2 ranks runs, under a copy of conftest.py, tests whose fixtures fail at setup on rank
1 only, fail at teardown on rank 0 only, or skip on rank 1 only, and a test that fails on rank 1
only; after each comes a test that checks, with a collective on COMM_WORLD, that both ranks are
running the same test. Every rank records the reports it logs, so the checks below see each
rank's outcomes, not only rank 0's printed report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import job_environment

HERE = Path(__file__).resolve().parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = [
    pytest.mark.ranks(1, reason="it starts a job of 2 ranks of its own"),
    pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec"),
]

CASES = textwrap.dedent('''
    import pytest
    from mpi4py import MPI

    RANK = MPI.COMM_WORLD.Get_rank()


    def assert_in_step(request):
        """Both ranks are in this test: a rank a test ahead or behind would fail this (or hang)."""
        names = MPI.COMM_WORLD.allgather(request.node.name)
        assert names == [request.node.name] * len(names), names


    @pytest.fixture
    def breaks_at_setup_on_rank_1():
        if RANK == 1:
            raise RuntimeError("setup broke on rank 1")


    @pytest.fixture
    def breaks_at_teardown_on_rank_0():
        yield
        if RANK == 0:
            raise RuntimeError("teardown broke on rank 0")


    @pytest.fixture
    def skips_on_rank_1():
        if RANK == 1:
            pytest.skip("nothing to do on rank 1")


    def test_setup_fails(breaks_at_setup_on_rank_1):
        pass


    def test_after_setup_failure(request):
        assert_in_step(request)


    def test_teardown_fails(breaks_at_teardown_on_rank_0):
        pass


    def test_after_teardown_failure(request):
        assert_in_step(request)


    def test_skipped(skips_on_rank_1):
        pass


    def test_after_skip(request):
        assert_in_step(request)


    def test_call_fails():
        assert RANK != 1, "call broke on rank 1"


    def test_last(request):
        assert_in_step(request)
''')

RECORDER = textwrap.dedent("""
    import json
    import os

    from mpi4py import MPI

    RANK = MPI.COMM_WORLD.Get_rank()


    def pytest_runtest_logreport(report):
        line = {
            "test": report.nodeid.split("::")[-1],
            "when": report.when,
            "outcome": report.outcome,
            "longrepr": str(report.longrepr),
        }
        path = os.path.join(os.path.dirname(__file__), "..", f"reports-{RANK}.jsonl")
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\\n")
""")


def _run_job(tmp_path: Path) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "conftest.py").write_text(RECORDER)
    (cases / "test_cases.py").write_text(CASES)
    env = job_environment()
    args = [str(MPIEXEC), "-n", "2", sys.executable, str(HERE / "run.py"), "cases", "-q"]
    args += ["-p", "no:cacheprovider", "--timeout=20", "--timeout-method=thread"]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


def _reports(path: Path) -> dict[tuple[str, str], dict]:
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {(line["test"], line["when"]): line for line in lines}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("exchange")
    result = _run_job(tmp_path)
    reports = [_reports(tmp_path / f"reports-{rank}.jsonl") for rank in (0, 1)]
    return result, reports


def test_every_rank_logs_the_same_phases_with_the_same_outcomes(job):
    result, (rank0, rank1) = job
    assert rank0.keys() == rank1.keys(), result.stdout + result.stderr
    assert {k: r["outcome"] for k, r in rank0.items()} == {
        k: r["outcome"] for k, r in rank1.items()
    }


def test_a_setup_failure_on_one_rank_is_an_error_at_setup_on_every_rank(job):
    _, reports = job
    for rank in reports:
        assert rank["test_setup_fails", "setup"]["outcome"] == "failed"
        assert ("test_setup_fails", "call") not in rank  # no rank runs the test
        assert rank["test_setup_fails", "teardown"]["outcome"] == "passed"
        message = rank["test_setup_fails", "setup"]["longrepr"]
        assert "failed on rank(s) [1] of 2" in message and "setup broke on rank 1" in message


def test_a_teardown_failure_on_one_rank_is_an_error_at_teardown_on_every_rank(job):
    _, reports = job
    for rank in reports:
        assert rank["test_teardown_fails", "call"]["outcome"] == "passed"
        assert rank["test_teardown_fails", "teardown"]["outcome"] == "failed"
        message = rank["test_teardown_fails", "teardown"]["longrepr"]
        assert "failed on rank(s) [0] of 2" in message and "teardown broke on rank 0" in message


def test_a_skip_on_one_rank_skips_the_test_on_every_rank(job):
    _, reports = job
    for rank in reports:
        assert rank["test_skipped", "setup"]["outcome"] == "skipped"
        assert ("test_skipped", "call") not in rank
        message = rank["test_skipped", "setup"]["longrepr"]
        assert "skipped on rank(s) [1] of 2" in message and "nothing to do on rank 1" in message


def test_a_failure_in_the_call_on_one_rank_fails_on_every_rank(job):
    _, reports = job
    for rank in reports:
        assert rank["test_call_fails", "call"]["outcome"] == "failed"
        assert "call broke on rank 1" in rank["test_call_fails", "call"]["longrepr"]


def test_the_tests_that_follow_run_in_step_and_pass_and_the_job_fails(job):
    result, reports = job
    for rank in reports:
        for name in ("after_setup_failure", "after_teardown_failure", "after_skip", "last"):
            name = f"test_{name}"
            for when in ("setup", "call", "teardown"):
                assert rank[name, when]["outcome"] == "passed", (name, when, rank[name, when])
    assert result.returncode != 0
    summary = result.stdout.strip().splitlines()[-1]
    for count in ("1 failed", "5 passed", "1 skipped", "2 errors"):
        assert count in summary, result.stdout
