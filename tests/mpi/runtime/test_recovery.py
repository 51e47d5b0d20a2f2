"""After an error inside a jitted product, every rank stays in step: the next product on every
rank runs and is right.

Two errors are injected: a checksum failure (``verify=True``, raised on every rank by a host
callback after the product), and a failure between a reduce's start and its finish on one rank
only (the native test hook ``inject_failure("osmm_reduce_finish")``: that rank's program stops
with the reduce epoch open while the others wait for it). The second is recovered by the
rank's next call, which closes the abandoned product with the others and marks it abandoned,
so that their product fails too instead of returning a partial sum; in the notified mode it
also sends every rank a notice, so that a rank that did not wait for it and went on into the
step's next product fails that one, and at their next product all ranks start again together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import default_sync

import osmm_jax as om
from osmm_jax._src.runtime import communicators, native, primitives
from osmm_jax._src.runtime.checksum import inject_fault

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
# Most of what is checked here does not change from three ranks to four (uneven splits and a
# rank with nothing appear from 3 on); on 4 ranks only the fetch of a 2 x 2 x 1 split runs.
THREE = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it")
M, K, N = 11, 13, 7


def _plans():
    """A K-split (reduce only) and a plan that also fetches (rows of A against columns of B)."""
    return {
        "k_split": om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N))),
        "fetch_and_reduce": om.plan(
            om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.grid((M, N), (1, SIZE))
        ),
    }


@pytest.fixture(params=["rma", "messages"])
def transport(request, monkeypatch):
    """The notified mode's transport (``OSMM_TRANSPORT``, read when a product is traced): its
    abandonment notices are the same, and starting again settles the messages in flight."""
    monkeypatch.setenv("OSMM_TRANSPORT", request.param)
    return request.param


def _run(plan, **options):
    """A jitted product under ``plan`` and its expected result on this rank."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    a_loc, b_loc = plan.a.shard(a, RANK), plan.b.shard(b, RANK)
    fn = jax.jit(lambda x, y: om.matmul(x, y, plan, **options))
    expected = plan.c.shard(a @ b, RANK)
    return (lambda: np.asarray(jax.block_until_ready(fn(a_loc, b_loc)))), expected


def _stats_after_warm_up(run):
    """``run()`` once, then every rank done with it: a rank's partials may leave at its start
    (the message transport), so without the barrier rank 0 could go on to abandon the next
    product while another rank still finishes this one, which that rank would then fail."""
    run()
    COMM.Barrier()
    return om.stats()


def _abandoned_by_rank_0(run):
    """``run()`` with rank 0's next reduce finish failing (its program stops with the product
    open): it raises there. Every other rank fails one product for it: this one, when the
    abandonment reaches it while it still waits in it; or, when its part was complete before
    rank 0's next call told it (every delivery it waited for had come), its next one, at the
    start. Either way the ranks start again together at their next product after that."""
    if RANK == 0:
        native.inject_failure("osmm_reduce_finish")
        with pytest.raises(jax.errors.JaxRuntimeError, match="injected failure"):
            run()
        return
    try:
        run()
    except jax.errors.JaxRuntimeError as error:
        assert "rank 0 abandoned" in str(error)
        return
    with pytest.raises(jax.errors.JaxRuntimeError, match="rank 0 abandoned"):
        run()


def _recovered(run, expected):
    """Warms ``run`` up, has rank 0 abandon it (:func:`_abandoned_by_rank_0`), then checks
    three products right on every rank; the stats before the abandonment and after."""
    before = _stats_after_warm_up(run)
    _abandoned_by_rank_0(run)
    for _ in range(3):
        np.testing.assert_allclose(run(), expected, rtol=1e-12, atol=1e-12)
    return before, om.stats()


@THREE
@pytest.mark.ranks(min=2, reason="one rank abandons a product the others are in")
@pytest.mark.parametrize("kind", ["k_split", "fetch_and_reduce"])
@pytest.mark.parametrize("chunk_bytes", [0, 64])
def test_a_product_abandoned_by_one_rank_fails_everywhere_then_the_next_is_right(
    kind, chunk_bytes, transport
):
    jax.config.update("jax_enable_x64", True)
    before, after = _recovered(*_run(_plans()[kind], chunk_bytes=chunk_bytes))
    assert after["windows"] == before["windows"]
    assert after["window_bytes"] == before["window_bytes"]


def _two_product_step():
    """A jitted step of two products: the first delivers to ranks 0 and 1 only (rank 2 owns no
    C rows, so it waits for nobody there), the second is a K-split over every rank. Returns
    the step and its expected results on this rank."""
    rows = (M // 2, M - M // 2) + (0,) * (SIZE - 2)
    first = om.plan(
        om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N), sizes=rows)
    )
    second = _plans()["k_split"]
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    a_loc, b_loc = first.a.shard(a, RANK), first.b.shard(b, RANK)
    step = jax.jit(lambda x, y: (om.matmul(x, y, first), om.matmul(x, y, second)))
    expected = (first.c.shard(a @ b, RANK), second.c.shard(a @ b, RANK))
    return (lambda: jax.tree.map(np.asarray, jax.block_until_ready(step(a_loc, b_loc)))), expected


@THREE
@pytest.mark.ranks(min=3, reason="a rank that waits for nobody in the abandoned product")
def test_a_step_abandoned_by_one_rank_fails_everywhere_then_every_rank_starts_again(transport):
    """Rank 0 abandons the step's first product. Rank 1 waits for it there and fails; rank 2
    waits for nobody there, goes on into the second product, and fails there when it reads
    rank 0's notice (notified mode), or waits in the first product's closing fence (fence
    mode). At their next step every rank starts again together and the steps are right."""
    jax.config.update("jax_enable_x64", True)
    step, expected = _two_product_step()
    before = _stats_after_warm_up(step)
    _abandoned_by_rank_0(step)
    for _ in range(3):
        for got, want in zip(step(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    after = om.stats()
    assert after["windows"] == before["windows"]
    notified = default_sync().mode == "notify"
    assert after["resyncs"] - before["resyncs"] == (1 if notified else 0)
    messages = COMM.allreduce(after["messages"] - before["messages"])
    assert (messages > 0) == (notified and transport == "messages")


@THREE
def test_inject_failure_refuses_other_calls():
    with pytest.raises(ValueError, match="osmm_reduce_finish"):
        native.inject_failure("osmm_fetch")


@THREE
@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_a_checksum_failure_leaves_every_rank_in_step(method):
    jax.config.update("jax_enable_x64", True)
    plan = _plans()["k_split"]
    with inject_fault(SIZE - 1, 64.0):
        bad, _ = _run(plan, method=method, verify=True)
        with pytest.raises(jax.errors.JaxRuntimeError, match="checksum verification failed"):
            bad()
    good, expected = _run(plan, method=method, verify=True)
    for _ in range(3):
        np.testing.assert_allclose(good(), expected, rtol=1e-12, atol=1e-12)


@THREE
@pytest.mark.ranks(min=2)
def test_every_rank_reports_where_the_others_are():
    run, _ = _run(_plans()["k_split"])
    run()
    plan_comm = communicators.comm_for_key(_plans()["k_split"].comm_key)
    MPI.COMM_WORLD.Barrier()
    report = native.describe_ranks(plan_comm.handle, "where are you")
    assert report.startswith("where are you\n")
    for r in range(SIZE):
        assert f"rank {r}" in report, report
    assert "did not answer" not in report, report


@pytest.mark.ranks(4, reason="a fetch where some ranks get nothing from the one that abandons")
def test_a_fetch_abandoned_by_one_rank_fails_everywhere_then_the_next_is_right(transport):
    """A 2 x 2 x 1 split of the work: rank 0 stops inside the fetch, which some ranks do not
    get pieces from; they go on into the reduce (or finish the product) and fail the product
    they are in, or the next, when rank 0's next call sends the notice; then every rank starts
    again together and the products are right."""
    jax.config.update("jax_enable_x64", True)
    a_l, b_l, c_l, work = om.three_d_layouts((M, K, N), (2, 2, 1))
    plan = om.plan(a_l, b_l, c_l, work=work)
    mine = plan.for_rank(RANK)
    getting = COMM.allgather({t.target for t in mine.gets})
    assert any(0 not in owners for r, owners in enumerate(getting) if r != 0)
    before, after = _recovered(*_run(plan))
    assert after["windows"] == before["windows"]
    assert after["resyncs"] - before["resyncs"] == 1


def _deferred_step(monkeypatch):
    """A jitted step of a deferred weight gradient (``OSMM_DEFER=1``: its finish off the token
    chain, on the waiter) and a K-split, in the notified mode; the step, its expected results on
    this rank, and its arguments."""
    monkeypatch.setenv("OSMM_DEFER", "1")
    monkeypatch.setenv("OSMM_SYNC", "notify")
    rows = om.plan(om.Layout.rows((M, K)), om.Layout.replicated((K, N)), om.Layout.rows((M, N)))
    k_split = _plans()["k_split"]
    rng = np.random.default_rng(5)
    a, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N))
    w = w.astype(np.float32)
    args = (rows.a.shard(a, RANK), w, k_split.a.shard(a, RANK), k_split.b.shard(w, RANK))

    def step():
        grad = jax.grad(lambda x, y: jnp.sum(jnp.sin(om.matmul(x, y, rows))), argnums=1)
        fn = jax.jit(lambda x, y, x2, y2: (grad(x, y), om.matmul(x2, y2, k_split)))
        return lambda: jax.tree.map(np.asarray, fn(*args))

    good = step()
    _stats_after_warm_up(good)
    return step, good, good()


@THREE
@pytest.mark.ranks(min=3, reason="ranks that fail the step at different products")
def test_a_step_with_a_deferred_product_abandoned_by_one_rank_starts_again_in_step(
    monkeypatch, transport
):
    """Rank 0 abandons the step's K-split. Another rank may fail its deferred weight gradient
    on the waiter while its program goes on to the next product's start, which then starts the
    ranks again: that product fails too (it is in the program that failed), so every rank's
    next program starts from its first product, and the steps after are right, bit for bit.
    (Were that product run after starting again, it would meet the abandoning rank's first
    product of its next program: the ranks out of step.)"""
    _, good, expected = _deferred_step(monkeypatch)
    for _ in range(3):  # the ranks meet the notice at different products from run to run
        _abandoned_by_rank_0(good)
        for _ in range(2):
            for got, want in zip(good(), expected):
                assert got.tobytes() == want.tobytes()
        COMM.Barrier()


class _FailingFinish:
    """Stands in for the deferred finish primitive: binds the real one on a ticket that a host
    callback raises on, on rank 0 only, so that rank 0's finish never runs."""

    def __init__(self, real):
        self.real = real

    def bind(self, ticket, **params):
        def check(t):
            if RANK == 0:
                raise RuntimeError("the deferred finish never runs")
            return t

        shape = jax.ShapeDtypeStruct(ticket.shape, ticket.dtype)
        return self.real.bind(jax.pure_callback(check, shape, ticket), **params)


@THREE
@pytest.mark.ranks(min=2, reason="a rank abandons a product the others are in")
def test_a_deferred_result_nobody_collects_is_held_until_release(monkeypatch, transport):
    """Rank 0's step stops twice: its deferred weight gradient's finish never runs (a host
    callback on the ticket fails), and its K-split's finish fails (it abandons that product).
    The waiter still does rank 0's part of the weight gradient and holds the result nobody
    will collect; the steps after that are right, with the same bits, and ``om.release()``
    forgets the results nobody collected."""
    step, good, expected = _deferred_step(monkeypatch)
    real = primitives.osmm_reduce_finish_deferred_p
    monkeypatch.setattr(primitives, "osmm_reduce_finish_deferred_p", _FailingFinish(real))
    stopping = step()  # traced at its first call, below
    if RANK == 0:
        native.inject_failure("osmm_reduce_finish")
        with pytest.raises(jax.errors.JaxRuntimeError, match="injected failure|never runs"):
            stopping()
        native.inject_failure("osmm_reduce_finish", 0)  # spent, unless XLA stopped before it
        assert om.stats()["deferred_held"] == 1
    else:
        try:
            stopping()
        except jax.errors.JaxRuntimeError as error:
            assert "rank 0 abandoned" in str(error)
        else:  # its part was complete: it fails its next product instead
            with pytest.raises(jax.errors.JaxRuntimeError, match="rank 0 abandoned"):
                good()
    monkeypatch.setattr(primitives, "osmm_reduce_finish_deferred_p", real)
    for _ in range(3):
        for got, want in zip(good(), expected):
            assert got.tobytes() == want.tobytes()
    # Rank 0's, and any other rank's whose failing program ended before its finish ran.
    assert om.stats()["deferred_held"] >= (1 if RANK == 0 else 0)
    om.release()
    assert om.stats()["deferred_held"] == 0
    for got, want in zip(good(), expected):
        assert got.tobytes() == want.tobytes()
