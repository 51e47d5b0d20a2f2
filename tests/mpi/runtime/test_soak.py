"""Soak: thousands of jitted products over a few plans, watching for leaks and drift.

A long-running job runs the same few products over and over. This test does that on a small
scale (``OSMM_SOAK_PRODUCTS`` jitted products, default 5000, cycling over several plans with
different layouts, shapes, dtypes, methods and chunking) and checks that nothing accumulates:

* memory: each rank's resident set grows by less than 20 MiB between the end of the warm-up
  (the first products of every plan, which compile them and create the windows) and the end;
* windows: as many live windows of the same total size at the end as after the warm-up;
* native counters: after the warm-up every product of a plan adds exactly what it added during
  the warm-up (fences, epochs, RMA operations and bytes), and no agreement is run again;
* results: every 500th product, and the last, match numpy, with inputs that alternate between
  two sets so that a stale result could not pass.

Run on 3 ranks: ``mpiexec -n 3 .venv/bin/python tests/mpi/run.py tests/mpi/runtime/test_soak.py -q -s``.
"""

from __future__ import annotations

import gc
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import product_and_grads_step, rss_mib

import osmm_jax as om

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

COUNT_VARIABLE = "OSMM_SOAK_PRODUCTS"
DEFAULT_COUNT = 5000
WARMUP = 200  # products: 40 of each plan, the first of which compile
CHECK_EVERY = 500
RSS_LIMIT_MIB = 20.0
# Counters a product adds to (the others are live totals or agreements, checked apart).
PER_PRODUCT = ("rma_ops", "rma_bytes", "sent_bytes", "accumulates", "puts", "gets")
PER_PRODUCT += ("fences", "notifications", "calls")


class SoakPlan(NamedTuple):
    """One of the products the soak cycles over."""

    name: str
    a: om.Layout
    b: om.Layout
    c: om.Layout
    dtype: np.dtype
    method: str
    chunk_bytes: int
    grads: bool  # forward and both gradients (three distributed products per step)


def soak_plans() -> list[SoakPlan]:
    """Five products on 3 ranks, with unequal and empty blocks: a K-split reduced by
    accumulate, a row-by-column product into a grid sent in many chunks, a grid product by
    the all-reduce baseline, a replicated result, and a data-parallel training step."""
    rows = om.Layout.rows
    cols = om.Layout.cols
    grid = om.Layout.grid
    rep = om.Layout.replicated
    return [
        SoakPlan(
            "k_split",
            cols((9, 13), weights=[1, 2, 0]),
            rows((13, 7), weights=[1, 2, 0]),
            rows((9, 7), weights=[2, 0, 1]),
            np.dtype(np.float32),
            "one_sided",
            0,
            False,
        ),
        SoakPlan(
            "rows_cols_grid_chunked",
            rows((11, 5), weights=[0, 1, 3]),
            cols((5, 6), weights=[1, 1, 1]),
            grid((11, 6), (1, 3), row_weights=[1], col_weights=[2, 1, 0]),
            np.dtype(np.float64),
            "one_sided",
            16,
            False,
        ),
        SoakPlan(
            "grid_allreduce",
            grid((8, 10), (3, 1), row_weights=[1, 0, 1], col_weights=[1]),
            grid((10, 5), (1, 3), row_weights=[1], col_weights=[1, 2, 1]),
            grid((8, 5), (3, 1), row_weights=[2, 1, 1], col_weights=[1]),
            np.dtype(ml_dtypes.bfloat16),
            "allreduce",
            0,
            False,
        ),
        SoakPlan(
            "replicated_result",
            rep((6, 12)),
            cols((12, 4), weights=[3, 1, 1]),
            rep((6, 4)),
            np.dtype(np.float16),
            "one_sided",
            32,
            False,
        ),
        SoakPlan(
            "data_parallel_step",
            rows((10, 6), weights=[1, 2, 0]),
            rep((6, 3)),
            rows((10, 3), weights=[1, 2, 0]),
            np.dtype(np.float32),
            "one_sided",
            0,
            True,
        ),
    ]


def make_step(spec: SoakPlan):
    """The jitted step of ``spec``: ``(a_loc, b_loc, g_loc) -> (C, dA, dB)``, the gradients
    being those of ``sum(C * G)`` (zeros without gradients, to keep one signature)."""
    plan = om.plan(spec.a, spec.b, spec.c)

    def product(x, y):
        return om.matmul(x, y, plan, method=spec.method, chunk_bytes=spec.chunk_bytes)

    if spec.grads:
        return jax.jit(product_and_grads_step(product))

    def forward_only(x, y, g):
        return product(x, y), jnp.zeros_like(x), jnp.zeros_like(y)

    return jax.jit(forward_only)


def operand_sets(spec: SoakPlan, index: int):
    """Two sets of global (A, B, G) for ``spec``, in its dtype, alike on every rank."""
    (m, k), n = spec.a.shape, spec.b.shape[1]
    rng = np.random.default_rng([index, m, k, n])
    return [
        tuple(rng.standard_normal(s).astype(spec.dtype) for s in ((m, k), (k, n), (m, n)))
        for _ in range(2)
    ]


def check(spec: SoakPlan, operands, result, product_index: int) -> str | None:
    """Why this rank's C (and dA, dB) of ``spec`` do not match float64 numpy products of the
    same inputs, or None if they do."""
    a, b, g = (np.asarray(x, np.float64) for x in operands)
    tol = 4 * float(ml_dtypes.finfo(spec.dtype).eps) * a.shape[1]
    expected = [(spec.c, a @ b, abs(a) @ abs(b))]
    if spec.grads:
        expected += [(spec.a, g @ b.T, abs(g) @ abs(b.T)), (spec.b, a.T @ g, abs(a.T) @ abs(g))]
    for name, got, (layout, exact, scale) in zip(("C", "dA", "dB"), result, expected):
        try:
            np.testing.assert_allclose(
                np.asarray(got, np.float64),
                layout.shard(exact, RANK),
                rtol=0,
                atol=tol * max(1.0, float(scale.max())),
                err_msg=f"{spec.name}: {name} of product {product_index} is wrong",
            )
        except AssertionError as error:
            return str(error)
    return None


def fail_together(problem: str | None) -> None:
    """Fail on every rank if ``problem`` is set on any: a rank that stopped alone would leave
    the others waiting in their next product."""
    everyone = COMM.allgather(problem)
    failed = {r: p for r, p in enumerate(everyone) if p is not None}
    if failed:
        pytest.fail("\n".join(f"rank {r}: {p}" for r, p in failed.items()), pytrace=False)


def counters() -> dict:
    """This rank's native counters (om.stats), less the staging time, which is no count."""
    return {key: value for key, value in om.stats().items() if key != "staging_seconds"}


@pytest.mark.ranks(3)
def test_soak_products_leak_nothing():
    count = COMM.bcast(int(os.environ.get(COUNT_VARIABLE, "").strip() or DEFAULT_COUNT), root=0)
    assert count >= WARMUP + len(soak_plans()), f"{COUNT_VARIABLE}={count} is below the warm-up"
    specs = soak_plans()
    steps = [make_step(spec) for spec in specs]
    operands = [operand_sets(spec, i) for i, spec in enumerate(specs)]
    blocks = [
        [
            tuple(layout.shard(x, RANK) for layout, x in zip((spec.a, spec.b, spec.c), ops))
            for ops in pair
        ]
        for spec, pair in zip(specs, operands)
    ]
    runs = [0] * len(specs)
    deltas: list[dict | None] = [None] * len(specs)

    def run(product_index: int) -> dict:
        """Run product ``product_index`` (plan ``product_index % len(specs)``); check it when
        due; return what it added to the counters."""
        p = product_index % len(specs)
        which = runs[p] % 2
        before = counters()
        result = jax.block_until_ready(steps[p](*blocks[p][which]))
        after = counters()
        runs[p] += 1
        if product_index % CHECK_EVERY == 0 or product_index == count - 1:
            fail_together(check(specs[p], operands[p][which], result, product_index))
        return {key: after[key] - before[key] for key in PER_PRODUCT}

    # Warm-up: compile every plan, create the windows, and learn what one product of each
    # plan adds to the counters (the same every time once compiled).
    for i in range(WARMUP):
        added = run(i)
        p = i % len(specs)
        if runs[p] == 1:
            continue  # the compiling run
        steady = deltas[p] is None or added == deltas[p]
        fail_together(
            None
            if steady
            else f"{specs[p].name}: product {i} added {added} to the counters, "
            f"the one before {deltas[p]}"
        )
        deltas[p] = added

    gc.collect()
    COMM.Barrier()
    rss_start, start = rss_mib(), counters()
    runs_start = list(runs)
    started = time.perf_counter()
    for i in range(WARMUP, count):
        run(i)
    elapsed = time.perf_counter() - started
    gc.collect()
    COMM.Barrier()
    rss_end, end = rss_mib(), counters()
    growth = rss_end - rss_start
    total = sum(runs)

    everyone = COMM.gather((RANK, rss_start, rss_end), root=0)
    if RANK == 0:
        print(
            f"\nsoak: {total} jitted products over {len(specs)} plans, "
            f"{count - WARMUP} after the warm-up in {elapsed:.1f} s "
            f"({1e3 * elapsed / (count - WARMUP):.2f} ms each); RSS growth per rank: "
            + ", ".join(f"rank {r} {b - a:+.2f} MiB ({a:.0f} -> {b:.0f})" for r, a, b in everyone)
            + f"; windows {end['windows']} ({end['window_bytes']} bytes); rank 0 per product: "
            + ", ".join(
                f"{s.name} {d['fences']} fences {d['calls']} epochs {d['rma_ops']} RMA ops"
                for s, d in zip(specs, deltas)
            ),
            flush=True,
        )

    assert total >= count, f"only {total} of {count} products ran"
    assert growth < RSS_LIMIT_MIB, (
        f"rank {RANK}: resident memory grew by {growth:.2f} MiB over {count - WARMUP} products "
        f"({rss_start:.1f} -> {rss_end:.1f} MiB); the limit is {RSS_LIMIT_MIB} MiB"
    )
    for key in ("windows", "window_bytes"):
        assert end[key] == start[key], (
            f"rank {RANK}: {key} went from {start[key]} after the warm-up to {end[key]}"
        )
    assert end["agreements"] == start["agreements"], (
        f"rank {RANK}: {end['agreements'] - start['agreements']} agreements after the warm-up"
    )
    # The exact-count check below means something only if the products communicate (fenced,
    # or notified: OSMM_SYNC=notify).
    synced = any((d["fences"] or d["notifications"]) and d["rma_ops"] for d in deltas)
    assert synced, f"no fences, notifications or RMA: {deltas}"
    for key in PER_PRODUCT:
        expected = sum((runs[p] - runs_start[p]) * deltas[p][key] for p in range(len(specs)))
        assert end[key] - start[key] == expected, (
            f"rank {RANK}: {key} grew by {end[key] - start[key]} after the warm-up, expected "
            f"{expected} from the per-product amounts "
            + ", ".join(f"{s.name} {d[key]}" for s, d in zip(specs, deltas))
        )
