"""Time one training step of a 2-layer MLP, data parallel, one_sided against all-reduce (DDP).

Run under MPI, best with heterogeneous ranks, e.g.::

    .venv/bin/mpiexec -n 3 -bind-to user:0,0,1 .venv/bin/python -m benchmarks.train_step --peers

The model: ``y = tanh(x @ W1) @ W2`` with x of ``batch x d_in``, W1 ``d_in x hidden``, W2
``hidden x d_out``; the loss is the squared error summed over the batch divided by the
global batch size; one step is ``jax.value_and_grad`` and a plain SGD update, all in one
``jax.jit``. The batch rows are split over the ranks; the weights are replicated. Both
products go through ``osmm_jax.matmul``; their backward products deliver dW1 and dW2,
summed over ranks, onto every rank (one_sided: MPI_Accumulate into every rank's window;
allreduce: one all-reduce per weight, like DDP).

Timed side by side (interleaved, medians, slowest rank per round):

* ``one_sided``: rows in proportion to the measured speeds;
* ``allreduce (DDP: uniform)``: equal rows and an all-reduce of each gradient, what
  DistributedDataParallel does;
* ``allreduce (speed-weighted)`` and ``one_sided (uniform)``: each change alone;
* ``floor``: this rank's forward and backward GEMMs on its speed-weighted rows, no
  communication;
* with ``--peers``: ``jax_named_sharding``, the same step jitted by JAX over a batch-sharded
  NamedSharding (equal rows; JAX inserts the gradient all-reduce, over gloo).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks import common
from benchmarks.common import RANK, SIZE

LEARNING_RATE = 1e-3


def plans(batch: int, d_in: int, hidden: int, d_out: int, weights):
    """Plans of the two products for batch rows split by ``weights`` (None: equal)."""
    rows = lambda cols: om.Layout.rows((batch, cols), weights=weights)  # noqa: E731
    first = om.plan(rows(d_in), om.Layout.replicated((d_in, hidden)), rows(hidden))
    second = om.plan(rows(hidden), om.Layout.replicated((hidden, d_out)), rows(d_out))
    return first, second


def make_step(first, second, batch: int, method: str | None):
    """One jitted SGD step on this rank's rows; gradients arrive summed over ranks."""

    def loss(params, x, y):
        w1, w2 = params
        if method is None:  # the floor: local products only
            h = jnp.tanh(x @ w1)
            out = h @ w2
        else:
            h = jnp.tanh(om.matmul(x, w1, first, method=method))
            out = om.matmul(h, w2, second, method=method)
        return jnp.sum((out - y) ** 2) / batch

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return step


def local_data(first, second, seed: int = 0):
    rng = np.random.default_rng(seed + RANK)
    x = jnp.asarray(rng.standard_normal(first.a.local_shape(RANK)), jnp.float32)
    y = jnp.asarray(rng.standard_normal(second.c.local_shape(RANK)), jnp.float32)
    return x, y


def jax_peer(batch, d_in, hidden, d_out, params):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = common.global_array(
        (batch, d_in), P("x", None), mesh, jnp.full((batch // SIZE, d_in), 0.1, jnp.float32)
    )
    y = common.global_array(
        (batch, d_out), P("x", None), mesh, jnp.full((batch // SIZE, d_out), 0.1, jnp.float32)
    )
    replicated = NamedSharding(mesh, P())
    global_params = tuple(common.global_array(p.shape, P(), mesh, p) for p in params)

    def loss(params, x, y):
        w1, w2 = params
        return jnp.sum((jnp.tanh(x @ w1) @ w2 - y) ** 2) / batch

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        return value, jax.lax.with_sharding_constraint(new, replicated)

    return step, (global_params, x, y)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="2-layer MLP train step: one_sided vs DDP")
    parser.add_argument("--batch", type=int, default=3072)
    parser.add_argument("--d-in", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--d-out", type=int, default=1024)
    common.add_run_arguments(
        parser, peers_help="also time JAX's NamedSharding step", label_default="train_step"
    )
    args = parser.parse_args(argv)
    speeds, rss_start = common.start(args)
    dims = (args.batch, args.d_in, args.hidden, args.d_out)
    rng = np.random.default_rng(42)  # the same weights on every rank
    params = (
        jnp.asarray(rng.standard_normal((args.d_in, args.hidden)) * 0.02, jnp.float32),
        jnp.asarray(rng.standard_normal((args.hidden, args.d_out)) * 0.02, jnp.float32),
    )

    weighted = plans(*dims, list(speeds))
    uniform = plans(*dims, None)
    fns = {}
    for name, (first, second), method in (
        ("one_sided", weighted, "one_sided"),
        ("allreduce (DDP: uniform)", uniform, "allreduce"),
        ("allreduce (speed-weighted)", weighted, "allreduce"),
        ("one_sided (uniform)", uniform, "one_sided"),
        ("floor (local GEMMs only)", weighted, None),
    ):
        x, y = local_data(first, second)
        fns[name] = (make_step(first, second, args.batch, method), (params, x, y))
    if args.peers:
        fns["jax_named_sharding"] = jax_peer(*dims, params)

    times = common.interleaved_times(fns, args.repeats)
    batch, d_in, hidden, d_out = dims
    flops = 3 * 2 * batch * hidden * (d_in + d_out)  # forward + two backward products each
    entries = common.summarise(times, flops)
    seconds = {e["name"]: e["seconds"] for e in entries}
    ideal = flops / (sum(speeds) * 1e9)
    record = {
        "case": "train_step",
        "label": args.label,
        "title": (
            f"{args.label}: 2-layer MLP step, batch {batch}, {d_in} -> {hidden} -> {d_out}, "
            f"float32, {SIZE} ranks ({common.binding_cached})"
        ),
        "ranks": SIZE,
        "dims": list(dims),
        "repeats": args.repeats,
        "speeds_gflops": [float(s) for s in speeds],
        "rows_per_rank": [weighted[0].a.local_shape(r)[0] for r in range(SIZE)],
        "entries": entries,
        "ideal_limit_s": ideal,
        "efficiency": ideal / seconds["one_sided"],
        **common.memory_fields(rss_start),
    }
    ratio = seconds["allreduce (DDP: uniform)"] / seconds["one_sided"]
    record["notes"] = [
        f"one_sided step is {ratio:.2f}x faster than the DDP-like all-reduce step",
        "Speeds (GFLOP/s): "
        + ", ".join(f"{s:.1f}" for s in speeds)
        + f"; speed-weighted rows {record['rows_per_rank']}",
        f"Aggregate limit {ideal * 1e3:.0f} ms: one_sided efficiency {record['efficiency']:.0%}",
    ]
    common.print_table(record)
    common.save(record, args.json)


if __name__ == "__main__":
    main()
