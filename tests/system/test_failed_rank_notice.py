"""A rank that fails tells the others at once: they end the job with its reason, not at the timeout.

Each case runs ``mpiexec -n 3 python tests/failure_programs/failing_rank.py HOW`` on this host
with OSMM_TIMEOUT=60: rank 2 raises an uncaught Python exception (``exception``) or its part
of a product fails as if XLA had failed (``xlaerror``) while ranks 0 and 2 wait for it in that
product. osmm_jax's ``sys.excepthook`` wrapper writes "rank 2 failed: <reason>" into the
others' side-channel windows (no collective); the ranks waiting read their own window every
watchdog tick and end the job, well before the timeout, with that reason in their report.
With ``OSMM_REPORT_FAILURES=0`` nobody is told, and the job ends at the timeout instead. With
``OSMM_ON_TIMEOUT=raise`` the ranks waiting should raise an error with the reason instead
(the program prints it as ``RAISED <time.time()> rank r: <error>``), and the job still end
non-zero.
"""

from __future__ import annotations

import functools
import re
import sys

import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, run_job

PROGRAM = REPO / "tests" / "failure_programs" / "failing_rank.py"
TIMEOUT_S = 60  # OSMM_TIMEOUT: the notice must end the job long before it
LIMIT_S = 20.0  # from the failure to the end of the job, on a loaded machine
HARD_TIMEOUT_S = 150.0

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")

_FAILURE = re.compile(r"^FAILURE (\d+\.\d+) ", re.MULTILINE)
_RAISED = re.compile(r"^RAISED (\d+\.\d+) ", re.MULTILINE)
_NOTICE = "rank 2 of the 3-rank communicator failed: "
_REASON = "RuntimeError: rank 2 gives up between products"
# What raise mode does today: a rank waiting in a product's fence ends the job on a notice.


@functools.cache
def _job(how: str, **settings: str):
    env = job_environment(**{"JAX_PLATFORMS": "cpu", "OSMM_TIMEOUT": str(TIMEOUT_S), **settings})
    end = run_job([*mpiexec(3), sys.executable, str(PROGRAM), how], env, HARD_TIMEOUT_S)
    failure = _FAILURE.search(end.stderr)
    assert failure, f"rank 2 never got to fail (status {end.status}):\n{end.stderr[-4000:]}"
    elapsed = end.ended - float(failure.group(1)) if end.ended is not None else None
    return end, elapsed


@pytest.mark.parametrize("how", ["exception", "xlaerror"])
def test_a_failed_rank_ends_the_job_at_once_with_its_reason(how):
    end, elapsed = _job(how)
    tail = end.stderr[-6000:]
    assert end.status is not None, f"still running after {HARD_TIMEOUT_S:.0f} s:\n{tail}"
    print(f"{how} on one host: status {end.status}, ended {elapsed:.1f} s after the failure")
    assert end.status != 0, tail
    assert elapsed < LIMIT_S, f"it ended {elapsed:.1f} s after the failure:\n{tail}"
    assert _NOTICE in end.stderr, tail
    assert "products went on" not in end.stderr, tail


def test_the_reason_is_the_exception():
    end, _ = _job("exception")
    assert f"failed: {_REASON}" in end.stderr, end.stderr


def test_raise_mode_raises_the_reason_in_the_waiting_ranks():
    end, elapsed = _job("exception", OSMM_ON_TIMEOUT="raise")
    tail = end.stderr[-6000:]
    assert end.status is not None, f"still running after {HARD_TIMEOUT_S:.0f} s:\n{tail}"
    print(
        f"exception, OSMM_ON_TIMEOUT=raise on one host: status {end.status}, ended {elapsed:.1f} s"
    )
    assert end.status != 0, tail
    assert elapsed < LIMIT_S, f"it ended {elapsed:.1f} s after the failure:\n{tail}"
    assert _NOTICE + _REASON in end.stderr, tail
    assert "products went on" not in end.stderr, tail
    raised = _RAISED.findall(end.stderr)
    assert raised, f"no rank raised the failed rank's notice:\n{tail}"
    failed_at = float(_FAILURE.search(end.stderr).group(1))
    assert max(float(at) for at in raised) - failed_at < LIMIT_S, tail
    assert _NOTICE + _REASON in end.stderr[end.stderr.index("RAISED ") :], tail


def test_reporting_failures_can_be_turned_off():
    """Without the hook the failed rank's exit waits in teardown, and the job ends only when a
    rank's watchdog times out (or the launcher ends it): never with a failure notice."""
    end, _ = _job("exception", OSMM_REPORT_FAILURES="0", OSMM_TIMEOUT="5")
    assert end.status is not None and end.status != 0, end.stderr[-4000:]
    assert "communicator failed" not in end.stderr, end.stderr[-4000:]
