"""Deferred finishes (``OSMM_DEFER=1``, xla_ffi/protocols/deferred.h): a notified product of one
chunk whose wait runs on its communicator's waiter thread, off the ordered token chain.

The same bits as the finish in place, run to run and on every rank holding a copy, for
products, both gradients, vmap and a data-parallel training step; products that cannot defer
(chunked, fetching, fenced) mixed with deferred ones on one communicator; products back to back
with a late rank (deliveries the waiter issues once the slot is free); and a finish that fails
on one rank fails that rank's product only, with every later product right everywhere.
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
M, K, N = 37, 12 * max(SIZE, 2), 29
pytestmark = pytest.mark.ranks(1, 2, 3, 4)


def _layouts():
    return {
        "k_split": (om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N))),
        "data_parallel": (
            om.Layout.cols((M, K)),
            om.Layout.rows((K, N)),
            om.Layout.replicated((M, N)),
        ),
        "grid": (
            om.Layout.cols((M, K)),
            om.Layout.rows((K, N)),
            om.Layout.grid((M, N), (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)),
        ),
    }


def _blocks(plan, seed=5):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(plan.a.shape).astype(np.float32)
    b = rng.standard_normal(plan.b.shape).astype(np.float32)
    return a, b, plan.a.shard(a, RANK), plan.b.shard(b, RANK)


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


@pytest.mark.parametrize("name", ["k_split", "data_parallel", "grid"])
def test_deferred_products_and_gradients_have_the_bits_of_the_finish_in_place(name, monkeypatch):
    plan = om.plan(*_layouts()[name])
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
    # the forward product and dB (a K-split over M) deliver; dA only fetches dC's rows
    assert _deferred_count() - before == (2 * 20 if SIZE > 1 else 0)
    for run in runs:
        for x, y in zip(jax.tree.leaves(in_place), jax.tree.leaves(run)):
            assert x.tobytes() == y.tobytes()
    np.testing.assert_allclose(runs[0][0], plan.c.shard(a @ b, RANK), rtol=2e-5, atol=2e-4)
    if plan.c.is_replicated:
        assert len(set(COMM.allgather(runs[0][0].tobytes()))) == 1


def test_a_data_parallel_training_step_defers_every_weight_gradient(monkeypatch):
    """A 3-layer MLP of osmm_jax.flax.Dense: every layer's weight gradient is one deferred
    product, and the parameters after three steps are those of the finish in place, bit for
    bit, on every rank."""
    flax_linen = pytest.importorskip("flax.linen")
    from osmm_jax.flax import Dense, value_and_grad

    rows = om.split_sizes(12 * SIZE + 1, SIZE)

    class MLP(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            x = jnp.tanh(Dense(24, row_sizes=rows)(x))
            x = jnp.tanh(Dense(24, row_sizes=rows)(x))
            return Dense(8, row_sizes=rows)(x)

    model = MLP()
    rng = np.random.default_rng(RANK)
    x = jnp.asarray(rng.standard_normal((rows[RANK], 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((rows[RANK], 8)), jnp.float32)
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


def test_vmap_and_eager_products_defer_with_the_same_bits(monkeypatch):
    plan = om.plan(*_layouts()["k_split"])
    _, _, a_loc, b_loc = _blocks(plan)
    batch_a = jnp.stack([a_loc, 2 * a_loc, -a_loc])

    def build():
        return jax.jit(jax.vmap(lambda x: om.matmul(x, b_loc, plan))), (batch_a,)

    _, _, in_place = _traced(monkeypatch, False, build)
    _, _, deferred = _traced(monkeypatch, True, build)
    assert in_place.tobytes() == deferred.tobytes()
    monkeypatch.setenv(config.DEFER, "1")
    eager = np.asarray(om.matmul(a_loc, b_loc, plan, sync="notify"))
    assert eager.tobytes() == in_place[0].tobytes()


@pytest.mark.ranks(min=2, reason="products that cannot defer, beside deferred ones")
def test_deferred_products_mix_with_chunked_fetching_and_fenced_ones(monkeypatch):
    """One program: a deferred K-split, the same product chunked (its finish in place), a
    product that fetches B's pieces, and a fenced one, all on COMM_WORLD, then the deferred
    one again; the call that cannot defer waits for the waiter first."""
    k_split = om.plan(*_layouts()["k_split"])
    fetching = om.plan(om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.rows((M, N)))
    a, b, a_loc, b_loc = _blocks(k_split)
    fa, fb = fetching.a.shard(a, RANK), fetching.b.shard(b, RANK)

    def build():
        def program(x, y, u, v):
            first = om.matmul(x, y, k_split)
            chunked = om.matmul(x, y, k_split, chunk_bytes=64)
            fetched = om.matmul(u, v, fetching)
            fenced = om.matmul(x, y, k_split, sync="fence")
            return first, chunked, fetched, fenced, om.matmul(2 * x, y, k_split)

        return jax.jit(program), (a_loc, b_loc, fa, fb)

    before = _deferred_count()
    fn, args, results = _traced(monkeypatch, True, build)
    results = [results] + [jax.tree.map(np.asarray, fn(*args)) for _ in range(4)]
    assert _deferred_count() - before == 10  # the first and the last product, five runs
    expected = k_split.c.shard(a @ b, RANK)
    for first, chunked, fetched, fenced, doubled in results:
        for c in (first, chunked, fenced):
            np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(fetched, fetching.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(doubled, 2 * expected, rtol=1e-4, atol=1e-4)


@pytest.mark.ranks(min=3, reason="origins that run ahead of a late target")
def test_deferred_products_back_to_back_with_a_late_target(monkeypatch):
    """Ranks 1.. only deliver (rank 0 owns C), and rank 0 sleeps before every product: their
    deferred products pile up on their waiters, whose deliveries wait for rank 0's slots."""
    m, n = 24, 16  # partials cheaper to send than A's and B's pieces: a K-split
    plan = om.plan(
        om.Layout.cols((m, K)),
        om.Layout.rows((K, n)),
        om.Layout.rows((m, n), sizes=[m] + [0] * (SIZE - 1)),
    )
    monkeypatch.setenv(config.DEFER, "1")
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    before = native.stats()
    rng = np.random.default_rng(13)
    results = []
    for _ in range(8):
        a = rng.standard_normal((m, K)).astype(np.float32)
        b = rng.standard_normal((K, n)).astype(np.float32)
        if RANK == 0:
            time.sleep(0.2)
        results.append((product(plan.a.shard(a, RANK), plan.b.shard(b, RANK)), a @ b))
    for c, full in results:
        np.testing.assert_allclose(np.asarray(c), plan.c.shard(full, RANK), rtol=1e-4, atol=1e-4)
    after = native.stats()
    counts = COMM.allgather(
        {k: after[k] - before[k] for k in ("deferred_reduces", "deferred_deliveries")}
    )
    assert [c["deferred_reduces"] for c in counts] == [8] * SIZE  # rank 0 waits on its waiter
    assert sum(c["deferred_deliveries"] for c in counts) > 0


@pytest.mark.ranks(min=2, reason="one rank's finish fails while the others complete")
def test_a_deferred_finish_that_fails_on_one_rank_fails_its_product_there_only(monkeypatch):
    """The waiter completes the failed rank's part (its partials were sent at the start), so
    the other ranks' products are right; the failed rank's program raises, and every product
    after it is right everywhere."""
    plan = om.plan(*_layouts()["data_parallel"])
    a, b, a_loc, b_loc = _blocks(plan)
    monkeypatch.setenv(config.DEFER, "1")
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    expected = plan.c.shard(a @ b, RANK)
    np.testing.assert_allclose(np.asarray(product(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4)
    resyncs = native.stats()["resyncs"]
    if RANK == 0:
        native.inject_failure("osmm_reduce_finish")
        with pytest.raises(jax.errors.JaxRuntimeError, match="injected failure"):
            np.asarray(product(a_loc, b_loc))
    else:
        np.testing.assert_allclose(
            np.asarray(product(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4
        )
    for _ in range(3):
        np.testing.assert_allclose(
            np.asarray(product(a_loc, b_loc)), expected, rtol=1e-4, atol=1e-4
        )
    assert COMM.allreduce(native.stats()["resyncs"] - resyncs) == 0  # nobody started again
