"""How close the layouts ``auto_layouts`` picks come to the communication lower bound.

No MPI, no device, no timing: for each product shape, rank count and speed mix it asks
:func:`osmm_jax.auto_layouts` for layouts, plans them, and compares the most elements one rank
moves (the input pieces it gets, the partials it sends to other ranks, and its share of keeping
a replicated operand in sync: a third of ``2 (P-1)/P`` of it, as auto_layouts prices it) with the most any rank must move with any
layout when work and data are shared by speed (:func:`osmm_jax._src.planning.comm_bound.rank_bounds`,
Loomis-Whitney). The same comparison for every candidate says whether a gap is the choice's
or the candidates' (``best candidate``). The chosen layouts' figure is
``LayoutChoice.bound_ratio``; auto_layouts itself prices each rank's link by the larger of what
it sends and what it receives, which the bound does not limit, so a choice may trade a little
of this ratio for a less loaded link. Deterministic: the results do not depend on the machine.

Shapes: square 8192^3, tall-skinny 65536 x 4096 x 4096, K-large 2048 x 65536 x 2048, flat
16384 x 1024 x 16384, and the GPT-3 FFN products 8192 x 12288 x 49152 and 8192 x 49152 x 12288
(M x K x N); P = 4, 8, 16, 64; equal speeds and a 1:1:2:2 mix (repeated). The cluster modelled:
15 TFLOP/s per speed unit (a GPU's float32 rate), 12.5 GB/s per rank (100 Gb/s links), 16 GiB
per rank for operands, float32, replicated operands kept in sync (auto_layouts' default).
Writes ``benchmarks/results/layout_bounds.json`` and ``.md``::

    python -m benchmarks.layout_bounds
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHAPES = {
    "square": (8192, 8192, 8192),
    "tall-skinny": (65536, 4096, 4096),
    "K-large": (2048, 65536, 2048),
    "flat": (16384, 1024, 16384),
    "GPT-3 FFN up": (8192, 12288, 49152),
    "GPT-3 FFN down": (8192, 49152, 12288),
}
RANKS = (4, 8, 16, 64)
MIXES = {"equal": (1.0,), "1:1:2:2": (1.0, 1.0, 2.0, 2.0)}
GFLOPS_PER_UNIT = 15000.0
BANDWIDTH = 12.5e9
MEMORY_BUDGET = 16 * 2**30
TARGET = 1.5
ACCUM_BYTES = 4  # float32 inputs, partials and gradients


def moved_with_sync(plan, choice_candidate, nranks: int) -> list[float]:
    """Elements each rank moves with ``plan``, its share of keeping replicas in sync included."""
    from osmm_jax._src.planning import comm_bound

    sync = choice_candidate.sync_bytes / ACCUM_BYTES
    return [m + sync for m in comm_bound.moved_elements(plan)]


def evaluate(name: str, dims: tuple[int, int, int], nranks: int, mix: str) -> dict:
    """The choice, its ratio to the bound, and every candidate's ratio, for one case."""
    from osmm_jax._src.planning import auto_layout, comm_bound
    from osmm_jax._src.planning.plan import Plan

    M, K, N = dims
    unit = MIXES[mix]
    speeds = [GFLOPS_PER_UNIT * unit[r % len(unit)] for r in range(nranks)]
    bound = max(comm_bound.rank_bounds(M, K, N, speeds))
    choice = auto_layout.auto_layouts(
        M, K, N, speeds, bandwidth=BANDWIDTH, memory_budget=MEMORY_BUDGET
    )
    by_name = {c.name: c for c in choice.candidates}
    ratios = {}
    for cand_name, a, b, c, work in auto_layout.candidate_layouts(M, K, N, speeds):
        cand = by_name[cand_name]
        moved = max(moved_with_sync(Plan(a, b, c, work=work), cand, nranks))
        ratios[cand_name] = {
            "ratio": moved / bound if bound else None,
            "fits": cand.fits,
            "predicted_seconds": cand.predicted_seconds,
        }
    best = min(
        (n for n, r in ratios.items() if r["fits"] and r["ratio"] is not None),
        key=lambda n: ratios[n]["ratio"],
    )
    return {
        "shape": name,
        "dims": dims,
        "nranks": nranks,
        "mix": mix,
        "bound_elements": bound,
        "chosen": choice.name,
        "chosen_ratio": ratios[choice.name]["ratio"],
        "best_candidate": best,
        "best_ratio": ratios[best]["ratio"],
        "candidates": ratios,
        "reason": choice.reason,
    }


def markdown(report: dict) -> str:
    """The results as a markdown table, with a summary against the target."""
    rows = report["results"]
    within = sum(1 for r in rows if r["chosen_ratio"] <= TARGET)
    lines = [
        "Communication of the layouts `auto_layouts` picks against the lower bound (most "
        "elements one rank moves / most any rank must move; Loomis-Whitney with work and data "
        f"shared by speed). Float32, {GFLOPS_PER_UNIT / 1000:g} TFLOP/s per speed unit, "
        f"{BANDWIDTH / 1e9:g} GB/s per rank, {MEMORY_BUDGET / 2**30:g} GiB per rank, "
        f"replicated operands kept in sync; {report['date']}.",
        "",
        f"Within {TARGET}x of the bound: {within} of {len(rows)} cases.",
        "",
        "| shape (M x K x N) | P | speeds | chosen | chosen / bound | best candidate | "
        "best / bound |",
        "|---|---:|---|---|---:|---|---:|",
    ]
    for r in rows:
        m, k, n = r["dims"]
        mark = "" if r["chosen_ratio"] <= TARGET else " (over)"
        lines.append(
            f"| {r['shape']} ({m} x {k} x {n}) | {r['nranks']} | {r['mix']} | {r['chosen']} | "
            f"{r['chosen_ratio']:.2f}{mark} | {r['best_candidate']} | {r['best_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(shapes=SHAPES, ranks=RANKS, mixes=MIXES) -> dict:
    results = [
        evaluate(name, dims, p, mix)
        for name, dims in shapes.items()
        for p in ranks
        for mix in mixes
    ]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "gflops_per_unit": GFLOPS_PER_UNIT,
            "bandwidth": BANDWIDTH,
            "memory_budget": MEMORY_BUDGET,
            "target": TARGET,
        },
        "results": results,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "layout_bounds.json")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated P")
    args = parser.parse_args(argv)
    ranks = tuple(int(p) for p in args.ranks.split(",") if p)
    report = run(ranks=ranks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
