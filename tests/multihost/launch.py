"""Launching tests/multihost/program.py across emulated hosts (network namespaces made by
netns.py): hydra's mpiexec (MPICH's or Intel MPI's) runs on host 0 and starts its proxies on
the others through the ns-launch script in place of ssh, over libfabric's TCP provider (each
MPI's settings for it: :class:`Transport`). Shared by tests/system/test_multihost.py,
test_multihost_failures.py and the stress run (stress.py)."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import netns  # noqa: E402
from jobs import MPIEXEC, OPEN_MPI, job_environment, run_job  # noqa: E402

PROGRAM = HERE / "program.py"
HOSTS = 4
SLOTS = (2, 1, 2, 1)  # ranks per host: shared memory and TCP in one job
HARD_TIMEOUT_S = 240.0  # per job; a loaded machine needs 100 s for the first
WATCHDOG_S = 60  # OSMM_TIMEOUT: a stuck MPI step ends the job well before the hard timeout

# Besides the launcher's: the network and osmm_jax settings of this process, which the jobs set.
HOST_VARIABLES = ("FI_", "UCX_", "OSMM_", "I_MPI_")
INTEL_MPI = (MPIEXEC.parent / "impi_info").exists()


@dataclass(frozen=True)
class Transport:
    """How the venv's MPI is told to carry traffic between hosts over libfabric's TCP provider
    on the hosts' ``eth0``, and the line of rank 0's output that proves it did."""

    settings: dict[str, str]
    no_local: dict[str, str]  # TCP between the ranks of one host too (no shared memory)
    proof: str


# MPICH: its default UCX netmod sees through the namespaces (one node, CMA); the ofi netmod
# with the tcp provider does not. MPIR_CVAR_DEBUG_SUMMARY names the provider and the subnet.
MPICH_TCP = Transport(
    settings={
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
        "MPIR_CVAR_DEBUG_SUMMARY": "1",
    },
    no_local={"MPIR_CVAR_NOLOCAL": "1"},
    proof=f"libfabric provider: tcp - {netns.SUBNET}.0/24",
)
# Intel MPI: shared memory within a host, its bundled libfabric's tcp provider between hosts;
# I_MPI_DEBUG=5 makes rank 0 name the provider at start-up. I_MPI_PIN=off leaves the ranks
# unbound, as MPICH's hydra does (Intel MPI pins each to a core of its own by default, and the
# speed cache's keys count the ranks that share CPUs).
INTEL_MPI_TCP = Transport(
    settings={
        "I_MPI_PIN": "off",
        "I_MPI_FABRICS": "shm:ofi",
        "I_MPI_OFI_PROVIDER": "tcp",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": "eth0",
        "I_MPI_DEBUG": "5",
    },
    no_local={"I_MPI_FABRICS": "ofi"},
    proof="MPI startup(): libfabric provider: tcp",
)
TRANSPORT = INTEL_MPI_TCP if INTEL_MPI else MPICH_TCP
TCP_SUMMARY = TRANSPORT.proof


def unavailable() -> str | None:
    """Why jobs cannot be launched across emulated hosts here, or None."""
    if not MPIEXEC.exists():
        return "needs the venv's mpiexec"
    if OPEN_MPI:
        return (
            "the launcher here is hydra's (MPICH, Intel MPI); Open MPI's prterun has no recipe yet"
        )
    return netns.unavailable_reason()


def launch(
    hosts,
    slots,
    program_args,
    *,
    genv=(),
    no_local=False,
    hostnames=True,
    tmp_path=None,
    timeout=HARD_TIMEOUT_S,
    program=PROGRAM,
):
    """Run ``program`` (default program.py) under mpiexec on host 0 over ``slots[i]`` ranks of
    host ``i`` (``no_local``: over TCP within a host too); return ``(status, output, result)``,
    result being rank 0's RESULT record (None if none)."""
    env = job_environment(
        drop=HOST_VARIABLES,
        OSMM_NETNS_PREFIX=hosts.prefix,
        OSMM_NETNS_HOSTNAMES="1" if hostnames else "0",
    )
    settings = {
        **TRANSPORT.settings,
        **(TRANSPORT.no_local if no_local else {}),
        "JAX_PLATFORMS": "cpu",
        "OSMM_TIMEOUT": str(WATCHDOG_S),
        **dict(genv),
    }
    # A machine file, "address:ranks" a line: both hydras read it alike (Intel MPI's -hosts
    # ignores the ":ranks" of a host list, and hands it to the launcher with the address).
    with tempfile.TemporaryDirectory() as scratch:
        machines = Path(scratch) / "machines"
        machines.write_text("".join(f"{a}:{n}\n" for a, n in zip(hosts.addresses, slots) if n))
        mpiexec = [str(MPIEXEC), "-machinefile", str(machines), "-launcher", "ssh"]
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
