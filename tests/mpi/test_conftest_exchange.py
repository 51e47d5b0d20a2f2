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
from jobs import MPIEXEC, job_environment, mpiexec

HERE = Path(__file__).resolve().parent

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
    env = job_environment(drop=("OSMM_TEST_LOG_DIR",))  # its logs go under its own folder
    args = [*mpiexec(2), sys.executable, str(HERE / "run.py"), "cases", "-q"]
    args += ["-p", "no:cacheprovider", "--timeout=20", "--timeout-method=thread"]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


def _reports(path: Path) -> dict[tuple[str, str], dict]:
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {(line["test"], line["when"]): line for line in lines}


@pytest.fixture(scope="module")
def job_folder(tmp_path_factory) -> Path:
    """Where the job runs: its tests, its ranks' reports and logs."""
    return tmp_path_factory.mktemp("exchange")


@pytest.fixture(scope="module")
def job(job_folder):
    result = _run_job(job_folder)
    reports = [_reports(job_folder / f"reports-{rank}.jsonl") for rank in (0, 1)]
    return result, reports


def _outcomes(reports: dict[tuple[str, str], dict], test: str) -> dict[str, str]:
    """The outcome a rank logged for each phase of ``test`` that it ran."""
    return {when: report["outcome"] for (name, when), report in reports.items() if name == test}


def test_every_rank_logs_the_same_phases_with_the_same_outcomes(job):
    result, (rank0, rank1) = job
    assert rank0.keys() == rank1.keys(), result.stdout + result.stderr
    assert {k: r["outcome"] for k, r in rank0.items()} == {
        k: r["outcome"] for k, r in rank1.items()
    }


@pytest.mark.parametrize(
    "test, outcomes, when, says",
    [
        pytest.param(
            "test_setup_fails",
            {"setup": "failed", "teardown": "passed"},  # no rank runs the test
            "setup",
            ["failed on rank(s) [1] of 2", "setup broke on rank 1"],
            id="a-setup-failure-is-an-error-at-setup",
        ),
        pytest.param(
            "test_teardown_fails",
            {"setup": "passed", "call": "passed", "teardown": "failed"},
            "teardown",
            ["failed on rank(s) [0] of 2", "teardown broke on rank 0"],
            id="a-teardown-failure-is-an-error-at-teardown",
        ),
        pytest.param(
            "test_skipped",
            {"setup": "skipped", "teardown": "passed"},  # no rank runs the test
            "setup",
            ["skipped on rank(s) [1] of 2", "nothing to do on rank 1"],
            id="a-skip-skips-the-test",
        ),
        pytest.param(
            "test_call_fails",
            {"setup": "passed", "call": "failed", "teardown": "passed"},
            "call",
            ["call broke on rank 1"],
            id="a-failure-in-the-call-fails-the-test",
        ),
    ],
)
def test_what_goes_wrong_on_one_rank_goes_wrong_on_every_rank(job, test, outcomes, when, says):
    """``test`` goes wrong on one rank: every rank logs ``outcomes`` for its phases (a phase
    left out: no rank ran it), and every rank's report of phase ``when`` says each of ``says``
    (which ranks, and what went wrong there)."""
    _, reports = job
    for rank in reports:
        assert _outcomes(rank, test) == outcomes
        message = rank[test, when]["longrepr"]
        assert all(text in message for text in says), message


def test_the_tests_that_follow_run_in_step_and_pass_and_the_job_fails(job):
    result, reports = job
    passed = {"setup": "passed", "call": "passed", "teardown": "passed"}
    for rank in reports:
        for name in ("after_setup_failure", "after_teardown_failure", "after_skip", "last"):
            assert _outcomes(rank, f"test_{name}") == passed, (name, rank)
    assert result.returncode != 0
    summary = result.stdout.strip().splitlines()[-1]
    for count in ("1 failed", "5 passed", "1 skipped", "2 errors"):
        assert count in summary, result.stdout


def test_rank_1_writes_its_report_to_its_log_and_rank_0_prints_its_own(job, job_folder):
    """tests/mpi/run.py: rank 0 prints pytest's report; rank 1's goes to
    build/mpi-logs/rank1.log in the job's folder (where a rank that dies alone leaves its last
    words), and no log stands for rank 0."""
    result, _ = job
    logs = job_folder / "build" / "mpi-logs"
    assert "==== MPI tests on 2 rank(s) ====" in result.stdout
    assert not (logs / "rank0.log").exists()
    summary = (logs / "rank1.log").read_text().strip().splitlines()[-1]
    for count in ("1 failed", "5 passed"):
        assert count in summary, summary
