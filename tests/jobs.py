"""Running an MPI job (or any program) as a subprocess of a test: a fresh environment, a hard
timeout that kills the whole job, and how it ended.

Used by the tests that launch their own ``mpiexec``: test_out_of_step.py, test_dead_ranks.py,
test_multihost.py, test_train_lm.py and mpi/test_conftest_exchange.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"

# What hydra puts in a rank's environment: without it removed, a job started from a test that
# itself runs under mpiexec would be taken for a part of that job instead of a job of its own.
JOB_VARIABLES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "MPI_LOCAL")


def job_environment(*, drop: tuple[str, ...] = (), **settings: str) -> dict[str, str]:
    """This process's environment without hydra's variables (and any starting with a prefix in
    ``drop``), plus ``settings``."""
    prefixes = JOB_VARIABLES + tuple(drop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(settings)
    return env


@dataclass(frozen=True)
class Ended:
    """How a job ended: its exit status (None: still running at the hard timeout, and killed),
    its output (stderr is "" when it was merged into stdout) and when it ended (time.time(),
    None if killed)."""

    status: int | None
    stdout: str
    stderr: str
    ended: float | None


def run_job(
    command: list[str], env: dict[str, str], timeout: float, *, merge_stderr: bool = False
) -> Ended:
    """Run ``command`` from the repository root in a process group of its own; a job still
    running after ``timeout`` seconds is killed whole (mpiexec and every rank)."""
    job = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
        return Ended(job.returncode, stdout, stderr or "", time.time())
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        return Ended(None, stdout, stderr or "", None)
