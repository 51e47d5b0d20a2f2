"""Time one_sided against its peers over TCP: emulated hosts, one rank each, and one host
with ``MPIR_CVAR_NOLOCAL=1``, under each way of making MPI progress.

Needs root (network namespaces, tests/multihost/netns.py) and the venv's mpiexec::

    sudo .venv/bin/python -m benchmarks.network                # everything: 7 jobs
    sudo .venv/bin/python -m benchmarks.network --cases k_split --paths tcp --repeats 7

Why: over shared memory the origin completes MPI_Accumulate alone; over a network MPICH
completes it with active messages that the *target* processes inside MPI calls, and a rank
busy in XLA's GEMMs makes none. Each job is one ``benchmarks.compare_methods`` (or
``benchmarks.train_step``) run across the namespaces by the venv's launcher over TCP, with the
settings tests/system/test_multihost.py uses for that MPI (tests/multihost/launch.py's
``Transport``: for MPICH ``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0``; Open
MPI's ob1 and TCP BTL with osc/rdma; Intel MPI's libfabric tcp provider), with ``--peers``
(the mpi4jax all-reduce and JAX's NamedSharding / shard_map over gloo are always timed in the
same run) and with ``--progress off,thread``: one_sided with osmm_jax's own progress thread
and without it, overlap on and off, interleaved in the same rounds (plain ``one_sided`` runs
under the default ``OSMM_PROGRESS``, ``off``). MPICH's own progress thread
(``MPIR_CVAR_ASYNC_PROGRESS=1``) is process-wide, so it gets a job of its own
(``--mpich-async``, on the first path only, under MPICH only), with osmm_jax's thread off.

Paths (``--paths``):

``tcp``
    one rank per emulated host (2 or 3 hosts), all traffic over TCP between namespaces;
``nolocal``
    every rank on one emulated host, same-host traffic through the network module too
    (MPICH: ``MPIR_CVAR_NOLOCAL=1``).

Cases (``--cases``): ``k_split`` (2 ranks, 2048³: partials of all of C reduced onto row
owners, the case progress is about), ``ffn_rows`` (3 ranks, 2046 x 2048 x 5504, rows x
replicated: no communication, a control), ``mlp`` (2 ranks, benchmarks.train_step: one
data-parallel step of a 2-layer MLP, whose weight gradients are reduced).

Every job's record goes to ``network.json`` (a JSON list, as compare_methods writes); the
report is ``network.md`` (every table, then one summary row per job: one_sided's speed-up
over the all-reduce and over NamedSharding, with and without each progress option) and
``network.png``. Timings on a shared machine are only good as ratios within one job.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "multihost"))

import netns  # noqa: E402
from jobs import MPIEXEC, job_environment, run_job  # noqa: E402
from launch import HOST_VARIABLES, MPICH_TCP, TRANSPORT, job_command  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
JOB_TIMEOUT_S = 300.0

# name -> (ranks, module, arguments)
CASES = {
    "k_split": (2, "benchmarks.compare_methods", ["--case", "k_split", "--size", "2048"]),
    "ffn_rows": (
        3,
        "benchmarks.compare_methods",
        ["--case", "rows", "--m", "2046", "--k", "2048", "--n", "5504"],
    ),
    "mlp": (2, "benchmarks.train_step", []),
}
PATHS = ("tcp", "nolocal")
SETTINGS = {"JAX_PLATFORMS": "cpu", "OSMM_TIMEOUT": "120"}
# What a job must not inherit from this process: the launcher's own variables (job_environment
# drops them), and network and osmm_jax settings, which each job sets itself.
_DROP = HOST_VARIABLES


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_one(
    hosts, case: str, path: str, progress: str, repeats: int, out: Path, extra: dict
) -> dict | None:
    """One job; returns its record (with ``path`` and ``progress`` added), or None.
    ``extra``: more environment variables for the ranks."""
    ranks, module, args = CASES[case]
    settings = {**TRANSPORT.settings, **SETTINGS, **extra}
    if path == "nolocal":
        settings.update(TRANSPORT.no_local)
        slots = (ranks,)
    else:
        slots = (1,) * ranks
    args = [*args, "--peers", "--repeats", str(repeats), "--json", str(out)]
    args += ["--label", f"{case} {path} {progress}"]
    if progress == "mpich-async":
        settings.update(MPIR_CVAR_ASYNC_PROGRESS="1", OSMM_PROGRESS="off")
    elif module == "benchmarks.compare_methods":
        args += ["--progress", "off,thread"]
    env = job_environment(drop=_DROP, OSMM_NETNS_PREFIX=hosts.prefix, OSMM_NETNS_HOSTNAMES="1")
    argv = [sys.executable, "-m", module, *args]
    before = len(json.loads(out.read_text())) if out.exists() else 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        command = job_command(hosts, slots, settings, argv, Path(scratch) / "machines")
        end = run_job(command, env, JOB_TIMEOUT_S, merge_stderr=True)
    took = time.perf_counter() - started
    records = json.loads(out.read_text()) if out.exists() else []
    print(f"{case} over {path}, progress {progress}: status {end.status}, {took:.0f} s", flush=True)
    if end.status != 0 or len(records) <= before:
        print(end.stdout[-4000:], flush=True)
        return None
    record = records[-1]
    record.update(path=path, progress=progress, job_seconds=took)
    records[-1] = record
    out.write_text(json.dumps(records, indent=1) + "\n")
    return record


def seconds(record: dict, name: str) -> float | None:
    return next((e["seconds"] for e in record["entries"] if e["name"] == name), None)


def ratios(record: dict) -> list[tuple[str, float | None, float | None]]:
    """(one_sided entry, its speed-up over allreduce, over NamedSharding) for every one_sided
    entry of ``record``."""
    allreduce = seconds(record, "allreduce") or seconds(record, "allreduce (DDP: uniform)")
    named = seconds(record, "jax_named_sharding")
    rows = []
    for e in record["entries"]:
        if not e["name"].startswith("one_sided"):
            continue
        rows.append(
            (
                e["name"],
                allreduce / e["seconds"] if allreduce else None,
                named / e["seconds"] if named else None,
            )
        )
    return rows


def entry_label(record: dict, name: str) -> str:
    """The progress option an entry ran under, in words."""
    if record["progress"] == "mpich-async":
        return f"{name} (MPIR_CVAR_ASYNC_PROGRESS=1)"
    if "progress" in name:
        return name
    return f"{name}, progress {record['progress']}"


def report(records: list[dict], out_dir: Path, elapsed: float) -> None:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [
        "# one_sided over TCP: emulated hosts and MPIR_CVAR_NOLOCAL",
        "",
        "Written by `sudo .venv/bin/python -m benchmarks.network`"
        f" ({elapsed / 60:.1f} min). Each row: one job (interleaved rounds, medians of the"
        " slowest rank); a ratio > 1 means one_sided is faster. `default` is `OSMM_PROGRESS`"
        " unset (`off`), `thread` osmm_jax's progress thread during every reduce, `off`"
        " none; `MPIR_CVAR_ASYNC_PROGRESS=1` is MPICH's own progress thread (its own job).",
        "",
        "| case | path | one_sided entry | ÷ allreduce | ÷ NamedSharding | ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        for name, over_allreduce, over_named in ratios(r):
            lines.append(
                f"| {r['case'] if 'case' in r else r['label'].split()[0]} | {r['path']} | "
                f"{entry_label(r, name)} | {fmt(over_allreduce)} | {fmt(over_named)} | "
                f"{seconds(r, name) * 1e3:.1f} |"
            )
    for r in records:
        lines += ["", f"## {r['title']}: {r['path']}, progress {r['progress']}", ""]
        lines += ["| method | time (ms) | GFLOP/s |", "| --- | --- | --- |"]
        for e in r["entries"]:
            lines.append(f"| {e['name']} | {e['seconds'] * 1e3:.2f} | {e['gflops']:.1f} |")
        lines += [f"\n{note}" for note in r.get("notes", [])]
    (out_dir / "network.md").write_text("\n".join(lines) + "\n")
    plot(records, out_dir / "network.png")


def plot(records: list[dict], path: Path) -> None:
    """One panel per job: median ms of every entry, one_sided entries highlighted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no network.png")
        return
    if not records:
        return
    fig, axes = plt.subplots(len(records), 1, figsize=(9, 2.2 + 0.28 * 12 * len(records)))
    axes = [axes] if len(records) == 1 else list(axes)
    for ax, r in zip(axes, records):
        names = [e["name"] for e in r["entries"]]
        ms = [e["seconds"] * 1e3 for e in r["entries"]]
        colors = ["tab:blue" if n.startswith("one_sided") else "tab:gray" for n in names]
        ax.barh(names, ms, color=colors)
        ax.invert_yaxis()
        ax.set_title(f"{r['label']}", fontsize=9)
        ax.set_xlabel("ms (median)")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="k_split,ffn_rows,mlp")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--mpich-async",
        default="k_split",
        help="cases also run under MPIR_CVAR_ASYNC_PROGRESS=1 (comma-separated; '' for none)",
    )
    # 21 rounds: with 9, the same setting timed twice in one job differed by up to 6%.
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default=str(RESULTS), help="folder for network.{json,md,png}")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set this in every rank's environment (repeatable), e.g. OSMM_PROGRESS_INTERVAL_US=0",
    )
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    if not MPIEXEC.exists():
        print(f"needs {MPIEXEC}: make install", file=sys.stderr)
        return 2
    if (reason := netns.unavailable_reason()) is not None:
        print(f"cannot make emulated hosts: {reason}", file=sys.stderr)
        return 2
    cases = [c for c in args.cases.split(",") if c]
    paths = [p for p in args.paths.split(",") if p]
    unknown = [c for c in cases if c not in CASES] + [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown case or path: {unknown}")
    mpich = [c for c in args.mpich_async.split(",") if c in cases and TRANSPORT is MPICH_TCP]
    jobs = [(c, p, "default") for c in cases for p in paths]
    # MPICH's thread spins for the whole program: one path shows what it costs.
    jobs += [(c, paths[0], "mpich-async") for c in mpich]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    records = []
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    hosts = netns.create(max(CASES[c][0] for c in cases))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "network.json"
            for case, path, progress in jobs:
                record = run_one(hosts, case, path, progress, args.repeats, raw, extra)
                if record is not None:
                    record["case"] = case
                    records.append(record)
    finally:
        netns.remove(hosts.prefix)
        for s, handler in previous.items():
            signal.signal(s, handler)
    (out_dir / "network.json").write_text(json.dumps(records, indent=1) + "\n")
    report(records, out_dir, time.perf_counter() - started)
    print(f"wrote {out_dir / 'network.md'} ({len(records)} of {len(jobs)} jobs)")
    return 0 if len(records) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
