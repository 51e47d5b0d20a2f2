"""The bulk totals of auto_layouts' candidate strategies equal the planner's, cell by cell."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osmm_jax._src.planning.auto_layout import candidate_layouts
from osmm_jax._src.planning.cells import cut_cells
from osmm_jax._src.planning.family_totals import family_totals
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.schedule import build_schedule
from osmm_jax._src.planning.totals import per_rank_totals, schedule_totals


@st.composite
def candidates(draw):
    """Speeds (some equal, some zero), dimensions from tiny to uneven, every strategy."""
    nranks = draw(st.integers(2, 12))
    speeds = draw(
        st.lists(st.sampled_from([0.0, 1.0, 1.0, 1.5, 2.0, 3.7]), min_size=nranks, max_size=nranks)
    )
    if not any(speeds):
        speeds[0] = 1.0
    dims = [draw(st.sampled_from([1, 2, 3, 7, 16, 33, 64, 100, 257])) for _ in range(3)]
    replication = draw(st.sampled_from(["synced", "fetched"]))
    return candidate_layouts(*dims, speeds, replication=replication)


@settings(max_examples=150, deadline=None)
@given(candidates())
def test_bulk_totals_equal_the_planners(strategies):
    for name, a, b, c, work in strategies:
        bulk = family_totals(a, b, c, work)
        if bulk is None:
            # Only an operand held whole, or a grid with an empty band, is planned cell by cell.
            assert any(x.is_replicated for x in (a, b, c)) or name.startswith("grid"), name
            continue
        cell_by_cell = schedule_totals(cut_cells(a, b, c, work))
        # Every field, the received elements included.
        for field in cell_by_cell._fields:
            assert getattr(bulk, field) == getattr(cell_by_cell, field), (name, field)
        assert len(bulk.received_inputs) == len(bulk.received_partials) == a.nranks, name
        # Each transfer is counted once where it leaves and once where it arrives.
        assert sum(bulk.inputs) == sum(bulk.received_inputs), name
        assert sum(bulk.partials) == sum(bulk.received_partials), name


def test_the_families_are_recognised_and_others_are_not():
    p, shape = 4, (40, 40)
    rows, cols = Layout.rows(shape, nranks=p), Layout.cols(shape, nranks=p)
    grid = Layout.grid(shape, (2, 2))
    for a, b, c in [(rows, rows, rows), (cols, cols, cols), (cols, rows, rows), (grid, grid, grid)]:
        assert family_totals(a, b, c) == schedule_totals(cut_cells(a, b, c))
    # Not a candidate family: C by columns under a K-split, or anything replicated.
    assert family_totals(cols, rows, cols) is None
    assert family_totals(rows, Layout.replicated(shape, nranks=p), rows) is None


@pytest.mark.parametrize("nranks", [64, 256])
def test_bulk_totals_at_scale_match_the_plan(nranks):
    speeds = [1.0 + 0.5 * (r % 3) for r in range(nranks)]
    for name, a, b, c, _ in candidate_layouts(4096, 4096, 4096, speeds):
        if name in ("k_split",) or name.startswith("grid 2x") or name.startswith("grid 4x"):
            bulk = family_totals(a, b, c)
            plan = Plan(a, b, c)
            assert bulk.flops == plan.flops, name
            assert tuple(i + p for i, p in zip(bulk.inputs, bulk.partials)) == plan.bytes_sent(1, 1)
            received = per_rank_totals(plan.transfers, nranks, "receiver", "elements")
            assert bulk.received() == received, name


def test_received_totals_of_a_replicated_c_count_every_other_server():
    # Every rank but a cell's server receives its partial of a replicated C.
    p, shape = 3, (6, 6)
    rows = Layout.rows(shape, nranks=p)
    a, b, c = rows, Layout.cols(shape, nranks=p), Layout.replicated(shape, nranks=p)
    cells = cut_cells(a, b, c)
    totals = schedule_totals(cells)
    # The direct sum (a plan may stage it instead): the schedule of every cell.
    every = itertools.product(range(len(cells.m)), range(len(cells.k)), range(len(cells.n)))
    schedule = build_schedule(cells, every, None, False)
    expected = per_rank_totals(schedule.gets + schedule.deliveries, p, "receiver", "elements")
    assert totals.received() == expected
    assert sum(totals.received_partials) == sum(totals.partials) > 0
