"""Launching tests/multihost/program.py across emulated hosts (network namespaces made by
netns.py): the venv's launcher (MPICH's or Intel MPI's hydra, Open MPI's prterun) runs on
host 0 and starts its proxies (daemons) on the others through the ns-launch script in place of
ssh, and the ranks talk over TCP between the hosts' ``eth0`` (each MPI's settings for it:
:class:`Transport`). Shared by tests/system/test_multihost.py, test_multihost_failures.py and
the stress run (stress.py)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import netns  # noqa: E402
from jobs import INTEL_MPI, MPIEXEC, OPEN_MPI, job_environment, run_job  # noqa: E402

PROGRAM = HERE / "program.py"
HOSTS = 4
SLOTS = (2, 1, 2, 1)  # ranks per host: shared memory and TCP in one job
HARD_TIMEOUT_S = 240.0  # per job; a loaded machine needs 100 s for the first
WATCHDOG_S = 60  # OSMM_TIMEOUT: a stuck MPI step ends the job well before the hard timeout

# Besides the launcher's: the network and osmm_jax settings of this process, which the jobs set.
HOST_VARIABLES = ("FI_", "UCX_", "OSMM_", "I_MPI_", "OMPI_MCA_", "PRTE_MCA_")


@dataclass(frozen=True)
class Transport:
    """How the venv's MPI is told to carry traffic between hosts over TCP on the hosts'
    ``eth0`` (environment variables for every rank), and the text of the job's output that
    proves it did."""

    mpi: str  # the MPI, in words
    settings: dict[str, str]
    no_local: dict[str, str]  # TCP between the ranks of one host too (no shared memory)
    proof: str


# MPICH: its default UCX netmod sees through the namespaces (one node, CMA); the ofi netmod
# with the tcp provider does not. MPIR_CVAR_DEBUG_SUMMARY names the provider and the subnet.
MPICH_TCP = Transport(
    mpi="MPICH",
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
    mpi="Intel MPI",
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
# Open MPI: ob1 over its own TCP BTL (shared memory within a host), and one-sided traffic by
# osc/rdma, which over TCP moves RMA as active messages through the same BTLs. Its UCX
# components would see through the namespaces as MPICH's UCX does, so neither is chosen.
# At btl_base_verbose 1 each rank names the BTL it sends through to each peer, and its node.
OPEN_MPI_TCP = Transport(
    mpi="Open MPI",
    settings={
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_osc": "rdma",
        "OMPI_MCA_btl": "self,sm,tcp",
        "OMPI_MCA_btl_tcp_if_include": "eth0",
        "OMPI_MCA_btl_base_verbose": "1",
    },
    no_local={"OMPI_MCA_btl": "self,tcp"},
    proof="mca: bml: Using tcp btl for send to",
)
TRANSPORT = OPEN_MPI_TCP if OPEN_MPI else INTEL_MPI_TCP if INTEL_MPI else MPICH_TCP
TCP_SUMMARY = TRANSPORT.proof


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
    with tempfile.TemporaryDirectory() as scratch:
        argv = [sys.executable, str(program), *program_args]
        command = job_command(hosts, slots, settings, argv, Path(scratch) / "machines")
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


def job_command(hosts, slots, settings: dict[str, str], argv: list[str], machines: Path):
    """The command that runs ``argv`` on ``slots[i]`` ranks of host ``i`` with the venv's
    launcher, ``settings`` in every rank's environment (``machines``: where to write the host
    file). The launcher itself runs on host 0, started the way it starts the other hosts."""
    build = _prterun_command if OPEN_MPI else _hydra_command
    mpiexec = [*build(hosts, slots, machines, settings), "-n", str(sum(slots)), *argv]
    return [str(netns.LAUNCHER), hosts.addresses[0], shlex.join(mpiexec)]


def _hydra_command(hosts, slots, machines: Path, settings: dict[str, str]) -> list[str]:
    """MPICH's or Intel MPI's mpiexec, up to ``-n``. A machine file, "address:ranks" a line:
    both hydras read it alike (Intel MPI's -hosts ignores the ":ranks" of a host list)."""
    machines.write_text("".join(f"{a}:{n}\n" for a, n in zip(hosts.addresses, slots) if n))
    command = [str(MPIEXEC), "-machinefile", str(machines), "-launcher", "ssh"]
    command += ["-launcher-exec", str(netns.LAUNCHER), "-iface", "eth0"]
    command += ["-print-all-exitcodes"] if INTEL_MPI else []
    for name, value in settings.items():
        command += ["-genv", name, value]
    return command


def _prterun_command(hosts, slots, machines: Path, settings: dict[str, str]) -> list[str]:
    """Open MPI's mpiexec (prterun), up to ``-n``: a host file, "address slots=ranks" a line;
    its daemons started by ns-launch in place of ssh (PRRTE's ``plm_ssh_agent``), reaching back
    over ``eth0`` and declared lost within seconds of silence; the ranks left unbound, as hydra leaves them (Open MPI binds each to
    a core of its own by default, and the speed cache's keys count the ranks that share
    CPUs); every setting exported to the ranks with ``-x``."""
    machines.write_text("".join(f"{a} slots={n}\n" for a, n in zip(hosts.addresses, slots) if n))
    command = [str(MPIEXEC), "--hostfile", str(machines)]
    command += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command += ["--prtemca", "plm_ssh_agent", str(netns.LAUNCHER)]
    command += ["--prtemca", "oob_tcp_if_include", "eth0", "--bind-to", "none"]
    # A daemon whose host dropped off the network is declared lost after 2 + 3 x 1 s of
    # silence, not after PRRTE's default 300 + 9 x 20 s, during which it outlives its ranks.
    for name, value in (("time", 2), ("intvl", 1), ("probes", 3)):
        command += ["--prtemca", f"oob_tcp_keepalive_{name}", str(value)]
    for name, value in settings.items():
        command += ["-x", f"{name}={value}"]
    return command
