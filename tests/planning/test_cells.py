"""The cells of a product and their decisions, one cell at a time: where the dimensions are cut,
who owns each piece, and which rank serves a cell (the worked example is the
``example_layouts`` fixture of ``conftest.py``)."""

from __future__ import annotations

from hypothesis import given, settings
from strategies import products

from osmm_jax._src.planning.cells import (
    EVERYONE,
    Decision,
    c_owners_compute_every_cell,
    cut_cells,
    decide,
)
from osmm_jax._src.planning.layout import Layout


def test_cut_cells_cuts_at_every_shared_boundary_and_looks_up_the_owners(example_layouts):
    cells = cut_cells(*example_layouts)
    assert (cells.m, cells.k, cells.n) == (((0, 1), (1, 4)), ((0, 2), (2, 6)), ((0, 3), (3, 5)))
    assert [[cells.a_owner(mi, ki) for ki in range(2)] for mi in range(2)] == [[0, 0], [1, 1]]
    assert [[cells.b_owner(ki, ni) for ni in range(2)] for ki in range(2)] == [[0, 0], [1, 1]]
    assert [[cells.c_owner(mi, ni) for ni in range(2)] for mi in range(2)] == [[0, 1], [0, 1]]
    assert cells.nranks == 2
    assert cells.flops(1, 1, 0) == 2 * 3 * 4 * 3
    # A replicated operand: every rank holds every piece.
    rep = cut_cells(
        Layout.replicated((2, 3), nranks=2),
        Layout.replicated((3, 2), nranks=2),
        Layout.rows((2, 2), nranks=2),
    )
    assert (rep.m, rep.k, rep.n) == (((0, 1), (1, 2)), ((0, 3),), ((0, 2),))
    assert rep.a_owner(1, 0) == EVERYONE and rep.c_owner(1, 0) == 1


@settings(max_examples=300, deadline=None)
@given(products())
def test_owner_lookups_are_the_layouts_owners(layouts):
    a, b, c = layouts
    cells = cut_cells(a, b, c)
    for index, layout, rows, cols in (
        (cells.a, a, cells.m, cells.k),
        (cells.b, b, cells.k, cells.n),
        (cells.c, c, cells.m, cells.n),
    ):
        for r in rows:
            for col in cols:
                owners = layout.owners(r, col)
                expected = EVERYONE if layout.is_replicated else owners[0]
                assert len(owners) == (layout.nranks if layout.is_replicated else 1)
                assert index.at(r[0], col[0]) == expected


def test_a_c_owner_holding_both_inputs_computes_the_cell_itself(example_layouts):
    cells = cut_cells(*example_layouts)
    assert decide(cells, 0, 0, 0) == Decision((0,), -1, 0, 0, 0, 0)
    assert decide(cells, 1, 1, 1) == Decision((1,), -1, 1, 1, 1, 1)
    # Everything replicated: every rank computes the cell; rank 0's copy is primary.
    everything = cut_cells(*(Layout.replicated((2, 2), nranks=2) for _ in range(3)))
    assert decide(everything, 0, 0, 0) == Decision((EVERYONE,), -1, 0, EVERYONE, EVERYONE, EVERYONE)
    # A replicated C, A split by rows: the A owner computes it and delivers it to the others.
    rep_c = cut_cells(
        Layout.rows((2, 2), nranks=2),
        Layout.replicated((2, 2), nranks=2),
        Layout.replicated((2, 2), nranks=2),
    )
    assert decide(rep_c, 1, 0, 0) == Decision((1,), 1, 1, 1, EVERYONE, EVERYONE)


def test_decide_picks_the_server_that_moves_the_fewest_elements(example_layouts):
    cells = cut_cells(*example_layouts)
    # Cell (0, 1, 0): A[0:1, 2:6] on rank 0, B[2:6, 0:3] on rank 1, C owner 0. Rank 0 would
    # get B (12 elements); rank 1 gets A (4) and sends the 1x3 result: 7.
    assert decide(cells, 0, 1, 0).server == 1
    # Cell (1, 0, 0): A on 1, B on 0, C on 0. The C owner gets A (6); rank 1 would get B (6)
    # and send 9.
    assert decide(cells, 1, 0, 0).server == 0
    # With compute_at_inputs, a rank holding both inputs computes even when the C owner
    # would move less: here rank 0 holds both, and sending its 4x4 result costs 16 > 8.
    a = Layout.rows((4, 1), sizes=[4, 0])
    b = Layout.rows((1, 4), sizes=[1, 0])
    c = Layout.rows((4, 4), sizes=[0, 4])
    cells = cut_cells(a, b, c)
    assert decide(cells, 0, 0, 0).server == 1
    assert decide(cells, 0, 0, 0, compute_at_inputs=True).server == 0


def test_ties_go_to_the_c_owner_then_take_turns():
    # Equal 2x2 grids: the cells whose three owners differ cost the same on each (one piece
    # in, one out, all the same size): the C owner computes them, as in stationary C.
    n = 8
    cells = cut_cells(*(Layout.grid((n, n), (2, 2)) for _ in range(3)))
    d = decide(cells, 0, 1, 0)  # A on 1, B on 2, C on 0
    assert (d.a_owner, d.b_owner, d.c_owner, d.server) == (1, 2, 0, 0)
    # K much larger than M and N: the C owner would get two big pieces; the A and B owners
    # tie, and take turns by the cell's position.
    cells = cut_cells(
        Layout.grid((4, 64), (2, 2)), Layout.grid((64, 4), (2, 2)), Layout.grid((4, 4), (2, 2))
    )
    assert decide(cells, 0, 1, 0).server == 2  # ranks (1, 2) tied, turn 1
    assert decide(cells, 1, 0, 1).server == 1  # ranks (1, 2) tied, turn 0


@settings(max_examples=300, deadline=None)
@given(products(max_dim=12, max_ranks=6))
def test_the_all_cells_check_of_stationary_c_agrees_with_deciding_each_cell(product):
    """``c_owners_compute_every_cell`` (every cell at once, as arrays) says yes exactly where
    :func:`decide`, cell by cell, gives every cell to its C owner."""
    a, b, c = product[:3]
    if any(x.is_replicated for x in (a, b, c)):
        return
    cells = cut_cells(a, b, c)
    by_cell = all(
        decide(cells, mi, ki, ni).primary == cells.c_owner(mi, ni)
        for mi, ki, ni in cells.every_cell()
    )
    assert c_owners_compute_every_cell(cells) == by_cell


def test_an_even_grid_is_stationary_c_and_a_k_split_is_not():
    grid = Layout.grid((8, 8), (2, 2))
    assert c_owners_compute_every_cell(cut_cells(grid, grid, grid))
    k_split = (
        Layout.cols((8, 8), nranks=2),
        Layout.rows((8, 8), nranks=2),
        Layout.rows((8, 8), nranks=2),
    )
    assert not c_owners_compute_every_cell(cut_cells(*k_split))
