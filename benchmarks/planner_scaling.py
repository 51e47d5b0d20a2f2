"""How long building one rank's plan takes, and how much memory, as the number of ranks grows.

No MPI and no device: layouts are built for an explicit rank count and one rank's part of the
plan (``Plan(...).for_rank(r)``, what ``osmm_jax.plan(..., rank=r)`` returns and what every rank
of a job builds for itself) is made in one process. Each (case, P) is measured in a fresh child
process, so its peak memory is its own: the seconds cover building the layouts and that rank's
part, for ranks 0, P/2 and P-1 (the slowest of the three is reported), the memory is the
child's peak resident set minus what it held before building. Wall-clock seconds are reported
with the process's CPU seconds, which say more when other work shares the machine. Up to
``--whole-max-ranks``, the record also says how even the whole plan is (built after the timed
part): the busiest rank's flops over the mean (``flops_ratio``), its modelled time over the mean
(``balance_ratio``, :meth:`Plan.balance`) and the bytes all ranks send (``total_bytes``).

Cases (M = K = N = ``--dim``):

* ``rows``: A rows, B replicated, C rows (the data-parallel product);
* ``k_split``: A cols, B rows, C rows (every rank sends a partial of every C block: P^2
  transfers in the whole plan, 2 (P - 1) per rank);
* ``grid``: A, B and C on the same ``pr x pc`` grid (pr the largest power of two <= sqrt(P));
* ``3d``: :func:`osmm_jax.three_d_layouts` and its :class:`osmm_jax.Work` split on the
  ``pm x pk x pn`` grid of least box surface (as :func:`osmm_jax.auto_layouts` ranks them);
* ``auto``: :func:`osmm_jax.auto_layouts` on uneven speeds (prices every candidate strategy).

P runs 64, 128, ... up to ``--max-ranks`` (``--auto-max-ranks`` for ``auto``); once one P of a
case takes longer than ``--budget`` seconds, its larger P are skipped. Writes
``benchmarks/results/planner_scaling.json`` and ``.md`` (a table), and ``.png`` (log-log) when
matplotlib is importable::

    python -m benchmarks.planner_scaling --max-ranks 16384 --budget 60

``--peers`` instead counts, on rank 0, what one notified product costs in peers,
notifications and slot windows (:func:`peer_counts`) for the cases that fetch pieces at P = 64,
1024 and 8192, into ``benchmarks/results/planner_peers.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CASES = ("rows", "k_split", "grid", "3d", "auto")


def _grid_shape(nranks: int) -> tuple[int, int]:
    pr = 1
    while (pr * 2) ** 2 <= nranks:
        pr *= 2
    while nranks % pr:
        pr //= 2
    return pr, nranks // pr


def layouts(case: str, nranks: int, dim: int):
    """The three layouts of one case (not ``auto``)."""
    from osmm_jax._src.planning.layout import Layout

    shape = (dim, dim)
    if case == "rows":
        return (
            Layout.rows(shape, nranks=nranks),
            Layout.replicated(shape, nranks=nranks),
            Layout.rows(shape, nranks=nranks),
        )
    if case == "k_split":
        return (
            Layout.cols(shape, nranks=nranks),
            Layout.rows(shape, nranks=nranks),
            Layout.rows(shape, nranks=nranks),
        )
    if case == "grid":
        grid = _grid_shape(nranks)
        return tuple(Layout.grid(shape, grid) for _ in range(3))
    raise ValueError(f"unknown case {case!r}")


def plan_of(case: str, nranks: int, dim: int):
    """The plan of one case (not ``auto``), its layouts built here."""
    from osmm_jax._src.planning.auto_layout import _three_d_grids
    from osmm_jax._src.planning.plan import Plan
    from osmm_jax._src.planning.work import three_d_layouts

    if case == "3d":
        a, b, c, work = three_d_layouts((dim, dim, dim), _three_d_grids(dim, dim, dim, nranks)[0])
        return Plan(a, b, c, work=work)
    return Plan(*layouts(case, nranks, dim))


def build(case: str, nranks: int, dim: int, rank: int = 0):
    """Build the layouts and ``rank``'s part of the plan (or the auto_layouts choice)."""
    from osmm_jax._src.planning.auto_layout import auto_layouts

    if case == "auto":
        speeds = [1.0 + 0.5 * (r % 3) for r in range(nranks)]
        return auto_layouts(dim, dim, dim, speeds)
    return plan_of(case, nranks, dim).for_rank(rank)


def peer_counts(plan, rank: int) -> dict:
    """What one notified product of ``plan`` costs ``rank`` in messages and windows (float32,
    the default 512 MiB slot budget): the ranks it hears from and sends to in the fetch and in
    the reduce, the notifications it sends, and its resident slot windows; ``*_all_to_all``:
    the same with the fetch of a plan that also delivers partials hearing from every rank, as
    it did before (P - 1 owners and getters)."""
    from osmm_jax._src.runtime import slots

    mine = plan.for_rank(rank)
    owners = {t.target for t in mine.gets}
    getters = {t.origin for t in mine.served}
    targets = {t.target for t in mine.deliveries}
    sync = slots.Sync("notify", 512 * 2**20)
    windows = slots.resident_window_bytes(plan, rank, 4, 4, sync)
    fetch_sends, fetch_slots = len(getters), len(owners)
    if plan.has_gets and plan.has_deliveries:
        fetch_sends = fetch_slots = plan.nranks - 1
    slot_count, slot_bytes = slots._fetch_slots(plan, 4, sync.slot_budget)
    reduce_window = windows if not plan.has_gets else 0
    if plan.has_deliveries and plan.has_gets:
        attribute = slots.notify_attribute(slots.executed_plan(plan, sync), rank, 4, sync)
        reduce_window = min(attribute[0], attribute[3]) * attribute[1]
    slot_count_before = max(slot_count, min(plan.nranks - 1, int(sync.slot_budget // slot_bytes)))
    fetch_window_before = min(fetch_slots, slot_count_before) * slot_bytes if plan.has_gets else 0
    return {
        "fetch_peers": len(owners | getters),
        "reduce_peers": len(set(mine.origins) | targets),
        "notifications": len(getters) + len(targets),
        "notifications_all_to_all": fetch_sends + len(targets),
        "window_bytes": windows,
        "window_bytes_all_to_all": max(reduce_window, fetch_window_before),
    }


def _rss_kib() -> int:
    """The current resident set (KiB), from /proc where there is one, else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure_one(case: str, nranks: int, dim: int, repeats: int, whole_max_ranks: int = 512) -> dict:
    """Time ``repeats`` builds of one case in this process; memory from the first build."""
    import gc

    import osmm_jax._src.planning.auto_layout  # noqa: F401  (imports outside the timed region)

    gc.collect()
    before = _rss_kib()
    ranks = (0,) if case == "auto" else sorted({0, nranks // 2, nranks - 1})
    seconds, cpu_seconds = [], []
    counts = {}
    for i in range(repeats):
        slowest, slowest_cpu = 0.0, 0.0
        for rank in ranks:
            start, cpu_start = time.perf_counter(), time.process_time()
            result = build(case, nranks, dim, rank)
            slowest = max(slowest, time.perf_counter() - start)
            slowest_cpu = max(slowest_cpu, time.process_time() - cpu_start)
            if i == 0 and rank == 0:
                counts = (
                    {"chosen": result.name}
                    if case == "auto"
                    else {
                        "rank_multiplies": len(result.multiplies),
                        "rank_transfers": len(result.gets) + len(result.deliveries),
                        "rank_received": len(result.received) + len(result.served),
                    }
                )
            del result
        seconds.append(slowest)
        cpu_seconds.append(slowest_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if case != "auto" and nranks <= whole_max_ranks:
        # Outside the timed region: how even the whole plan is (see Plan.balance).
        whole = plan_of(case, nranks, dim)
        flops = whole.flops
        counts.update(
            multiplies=len(whole.multiplies),
            transfers=len(whole.transfers),
            flops_ratio=max(flops) * len(flops) / sum(flops) if sum(flops) else 1.0,
            balance_ratio=whole.balance().ratio,
            total_bytes=sum(whole.bytes_sent()),
        )
    return {
        "case": case,
        "nranks": nranks,
        "ranks_timed": list(ranks),
        "seconds": statistics.median(seconds),
        "seconds_all": seconds,
        "cpu_seconds": statistics.median(cpu_seconds),
        "peak_mib": max(0, peak - before) / 1024,
        **counts,
    }


def _run_child(case: str, nranks: int, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.planner_scaling",
        "--one",
        case,
        str(nranks),
        "--dim",
        str(args.dim),
        "--repeats",
        str(args.repeats),
        "--whole-max-ranks",
        str(args.whole_max_ranks),
    ]
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, timeout=args.timeout, check=True
        )
    except subprocess.TimeoutExpired:
        return {"case": case, "nranks": nranks, "timed_out": args.timeout}
    except subprocess.CalledProcessError as e:
        return {"case": case, "nranks": nranks, "error": e.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def run_all(args) -> dict:
    results = []
    for case in args.cases:
        top = args.auto_max_ranks if case == "auto" else args.max_ranks
        nranks = args.min_ranks
        while nranks <= top:
            record = _run_child(case, nranks, args)
            results.append(record)
            if "seconds" in record:
                balance = (
                    f"  busiest {record['balance_ratio']:.3f}x mean"
                    if "balance_ratio" in record
                    else ""
                )
                print(
                    f"{case:8s} P={nranks:6d}  {record['seconds']:9.3f} s  "
                    f"(cpu {record['cpu_seconds']:.3f} s)  "
                    f"{record['peak_mib']:9.1f} MiB{balance}  (load {_load()})",
                    flush=True,
                )
            else:
                print(f"{case:8s} P={nranks:6d}  {record}", flush=True)
            if record.get("seconds", float("inf")) > args.budget:
                print(f"{case:8s} over the {args.budget:g} s budget: larger P skipped", flush=True)
                break
            nranks *= 2
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_after": _load(),
        },
        "settings": {
            "dim": args.dim,
            "repeats": args.repeats,
            "budget_s": args.budget,
            "max_ranks": args.max_ranks,
            "auto_max_ranks": args.auto_max_ranks,
            "whole_max_ranks": args.whole_max_ranks,
        },
        "results": results,
    }


def markdown(report: dict) -> str:
    """A Markdown table: one row per P, seconds and peak MiB per case."""
    cases = [c for c in CASES if any(r["case"] == c for r in report["results"])]
    by = {(r["case"], r["nranks"]): r for r in report["results"]}
    ranks = sorted({r["nranks"] for r in report["results"]})
    head = "| P | " + " | ".join(f"{c} s (cpu s) | {c} MiB" for c in cases) + " |"
    rule = "|---:|" + "---:|---:|" * len(cases)
    lines = [
        f"Time to build one rank's part of the plan, layouts included (the slowest of ranks 0, "
        f"P/2 and P-1; median of {report['settings']['repeats']}) and peak memory; ``auto``: "
        f"auto_layouts over every rank, "
        f"M = K = N = {report['settings']['dim']}; {report['machine']['cpus']} CPUs, "
        f"load average after the run {report['machine']['loadavg_after']}; {report['date']}.",
        "",
        head,
        rule,
    ]
    for p in ranks:
        cells = []
        for c in cases:
            r = by.get((c, p))
            if r is None:
                cells += ["", ""]
            elif "seconds" in r:
                fewer = "*" if len(r["seconds_all"]) < report["settings"]["repeats"] else ""
                cpu = f" ({r['cpu_seconds']:.3f})" if "cpu_seconds" in r else ""
                cells += [f"{r['seconds']:.3f}{cpu}{fewer}", f"{r['peak_mib']:.1f}"]
            else:
                cells += ["timeout" if "timed_out" in r else "error", ""]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if any(len(r.get("seconds_all", ())) < report["settings"]["repeats"] for r in by.values()):
        lines += ["", "\\* fewer runs than the others (measured on its own)."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """A log-log plot of seconds and peak MiB against P; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in CASES:
        rows = [r for r in report["results"] if r["case"] == case and "seconds" in r]
        if not rows:
            continue
        ps = [r["nranks"] for r in rows]
        (line,) = ax_t.plot(ps, [r["seconds"] for r in rows], "o-", label=case)
        if all("cpu_seconds" in r for r in rows):
            ax_t.plot(
                ps, [r["cpu_seconds"] for r in rows], ".--", color=line.get_color(), alpha=0.6
            )
        ax_m.plot(ps, [max(r["peak_mib"], 0.1) for r in rows], "o-", label=case)
    for ax, what in (
        (ax_t, "seconds to build one rank's plan (dashed: CPU)"),
        (ax_m, "peak memory (MiB)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("osmm_jax planner scaling (one process, no MPI)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


PEER_CASES = ("grid", "3d")
PEER_RANKS = (64, 1024, 8192)


def peers_markdown(dim: int) -> str:
    """Rank 0's :func:`peer_counts` for the cases that fetch pieces, at P = 64, 1024, 8192."""
    lines = [
        f"Per notified product on rank 0 (float32, 512 MiB slot budget, M = K = N = {dim}): the "
        "ranks it exchanges pieces with in the fetch and partials with in the reduce, the "
        "notifications it sends, and its resident slot windows; before: the fetch of a plan "
        "that also delivers partials heard from every rank.",
        "",
        "| case | P | fetch peers | reduce peers | notifications sent | before | slot windows MiB "
        "| before |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in PEER_CASES:
        for p in PEER_RANKS:
            c = peer_counts(plan_of(case, p, dim), 0)
            lines.append(
                f"| {case} | {p} | {c['fetch_peers']} | {c['reduce_peers']} | "
                f"{c['notifications']} | {c['notifications_all_to_all']} | "
                f"{c['window_bytes'] / 2**20:.0f} | {c['window_bytes_all_to_all'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-ranks", type=int, default=16384)
    parser.add_argument("--auto-max-ranks", type=int, default=8192)
    parser.add_argument("--min-ranks", type=int, default=64)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per P before skipping")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before one P is abandoned"
    )
    parser.add_argument("--repeats", type=int, default=3, help="builds per (case, P); median")
    parser.add_argument("--dim", type=int, default=65536, help="M = K = N")
    parser.add_argument(
        "--whole-max-ranks",
        type=int,
        default=512,
        help="also build the whole plan (after the timing) up to this P, for its balance",
    )
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "planner_scaling.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="only count each product's peers, notifications and windows on rank 0 (grid, 3d at "
        "P = 64, 1024, 8192) into results/planner_peers.md",
    )
    parser.add_argument("--one", nargs=2, metavar=("CASE", "P"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peers:
        text = peers_markdown(args.dim)
        (RESULTS_DIR / "planner_peers.md").write_text(text)
        print(text)
        return
    if args.one:
        case, nranks = args.one[0], int(args.one[1])
        print(json.dumps(measure_one(case, nranks, args.dim, args.repeats, args.whole_max_ranks)))
        return
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    report = run_all(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    if not args.no_plot and plot(report, args.out.with_suffix(".png")):
        print(f"wrote {args.out.with_suffix('.png')}")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
