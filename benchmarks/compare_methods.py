"""Time osmm_jax's one_sided method against the all-reduce baseline on one product.

Run under MPI, e.g.::

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.compare_methods --case k_split --size 2048

Cases (float32 unless ``--dtype``):

``k_split``
    A split by columns, B by rows, C by rows: every rank holds a partial of all of C,
    which must be reduced and scattered (one-sided: each partial block goes straight
    to its owner by MPI_Accumulate; baseline: an all-reduce of the whole C).
``rows``
    A split by rows, B replicated, C by rows: no communication at all (the floor).
``grid``
    A, B and C on a 2-D grid (as square as the rank count allows).

Each method is jitted, warmed up, then timed ``--repeats`` times; a repetition's
time is the slowest rank's, and the median is reported, with GFLOP/s and the
bytes moved by the RMA operations each rank issued (measured by
``osmm_jax.stats()``, next to the plan's prediction). Rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def layouts(case: str, m: int, k: int, n: int):
    if case == "k_split":
        return om.Layout.cols((m, k)), om.Layout.rows((k, n)), om.Layout.rows((m, n))
    if case == "rows":
        return om.Layout.rows((m, k)), om.Layout.replicated((k, n)), om.Layout.rows((m, n))
    if case == "grid":
        pr = max(d for d in range(1, int(SIZE**0.5) + 1) if SIZE % d == 0)
        grid = (pr, SIZE // pr)
        return (
            om.Layout.grid((m, k), grid),
            om.Layout.grid((k, n), grid),
            om.Layout.grid((m, n), grid),
        )
    raise ValueError(f"unknown case {case!r}")


def median_time(fn, args, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's wall time, in seconds, after a warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description="one_sided vs allreduce on one distributed product"
    )
    parser.add_argument("--case", choices=("k_split", "rows", "grid"), default="k_split")
    parser.add_argument("--size", type=int, default=2048, help="M = K = N unless given separately")
    parser.add_argument("--m", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    m, k, n = (v or args.size for v in (args.m, args.k, args.n))

    a_layout, b_layout, c_layout = layouts(args.case, m, k, n)
    plan = om.plan(a_layout, b_layout, c_layout)
    rng = np.random.default_rng(RANK)
    dtype = jnp.dtype(args.dtype)
    a = jnp.asarray(rng.standard_normal(a_layout.local_shape(RANK)), dtype)
    b = jnp.asarray(rng.standard_normal(b_layout.local_shape(RANK)), dtype)

    rows = []
    for method in ("one_sided", "allreduce"):
        fn = jax.jit(lambda x, y, method=method: om.matmul(x, y, plan, method=method))
        before = om.stats()["rma_bytes"]
        seconds = median_time(fn, (a, b), args.repeats)
        sent = (om.stats()["rma_bytes"] - before) // (args.repeats + 1)
        rows.append((method, seconds, COMM.gather(sent)))

    if RANK == 0:
        flops = 2 * m * k * n
        predicted = plan.bytes_issued(dtype.itemsize, 4)
        print(
            f"\n{args.case}: C[{m}x{n}] = A[{m}x{k}] @ B[{k}x{n}], {args.dtype}, {SIZE} ranks, "
            f"median of {args.repeats}\n"
        )
        print(
            "| method | time (ms) | GFLOP/s | MiB moved by RMA per rank (measured) | MiB (planned) |"
        )
        print("| --- | --- | --- | --- | --- |")
        for method, seconds, sent in rows:
            planned = predicted if method == "one_sided" else ["-"] * SIZE
            fmt = lambda xs: ", ".join(x if isinstance(x, str) else f"{x / 2**20:.1f}" for x in xs)  # noqa: E731
            print(
                f"| {method} | {seconds * 1e3:.1f} | {flops / seconds / 1e9:.1f} | {fmt(sent)} | {fmt(planned)} |"
            )
        speedup = rows[1][1] / rows[0][1]
        print(f"\none_sided is {speedup:.2f}x the speed of the allreduce baseline")


if __name__ == "__main__":
    main()
