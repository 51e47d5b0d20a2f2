"""Which pieces of C's cotangent the backward products share (osmm_jax._src.runtime.backward),
and what rma_bytes and memory_bytes then say; no MPI traffic (the products themselves run in
tests/mpi/runtime/test_backward.py)."""

from __future__ import annotations

import numpy as np
import pytest

import osmm_jax as om
from osmm_jax._src.planning import memory
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import backward, fetch
from osmm_jax._src.runtime.slots import Sync

NOTIFY, FENCE = Sync("notify"), Sync("fence")


def _k_split(n=8, p=4):
    """A by columns, B by rows, C by rows: dA and dB both multiply by the whole dC."""
    return Plan(
        Layout.cols((n, n), nranks=p), Layout.rows((n, n), nranks=p), Layout.rows((n, n), nranks=p)
    )


def test_a_k_split_s_weight_gradient_takes_all_of_dc_from_da_s_fetch():
    plan = _k_split()
    d_a, d_b = plan.backward()
    assert backward.shares_cotangent(plan, NOTIFY)
    assert backward.fetches_nothing(plan, NOTIFY)
    for rank in range(4):
        mine = d_b.for_rank(rank)
        assert mine.gets and backward.taken_on(plan, rank) == {*mine.gets, *mine.served}
        assert fetch.moved(d_b, rank, backward.taken_on(plan, rank)) == ((), ())
        # every rank gets the 6 rows of dC it does not hold, 8 wide, from the 3 other owners
        assert sum(t.elements for t in mine.gets) == 6 * 8
    assert backward.taken_bytes(plan, NOTIFY, 4, 8) == (6 * 8 * 8,) * 4  # pushed, float64 sums
    assert backward.taken_bytes(plan, FENCE, 4, 8) == (6 * 8 * 4,) * 4  # got, float32


@pytest.mark.parametrize("sync", ["notify", "fence"])
def test_rma_bytes_of_the_backward_products_count_the_shared_pieces_once(sync):
    plan = _k_split()
    d_a, d_b = plan.backward()
    both = [om.rma_bytes(p, 4, 4, sync=sync) for p in (d_a, d_b)]
    taken = backward.taken_bytes(plan, Sync(sync), 4, 4)
    expected = tuple(x + y - t for x, y, t in zip(*both, taken))
    assert om.rma_bytes(plan, 4, 4, direction="backward", sync=sync) == expected
    assert sum(taken) > 0
    assert om.rma_bytes(plan, 4, 4, direction="forward", sync=sync) == om.rma_bytes(
        plan, 4, 4, sync=sync
    )


def test_memory_bytes_of_the_gradient_counts_the_shared_pieces_once(monkeypatch):
    # In place: a fetch ahead's copies are test_matmul's test_a_fetch_ahead_adds_the_waiter_s_copies.
    monkeypatch.setenv("OSMM_FETCH_AHEAD", "0")
    plan = _k_split()
    d_a, d_b = plan.backward()
    for rank in range(4):
        taken = backward.taken_on(plan, rank)
        peak = om.memory_bytes(plan, rank, direction="backward", sync="notify")
        d_b_shared = memory.one_sided_transient(d_b, rank, True, taken=taken)
        # dB's GEMM over all of dC's rows joins dC's pieces (8 x 8); its A.T operand is the
        # rank's whole block of A.T (2 x 8), read in place. That copy, not pieces of its own,
        # is its peak; it serves nothing.
        assert d_b_shared == 8 * 8
        d_a_alone = memory.one_sided_transient(d_a, rank, fetch.packs_pieces(d_a, rank, True))
        forward = memory.one_sided_transient(plan, rank, False)
        assert peak.transient == max(forward, d_a_alone + d_b_shared) * 4


def test_an_even_grid_shares_nothing_but_runs_both_fetches():
    """dA's product fetches the rows of dC, dB's its columns: they meet in the rank's own
    block, which neither fetches."""
    plan = Plan(*(Layout.grid((8, 8), (2, 2)) for _ in range(3)))
    assert backward.shares_cotangent(plan, NOTIFY)
    assert not backward.fetches_nothing(plan, NOTIFY)
    assert all(not backward.taken_on(plan, rank) for rank in range(4))
    assert backward.taken_bytes(plan, NOTIFY, 4, 4) == (0,) * 4


def test_nothing_is_shared_where_one_backward_product_fetches_nothing():
    """Rows x replicated: dA = dC @ B.T is local."""
    plan = Plan(
        Layout.rows((8, 8), nranks=4),
        Layout.replicated((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
    )
    assert not backward.shares_cotangent(plan, NOTIFY)
    assert not backward.fetches_nothing(plan, NOTIFY)
    assert backward.taken_bytes(plan, NOTIFY, 4, 4) == (0,) * 4


def test_a_fetch_that_leaves_pieces_out_lays_out_the_rest_from_zero():
    """The pieces left are laid out one after another in owner order, as if the others had
    never been asked for."""
    plan = _k_split()
    _, d_b = plan.backward()
    gets = sorted(d_b.for_rank(0).gets, key=lambda t: t.target)
    taken = frozenset(gets[:1])
    left, _ = fetch.moved(d_b, 0, taken)
    assert sorted(left, key=lambda t: t.target) == gets[1:]
    total = sum(t.elements for t in left)
    pieces = fetch.pieces_in(d_b, 0, (np.arange(float(total)),), "notify", taken)
    assert sorted(pieces) == sorted((t.matrix, t.rows, t.cols) for t in left)
    start = 0
    for t in gets[1:]:
        piece = pieces[(t.matrix, t.rows, t.cols)]
        assert piece.ravel()[0] == start and piece.size == t.elements
        start += t.elements


# -- the forward product's fetch, kept (keep_fetched) --------------------------------------


def _sequence_parallel(p=3):
    """A sequence-parallel column layer: rows of A uneven, B and C by columns."""
    return Plan(
        Layout.rows((14, 9), sizes=[2, 4, 8][:p]),
        Layout.cols((9, 12), weights=[1.0, 1.0, 2.0][:p]),
        Layout.cols((14, 12), weights=[1.0, 1.0, 2.0][:p]),
    )


def test_kept_pieces_lie_transposed_within_what_the_forward_product_fetched():
    plan = _sequence_parallel()
    how = backward.reuse(plan, NOTIFY, True, True)
    assert how == backward.Reuse(True, frozenset({"dA", "dB"}))
    for rank in range(3):
        fwd = plan.for_rank(rank).gets
        for product, matrix in (("dA", "B"), ("dB", "A")):
            for t in backward.kept_on(plan, rank, product):
                assert t.matrix == matrix
                if t.origin == rank:  # a piece this rank gets: one the forward product got
                    assert any(
                        f.matrix == matrix
                        and f.target == t.target
                        and f.rows[0] <= t.cols[0] <= t.cols[1] <= f.rows[1]
                        and f.cols[0] <= t.rows[0] <= t.rows[1] <= f.cols[1]
                        for f in fwd
                    )
    # Every piece of B.T and A.T the backward products get was fetched forward: those
    # rounds run on no rank, and what is left of dB's fetch is dC's, taken from dA's.
    assert backward.skipped(plan, "dA", how) >= {"B"}
    assert backward.skipped(plan, "dB", how) == {"A", "B"}
    assert backward.skipped(plan, "dB", backward.Reuse(True)) == {"B"}


def test_keep_fetched_moves_fewer_bytes_and_counts_what_it_keeps():
    plan = _sequence_parallel()
    for sync in ("notify", "fence"):
        kept = om.rma_bytes(plan, 4, 4, direction="backward", sync=sync, keep_fetched=True)
        again = om.rma_bytes(plan, 4, 4, direction="backward", sync=sync)
        assert all(k <= a for k, a in zip(kept, again)) and sum(kept) < sum(again)
    how = backward.reuse(plan, NOTIFY, True, True)
    for rank in range(3):
        # What each backward product reads from the kept buffers counts as received by it.
        for product in ("dA", "dB"):
            got = [t for t in backward.kept_on(plan, rank, product) if t.origin == rank]
            assert backward.kept_elements(plan, rank, product, how) == sum(t.elements for t in got)
        peak = om.memory_bytes(plan, rank, direction="backward", sync="notify", keep_fetched=True)
        assert peak.total > 0
    with pytest.raises(TypeError, match="keep_fetched must be True or False"):
        om.rma_bytes(plan, direction="backward", keep_fetched=1)


def test_nothing_is_kept_without_keep_fetched_or_a_forward_fetch():
    assert backward.reuse(_sequence_parallel(), NOTIFY, True, False).keep == frozenset()
    plan = _k_split()  # the forward product fetches nothing: a K-split delivers partials
    assert backward.reuse(plan, NOTIFY, True, True).keep == frozenset()
