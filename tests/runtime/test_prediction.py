"""osmm_jax.memory_bytes (osmm_jax._src.runtime.prediction), without MPI traffic."""

from __future__ import annotations

import pytest

import osmm_jax as om
from osmm_jax._src.planning import memory
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import allreduce, fetch, slots


@pytest.fixture(autouse=True)
def _fetch_in_place(monkeypatch):
    """The formulas below are those of a fetch in place (the waiter's copies of a fetch ahead:
    :func:`test_a_fetch_ahead_adds_the_waiter_s_copies`)."""
    monkeypatch.setenv("OSMM_FETCH_AHEAD", "0")


def _grid(n=8):
    return Plan(*(Layout.grid((n, n), (2, 2)) for _ in range(3)))


@pytest.mark.parametrize("rank", range(4))
def test_a_forward_peak_is_the_blocks_the_product_s_buffers_and_the_slots(rank):
    """The grid's rank fetches one A and one B block, each in a round of its own, and its two
    GEMMs read them and its own blocks whole: nothing is joined, so the product adds the
    fetched pieces (joined, the A and B panels: four blocks), and one slot is resident."""
    plan = _grid()
    peak = om.memory_bytes(plan, rank, sync="notify")
    assert peak.blocks == 3 * 16 * 4  # A, B and C blocks of 4x4 float32
    cells = {(m.rows, m.cols) for m in plan.multiplies_on(rank)}
    assert len(cells) == 1 and len(plan.multiplies_on(rank)) == 2
    assert peak.transient == memory.one_sided_transient(plan, rank, False, unjoined=cells) * 4
    assert peak.transient == 2 * 16 * 4
    assert memory.one_sided_transient(plan, rank, packed=False) * 4 == 4 * 16 * 4  # joined
    assert peak.windows == slots.resident_window_bytes(plan, rank, 4, 4, slots.Sync("notify"))
    assert peak.windows == 16 * 4
    assert peak.total == peak.blocks + peak.transient + peak.windows


@pytest.mark.parametrize("input_itemsize", [4, 2])
def test_a_gradient_peak_holds_both_backward_products_or_the_forward_with_their_packing(
    input_itemsize,
):
    """float32 pieces that are whole blocks are sent from the blocks (nothing packed), but a
    backward product's transposed operand (B.T for dA, A.T for dB) is a copy XLA forms to
    send from; 16-bit ones are packed, cast to float32. XLA may form either while the forward
    product runs."""
    plan = _grid()
    d_a, d_b = plan.backward()
    same = input_itemsize == 4
    for rank in range(4):
        peak = om.memory_bytes(plan, rank, input_itemsize, 4, direction="backward", sync="notify")
        assert peak.blocks == (2 * (16 + 16) + 16) * input_itemsize  # A, B, dA, dB, C's cotangent
        copies = [
            16 if same and any(t.matrix == m for t in p.for_rank(rank).served) else 0
            for p, m in ((d_a, "B"), (d_b, "A"))
        ]
        assert sum(copies) == (32 if same else 0)  # every rank serves its blocks here
        both = sum(
            memory.one_sided_transient(
                p, rank, fetch.packs_pieces(p, rank, same), ahead=c, unjoined=_unjoined(p, rank)
            )
            for p, c in zip((d_a, d_b), copies)
        )
        packed = sum(t.elements for p in (d_a, d_b) for t in p.for_rank(rank).served)
        forward = memory.one_sided_transient(plan, rank, not same, unjoined=_unjoined(plan, rank))
        early = forward + (0 if same else packed) + sum(copies)
        assert peak.transient == max(both, early) * 4


def _unjoined(plan, rank):
    """The cells of ``plan`` whose GEMMs ``rank`` runs apart, every operand read whole."""
    return fetch.whole_cells(plan, rank, fetch.lone_pieces(plan, rank, "notify"))


def test_pieces_are_packed_unless_they_are_whole_rows_in_the_accumulation_dtype():
    grid = _grid()  # every piece served is a whole 4x4 block
    assert not any(fetch.packs_pieces(grid, r, True) for r in range(4))
    assert all(fetch.packs_pieces(grid, r, False) for r in range(4))
    # C by columns from B by rows: each rank serves the others column strips of its B rows
    strips = Plan(
        Layout.replicated((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
        Layout.cols((8, 8), nranks=4),
    )
    for rank in range(4):
        served = strips.for_rank(rank).served
        assert served and all(t.cols != strips.b.blocks[rank][1] for t in served)
        assert fetch.packs_pieces(strips, rank, True)
    # A by columns, C by rows: rank 0 sends rows 2-8 of its A strip (whole rows), never rows
    # 0-2, which it multiplies itself: a device would stage the whole block, so it packs
    partial = Plan(
        Layout.cols((8, 8), nranks=4),
        Layout.replicated((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
    )
    assert sorted(t.rows for t in partial.for_rank(0).served) == [(2, 4), (4, 6), (6, 8)]
    assert fetch.packs_pieces(partial, 0, True)
    local = Plan(
        Layout.rows((8, 8), nranks=4),
        Layout.replicated((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
    )
    assert not any(fetch.packs_pieces(local, r, False) for r in range(4))  # serves nothing


def test_the_allreduce_method_of_a_plan_made_elsewhere_counts_its_whole_matrices():
    """A plan whose communicator is not in this process (built to size a job) is counted from
    the plan: the whole matrices, the backward products side by side, and MPI's buffer for the
    largest sum (half the whole 8 x 8 C); no windows."""
    plan = _grid()
    mpi = 8 * 8 * 4 // 2
    forward = om.memory_bytes(plan, 0, method="allreduce")
    assert (forward.transient, forward.windows) == (memory.allreduce_transient(plan) * 4 + mpi, 0)
    backward = om.memory_bytes(plan, 0, method="allreduce", direction="backward")
    d_a, d_b = plan.backward()
    both = memory.allreduce_transient(d_a) + memory.allreduce_transient(d_b)
    assert backward.transient == max(memory.allreduce_transient(plan), both) * 4 + mpi
    assert memory.allreduce_transient(plan) == 4 * 8 * 8  # whole A, B, C and the summed C


@pytest.mark.parametrize(
    ("nranks", "shares"),
    [(2, [0.5, 0.5]), (3, [0.0, 1.0, 0.5]), (4, [0.5] * 4), (6, [0, 1, 0, 1, 0.5, 0.5])],
)
def test_mpich_receives_half_a_sum_or_on_a_paired_rank_all_of_it(nranks, shares):
    """Beyond a power of two, the first ranks pair up: the even one sends, the odd one
    receives the whole message (as measured on 3 ranks); the rest receive half."""
    assert [allreduce.receive_share(r, nranks) for r in range(nranks)] == shares


def test_16_bit_inputs_count_their_blocks_in_two_bytes_and_the_buffers_in_four():
    """16-bit pieces are packed as float32 to be served (float32 ones leave from the blocks):
    the packed copy of the two served blocks counts beside the two fetched ones."""
    plan = _grid()
    peak = om.memory_bytes(plan, 0, 2, 4, sync="notify")
    assert peak.blocks == 3 * 16 * 2
    assert peak.transient == (2 + 2) * 16 * 4
    assert om.memory_bytes(plan, 0, 4, 4, sync="notify").transient == 2 * 16 * 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"direction": "sideways"}, "direction"),
        ({"rank": 4}, "rank"),
        ({"rank": -1}, "rank"),
        ({"method": "carrier pigeon"}, "method"),
        ({"input_itemsize": 0}, "input_itemsize"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = {"rank": 0, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        om.memory_bytes(_grid(), **args)


@pytest.mark.parametrize("transport", ["rma", "messages"])
def test_a_fetch_ahead_adds_the_waiter_s_copies(monkeypatch, transport):
    """Fetching ahead, a rank's waiter holds a copy of what it gets, and with RMA a copy of
    the block its pieces leave from (sent from its A block: whole rows); its GEMMs on own and
    fetched rows are apart, so its C block is summed from their results (one block more)."""
    plan = Plan(
        Layout.rows((12, 4), nranks=3),
        Layout.cols((4, 30), nranks=3),
        Layout.cols((12, 30), nranks=3),
    )
    monkeypatch.setenv("OSMM_TRANSPORT", transport)
    for rank in range(3):
        mine = plan.for_rank(rank)
        gets = sum(t.elements for t in mine.gets)
        assert gets > 0 and {t.matrix for t in mine.served} == {"A"}
        in_place = om.memory_bytes(plan, rank, sync="notify")
        monkeypatch.setenv("OSMM_FETCH_AHEAD", "1")
        ahead = om.memory_bytes(plan, rank, sync="notify")
        monkeypatch.setenv("OSMM_FETCH_AHEAD", "0")
        a_block = 4 * 4 if transport == "rma" else 0  # 4 rows of A, 4 wide
        messages = transport == "messages"
        c_block = 12 * 10
        expected = memory.one_sided_transient(
            plan, rank, False, messages=messages, ahead=gets + a_block + c_block
        )
        assert ahead.transient == expected * 4 > in_place.transient
        assert ahead.blocks == in_place.blocks and ahead.windows == in_place.windows
