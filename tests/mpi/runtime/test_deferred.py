"""Deferred finishes (``OSMM_DEFER``, on by default; xla_ffi/protocols/deferred.h): the weight
gradient of a product (dB of ``A @ B``), when it is a notified reduce of one chunk, waits on its
communicator's waiter thread, off the ordered token chain.

The same bits as the finish in place, run to run and on every rank holding a copy, for the
gradients of data-parallel products, under vmap, outside jit and in a training step; products
that finish in place (chunked, fetching, fenced, forward) mixed with deferred ones on one
communicator; products back to back with a late rank (deliveries the waiter issues once the
slot is free); and a finish that fails on one rank fails that rank's product only, with every
later product right everywhere.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src import config
from osmm_jax._src.runtime import native

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
M, K, N = 12 * max(SIZE, 2) + 1, 23, 17
pytestmark = pytest.mark.ranks(1, 2, 3, 4)


def _data_parallel(weights=None):
    """``x @ W`` of a data-parallel layer: rows of x (and of the result) split over the ranks,
    W replicated; its weight gradient x.T @ dY is summed onto every rank."""
    return om.plan(
        om.Layout.rows((M, K), weights=weights),
        om.Layout.replicated((K, N)),
        om.Layout.rows((M, N), weights=weights),
    )


def _plans():
    return {"even": _data_parallel(), "uneven": _data_parallel([1 + r for r in range(SIZE)])}


def _blocks(plan, seed=5):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(plan.a.shape).astype(np.float32)
    b = rng.standard_normal(plan.b.shape).astype(np.float32)
    return a, b, plan.a.shard(a, RANK), plan.b.shard(b, RANK)


def _weight_grad(plan):
    """d/dW of sum(sin(x @ W)) on this rank's rows (the gradient summed over the ranks)."""
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(om.matmul(x, w, plan))), argnums=1)


def _traced(monkeypatch, defer: bool, build):
    """``build()``'s jitted function, traced (by one call inside) with ``OSMM_DEFER`` set so."""
    monkeypatch.setenv(config.DEFER, "1" if defer else "0")
    monkeypatch.setenv(config.SYNC, "notify")
    fn, args = build()
    result = jax.tree.map(np.asarray, fn(*args))
    monkeypatch.delenv(config.DEFER)
    return fn, args, result


def _deferred_count():
    return native.stats()["deferred_reduces"]


@pytest.mark.parametrize("name", ["even", "uneven"])
def test_deferred_weight_gradients_have_the_bits_of_the_finish_in_place(name, monkeypatch):
    plan = _plans()[name]
    a, b, a_loc, b_loc = _blocks(plan)

    def build():
        def loss(x, y):
            return jnp.sum(jnp.sin(om.matmul(x, y, plan)))

        step = jax.jit(lambda x, y: (om.matmul(x, y, plan), jax.grad(loss, (0, 1))(x, y)))
        return step, (a_loc, b_loc)

    _, _, in_place = _traced(monkeypatch, False, build)
    before = _deferred_count()
    step, args, deferred = _traced(monkeypatch, True, build)
    runs = [deferred] + [jax.tree.map(np.asarray, step(*args)) for _ in range(19)]
    # dB, the weight gradient, is the one product that delivers (the forward and dA are local)
    assert _deferred_count() - before == (20 if SIZE > 1 else 0)
    for run in runs:
        for x, y in zip(jax.tree.leaves(in_place), jax.tree.leaves(run)):
            assert x.tobytes() == y.tobytes()
    np.testing.assert_allclose(runs[0][0], plan.c.shard(a @ b, RANK), rtol=2e-5, atol=2e-4)
    assert len(set(COMM.allgather(runs[0][1][1].tobytes()))) == 1  # dW: the same bits everywhere


@pytest.mark.parametrize("widths", [(16, 24, 24, 8), (24, 24, 24, 24)])
def test_a_data_parallel_training_step_defers_every_weight_gradient(monkeypatch, widths):
    """A 3-layer MLP of osmm_jax.flax.Dense: every layer's weight gradient is one deferred
    product, and the parameters after three steps are those of the finish in place, bit for
    bit, on every rank. With layers of one size, each gradient is delivered into the other set
    of slots while its targets still sum the one before; with layers of several sizes the slot
    layouts differ and a gradient waits for the one before to be summed."""
    flax_linen = pytest.importorskip("flax.linen")
    from osmm_jax.flax import Dense, value_and_grad

    rows = om.split_sizes(12 * SIZE + 1, SIZE)

    class MLP(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            x = jnp.tanh(Dense(widths[1], row_sizes=rows)(x))
            x = jnp.tanh(Dense(widths[2], row_sizes=rows)(x))
            return Dense(widths[3], row_sizes=rows)(x)

    model = MLP()
    rng = np.random.default_rng(RANK)
    x = jnp.asarray(rng.standard_normal((rows[RANK], widths[0])), jnp.float32)
    y = jnp.asarray(rng.standard_normal((rows[RANK], widths[3])), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def build():
        def loss(p):
            return jnp.sum((model.apply(p, x) - y) ** 2) / sum(rows)

        @jax.jit
        def step(p):
            _, grads = value_and_grad(loss)(p)
            return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

        return step, (params,)

    def train(defer):
        step, args, p = _traced(monkeypatch, defer, build)
        for _ in range(2):
            p = step(p)
        return jax.tree.map(np.asarray, p)

    in_place = train(False)
    before = _deferred_count()
    deferred = train(True)
    assert _deferred_count() - before == (9 if SIZE > 1 else 0)  # 3 layers x 3 steps
    for u, v in zip(jax.tree.leaves(in_place), jax.tree.leaves(deferred)):
        assert u.tobytes() == v.tobytes()
    assert len(set(COMM.allgather(jax.tree.leaves(deferred)[0].tobytes()))) == 1


def test_vmap_and_eager_weight_gradients_defer_with_the_same_bits(monkeypatch):
    plan = _plans()["even"]
    _, _, a_loc, b_loc = _blocks(plan)
    batch_a = jnp.stack([a_loc, 2 * a_loc, -a_loc])
    grad = _weight_grad(plan)

    def build():
        return jax.jit(jax.vmap(lambda x: grad(x, b_loc))), (batch_a,)

    _, _, in_place = _traced(monkeypatch, False, build)
    before = _deferred_count()
    _, _, deferred = _traced(monkeypatch, True, build)
    assert in_place.tobytes() == deferred.tobytes()
    monkeypatch.setenv(config.DEFER, "1")
    monkeypatch.setenv(config.SYNC, "notify")
    eager = np.asarray(grad(a_loc, b_loc))
    assert eager.tobytes() == in_place[0].tobytes()
    assert _deferred_count() - before == (4 if SIZE > 1 else 0)  # three in the batch, one eager


@pytest.mark.ranks(min=2, reason="products that finish in place, beside deferred ones")
def test_deferred_gradients_mix_with_chunked_fetching_and_fenced_products(monkeypatch):
    """One program: a deferred weight gradient, a chunked K-split (its finish in place), a
    product that fetches B's pieces, a fenced one, all on COMM_WORLD, then another deferred
    weight gradient; each call that cannot defer waits for the waiter first."""
    layer = _plans()["even"]
    k_split = om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N)))
    fetching = om.plan(om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.rows((M, N)))
    a, b, xa, xb = _blocks(layer)
    ka, kb = k_split.a.shard(a, RANK), k_split.b.shard(b, RANK)
    fa, fb = fetching.a.shard(a, RANK), fetching.b.shard(b, RANK)
    grad = _weight_grad(layer)

    def build():
        def program(x, w, ka, kb, fa, fb):
            first = grad(x, w)
            chunked = om.matmul(ka, kb, k_split, chunk_bytes=64)
            fetched = om.matmul(fa, fb, fetching)
            fenced = om.matmul(ka, kb, k_split, sync="fence")
            return first, chunked, fetched, fenced, grad(2 * x, w)

        return jax.jit(program), (xa, xb, ka, kb, fa, fb)

    _, _, in_place = _traced(monkeypatch, False, build)
    before = _deferred_count()
    fn, args, results = _traced(monkeypatch, True, build)
    results = [results] + [jax.tree.map(np.asarray, fn(*args)) for _ in range(4)]
    assert _deferred_count() - before == 10  # the two weight gradients, five runs
    for first, chunked, fetched, fenced, doubled in results:
        assert first.tobytes() == in_place[0].tobytes()
        assert doubled.tobytes() == in_place[4].tobytes()
        for c in (chunked, fenced):
            np.testing.assert_allclose(c, k_split.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(fetched, fetching.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)


@pytest.mark.ranks(min=3, reason="origins that run ahead of a late target")
def test_deferred_gradients_back_to_back_with_a_late_rank(monkeypatch):
    """Three weight gradients in one program, rank 0 late to the first (its input comes from a
    slow host callback): the others start all three at once, find the slots of the second and
    third still busy, and their waiters deliver once the targets have summed the one before.
    (Busy slots are the RMA transport's: with messages a target posts its receives when it is
    ready, test_messages.py.)"""
    plan = _plans()["even"]
    a, b, a_loc, b_loc = _blocks(plan)
    monkeypatch.setenv(config.TRANSPORT, "rma")
    monkeypatch.setenv(config.DEFER, "1")
    monkeypatch.setenv(config.SYNC, "notify")
    grad = _weight_grad(plan)

    def late(x):
        if RANK == 0:
            # Long enough that the others are through all three starts on a loaded machine:
            # 0.2 s left none of them waiting for a slot in one full run out of four.
            time.sleep(0.5)
        return x

    @jax.jit
    def program(x, w):
        x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return [grad(s * x, w) for s in (1.0, 2.0, 3.0)]

    before = native.stats()
    for _ in range(3):
        for s, dw in zip((1.0, 2.0, 3.0), program(a_loc, b_loc)):
            expected = (s * a).T @ np.cos((s * a) @ b)
            np.testing.assert_allclose(np.asarray(dw), expected, rtol=1e-4, atol=1e-4)
    after = native.stats()
    counts = COMM.allgather(
        {k: after[k] - before[k] for k in ("deferred_reduces", "deferred_deliveries")}
    )
    assert [c["deferred_reduces"] for c in counts] == [9] * SIZE
    assert sum(c["deferred_deliveries"] for c in counts) > 0


@pytest.mark.ranks(min=2, reason="one rank's finish fails while the others complete")
def test_a_deferred_finish_that_fails_on_one_rank_fails_its_gradient_there_only(monkeypatch):
    """The waiter completes the failed rank's part (its partials left at the start), so the
    other ranks' gradients are right; the failed rank's program raises, and every gradient
    after it is right everywhere, with no rank starting again."""
    plan = _plans()["even"]
    a, b, a_loc, b_loc = _blocks(plan)
    monkeypatch.setenv(config.DEFER, "1")
    monkeypatch.setenv(config.SYNC, "notify")
    grad = jax.jit(_weight_grad(plan))
    expected = a.T @ np.cos(a @ b)
    np.testing.assert_allclose(np.asarray(grad(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4)
    resyncs = native.stats()["resyncs"]
    if RANK == 0:
        native.inject_failure("osmm_reduce_finish")
        with pytest.raises(jax.errors.JaxRuntimeError, match="injected failure"):
            np.asarray(grad(a_loc, b_loc))
    else:
        np.testing.assert_allclose(np.asarray(grad(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4)
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(grad(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4)
    assert COMM.allreduce(native.stats()["resyncs"] - resyncs) == 0


def test_forward_products_finish_in_place(monkeypatch):
    """Only weight gradients defer: a forward K-split's result is read at once."""
    plan = om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N)))
    _, _, a_loc, b_loc = _blocks(plan)
    monkeypatch.setenv(config.DEFER, "1")
    before = _deferred_count()
    jax.block_until_ready(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(a_loc, b_loc))
    assert _deferred_count() == before
