"""The notified reduce's slots (osmm_jax._src.runtime.slots), without MPI."""

from __future__ import annotations

import math

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.records import combine_facts
from osmm_jax._src.runtime import slots


def _k_split(nranks=4, m=10, k=16, n=6):
    return Plan(
        Layout.cols((m, k), nranks=nranks),
        Layout.rows((k, n), nranks=nranks),
        Layout.rows((m, n), nranks=nranks),
    )


def test_every_other_rank_is_an_origin_of_a_k_split():
    plan = _k_split()
    assert [plan.for_rank(r).origins for r in range(4)] == [
        (1, 2, 3),
        (0, 2, 3),
        (0, 1, 3),
        (0, 1, 2),
    ]
    facts = combine_facts(plan.for_rank(r).facts for r in range(4))
    assert facts.max_origins == 3 == plan._schedule_facts.max_origins


def test_slots_are_capped_by_the_budget_but_never_below_one():
    plan = _k_split()
    block = 3 * 6 * 4  # the largest C block (3 rows x 6), float32, is 72 bytes
    assert slots.slot_bytes(plan, 4) == 128  # aligned to 64 bytes
    assert block <= slots.slot_bytes(plan, 4)
    assert slots.slot_count(plan, 4, math.inf) == 3
    assert slots.slot_count(plan, 4, 256) == 2
    assert slots.slot_count(plan, 4, 1) == 1
    assert slots.window_bytes(plan, 4, 256) == 3 * 128


def test_the_attribute_lists_this_ranks_origins_and_targets():
    plan = _k_split()
    attribute = slots.notify_attribute(plan, 1, 4, slots.Sync("notify"))
    assert attribute == (3, 128, 0, 3, 0, 2, 3, 3, 0, 2, 3)
    pulled = slots.notify_attribute(plan, 1, 4, slots.Sync("notify", 256, credits="pull"))
    assert pulled == (2, 128, 1, 3, 0, 2, 3, 3, 0, 2, 3)
    assert set(plan._rank_plans) == {1}  # only this rank's part of the plan was built


def test_the_message_transport_is_flag_8_and_needs_no_second_set():
    """``transport="messages"`` sets flag 8 in every notified attribute (sums, placed fetches,
    gathers); a deferred product then keeps one set of slots, since a target posts its
    receives only after summing the product before. ``"rma"`` leaves the flags as they were;
    a fenced product or a single rank never uses messages."""
    plan = _k_split()
    messages = slots.Sync("notify", transport="messages")
    assert slots.uses_messages(plan, messages)
    assert slots.notify_attribute(plan, 1, 4, messages)[:3] == (3, 128, 8)
    deferred = messages._replace(defer=True)
    assert slots.notify_attribute(plan, 1, 4, deferred)[:3] == (3, 128, 8)
    rma_deferred = slots.Sync("notify", defer=True, transport="rma")
    assert slots.notify_attribute(plan, 1, 4, rma_deferred)[:3] == (6, 128, 2)
    fetched = slots.fetch_attribute(plan, 4, messages, (0,), (2,), (0,), (64,))
    assert fetched[2] == 4 | 8
    assert not slots.uses_messages(plan, slots.Sync("fence", transport="messages"))
    assert not slots.uses_messages(_k_split(nranks=1), messages)


def test_the_resident_window_is_the_slots_a_rank_s_origins_write():
    """Notified: a K-split rank's three origins each write a slot of the largest C block (2x8
    float32, 64 bytes); the sum of the origins below a rank, formed before its own partial
    joins, is held in a slot while its round lasts and needs the accumulator (one slot more)
    only where a round of origins all below the rank is followed by another; a grid rank gets its A piece and its B piece from two owners in two
    rounds, each writing the same slot (of the most one owner sends, a 4x4 piece, 64 bytes),
    placed without the accumulator. Fenced: the reduce window (one C block) and the exposed A
    and B blocks."""
    notify = slots.Sync("notify")
    k_split = _k_split(m=8, k=8, n=8)
    assert slots.resident_window_bytes(k_split, 0, 4, 4, notify) == 3 * 64
    for rank in (1, 2, 3):  # every origin in one round
        assert slots.resident_window_bytes(k_split, rank, 4, 4, notify) == 3 * 64
    one_slot = slots.Sync("notify", slot_budget=64)  # rounds of one slot
    assert slots.resident_window_bytes(k_split, 0, 4, 4, one_slot) == 64
    for rank in (1, 2, 3):  # the round of origin 0 is followed by another
        assert slots.resident_window_bytes(k_split, rank, 4, 4, one_slot) == 2 * 64
    two_slots = slots.Sync("notify", slot_budget=128)  # rounds (0, 1), (2, 3) less the rank
    assert slots.resident_window_bytes(k_split, 1, 4, 4, two_slots) == 2 * 64  # (0, 2): 2 above
    for rank in (2, 3):  # (0, 1), both below, then another round
        assert slots.resident_window_bytes(k_split, rank, 4, 4, two_slots) == 3 * 64
    assert slots.resident_window_bytes(k_split, 0, 4, 4, slots.FENCE) == 64
    grid = Plan(*(Layout.grid((8, 8), (2, 2)) for _ in range(3)))
    assert slots.fetch_rounds(grid, "notify") == (("A",), ("B",))
    assert slots.fetch_rounds(grid, "fence") == (("A", "B"),)
    assert slots.resident_window_bytes(grid, 0, 4, 4, notify) == 64
    assert slots.resident_window_bytes(grid, 0, 4, 4, slots.FENCE) == (16 + 16) * 4
    assert slots.resident_window_bytes(grid, 0, 4, 4, slots.Sync("notify", slot_budget=64)) == 64


def _sequence_parallel(rows, nranks=3, k=4, n=9):
    """Rows of A split, B and C by columns: every rank gets the other ranks' rows of A."""
    return Plan(
        Layout.rows((rows, k), nranks=nranks),
        Layout.cols((k, n), nranks=nranks),
        Layout.cols((rows, n), nranks=nranks),
    )


def test_a_fetch_runs_ahead_by_default_while_it_gets_few_elements():
    """Unset (None), a rank fetches ahead while it gets at most FETCH_AHEAD_MAX_ELEMENTS;
    ``True``/``False`` decide alone; never fenced, on one rank, or for a rank that gets
    nothing."""
    small, notify = _sequence_parallel(30), slots.Sync("notify", fetch_ahead=None)
    gets = sum(t.elements for t in small.for_rank(0).gets)
    assert 0 < gets <= slots.FETCH_AHEAD_MAX_ELEMENTS
    assert slots.fetches_ahead(small, 0, notify)
    assert not slots.fetches_ahead(small, 0, notify._replace(fetch_ahead=False))
    assert not slots.fetches_ahead(small, 0, slots.Sync("fence", fetch_ahead=True))
    assert not slots.fetches_ahead(_sequence_parallel(30, nranks=1), 0, notify)
    # Each rank gets 2/3 of the rows x 4 columns (wide C: cheaper than B's columns).
    large = _sequence_parallel(slots.FETCH_AHEAD_MAX_ELEMENTS // 2, n=3000)
    assert sum(t.elements for t in large.for_rank(0).gets) > slots.FETCH_AHEAD_MAX_ELEMENTS
    assert not slots.fetches_ahead(large, 0, notify)
    assert slots.fetches_ahead(large, 0, notify._replace(fetch_ahead=True))
    k_split = _k_split()  # delivers partials, gets nothing
    assert not slots.fetches_ahead(k_split, 0, slots.Sync("notify", fetch_ahead=True))
