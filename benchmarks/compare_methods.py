"""Time osmm_jax's one_sided method against its peers on one distributed product.

Run under MPI, e.g.::

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.compare_methods --case k_split --size 2048
    .venv/bin/mpiexec -n 3 -bind-to user:0,0,1 .venv/bin/python -m benchmarks.compare_methods \\
        --case rows --m 2048 --k 2048 --n 5504 --split both --peers

Cases (float32 unless ``--dtype``):

``k_split``
    A split by columns, B by rows, C by rows: every rank holds a partial of all of C,
    which must be reduced and scattered (one-sided: each partial block goes straight
    to its owner by MPI_Accumulate; baseline: an all-reduce of the whole C).
``rows``
    A split by rows, B replicated, C by rows (the forward product of a data-parallel
    dense layer): no communication at all.
``grid``
    A, B and C on a 2-D grid (as square as the rank count allows).

``--split`` chooses how rows (and the K-split's inner dimension) are divided: ``uniform``,
``speed`` (in proportion to the GEMM rates ``osmm_jax.profile_speeds`` measures at the
start), or ``both`` (the speed-weighted split is "one_sided"; uniform variants are timed
next to it). ``--sizes 64,128,...`` runs the case once per size (per-call overhead).

Timed side by side, in one process per rank, jitted, warmed up, then ``--repeats`` rounds
interleaved A B C ..., each round's time being the slowest rank's; medians reported:

* ``one_sided`` (overlap on, the default chunk size) and ``one_sided, overlap off``
  (``chunk_bytes=0``; only when the plan sends anything);
* ``allreduce``, the mpi4jax baseline;
* with ``--progress off,thread,...``, ``one_sided, progress <mode>`` (and ``..., overlap off,
  progress <mode>``) for each mode: who makes MPI progress during the reduce
  (``OSMM_PROGRESS``; plain ``one_sided`` keeps the environment's setting);
* ``floor``: this rank's GEMMs alone, no communication;
* ``reference``: rank 0 doing the whole product alone;
* with ``--peers``, JAX's own multi-process path on the same ranks (gloo collectives):
  ``jax_named_sharding`` (``jax.jit`` over NamedSharding inputs; uniform splits only, the
  only kind it has) and ``jax_shard_map`` (local dots plus ``psum_scatter``; not for grids).

Also reported: the bytes each rank's RMA operations moved (``osmm_jax.stats()``) next to the
plan's prediction, the efficiency of one_sided against the aggregate limit (the time the
slowest rank needs for its share at its own measured GEMM rate), and memory (peak RSS per
rank, MPI window bytes, operand bytes). Rank 0 prints a Markdown table and, with
``--json``, appends the record to a JSON list (``benchmarks/report.py`` turns those into
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks import common
from benchmarks.common import COMM, RANK, SIZE


def layouts(case: str, m: int, k: int, n: int, weights=None):
    """(A, B, C) layouts of ``case``; ``weights`` divide rows / the inner dimension."""
    if case == "k_split":
        return (
            om.Layout.cols((m, k), weights=weights),
            om.Layout.rows((k, n), weights=weights),
            om.Layout.rows((m, n), weights=weights),
        )
    if case == "rows":
        return (
            om.Layout.rows((m, k), weights=weights),
            om.Layout.replicated((k, n)),
            om.Layout.rows((m, n), weights=weights),
        )
    if case == "grid":
        pr = max(d for d in range(1, int(SIZE**0.5) + 1) if SIZE % d == 0)
        grid = (pr, SIZE // pr)
        return (
            om.Layout.grid((m, k), grid),
            om.Layout.grid((k, n), grid),
            om.Layout.grid((m, n), grid),
        )
    raise ValueError(f"unknown case {case!r}")


def local_blocks(plan: om.Plan, dtype, seed: int = 0):
    rng = np.random.default_rng(seed + RANK)
    a = jnp.asarray(rng.standard_normal(plan.a.local_shape(RANK)), dtype)
    b = jnp.asarray(rng.standard_normal(plan.b.local_shape(RANK)), dtype)
    return a, b


def jax_peers(case: str, dims, dtype) -> dict:
    """JAX's multi-process path on the same ranks, with an even split (all it supports)."""
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    m, k, n = dims
    if case == "grid":
        pr = max(d for d in range(1, int(SIZE**0.5) + 1) if SIZE % d == 0)
        mesh = Mesh(np.array(jax.devices()).reshape(pr, SIZE // pr), ("x", "y"))
        specs = (P("x", "y"), P("x", "y"))
        out_spec = P("x", "y")
    else:
        mesh = Mesh(np.array(jax.devices()), ("x",))
        specs = {"k_split": (P(None, "x"), P("x", None)), "rows": (P("x", None), P(None, None))}[
            case
        ]
        out_spec = P("x", None)
    arrays = []
    for shape, spec in ((m, k), specs[0]), ((k, n), specs[1]):
        sharding = NamedSharding(mesh, spec)
        local_shape = sharding.shard_shape(shape)
        local = jnp.full(local_shape, 0.5, dtype)
        arrays.append(common.global_array(shape, spec, mesh, local))
    named = jax.jit(lambda x, y: x @ y, out_shardings=NamedSharding(mesh, out_spec))
    peers = {"jax_named_sharding": (named, tuple(arrays))}
    if case != "grid":

        def local(x, y):
            c = jnp.dot(x, y, preferred_element_type=jnp.float32)
            if case == "k_split":
                c = jax.lax.psum_scatter(c, "x", scatter_dimension=0, tiled=True)
            return c

        mapped = jax.jit(shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec))
        peers["jax_shard_map"] = (mapped, tuple(arrays))
    return peers


def matmul_fn(plan, method, chunk_bytes=None):
    return jax.jit(lambda x, y: om.matmul(x, y, plan, method=method, chunk_bytes=chunk_bytes))


def with_progress(fn, mode: str):
    """``fn`` run with the native progress ``mode`` (config.PROGRESS), the setting in force
    restored after each call: interleaved entries can then differ in that alone."""
    from osmm_jax._src.runtime import native

    def run(*args):
        previous = native.progress_settings()[0]
        native.set_progress(mode)
        try:
            return jax.block_until_ready(fn(*args))
        finally:
            native.set_progress(previous)

    return run


def measured_bytes(fn, args) -> list[int]:
    """RMA bytes every rank's operations moved in one more call of ``fn``."""
    before = om.stats()["rma_bytes"]
    jax.block_until_ready(fn(*args))
    return COMM.allgather(om.stats()["rma_bytes"] - before)


def run_case(args, dims, speeds, rss_start) -> dict:
    m, k, n = dims
    dtype = jnp.dtype(args.dtype)
    weighted = args.split in ("speed", "both")
    main_weights = list(speeds) if weighted else None
    plan = om.plan(*layouts(args.case, m, k, n, main_weights))
    a, b = local_blocks(plan, dtype)

    fns = {"one_sided": (matmul_fn(plan, "one_sided"), (a, b))}
    if plan.has_deliveries:
        fns["one_sided, overlap off"] = (matmul_fn(plan, "one_sided", chunk_bytes=0), (a, b))
    for mode in args.progress.split(",") if args.progress else ():
        fns[f"one_sided, progress {mode}"] = (with_progress(fns["one_sided"][0], mode), (a, b))
        if plan.has_deliveries:
            off = fns["one_sided, overlap off"][0]
            fns[f"one_sided, overlap off, progress {mode}"] = (with_progress(off, mode), (a, b))
    fns["allreduce"] = (matmul_fn(plan, "allreduce"), (a, b))
    uniform_plan = None
    if args.split == "both" and args.case != "grid":
        uniform_plan = om.plan(*layouts(args.case, m, k, n))
        ua, ub = local_blocks(uniform_plan, dtype)
        fns["one_sided (uniform)"] = (matmul_fn(uniform_plan, "one_sided"), (ua, ub))
        fns["allreduce (uniform)"] = (matmul_fn(uniform_plan, "allreduce"), (ua, ub))
    fns["floor (local GEMMs only)"] = common.local_floor(plan, dtype)
    fns["reference (rank 0 alone)"] = common.reference(m, k, n, dtype)
    if args.peers:
        fns.update(jax_peers(args.case, dims, dtype))

    times = common.interleaved_times(fns, args.repeats)
    flops = 2 * m * k * n
    entries = common.summarise(times, flops)
    seconds = {e["name"]: e["seconds"] for e in entries}

    sent = measured_bytes(*fns["one_sided"])
    itemsize = dtype.itemsize
    c_bytes = m * n * 4
    # The slowest rank's share at its own measured rate, for this plan and for the ideal split.
    plan_limit = max(f / (s * 1e9) for f, s in zip(plan.flops, speeds))
    ideal_limit = flops / (sum(speeds) * 1e9)
    operand_bytes = COMM.allgather(
        int(a.nbytes + b.nbytes + np.prod(plan.c.local_shape(RANK)) * itemsize)
    )
    record = {
        "case": args.case,
        "label": args.label or args.case,
        "title": (
            f"{args.label or args.case}: C[{m}x{n}] = A[{m}x{k}] @ B[{k}x{n}], {args.dtype}, "
            f"{SIZE} ranks ({common.binding_cached}), split {args.split}"
        ),
        "ranks": SIZE,
        "dims": [m, k, n],
        "dtype": args.dtype,
        "split": args.split,
        "repeats": args.repeats,
        "speeds_gflops": [float(s) for s in speeds],
        "rows_per_rank": [plan.c.local_shape(r)[0] for r in range(SIZE)],
        "entries": entries,
        "bytes_measured": sent,
        "bytes_planned": list(plan.bytes_issued(itemsize, 4)),
        # A bandwidth-optimal (ring) all-reduce of the float32 C sends 2 (P-1)/P of it per rank.
        "bytes_allreduce_model": (
            int(2 * (SIZE - 1) / SIZE * c_bytes) if (plan.has_deliveries or plan.has_gets) else 0
        ),
        "aggregate_limit_s": plan_limit,
        "ideal_limit_s": ideal_limit,
        "efficiency": ideal_limit / seconds["one_sided"],
        **common.memory_fields(rss_start),
        "operand_mib": [x / 2**20 for x in operand_bytes],
    }
    mib = lambda xs: ", ".join(f"{x / 2**20:.2f}" for x in xs)  # noqa: E731
    record["notes"] = [
        f"MiB moved by one_sided RMA per rank per product: measured {mib(sent)}, planned "
        f"{mib(record['bytes_planned'])} (a ring all-reduce of C: "
        f"{record['bytes_allreduce_model'] / 2**20:.2f} per rank)",
        "Speeds (GFLOP/s, measured all ranks at once): "
        + ", ".join(f"{s:.1f}" for s in speeds)
        + f"; rows per rank {record['rows_per_rank']}",
        f"Aggregate limit {ideal_limit * 1e3:.1f} ms (ideal split; this plan's slowest share "
        f"{plan_limit * 1e3:.1f} ms): one_sided efficiency {record['efficiency']:.0%}",
        "Peak RSS MiB per rank: "
        + ", ".join(f"{x:.0f}" for x in record["rss_peak_mib"])
        + " (after start-up: "
        + ", ".join(f"{x:.0f}" for x in record["rss_start_mib"])
        + "); windows MiB: "
        + ", ".join(f"{x:.1f}" for x in record["window_mib"])
        + "; operands MiB: "
        + ", ".join(f"{x:.1f}" for x in record["operand_mib"]),
    ]
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="one_sided vs its peers on one distributed product"
    )
    parser.add_argument("--case", choices=("k_split", "rows", "grid"), default="k_split")
    parser.add_argument("--size", type=int, default=2048, help="M = K = N unless given separately")
    parser.add_argument("--sizes", help="comma-separated sizes: run the case once per size")
    parser.add_argument("--m", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--split", choices=("uniform", "speed", "both"), default="uniform")
    parser.add_argument(
        "--progress",
        help="comma-separated OSMM_PROGRESS modes (off,thread,auto): one more one_sided "
        "entry (overlap on and off) per mode",
    )
    common.add_run_arguments(
        parser, peers_help="also time JAX's multi-process path", label_default=None
    )
    args = parser.parse_args(argv)
    speeds, rss_start = common.start(args)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [args.size]
    for size in sizes:
        dims = tuple(v or size for v in (args.m, args.k, args.n))
        record = run_case(args, dims, speeds, rss_start)
        common.print_table(record)
        common.save(record, args.json)


if __name__ == "__main__":
    main()
