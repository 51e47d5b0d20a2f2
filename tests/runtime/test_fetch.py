"""Which ranks fetch ahead of their GEMMs (osmm_jax._src.runtime.fetch.runs_ahead); no MPI
traffic (the fetches themselves run in tests/mpi/runtime/test_fetch_ahead.py)."""

from __future__ import annotations

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import backward, fetch
from osmm_jax._src.runtime.slots import Sync

AHEAD = Sync("notify", fetch_ahead=True)


def _grid(n=8):
    return Plan(*(Layout.grid((n, n), (2, 2)) for _ in range(3)))


def test_a_rank_that_sends_from_two_blocks_fetches_in_place():
    """A 2x2 grid rank serves pieces of both its A and its B block. In float32 it sends them
    from the blocks, two buffers, so the round cannot be a waiter's and its GEMMs stay merged;
    in 16-bit it packs them, cast, into one buffer and runs ahead."""
    grid = _grid()
    for rank in range(4):
        assert {t.matrix for t in fetch.moved(grid, rank)[1]} == {"A", "B"}
        assert not fetch.packs_pieces(grid, rank, True)
        assert not fetch.runs_ahead(grid, rank, AHEAD, True)
        assert fetch.runs_ahead(grid, rank, AHEAD, False)


def test_a_rank_that_sends_from_one_block_runs_ahead_where_slots_allow():
    """Rows of A split, B and C by columns: every rank serves its rows of A, one buffer. It
    runs ahead unless OSMM_FETCH_AHEAD says no or the mode is fenced."""
    plan = Plan(
        Layout.rows((12, 4), nranks=3),
        Layout.cols((4, 9), nranks=3),
        Layout.cols((12, 9), nranks=3),
    )
    for rank in range(3):
        assert fetch.runs_ahead(plan, rank, AHEAD, True)
        assert not fetch.runs_ahead(plan, rank, AHEAD._replace(fetch_ahead=False), True)
        assert not fetch.runs_ahead(plan, rank, Sync("fence", fetch_ahead=True), True)


def test_a_fetch_left_with_nothing_to_get_runs_in_place():
    """A K-split's weight gradient takes all of dC from dA's fetch: what is left of its own
    fetch gets nothing, so there is nothing for a waiter to overlap."""
    plan = Plan(
        Layout.cols((8, 8), nranks=4), Layout.rows((8, 8), nranks=4), Layout.rows((8, 8), nranks=4)
    )
    _, d_b = plan.backward()
    for rank in range(4):
        taken = backward.taken_on(plan, rank)
        assert fetch.moved(d_b, rank)[0] and not fetch.moved(d_b, rank, taken)[0]
        assert not fetch.runs_ahead(d_b, rank, AHEAD, True, taken)
