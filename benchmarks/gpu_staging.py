"""The FFN products on GPUs: one_sided, allreduce and one GPU alone, in TFLOP/s, with the
share of one_sided's time spent staging between GPU and host memory.

Run under MPI on a machine with an NVIDIA GPU (``make gpu-bench``)::

    JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 .venv/bin/mpiexec -n 2 \\
        .venv/bin/python -m benchmarks.gpu_staging --m 8190 --k 8192 --n 22016

The FFN of a data-parallel layer: forward C = A·W (A by rows, W replicated, C by rows: no
communication), and the weight gradient dW = Aᵀ·dC (K-split: every rank holds a partial of
all of dW, reduced onto every rank). Staging: the CUDA handlers' device <-> host copies,
from ``osmm_jax.stats()`` (``staging_seconds`` of the slowest rank over the wall time).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om
from benchmarks.common import COMM, RANK, SIZE, interleaved_times


def _time(fn, args, repeats):
    """Median seconds of ``fn(*args)`` (each time the slowest rank's), after one warm-up."""
    return float(np.median(interleaved_times({"fn": (fn, args)}, repeats, warmup=1)["fn"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8190)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=22016)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    m, k, n = args.m, args.k, args.n
    rows = om.Layout.rows((m, k))
    products = {
        "forward C = A·W": om.plan(rows, om.Layout.replicated((k, n)), om.Layout.rows((m, n))),
        "gradient dW = Aᵀ·dC": om.plan(
            om.Layout.cols((k, m)), om.Layout.rows((m, n)), om.Layout.replicated((k, n))
        ),
    }
    if RANK == 0:
        print(f"{SIZE} ranks, {jax.devices()[0].device_kind}, {args.dtype}, M={m} K={k} N={n}")
        print("| product | method | ms | TFLOP/s | staging share |")
        print("| --- | --- | ---: | ---: | ---: |")
    for name, plan in products.items():
        a = jnp.ones(plan.a.local_shape(RANK), dtype)
        b = jnp.ones(plan.b.local_shape(RANK), dtype)
        gm, gk = plan.a.shape
        flops = 2.0 * gm * gk * plan.b.shape[1]
        for method in ("one_sided", "allreduce"):
            fn = jax.jit(
                lambda x, y, method=method, plan=plan: om.matmul(x, y, plan, method=method)
            )
            before = om.stats()["staging_seconds"]
            seconds = _time(fn, (a, b), args.repeats)
            staged = COMM.allreduce(om.stats()["staging_seconds"] - before, op=MPI.MAX)
            share = staged / ((args.repeats + 1) * seconds)
            if RANK == 0:
                print(
                    f"| {name} | {method} | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.1f} "
                    f"| {share:.0%} |"
                )
        whole_a = jnp.ones(plan.a.shape if RANK == 0 else (0, gk), dtype)
        whole_b = jnp.ones(plan.b.shape if RANK == 0 else (gk, 0), dtype)
        seconds = _time(jax.jit(jnp.dot), (whole_a, whole_b), args.repeats)
        if RANK == 0:
            print(
                f"| {name} | one GPU alone | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.1f} | |"
            )


if __name__ == "__main__":
    main()
