"""The backward products fetching what they share once (osmm_jax._src.runtime.backward).

Where dB's product needs only pieces of dC that dA's product fetches (a K-split product, or a
work split over K), dB takes them from dA's fetched buffer: the same bits as two fetches, in
both synchronisations, with dB's finish deferred or in place, under vmap; fewer bytes, exactly
as ``rma_bytes(direction="backward")`` predicts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import K, M, N, global_inputs, make_layouts

import osmm_jax as om
from osmm_jax._src import config
from osmm_jax._src.runtime import backward, native, slots

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.ranks(min=2, reason="one rank fetches nothing")


def _k_split():
    return om.plan(*make_layouts(("cols", "rows", "rows"), shifts=(0, 1, 2)))


def _k_split_work():
    """Every rank computes a slice of K for every C element: dA and dB both fetch all of dC
    but the rank's own block, and both deliver partials (dB's may be deferred)."""
    work = om.Work.grid((M, K, N), (1, SIZE, 1), k_weights=[2.0, 1.0, 1.0, 3.0][:SIZE])
    return om.plan(*make_layouts(("rows", "cols", "grid"), shifts=(0, 1, 2)), work=work)


def _grid():
    """dA's product fetches rows of dC, dB's columns: they share some pieces."""
    return om.plan(*make_layouts(("grid", "grid", "grid"), shifts=(0, 1, 2)))


PLANS = {"k_split": _k_split, "k_split_work": _k_split_work, "grid": _grid}


def _gradients(plan, sync, shared, monkeypatch):
    """dA and dB of ``sum(C * G)`` (second jitted run) with the cotangent's fetch shared or
    not, and the RMA bytes this rank issued in that run."""
    if not shared:
        monkeypatch.setattr(backward, "shares_cotangent", lambda *args: False)
    a, b, g = global_inputs(seed=21)
    blocks = plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan.c.shard(g, RANK)
    loss = lambda x, y, gc: jnp.sum(om.matmul(x, y, plan, sync=sync) * gc)  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(*blocks))
    before = om.stats()["rma_bytes"]
    d_a, d_b = jax.block_until_ready(step(*blocks))
    moved = om.stats()["rma_bytes"] - before
    monkeypatch.undo()
    np.testing.assert_allclose(d_a, plan.a.shard(g @ b.T, RANK), rtol=1e-12)
    np.testing.assert_allclose(d_b, plan.b.shard(a.T @ g, RANK), rtol=1e-12)
    return np.asarray(d_a), np.asarray(d_b), moved


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("sync", ["notify", "fence"])
@pytest.mark.parametrize("name", list(PLANS))
def test_one_fetch_of_the_cotangent_gives_the_bits_of_two(name, sync, defer, monkeypatch):
    plan = PLANS[name]()
    resolved = slots.Sync(sync, config.slot_budget())
    assert backward.shares_cotangent(plan, resolved)
    monkeypatch.setenv(config.DEFER, "1" if defer else "0")
    deferred = native.stats()["deferred_reduces"]
    *shared, moved = _gradients(plan, sync, True, monkeypatch)
    deferred = native.stats()["deferred_reduces"] - deferred
    monkeypatch.setenv(config.DEFER, "1" if defer else "0")
    *separate, moved_separately = _gradients(plan, sync, False, monkeypatch)
    for got, expected in zip(shared, separate):
        np.testing.assert_array_equal(got, expected)
    forward = om.rma_bytes(plan, 8, 8, sync=sync)[RANK]
    assert moved == forward + om.rma_bytes(plan, 8, 8, direction="backward", sync=sync)[RANK]
    taken = backward.taken_bytes(plan, resolved, 8, 8)
    assert moved == moved_separately - taken[RANK]
    # K-split: dB's product fetches nothing; the work split leaves it A.T to fetch, the grid
    # (uneven blocks) the pieces of dC dA's product does not fetch.
    assert backward.fetches_nothing(plan, resolved) == (name == "k_split")
    assert sum(taken) > 0
    # A dB that delivers partials (the work split's) is deferred when asked: two compiles and
    # two runs.
    delivers = plan.backward()[1].has_deliveries and sync == "notify"
    assert deferred == (2 if delivers and defer else 0)


@pytest.mark.parametrize("keep", [False, True])
def test_per_example_gradients_share_or_keep_the_fetch_under_vmap(keep):
    """Three products, each backward fetch shared (the K-split work split) or taken from the
    forward product's (a sequence-parallel layer, keep_fetched)."""
    plan = _sequence_parallel() if keep else _k_split_work()
    resolved = slots.Sync("notify", config.slot_budget())
    assert backward.reuse(plan, resolved, True, keep) != backward.NONE
    batch = [global_inputs(seed=30 + i) for i in range(3)]
    stack = lambda layout, i: jnp.stack([layout.shard(x[i], RANK) for x in batch])  # noqa: E731

    def loss(x, y, g):
        return jnp.sum(om.matmul(x, y, plan, sync="notify", keep_fetched=keep) * g)

    step = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))
    args = stack(plan.a, 0), stack(plan.b, 1), stack(plan.c, 2)
    jax.block_until_ready(step(*args))
    before = om.stats()["rma_bytes"]
    d_a, d_b = jax.block_until_ready(step(*args))
    moved = om.stats()["rma_bytes"] - before
    forward = om.rma_bytes(plan, 8, 8, sync="notify")[RANK]
    back = om.rma_bytes(plan, 8, 8, direction="backward", sync="notify", keep_fetched=keep)
    assert moved == 3 * (forward + back[RANK])
    for i, (a, b, g) in enumerate(batch):
        np.testing.assert_allclose(d_a[i], plan.a.shard(g @ b.T, RANK), rtol=1e-12)
        np.testing.assert_allclose(d_b[i], plan.b.shard(a.T @ g, RANK), rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_gradients_share_the_fetch_with_the_bits_of_two(dtype, monkeypatch):
    """16-bit pieces travel as float32 and come back in the input dtype, in both fetches."""
    plan = _k_split()
    a, b, g = (jnp.asarray(x, dtype) for x in global_inputs(seed=23))
    blocks = plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan.c.shard(g, RANK)
    loss = lambda x, y, gc: jnp.sum(om.matmul(x, y, plan) * gc)  # noqa: E731
    shared = jax.jit(jax.grad(loss, argnums=(0, 1)))(*blocks)
    monkeypatch.setattr(backward, "shares_cotangent", lambda *args: False)
    separate = jax.jit(jax.grad(loss, argnums=(0, 1)))(*blocks)
    for got, expected in zip(shared, separate):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_a_derivative_of_the_shared_gradient_is_refused_on_every_rank():
    plan = _k_split()
    a, b, g = global_inputs(seed=24)
    blocks = plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan.c.shard(g, RANK)

    def grads_dot(x, y, gc):
        d_a, d_b = jax.grad(lambda x, y: jnp.sum(om.matmul(x, y, plan) * gc), (0, 1))(x, y)
        return jnp.sum(d_a) + jnp.sum(d_b)

    with pytest.raises(NotImplementedError, match="first-order"):
        jax.grad(grads_dot, argnums=2)(*blocks)


# -- the forward product's fetch, kept (keep_fetched) --------------------------------------
# The backward products take pieces from it: the same bits as fetching them again (fenced:
# but for the order partials arrive in), with one input differentiated or both, under vmap;
# fewer bytes, exactly as rma_bytes(direction="backward", keep_fetched=True) predicts.


def _sequence_parallel():
    """A sequence-parallel column layer: A's rows (sequences) split unevenly, the kernel B and
    C by columns. The forward product fetches rows of A and columns of B; dA's product takes
    B.T's pieces from it, dB's A.T's."""
    rows = [1, 2, 4, 0][:SIZE]
    rows[-1] += M - sum(rows)
    return om.plan(
        om.Layout.rows((M, K), sizes=rows),
        om.Layout.cols((K, N), weights=[1.0, 1.0, 2.0, 3.0][:SIZE]),
        om.Layout.cols((M, N), weights=[1.0, 1.0, 2.0, 3.0][:SIZE]),
    )


def _rows_into_grid():
    return om.plan(*make_layouts(("rows", "cols", "grid"), shifts=(0, 1, 2)))


KEPT_PLANS = {
    "sequence_parallel": _sequence_parallel,
    "grid": _grid,
    "rows_cols_grid": _rows_into_grid,
}
WRT = {"both": (0, 1), "a": (0,), "b": (1,)}


def _kept_gradients(plan, sync, keep, argnums):
    """The gradients of ``sum(C * G)`` with respect to ``argnums`` (second jitted run), and
    the RMA bytes this rank issued in that run."""
    a, b, g = global_inputs(seed=41)
    blocks = plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan.c.shard(g, RANK)

    def loss(x, y, gc):
        return jnp.sum(om.matmul(x, y, plan, sync=sync, keep_fetched=keep) * gc)

    step = jax.jit(jax.grad(loss, argnums=argnums))
    jax.block_until_ready(step(*blocks))
    before = om.stats()["rma_bytes"]
    grads = jax.block_until_ready(step(*blocks))
    moved = om.stats()["rma_bytes"] - before
    expected = {0: plan.a.shard(g @ b.T, RANK), 1: plan.b.shard(a.T @ g, RANK)}
    for i, grad in zip(argnums, grads):
        np.testing.assert_allclose(grad, expected[i], rtol=1e-12)
    return [np.asarray(x) for x in grads], moved


@pytest.mark.parametrize("wrt", list(WRT))
@pytest.mark.parametrize("sync", ["notify", "fence"])
@pytest.mark.parametrize("name", list(KEPT_PLANS))
def test_pieces_kept_from_the_forward_give_the_bits_of_a_second_fetch(name, sync, wrt):
    plan = KEPT_PLANS[name]()
    resolved = slots.Sync(sync, config.slot_budget())
    how = backward.reuse(plan, resolved, True, True)
    assert how.keep == {"dA", "dB"}
    kept, moved = _kept_gradients(plan, sync, True, WRT[wrt])
    fetched, moved_again = _kept_gradients(plan, sync, False, WRT[wrt])
    for got, expected in zip(kept, fetched):
        if sync == "notify":
            np.testing.assert_array_equal(got, expected)
        else:  # a fenced reduce sums its partials in arrival order: the last bit may differ
            np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-15)
    if wrt != "both":
        return  # rma_bytes counts the gradient with respect to both
    forward = om.rma_bytes(plan, 8, 8, sync=sync)[RANK]
    predicted = om.rma_bytes(plan, 8, 8, direction="backward", sync=sync, keep_fetched=True)
    assert moved == forward + predicted[RANK]
    saved = sum(om.rma_bytes(plan, 8, 8, direction="backward", sync=sync)) - sum(predicted)
    assert saved > 0
    assert moved <= moved_again


def test_a_sequence_parallel_weight_gradient_fetches_nothing_again():
    """Every piece of A.T and B.T the backward products need was fetched by the forward
    product: their rounds of those matrices run on no rank."""
    plan = _sequence_parallel()
    how = backward.reuse(plan, slots.Sync("notify", config.slot_budget()), True, True)
    assert backward.skipped(plan, "dA", how) >= {"B"}
    assert backward.skipped(plan, "dB", how) >= {"A"}


def test_keep_fetched_must_be_a_bool():
    plan = _sequence_parallel()
    a, b, _ = global_inputs(seed=3)
    with pytest.raises(TypeError, match="keep_fetched must be True or False"):
        om.matmul(plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan, keep_fetched="yes")
