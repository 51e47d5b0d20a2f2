"""Run MPI tests collectively: under ``mpiexec -n N python -m pytest tests/mpi``.

Every rank runs the same tests in the same order. After each test the ranks
exchange their outcomes, so a test that fails on one rank fails on all of them,
and the report names the failing ranks and their errors (only rank 0 prints;
see ``tests/mpi/run.py``). A rank stuck in a collective is caught by
pytest-timeout and by the timeout around mpiexec, so a run always ends.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

_OUTCOMES = MPI.COMM_WORLD.Dup()


@pytest.fixture(scope="session")
def world():
    """(rank, size) of COMM_WORLD."""
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call":
        return
    report = outcome.get_result()
    message = str(report.longrepr)[-3000:] if report.failed else None
    everyone = _OUTCOMES.allgather(message)
    failed = {r: msg for r, msg in enumerate(everyone) if msg is not None}
    if failed and not report.failed:
        report.outcome = "failed"
    if failed:
        detail = "\n".join(f"---- rank {r} ----\n{msg}" for r, msg in failed.items())
        report.longrepr = f"failed on rank(s) {sorted(failed)} of {len(everyone)}:\n{detail}"
