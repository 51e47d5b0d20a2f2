"""The notified mode's message transport (``OSMM_TRANSPORT=messages``,
xla_ffi/notified/messages.h): partials and pieces travel as two-sided messages, one per origin
and target, into receives the targets post, and the sums are the same bits as the RMA
transport's.

Covered on 1-4 ranks: sums, placed fetches and all-gathers of several layouts in both dtypes;
the origins summed in rounds under a small slot budget; deferred weight gradients and a
training step; large messages into a target that starts late; what the counters say; and a
transport set differently on one rank, refused on every rank before any data moves.
(Abandoned products with messages: test_recovery.py, which runs both transports.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
pytestmark = pytest.mark.ranks(1, 2, 3, 4)
M, K, N = 4 * SIZE + 3, 19, 4 * SIZE + 1


def _plans():
    """Layouts that sum partials (a K-split, an uneven grid), fetch pieces (placement) and
    gather a replicated C, by name."""
    grid = (2, SIZE // 2) if SIZE % 2 == 0 else (1, SIZE)
    uneven = tuple(range(1, SIZE + 1))
    return {
        "k_split": (om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N))),
        "k_split_uneven": (
            om.Layout.cols((M, K), sizes=_sizes(K, uneven)),
            om.Layout.rows((K, N), sizes=_sizes(K, uneven)),
            om.Layout.grid((M, N), grid),
        ),
        "fetch": (om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.grid((M, N), grid)),
        "replicated_c": (
            om.Layout.cols((M, K)),
            om.Layout.rows((K, N)),
            om.Layout.replicated((M, N)),
        ),
        "data_parallel": (
            om.Layout.rows((M, K)),
            om.Layout.replicated((K, N)),
            om.Layout.rows((M, N)),
        ),
    }


def _sizes(total, weights):
    """``total`` split in proportion to ``weights``, in whole rows."""
    cuts = np.round(np.cumsum((0,) + weights) / sum(weights) * total).astype(int)
    return tuple(int(b - a) for a, b in zip(cuts[:-1], cuts[1:]))


def _product(monkeypatch, transport, layouts, dtype, **options):
    """One jitted product of ``layouts`` with ``OSMM_TRANSPORT=transport`` (read while it is
    traced): its result on this rank, and the counters it moved."""
    monkeypatch.setenv("OSMM_TRANSPORT", transport)
    plan = om.plan(*layouts)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((M, K)).astype(dtype)
    b = rng.standard_normal((K, N)).astype(dtype)
    fn = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify", **options))
    a_loc, b_loc = plan.a.shard(a, RANK), plan.b.shard(b, RANK)
    np.asarray(fn(a_loc, b_loc))  # traced and warmed up
    before = om.stats()
    c = np.asarray(fn(a_loc, b_loc))
    after = om.stats()
    np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    return plan, c, {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


@pytest.mark.parametrize("name", list(_plans()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_messages_give_the_rma_transport_s_bits(monkeypatch, name, dtype):
    jax.config.update("jax_enable_x64", True)
    layouts = _plans()[name]
    _, by_rma, rma = _product(monkeypatch, "rma", layouts, dtype)
    plan, by_messages, moved = _product(monkeypatch, "messages", layouts, dtype)
    assert by_messages.tobytes() == by_rma.tobytes()
    assert moved["accumulates"] == moved["puts"] == 0
    assert moved["messages"] == moved["notifications"] == rma["notifications"]
    # The payload is what the RMA transport moves; the messages add their stamps only (the
    # records go packed, and the targets place them).
    itemsize = np.dtype(dtype).itemsize
    assert moved["rma_bytes"] == rma["rma_bytes"] == om.rma_bytes(plan, itemsize, itemsize)[RANK]
    assert moved["message_bytes"] == moved["rma_bytes"] + 8 * moved["messages"]
    if SIZE > 1 and plan.has_deliveries:
        assert COMM.allreduce(moved["messages"]) > 0


@pytest.mark.ranks(3, 4, reason="more origins than one slot")
def test_origins_beyond_the_slot_budget_are_received_in_rounds(monkeypatch):
    layouts = _plans()["k_split"]
    _, by_rma, _ = _product(monkeypatch, "rma", layouts, np.float32)
    monkeypatch.setenv("OSMM_SLOT_BUDGET", "1")  # one slot: one origin per round
    _, by_messages, moved = _product(monkeypatch, "messages", layouts, np.float32)
    assert by_messages.tobytes() == by_rma.tobytes()
    assert moved["messages"] == SIZE - 1


def _training_steps(monkeypatch, transport, steps=3):
    """Three SGD steps of a two-layer data-parallel model, weight gradients deferred, with
    ``transport``: the final weights and the deferred reduces run."""
    monkeypatch.setenv("OSMM_TRANSPORT", transport)
    monkeypatch.setenv("OSMM_DEFER", "1")
    p1 = om.plan(*_plans()["data_parallel"])
    p2 = om.plan(om.Layout.rows((M, N)), om.Layout.replicated((N, 5)), om.Layout.rows((M, 5)))
    rng = np.random.default_rng(5)
    x = p1.a.shard(rng.standard_normal((M, K)).astype(np.float32), RANK)
    w = (rng.standard_normal((K, N)), rng.standard_normal((N, 5)))
    w = tuple(v.astype(np.float32) for v in w)

    def loss(w, x):
        h = jnp.tanh(om.matmul(x, w[0], p1))
        return jnp.sum(om.matmul(h, w[1], p2) ** 2)

    @jax.jit
    def step(w, x):
        return jax.tree.map(lambda v, g: v - 1e-3 * g, w, jax.grad(loss)(w, x))

    before = om.stats()["deferred_reduces"]
    for _ in range(steps):
        w = step(w, x)
    return jax.tree.map(np.asarray, w), om.stats()["deferred_reduces"] - before


def test_deferred_training_steps_give_the_rma_transport_s_bits(monkeypatch):
    by_rma, _ = _training_steps(monkeypatch, "rma")
    by_messages, deferred = _training_steps(monkeypatch, "messages")
    for got, want in zip(by_messages, by_rma):
        assert got.tobytes() == want.tobytes()
    assert deferred == (6 if SIZE > 1 else 0)


@pytest.mark.ranks(min=2, reason="a target that starts late")
def test_large_messages_wait_for_a_late_target(monkeypatch):
    """Messages above any eager limit (about 1 MiB each) sent before their target has posted
    its receives: they wait for it, and the next products are right."""
    monkeypatch.setenv("OSMM_TRANSPORT", "messages")
    rows, inner, cols = 512, 8 * SIZE, 512
    plan = om.plan(
        om.Layout.cols((rows, inner)), om.Layout.rows((inner, cols)), om.Layout.rows((rows, cols))
    )
    rng = np.random.default_rng(9)
    a = rng.standard_normal((rows, inner)).astype(np.float32)
    b = rng.standard_normal((inner, cols)).astype(np.float32)

    def late(x):
        if RANK == 0:
            time.sleep(0.3)
        return x

    @jax.jit
    def product(x, y):
        x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return om.matmul(x, y, plan)

    for _ in range(3):
        c = np.asarray(product(plan.a.shard(a, RANK), plan.b.shard(b, RANK)))
        np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)


@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_a_transport_set_on_one_rank_only_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv("OSMM_TRANSPORT", "messages" if RANK == 0 else "rma")
    plan = om.plan(*_plans()["k_split"])
    x = np.ones(plan.a.local_shape(RANK), np.float32)
    y = np.ones(plan.b.local_shape(RANK), np.float32)
    before = om.stats()
    with pytest.raises(ValueError, match="ranks disagree.*transport='messages'"):
        np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(x, y))
    after = om.stats()
    assert after["messages"] == before["messages"]
    assert after["rma_bytes"] == before["rma_bytes"]
    # Every rank is still in step: the next product, set alike, is right.
    monkeypatch.setenv("OSMM_TRANSPORT", "messages")
    c = np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(x, y))
    np.testing.assert_allclose(c, plan.c.shard(np.ones((M, K)) @ np.ones((K, N)), RANK))


def test_the_transport_must_be_one_osmm_knows(monkeypatch):
    monkeypatch.setenv("OSMM_TRANSPORT", "carrier-pigeon")
    plan = om.plan(*_plans()["k_split"])
    x = np.ones(plan.a.local_shape(RANK), np.float32)
    y = np.ones(plan.b.local_shape(RANK), np.float32)
    with pytest.raises(ValueError, match="OSMM_TRANSPORT must be one of"):
        om.matmul(x, y, plan)
