"""MPI tests: every rank of a job runs them together.

Run them on N ranks with ``tests/mpi/run.py``, which prints rank 0's report and logs the others' (``make test``
runs N = 1, 2, 3, 4, then the heterogeneity tests on 3 ranks bound to cores 0, 0, 1)::

    mpiexec -n N .venv/bin/python tests/mpi/run.py tests/mpi -q [pytest arguments]

Without ``mpiexec`` they run in-process on one rank, alone (``.venv/bin/python -m pytest
tests/mpi``) or as part of a bare ``pytest`` from the repository root.

A test that needs particular job sizes says so with the ``ranks`` marker; on other sizes it is
skipped, with a reason that names the sizes::

    @pytest.mark.ranks(3)                  # exactly 3 ranks
    @pytest.mark.ranks(2, 4)               # 2 or 4 ranks
    @pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")

Every rank runs the same tests in the same order: the skips depend on the job size alone, and
after collection the ranks compare their lists of tests and stop with a usage error if they
differ (e.g. after ``--lf``, whose cache only rank 0 keeps).

After each phase of each test (setup, call, teardown) the ranks exchange their outcomes, so a
test that fails, or whose fixture fails at setup or at teardown, on one rank fails (or errors)
on all of them, and the report names the failing ranks and their errors; a test skipped on some
ranks only (``pytest.skip`` in a fixture) is skipped on all, naming those ranks. The merged
outcome of setup decides on every rank alike whether the test itself runs, so all ranks make
the same exchanges in the same order whatever failed where: a fixture error on one rank cannot
leave the ranks a test apart. A rank stuck in a collective is caught by pytest-timeout and by
the timeout around mpiexec, so a run always ends (tests/mpi/test_conftest_exchange.py).
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))  # helper modules shared by the tests (product_cases)

_OUTCOMES = MPI.COMM_WORLD.Dup()
_SIZE = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="session")
def world():
    """(rank, size) of COMM_WORLD."""
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _ranks_skip_reason(mark, size: int) -> str | None:
    """Why a test marked ``mark`` (``ranks(*sizes, min=None, reason=None)``) cannot run on a
    job of ``size`` ranks, or None if it can."""
    sizes, minimum = mark.args, mark.kwargs.get("min")
    counts = sizes if minimum is None else (*sizes, minimum)
    valid = all(type(n) is int and n >= 1 for n in counts) and set(mark.kwargs) <= {"min", "reason"}
    if not valid or bool(sizes) == (minimum is not None):
        raise pytest.UsageError(
            f"bad marker {mark}: write ranks(n, ...) or ranks(min=n) with positive integer "
            "counts, and optionally reason=..."
        )
    if sizes:
        if size in sizes:
            return None
        needs = " or ".join(map(str, sizes))
        needs = f"needs {needs} rank{'s' if sizes != (1,) else ''}"
    else:
        if size >= minimum:
            return None
        needs = f"needs at least {minimum} ranks"
    why = mark.kwargs.get("reason")
    return f"{needs}, this job has {size}" + (f" ({why})" if why else "")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in item.iter_markers("ranks"):
            reason = _ranks_skip_reason(mark, _SIZE)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def pytest_collection_finish(session):
    """Stop, on every rank, unless all ranks are about to run the same tests in the same order."""
    if _SIZE == 1:
        return
    mine = [item.nodeid for item in session.items]
    everyone = _OUTCOMES.allgather(mine)
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        counts = ", ".join(f"rank {r}: {len(everyone[r])}" for r in [0, *differ])
        raise pytest.UsageError(
            f"ranks {differ} would run other tests than rank 0 ({counts} tests); every rank "
            "must run the same tests in the same order (same arguments, no --lf/--ff/--sw)"
        )


def _merge_outcomes(report, everyone: list[tuple[str, object]]) -> None:
    """Make ``report`` (this rank's report of one phase of one test) tell what happened on every
    rank, given each rank's ``(outcome, detail)`` for that phase: failed if any rank failed
    (naming those ranks and their errors), else skipped if any rank skipped (naming them and the
    first one's reason), else as it is (passed everywhere, or skipped everywhere)."""
    failed = {r: detail for r, (outcome, detail) in enumerate(everyone) if outcome == "failed"}
    if failed:
        report.outcome = "failed"
        if hasattr(report, "wasxfail"):
            del report.wasxfail  # a failure is a failure on every rank, not an expected one
        errors = "\n".join(f"---- rank {r} ----\n{msg}" for r, msg in failed.items())
        report.longrepr = f"failed on rank(s) {sorted(failed)} of {len(everyone)}:\n{errors}"
        return
    skipped = [r for r, (outcome, _) in enumerate(everyone) if outcome == "skipped"]
    if skipped and len(skipped) < len(everyone):
        path, lineno, reason = everyone[skipped[0]][1]
        report.outcome = "skipped"
        report.longrepr = (
            path,
            lineno,
            f"skipped on rank(s) {skipped} of {len(everyone)}: {reason}",
        )


def _detail(report):
    """What the other ranks need to know of this rank's report: its error, or where and why it
    was skipped as ``(path, lineno, reason)``."""
    if report.failed:
        return str(report.longrepr)[-3000:]
    if report.skipped:
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            return tuple(longrepr)
        return (str(report.fspath), report.location[1], str(longrepr))
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Exchange the outcome of every phase (setup, call, teardown) of every test between the
    ranks, and report the merged outcome on each.

    Every rank runs setup and teardown, and runs the call only if its setup report passed, which
    after the merge is so on every rank or on none: so every rank makes the same exchanges for
    every test, whatever failed where, and a failure on one rank cannot leave the others a phase
    ahead (pairing one test's exchange with another's, or waiting for ever)."""
    outcome = yield
    if _SIZE == 1:
        return
    report = outcome.get_result()
    everyone = _OUTCOMES.allgather((report.outcome, _detail(report)))
    _merge_outcomes(report, everyone)
