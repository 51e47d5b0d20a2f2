"""Time data-parallel training steps with deferred finishes on and off, against the all-reduce.

Run under mpiexec (every rank runs it), on this host or across emulated hosts::

    .venv/bin/mpiexec -n 3 -bind-to user:0,0,1 .venv/bin/python -m benchmarks.overlap_step \\
        --cases mlp,mlp:512:1536

Entries, interleaved in shuffled rounds (medians of the slowest rank's time, after warm-up):
``deferred`` (the notified mode with ``OSMM_DEFER=1``: each layer's weight gradient leaves
when it is computed and is waited for only by that layer's update), ``in place``
(``OSMM_DEFER=0``: each product's finish waits where the product is), ``allreduce`` (the
mpi4jax baseline, one all-reduce per layer), ``floor`` (the same step with local products
only, no communication), with ``--rma`` ``deferred rma`` and ``in place rma`` (the same with
``OSMM_TRANSPORT=rma``: the default, ``auto``, moves partials as two-sided messages where the
ranks span several hosts), with ``--meetings`` ``floor + meetings`` and ``floor + allreduce
meetings`` (the floor with, in each layer's backward, one meeting of every rank: a sum of one
element by a notified product in place, or by the all-reduce method; what synchronising the
ranks costs without the bytes) and, with ``--peers``, ``jax NamedSharding`` (JAX's own
data-parallel step of the same model on the same ranks: the batch sharded over one device per
process, parameters replicated, the gradient all-reduce XLA inserts running over gloo; the
batch rounded down to a multiple of the rank count, which JAX's even sharding needs).
Cases (``name[:width[:rows]]``):

``mlp``     one jitted SGD step of a 4-layer MLP of :class:`osmm_jax.flax.Dense` (default width
            256, 512 rows split evenly), gradients summed by the layers' products
            (``osmm_jax.flax.value_and_grad``), as ``benchmarks.sync``'s ``mlp`` case.

Per entry, also the fraction of communication time hidden: ``1 - (t - floor) / (in place -
floor)`` for ``deferred`` (0: nothing hidden, 1: the step takes the floor's time).
Rank 0 prints a Markdown table and one JSON line per case (``--json`` appends the records).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks import common
from benchmarks.common import RANK, SIZE


@contextlib.contextmanager
def deferral(on: bool, transport: str = "auto"):
    """``OSMM_SYNC=notify``, ``OSMM_DEFER`` and ``OSMM_TRANSPORT`` while a step is traced (the
    layers' products read them then); the caller's own values afterwards."""
    names = ("OSMM_SYNC", "OSMM_DEFER", "OSMM_TRANSPORT")
    before = {k: os.environ.get(k) for k in names}
    os.environ.update(OSMM_SYNC="notify", OSMM_DEFER="1" if on else "0", OSMM_TRANSPORT=transport)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def rendezvous(method: str):
    """An identity whose gradient meets every rank once: the cotangent passes unchanged, after a
    sum over the ranks of one element of it (a K-split product of 1 x P by P x 1 with
    ``method``, in place), so that the backward pass waits, at that point, for every rank to
    reach it. The same synchronisation as a layer's gradient sum, without its bytes."""
    plan = om.plan(
        om.Layout.cols((1, SIZE)), om.Layout.rows((SIZE, 1)), om.Layout.replicated((1, 1))
    )

    @jax.custom_vjp
    def meet(x):
        return x

    def forward(x):
        return x, None

    def backward(_, cotangent):
        one = cotangent.reshape(-1)[:1].reshape(1, 1)
        summed = om.matmul(one, jnp.ones((1, 1), one.dtype), plan, method=method)
        return (cotangent + 0.0 * summed,)  # x * 0.0 is not folded for floats

    meet.defvjp(forward, backward)
    return meet


def mlp_step(method: str | None, width: int, rows_total: int, meet: str | None = None):
    """A jitted SGD step of the 4-layer MLP and its arguments; ``method=None``: local
    products (``flax.linen.Dense``), the floor. ``meet``: with ``method=None``, every layer's
    input goes through :func:`rendezvous` with that method: the floor plus one meeting of the
    ranks per layer in the backward pass, where the layers' gradient sums would be."""
    import flax.linen as nn

    from osmm_jax.flax import Dense, value_and_grad

    rows = om.split_sizes(rows_total, SIZE)
    meeting = rendezvous(meet) if meet else (lambda x: x)

    def layer():
        if method is None:
            return nn.Dense(width)
        return Dense(width, row_sizes=rows, method=method)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = jnp.tanh(layer()(meeting(x)))
            return layer()(meeting(x))

    model = MLP()
    rng = np.random.default_rng(RANK)
    x = jnp.asarray(rng.standard_normal((rows[RANK], width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((rows[RANK], width)), jnp.float32)
    params = model.init(jax.random.key(0), jnp.zeros((rows[RANK], width), jnp.float32))
    grad = jax.value_and_grad if method is None else value_and_grad

    def loss(p, x, y):
        return jnp.sum((model.apply(p, x) - y) ** 2) / rows_total

    @jax.jit
    def step(p, x, y):
        value, grads = grad(loss)(p, x, y)
        return value, jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)

    return step, (params, x, y)


def jax_peer_step(width: int, rows_total: int):
    """JAX's own data-parallel step of the same MLP (``flax.linen.Dense`` layers) over a
    one-axis mesh of every process's device, and its global arguments."""
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows_total -= rows_total % SIZE
    rows = rows_total // SIZE

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = jnp.tanh(nn.Dense(width)(x))
            return nn.Dense(width)(x)

    model = MLP()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rng = np.random.default_rng(RANK)
    batch = [jnp.asarray(rng.standard_normal((rows, width)), jnp.float32) for _ in range(2)]
    x, y = (common.global_array((rows_total, width), P("batch"), mesh, b) for b in batch)
    local = model.init(jax.random.key(0), jnp.zeros((rows, width), jnp.float32))
    params = jax.tree.map(lambda p: common.global_array(p.shape, P(), mesh, p), local)
    replicated = NamedSharding(mesh, P())

    def loss(p, x, y):
        return jnp.sum((model.apply(p, x) - y) ** 2) / rows_total

    @jax.jit
    def step(p, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        new = jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)
        return value, jax.lax.with_sharding_constraint(new, replicated)

    return step, (params, x, y)


def entries(
    width: int, rows: int, peers: bool = False, rma: bool = False, meetings: bool = False
) -> dict:
    fns = {}
    settings = [("deferred", True, "auto"), ("in place", False, "auto")]
    if rma:
        settings += [("deferred rma", True, "rma"), ("in place rma", False, "rma")]
    for name, on, transport in settings:
        with deferral(on, transport):
            step, args = mlp_step("one_sided", width, rows)
            jax.block_until_ready(step(*args))  # traced now, under this setting
        fns[name] = (step, args)
    fns["allreduce"] = mlp_step("allreduce", width, rows)
    fns["floor"] = mlp_step(None, width, rows)
    if meetings:
        with deferral(False):
            fns["floor + meetings"] = mlp_step(None, width, rows, meet="one_sided")
        fns["floor + allreduce meetings"] = mlp_step(None, width, rows, meet="allreduce")
    if peers:
        fns["jax NamedSharding"] = jax_peer_step(width, rows)
    return fns


def run(
    case: str, repeats: int, peers: bool = False, rma: bool = False, meetings: bool = False
) -> dict:
    kind, *sizes = case.split(":")
    if kind != "mlp":
        raise SystemExit(f"unknown case {case!r}")
    width = int(sizes[0]) if sizes else 256
    rows = int(sizes[1]) if len(sizes) > 1 else 512
    fns = entries(width, rows, peers, rma, meetings)
    before = om.stats()["deferred_reduces"]
    times = common.interleaved_times(fns, repeats)
    deferred = om.stats()["deferred_reduces"] - before
    flops = 3 * 4 * 2 * rows * width * width
    record = {
        "title": f"{case} on {SIZE} ranks ({common.binding()})",
        "case": case,
        "ranks": SIZE,
        "repeats": repeats,
        "entries": common.summarise(times, flops),
        "deferred_reduces": deferred,
    }
    seconds = {e["name"]: e["seconds"] for e in record["entries"]}
    exposed = seconds["in place"] - seconds["floor"]
    record["deferred_vs_allreduce"] = seconds["allreduce"] / seconds["deferred"]
    record["in_place_vs_allreduce"] = seconds["allreduce"] / seconds["in place"]
    record["hidden_fraction"] = (
        1 - (seconds["deferred"] - seconds["floor"]) / exposed if exposed > 0 else None
    )
    if rma:
        record["deferred_vs_deferred_rma"] = seconds["deferred rma"] / seconds["deferred"]
        record["in_place_vs_in_place_rma"] = seconds["in place rma"] / seconds["in place"]
    if meetings:
        for name in ("floor + meetings", "floor + allreduce meetings"):
            record[f"{name} over floor (s)"] = seconds[name] - seconds["floor"]
    if peers:
        record["jax_vs_deferred"] = seconds["jax NamedSharding"] / seconds["deferred"]
        record["jax_vs_in_place"] = seconds["jax NamedSharding"] / seconds["in place"]
    hidden = record["hidden_fraction"]
    record["notes"] = [
        f"deferred / allreduce: {record['deferred_vs_allreduce']:.2f}x, in place / allreduce: "
        f"{record['in_place_vs_allreduce']:.2f}x, communication hidden by deferring: "
        + ("n/a (in place is not slower than the floor)" if hidden is None else f"{hidden:.2f}")
        + f"; deferred reduces on rank {RANK}: {deferred}"
        + (
            f"; jax NamedSharding / deferred: {record['jax_vs_deferred']:.2f}x, / in place: "
            f"{record['jax_vs_in_place']:.2f}x"
            if peers
            else ""
        )
    ]
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="append the records to this JSON list")
    parser.add_argument(
        "--peers", action="store_true", help="also time JAX's own data-parallel step (gloo)"
    )
    parser.add_argument(
        "--rma",
        action="store_true",
        help="also time both steps with OSMM_TRANSPORT=rma (the default picks messages across hosts)",
    )
    parser.add_argument(
        "--meetings",
        action="store_true",
        help="also time the floor with one meeting of the ranks per layer (no bytes summed)",
    )
    args = parser.parse_args(argv)
    if args.peers:
        common.init_jax_distributed()  # before any computation
    for case in args.cases.split(","):
        record = run(case, args.repeats, args.peers, args.rma, args.meetings)
        common.print_table(record, baseline="allreduce")
        if RANK == 0:
            print(json.dumps({k: v for k, v in record.items() if k != "entries"}))
        common.save(record, args.json)


if __name__ == "__main__":
    main()
