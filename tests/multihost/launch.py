"""Launching tests/multihost/program.py across emulated hosts (network namespaces made by
netns.py): hydra's mpiexec runs on host 0 and starts its proxies on the others through the
ns-launch script in place of ssh, over libfabric's TCP provider. Shared by
tests/system/test_multihost.py and the stress run (stress.py)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import netns  # noqa: E402
from jobs import MPIEXEC, job_environment, run_job  # noqa: E402

PROGRAM = HERE / "program.py"
HOSTS = 4
SLOTS = (2, 1, 2, 1)  # ranks per host: shared memory and TCP in one job
HARD_TIMEOUT_S = 240.0  # per job; a loaded machine needs 100 s for the first
WATCHDOG_S = 60  # OSMM_TIMEOUT: a stuck MPI step ends the job well before the hard timeout

# Besides hydra's: the network and osmm_jax settings of this process, which the jobs set.
HOST_VARIABLES = ("FI_", "UCX_", "OSMM_")
TCP_SUMMARY = f"libfabric provider: tcp - {netns.SUBNET}.0/24"


def unavailable() -> str | None:
    """Why jobs cannot be launched across emulated hosts here, or None."""
    if not MPIEXEC.exists():
        return "needs the venv's mpiexec"
    return netns.unavailable_reason()


def launch(
    hosts,
    slots,
    program_args,
    *,
    genv=(),
    hostnames=True,
    tmp_path=None,
    timeout=HARD_TIMEOUT_S,
    program=PROGRAM,
):
    """Run ``program`` (default program.py) under mpiexec on host 0 over ``slots[i]`` ranks of
    host ``i``; return ``(status, output, result)``, result being rank 0's RESULT record (None
    if none)."""
    env = job_environment(
        drop=HOST_VARIABLES,
        OSMM_NETNS_PREFIX=hosts.prefix,
        OSMM_NETNS_HOSTNAMES="1" if hostnames else "0",
    )
    host_list = ",".join(f"{a}:{n}" for a, n in zip(hosts.addresses, slots) if n)
    settings = {
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
        "MPIR_CVAR_DEBUG_SUMMARY": "1",
        "JAX_PLATFORMS": "cpu",
        "OSMM_TIMEOUT": str(WATCHDOG_S),
        **dict(genv),
    }
    mpiexec = [str(MPIEXEC), "-hosts", host_list, "-launcher", "ssh"]
    mpiexec += ["-launcher-exec", str(netns.LAUNCHER), "-iface", "eth0"]
    for name, value in settings.items():
        mpiexec += ["-genv", name, value]
    mpiexec += ["-n", str(sum(slots)), sys.executable, str(program), *program_args]
    # mpiexec itself runs on host 0, started the way the launcher starts the other hosts.
    command = [str(netns.LAUNCHER), hosts.addresses[0], shlex.join(mpiexec)]
    started = time.perf_counter()
    end = run_job(command, env, timeout, merge_stderr=True)
    status, output = end.status, end.stdout
    results = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
    result = results[-1] if results else None
    took = f"{time.perf_counter() - started:.1f} s"
    if result:
        took += f"; per rank: imports {result['import_seconds']} s, products {result['product_seconds']} s"
    print(f"{' '.join(program_args)}: status {status}, {took}")
    return status, output, result
