"""A rank of a job of osmm_jax products dies: the rest of the job must end soon, with an error.

Each case runs ``mpiexec -n 3 python tests/failure_programs/dead_rank.py HOW WHERE``: rank 1
dies by SIGKILL, by SIGSEGV, by ``os._exit(3)`` or by ``os._exit(0)`` (a clean status, but
without MPI_Finalize), while ranks 0 and 2 wait for it inside a product's fence or are between
two products. The job must end, non-zero, less than 30 s after the death, and say why.

What MPICH's hydra does (measured with MPICH 5.0.2 on 2 loaded cores, 8 runs of each case):
when a rank's process ends without MPI_Finalize, its proxy sees the rank's PMI socket close, or
reaps the process, and kills the other ranks with SIGKILL at once, whatever they are blocked in
(inside, ranks 0 and 2 wait in the opening MPI_Win_fence of the product's fetch). The job ends
0.02-0.13 s after the death in every case. What it then reports depends on which of the two
events the proxy handles first (hydra's proxy/pmip_cb.c, and strace of the proxy):

- the exit is seen first: the job exits 9 (or 11 for SIGSEGV) and hydra prints its "BAD
  TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" banner, on stdout, not stderr. Always so
  for ``sigkill`` and ``segfault``; about half the time for ``exit3`` and ``exit0``.
- the closed socket is seen first: the proxy sets the other ranks' exit statuses to 0 before it
  kills them, so the job exits with the dead rank's own status, 3 for ``exit3`` or 0 for
  ``exit0``, and prints nothing at all (``-print-all-exitcodes`` shows ``0,0,0`` for
  ``exit0``). So ``exit3`` has no message and ``exit0`` neither a message nor a non-zero status
  about half the time, and those tests fail as often: nothing left alive could say more.

The program sets OSMM_TIMEOUT=10 unless it is set: osmm_jax's own bound on a blocking step,
for a job whose launcher does not kill it (under ``mpiexec -disable-auto-cleanup`` the others
stay in the fence until osmm_jax's watchdog ends the job, 10 s after they entered it).
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass

import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, run_job

PROGRAM = REPO / "tests" / "failure_programs" / "dead_rank.py"
LIMIT_S = 30.0  # from the death to the end of the job
HARD_TIMEOUT_S = 90.0  # the whole job, start-up included

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")

_DEATH = re.compile(r"^DEATH (\d+\.\d+) ", re.MULTILINE)
_BANNER = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"


@dataclass(frozen=True)
class Job:
    """How one job ended: exit status (None if it was still running at the hard timeout and
    was killed), what it printed, and the seconds from rank 1's death to the job's end."""

    status: int | None
    stdout: str
    stderr: str
    elapsed: float | None

    def __str__(self) -> str:
        return f"---- stdout ----\n{self.stdout}\n---- stderr ----\n{self.stderr}"


@functools.cache
def _job(how: str, where: str) -> Job:
    """Run the job once per case (the tests below look at different sides of its end). A job
    still running after HARD_TIMEOUT_S is killed, mpiexec and ranks alike."""
    env = job_environment(JAX_PLATFORMS="cpu")
    end = run_job([*mpiexec(3), sys.executable, str(PROGRAM), how, where], env, HARD_TIMEOUT_S)
    stdout, stderr, status, ended = end.stdout, end.stderr, end.status, end.ended
    death = _DEATH.search(stderr)
    elapsed = ended - float(death.group(1)) if death and ended is not None else None
    return Job(status, stdout, stderr, elapsed)


CASES = pytest.mark.parametrize(
    "how, where",
    [
        (how, where)
        for how in ("sigkill", "segfault", "exit3", "exit0")
        for where in ("inside", "between")
    ],
)


def _died(job: Job) -> None:
    assert _DEATH.search(job.stderr), f"rank 1 never got to die (status {job.status}):\n{job}"


@CASES
def test_the_job_ends_soon_after_a_rank_dies(how, where):
    job = _job(how, where)
    _died(job)
    assert job.status is not None, f"still running {HARD_TIMEOUT_S:.0f} s after it started:\n{job}"
    print(f"{how} {where}: status {job.status}, ended {job.elapsed:.2f} s after the death")
    assert job.elapsed < LIMIT_S, f"it ended {job.elapsed:.1f} s after the death:\n{job}"


# A rank that exits by itself without MPI_Finalize: whether hydra reports the others' SIGKILL
# (status 9, banner) or their status as 0 depends on which event its proxy handles first (see
# above); nothing left alive can change that, so these outcomes are recorded, not required.
_HYDRA_RACE = pytest.mark.xfail(
    strict=False,
    reason="hydra may report a rank that exited by itself without MPI_Finalize with its own "
    "status and no message (the others are killed within 0.2 s, before they can say more)",
)


def _cases_with_race(test):
    return pytest.mark.parametrize(
        "how, where",
        [
            pytest.param(how, where, marks=_HYDRA_RACE)
            if how in ("exit3", "exit0")
            else (how, where)
            for how in ("sigkill", "segfault", "exit3", "exit0")
            for where in ("inside", "between")
        ],
    )(test)


@_cases_with_race
def test_the_job_fails_when_a_rank_dies(how, where):
    job = _job(how, where)
    _died(job)
    assert job.status != 0, f"it exited with status 0, {job.elapsed:.2f} s after the death:\n{job}"


@_cases_with_race
def test_the_job_says_why_it_ended_when_a_rank_dies(how, where):
    """A line on stderr besides the program's own, or hydra's banner (which it prints on
    stdout) says why the job ended."""
    job = _job(how, where)
    _died(job)
    said = [line for line in job.stderr.splitlines() if line.strip() and not _DEATH.match(line)]
    assert said or _BANNER in job.stdout, (
        f"nothing says why the job ended (status {job.status}):\n{job}"
    )
