"""Time osmm_jax's one_sided method against its peers on one distributed product.

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

Timed side by side (jitted, warmed up, then ``--repeats`` rounds interleaved A B
C ..., each round's time being the slowest rank's; medians reported): osmm_jax's
``one_sided`` and ``allreduce``; the floor (this rank's GEMMs alone, no
communication); the reference (rank 0 doing the whole product); and with
``--peers`` JAX's own multi-process path on the same ranks (gloo collectives:
``jit`` over a NamedSharding, and ``shard_map`` with ``psum_scatter``). Also the
bytes moved by the RMA operations each rank issued (``osmm_jax.stats()``) next
to the plan's prediction. Rank 0 prints a Markdown table.
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


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds per entry of ``{name: (fn, args)}``, timed A B C A B C ... after a warm-up.

    A repetition's time is the slowest rank's. Interleaving makes drift on a
    shared machine hit every method alike.
    """
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            COMM.Barrier()
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {name: float(np.median(t)) for name, t in times.items()}


def local_floor(plan, a, b):
    """This rank's GEMMs of ``plan`` alone, on local stand-ins of every piece: no communication."""

    def run(a, b):
        outs = []
        for m in plan.multiplies_on(RANK):
            rows, inner, cols = (hi - lo for lo, hi in (m.rows, m.inner, m.cols))
            x = (
                jnp.zeros((rows, inner), a.dtype) + a.ravel()[:1]
                if a.size
                else jnp.zeros((rows, inner), a.dtype)
            )
            y = (
                jnp.zeros((inner, cols), b.dtype) + b.ravel()[:1]
                if b.size
                else jnp.zeros((inner, cols), b.dtype)
            )
            outs.append(jnp.dot(x, y, preferred_element_type=jnp.float32))
        return outs

    return jax.jit(run)


def jax_peers(case: str, plan, a, b):
    """JAX's own multi-process path on the same ranks: jit over NamedSharding and shard_map."""
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    specs = {"k_split": (P(None, "x"), P("x", None)), "rows": (P("x", None), P(None, None))}[case]
    a_global = jax.make_array_from_single_device_arrays(
        plan.a.shape, NamedSharding(mesh, specs[0]), [jax.device_put(a, jax.local_devices()[0])]
    )
    b_global = jax.make_array_from_single_device_arrays(
        plan.b.shape, NamedSharding(mesh, specs[1]), [jax.device_put(b, jax.local_devices()[0])]
    )
    out = NamedSharding(mesh, P("x", None))
    named = jax.jit(lambda x, y: x @ y, out_shardings=out)

    def local(x, y):
        c = x @ y
        return (
            jax.lax.psum_scatter(c, "x", scatter_dimension=0, tiled=True)
            if case == "k_split"
            else c
        )

    mapped = jax.jit(shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x", None)))
    return {
        "jax_named_sharding": (named, (a_global, b_global)),
        "jax_shard_map": (mapped, (a_global, b_global)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="one_sided vs its peers on one distributed product"
    )
    parser.add_argument("--case", choices=("k_split", "rows", "grid"), default="k_split")
    parser.add_argument("--size", type=int, default=2048, help="M = K = N unless given separately")
    parser.add_argument("--m", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also time JAX's multi-process path (k_split and rows; needs even splits)",
    )
    args = parser.parse_args()
    if args.peers:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(cluster_detection_method="mpi4py")
    m, k, n = (v or args.size for v in (args.m, args.k, args.n))

    a_layout, b_layout, c_layout = layouts(args.case, m, k, n)
    plan = om.plan(a_layout, b_layout, c_layout)
    rng = np.random.default_rng(RANK)
    dtype = jnp.dtype(args.dtype)
    a = jnp.asarray(rng.standard_normal(a_layout.local_shape(RANK)), dtype)
    b = jnp.asarray(rng.standard_normal(b_layout.local_shape(RANK)), dtype)

    fns = {
        method: (jax.jit(lambda x, y, method=method: om.matmul(x, y, plan, method=method)), (a, b))
        for method in ("one_sided", "allreduce")
    }
    fns["floor (local GEMMs only)"] = (local_floor(plan, a, b), (a, b))
    full_a = jnp.ones((m, k) if RANK == 0 else (0, k), dtype)
    full_b = jnp.ones((k, n) if RANK == 0 else (k, 0), dtype)
    fns["reference (rank 0 alone)"] = (jax.jit(jnp.dot), (full_a, full_b))
    if args.peers and args.case in ("k_split", "rows"):
        fns.update(jax_peers(args.case, plan, a, b))

    before = om.stats()["rma_bytes"]
    medians = interleaved_medians(fns, args.repeats)
    sent = (om.stats()["rma_bytes"] - before) // (args.repeats + 1)
    sent_by_rank = COMM.gather(sent)

    if RANK == 0:
        flops = 2 * m * k * n
        predicted = plan.bytes_issued(dtype.itemsize, 4)
        print(
            f"\n{args.case}: C[{m}x{n}] = A[{m}x{k}] @ B[{k}x{n}], {args.dtype}, {SIZE} ranks, "
            f"median of {args.repeats}, interleaved\n"
        )
        print("| method | time (ms) | GFLOP/s | one_sided is ... x faster |")
        print("| --- | --- | --- | --- |")
        for name, seconds in medians.items():
            ratio = seconds / medians["one_sided"]
            print(f"| {name} | {seconds * 1e3:.1f} | {flops / seconds / 1e9:.1f} | {ratio:.2f} |")
        fmt = lambda xs: ", ".join(f"{x / 2**20:.2f}" for x in xs)  # noqa: E731
        print(
            f"\nMiB moved by one_sided RMA per rank per product: measured {fmt(sent_by_rank)}, "
            f"planned {fmt(predicted)}"
        )


if __name__ == "__main__":
    main()
