"""Measure the memory a distributed product holds on each rank, against what it needs.

Run under MPI, with glibc's malloc told to give large blocks back to the system when they are
freed (otherwise it keeps freed memory resident and reuses it, and a product's peak hides in
what the previous one left), e.g.::

    MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/mpiexec -n 4 .venv/bin/python -m benchmarks.memory \\
        --n 6144 --json benchmarks/results/memory.json

For every layout family (``rows``: A by rows, B replicated, C by rows; ``k_split``: A by
columns, B and C by rows; ``grid``: all three on a 2-D grid, as square as the rank count
allows; ``sequence``, only when named in ``--families``: A by rows, B and C by columns, a
sequence-parallel column layer, whose forward product gathers A's rows), both methods
(``one_sided``, ``allreduce``; ``--keep-fetched``: one_sided with ``keep_fetched``) and both
directions (``forward``: the
jitted product; ``backward``: the jitted vector-Jacobian product with respect to A and B for
a cotangent of C given as an argument, as in training (a constant one, such as the gradient
of a sum, XLA folds into the program), which runs the forward product and both backward
ones), on every rank:

* ``needed``: the rank's blocks of A, B and C plus the bytes it receives (the plan's
  ``bytes_received``; for the backward pass, the forward's and both backward plans' summed,
  less the pieces the backward products take from another product's fetch);
* ``held``: the call's arguments (the rank's A and B blocks, and the cotangent) plus the
  resident-set high-water mark above the resident set before the call (``/proc/self/status``
  VmHWM, reset through ``/proc/self/clear_refs``), each call after osmm_jax's windows were
  freed, so that the windows it creates count; less the pages of other ranks' windows it
  wrote into, plus the pages of its own that only other ranks wrote (:func:`benchmarks.pages.window_pages`);
* ``kept``: what stays resident after the call, its result dropped (windows, slots, caches),
  counted the same way;
* ``released``: how much of the resident set :func:`osmm_jax.release` then gives back (the
  windows it frees);
* ``predicted``: :func:`osmm_jax.memory_bytes` for the rank, the method and the direction.

Within a node MPICH maps every rank's window memory into every process, and Linux counts a
shared page in the resident set of each process that touched it, so ``held`` and ``kept``
count a window page on the rank that owns it (``benchmarks/pages.py``). Other ranks' pages
are counted as they are after the call; the fetch writes them at the call's start and the
deliveries while the partials they come from are alive, so the peak includes them.

Every figure is the median over ``--repeats`` calls. Rank 0 prints a Markdown table with
held / needed and held / predicted per case and rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks import common
from benchmarks.common import COMM, RANK, SIZE
from benchmarks.pages import window_pages
from osmm_jax._src.runtime import backward, slots

MiB = 2**20
FAMILIES = ("rows", "k_split", "grid")
OTHER_FAMILIES = ("sequence",)  # timed only when asked for (--families)
METHODS = ("one_sided", "allreduce")
DIRECTIONS = ("forward", "backward")


def layouts(family: str, n: int):
    """(A, B, C) layouts of an ``n x n x n`` product of ``family`` on every rank."""
    if family == "rows":
        return om.Layout.rows((n, n)), om.Layout.replicated((n, n)), om.Layout.rows((n, n))
    if family == "k_split":
        return om.Layout.cols((n, n)), om.Layout.rows((n, n)), om.Layout.rows((n, n))
    if family == "sequence":  # a sequence-parallel column layer: gathers A's rows
        return om.Layout.rows((n, n)), om.Layout.cols((n, n)), om.Layout.cols((n, n))
    rows = max(d for d in range(1, int(SIZE**0.5) + 1) if SIZE % d == 0)
    grid = (rows, SIZE // rows)
    return tuple(om.Layout.grid((n, n), grid) for _ in range(3))


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """Start the resident-set high-water mark again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def needed_bytes(plan, direction: str, keep_fetched: bool = False) -> int:
    """This rank's A, B and C blocks plus the bytes it receives, for ``direction`` (backward:
    less the pieces the backward products take from dA's fetch and, with ``keep_fetched``,
    from the forward product's, which they do not receive again)."""
    blocks = sum(int(np.prod(layout.local_shape(RANK))) * 4 for layout in (plan.a, plan.b, plan.c))
    if direction == "forward":
        return blocks + plan.bytes_received()[RANK]
    received = sum(p.bytes_received()[RANK] for p in (plan, *plan.backward()))
    sync = slots.Sync("notify")
    how = backward.reuse(plan, sync, backward.shares_cotangent(plan, sync), keep_fetched)
    taken = sum(
        t.elements * 4
        for product in backward.PRODUCTS
        for t in (backward.taken(plan, RANK, product, how) or ())
        if t.origin == RANK
    )
    return blocks + received - taken


def measure(
    family: str, method: str, direction: str, n: int, repeats: int, keep: bool = False
) -> dict:
    """This rank's figures for one case (bytes); ``keep``: ``keep_fetched``."""
    plan = om.plan(*layouts(family, n))
    rng = np.random.default_rng(RANK)
    a = jnp.asarray(rng.standard_normal(plan.a.local_shape(RANK)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(plan.b.local_shape(RANK)), jnp.float32)
    product = lambda x, y: om.matmul(x, y, plan, method=method, keep_fetched=keep)  # noqa: E731
    if direction == "forward":
        fn, args = jax.jit(product), (a, b)
    else:  # a cotangent XLA cannot fold into constants, as in training
        dc = jnp.asarray(rng.standard_normal(plan.c.local_shape(RANK)), jnp.float32)
        fn, args = jax.jit(lambda x, y, d: jax.vjp(product, x, y)[1](d)), (a, b, dc)
    jax.block_until_ready(fn(*args))  # compile
    jax.effects_barrier()
    held, kept = [], []
    for _ in range(repeats):
        om.release()  # each measured call creates the windows it needs
        gc.collect()
        COMM.Barrier()
        before = _status_bytes("VmRSS")
        _reset_peak()
        out = jax.block_until_ready(fn(*args))
        peak = _status_bytes("VmHWM")
        del out
        gc.collect()
        correction = window_pages()
        held.append(peak - before + correction + sum(x.nbytes for x in args))
        kept.append(_status_bytes("VmRSS") - before + correction)
    window_bytes = om.stats()["window_bytes"]
    resident = _status_bytes("VmRSS") + window_pages()
    om.release()
    released = resident - _status_bytes("VmRSS")
    predicted = om.memory_bytes(plan, RANK, method=method, direction=direction, keep_fetched=keep)
    return {
        "needed": needed_bytes(plan, direction, keep),
        "predicted": predicted.total,
        "held": statistics.median(held),
        "kept": statistics.median(kept),
        "window_bytes": window_bytes,
        "released": released,
    }


def print_table(records: list[dict]) -> None:
    """Rank 0: one row per case and rank, MiB and held / needed."""
    print(
        "| family | method | direction | rank | needed MiB | held MiB | held / needed | kept MiB "
        "| released MiB | predicted MiB | held / predicted |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rec in records:
        for rank, r in enumerate(rec["ranks"]):
            print(
                f"| {rec['family']} | {rec['method']} | {rec['direction']} | {rank} | "
                f"{r['needed'] / MiB:.0f} | {r['held'] / MiB:.0f} | "
                f"{r['held'] / max(r['needed'], 1):.2f} | {r['kept'] / MiB:.0f} | "
                f"{r.get('released', 0) / MiB:.0f} | "
                f"{r['predicted'] / MiB:.0f} | {r['held'] / max(r['predicted'], 1):.2f} |"
            )


def draw(path: str, out: str, labels: list[str] | None = None) -> None:
    """A bar chart of held / needed (the worst rank) per case, one bar per record of the JSON
    list at ``path`` (its ``label`` in the legend; only those ``labels`` if given, in their
    order), saved to ``out``."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads(Path(path).read_text())
    if labels:
        by_label = {run["label"]: run for run in runs}
        runs = [by_label[label] for label in labels]
    key = lambda r: (r["family"], r["method"], r["direction"])  # noqa: E731
    cases = list(dict.fromkeys(key(r) for run in runs for r in run["records"]))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):  # a record may hold some of the cases only
        where = [cases.index(key(r)) + i * width for r in run["records"]]
        ratios = [max(x["held"] / x["needed"] for x in r["ranks"]) for r in run["records"]]
        ax.bar(where, ratios, width, label=run["label"])
    ax.axhline(1.3, color="black", linestyle="--", linewidth=1, label="1.3x")
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    ax.set_xticklabels(["\n".join(c) for c in cases], fontsize=7)
    ax.set_ylabel("held / needed (worst rank)")
    ax.set_title(f"memory per rank, {runs[0]['ranks']} ranks, {runs[0]['n']}^3 float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=6144, help="M = K = N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"of {', '.join(FAMILIES + OTHER_FAMILIES)}",
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--directions", default=",".join(DIRECTIONS))
    parser.add_argument(
        "--keep-fetched", action="store_true", help="one_sided: matmul's keep_fetched"
    )
    parser.add_argument("--json", default=None, help="append the record to this JSON list")
    parser.add_argument("--label", default="", help="the record's name in the picture")
    parser.add_argument(
        "--draw", default=None, help="only draw the JSON list at --json to this PNG, no MPI"
    )
    parser.add_argument(
        "--draw-label",
        action="append",
        default=None,
        help="with --draw: a record to draw (repeat it; default every record)",
    )
    args = parser.parse_args(argv)
    if args.draw:
        draw(args.json, args.draw, args.draw_label)
        return
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        raise SystemExit(
            "set MALLOC_MMAP_THRESHOLD_=1048576 (glibc then returns freed blocks of 1 MiB and "
            "more to the system, so each call's peak is its own); see the module docstring"
        )
    records = []
    for family in args.families.split(","):
        for method in args.methods.split(","):
            for direction in args.directions.split(","):
                keep = args.keep_fetched and method == "one_sided"
                mine = measure(family, method, direction, args.n, args.repeats, keep)
                records.append(
                    {
                        "family": family,
                        "method": method,
                        "direction": direction,
                        **({"keep_fetched": True} if keep else {}),
                        "ranks": COMM.allgather(mine),
                    }
                )
                jax.clear_caches()
    if RANK == 0:
        print(f"\n{SIZE} ranks, {args.n}^3 float32 (median of {args.repeats} calls)\n")
        print_table(records)
    record = {"title": "memory per rank", "ranks": SIZE, "n": args.n, "records": records}
    common.save({**record, "label": args.label} if args.label else record, args.json)


if __name__ == "__main__":
    main()
