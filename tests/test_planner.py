"""The planner, without MPI or JAX: coverage, flop and byte accounting, exact results."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from strategies import products

from osmm_jax._src.layout import Layout
from osmm_jax._src.planner import (
    Assignment,
    Cells,
    LocalMultiply,
    LocalUpdate,
    Transfer,
    Unserved,
    backward_plans,
    choose_servers,
    cut_cells,
    emit_schedule,
    make_plan,
    moved,
    per_rank_totals,
    serve_self,
    server_candidates,
)


def _size(iv):
    return iv[1] - iv[0]


def simulate(plan, a, b):
    """Run a plan with numpy: each rank's products, local updates and deliveries, and for a
    staged plan the gathers of the summed blocks; returns every rank's C block."""
    if plan.gather_stage is not None:
        split = plan.gather_stage.c
        summed = simulate(plan.gather_stage, a, b)
        blocks = []
        for rank in range(plan.nranks):
            full = np.full(plan.c.shape, np.nan)
            full[split.local_slices(rank)] = summed[rank]
            for t in plan.gathers_by(rank):
                full[split.local_slices(t.target)] = summed[t.target]
            blocks.append(full)
        return blocks
    products_by_rank = {}
    for m in plan.multiplies:
        products_by_rank[(m.rank, m.rows, m.inner, m.cols)] = (
            a[slice(*m.rows), slice(*m.inner)] @ b[slice(*m.inner), slice(*m.cols)]
        )
    blocks = [np.zeros(plan.c.local_shape(r)) for r in range(plan.nranks)]

    def deliver(origin, target, rows, cols, inner):
        part = sum(products_by_rank[(origin, rows, k, cols)] for k in inner)
        (r0, _), (c0, _) = plan.c.blocks[target]
        blocks[target][rows[0] - r0 : rows[1] - r0, cols[0] - c0 : cols[1] - c0] += part

    for u in plan.local_updates:
        deliver(u.rank, u.rank, u.rows, u.cols, u.inner)
    for t in plan.transfers:
        if t.op != "get":
            deliver(t.origin, t.target, t.rows, t.cols, t.inner)
    return blocks


@settings(max_examples=300, deadline=None)
@given(products())
def test_plan_computes_the_product_exactly(layouts):
    a_layout, b_layout, c_layout = layouts
    plan = make_plan(a_layout, b_layout, c_layout)
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, a_layout.shape).astype(np.float64)
    b = rng.integers(-4, 5, b_layout.shape).astype(np.float64)
    expected = a @ b
    for rank, block in enumerate(simulate(plan, a, b)):
        np.testing.assert_array_equal(block, c_layout.shard(expected, rank))


@settings(max_examples=300, deadline=None)
@given(products())
def test_every_c_element_gets_each_contraction_index_exactly_once(layouts):
    plan = make_plan(*layouts)
    if plan.gather_stage is not None:  # summed in the stage, then copied
        plan = plan.gather_stage
    (M, K), N = plan.a.shape, plan.b.shape[1]
    for rank in range(plan.nranks):
        count = np.zeros((M, N, K), dtype=np.int64)
        updates = [u for u in plan.local_updates if u.rank == rank]
        updates += [t for t in plan.transfers if t.op != "get" and t.target == rank]
        for u in updates:
            for k in u.inner:
                count[slice(*u.rows), slice(*u.cols), slice(*k)] += 1
        rows, cols = plan.c.local_slices(rank)
        assert (count[rows, cols] == 1).all()
        outside = count.copy()
        outside[rows, cols] = 0
        assert not outside.any(), "a delivery lands outside the target's C block"


@settings(max_examples=300, deadline=None)
@given(products())
def test_flops_and_bytes_add_up(layouts):
    plan = make_plan(*layouts)
    M, K, N = plan.dims
    primary = sum(m.flops for m in plan.multiplies if m.primary)
    assert primary == 2 * M * N * K
    assert sum(plan.flops) >= primary
    assert len(plan.flops) == len(plan.bytes_sent()) == plan.nranks
    # Bytes: exactly what the transfers move, charged to the rank the data leaves.
    expected = [0] * plan.nranks
    for t in plan.transfers:
        expected[t.target if t.op == "get" else t.origin] += 4 * _size(t.rows) * _size(t.cols)
    assert list(plan.bytes_sent()) == expected
    assert plan.bytes_sent(8, 8) == tuple(2 * x for x in expected)
    assert sum(plan.bytes_issued()) == sum(expected)
    # Issued: the same bytes, charged to the rank that runs the RMA operation.
    issued = [0] * plan.nranks
    for t in plan.transfers:
        issued[t.origin] += 4 * _size(t.rows) * _size(t.cols)
    assert list(plan.bytes_issued()) == issued


@settings(max_examples=300, deadline=None)
@given(products())
def test_transfers_are_needed_and_well_formed(layouts):
    plan = make_plan(*layouts)
    needed = set()
    for m in plan.multiplies:
        assert plan.a.owners(m.rows, m.inner), "A piece must lie inside one block"
        assert m.a_source in plan.a.owners(m.rows, m.inner)
        assert m.b_source in plan.b.owners(m.inner, m.cols)
        if m.a_source != m.rank:
            needed.add((m.rank, "A", m.rows, m.inner, m.a_source))
        if m.b_source != m.rank:
            needed.add((m.rank, "B", m.inner, m.cols, m.b_source))
    gets = [
        (t.origin, t.matrix, t.rows, t.cols, t.target)
        for t in plan.transfers
        if t.op == "get" and t.matrix != "C"
    ]
    assert len(gets) == len(set(gets)), "the same piece is fetched twice"
    assert set(gets) == needed, "every get feeds a multiply and every remote piece is fetched"
    computed = {(m.rank, m.rows, m.inner, m.cols) for m in plan.multiplies}
    receivers = {}
    for t in plan.transfers:
        assert t.origin != t.target
        assert 0 <= t.origin < plan.nranks and 0 <= t.target < plan.nranks
        if t.op == "get":
            continue
        assert t.matrix == "C" and t.op in ("put", "accumulate")
        for k in t.inner:
            assert (t.origin, t.rows, k, t.cols) in computed
        receivers.setdefault((t.target, t.rows, t.cols), []).append(t)
    for (target, rows, cols), ts in receivers.items():
        local = [u for u in plan.local_updates if (u.rank, u.rows, u.cols) == (target, rows, cols)]
        if any(t.op == "put" for t in ts):
            assert len(ts) == 1 and not local, (
                "a put must be the only contribution to its rectangle"
            )


def test_row_split_with_replicated_b_needs_no_communication():
    a = Layout.rows((10, 6), weights=[1, 2, 3])
    b = Layout.replicated((6, 4), nranks=3)
    c = Layout.rows((10, 4), weights=[1, 2, 3])
    plan = make_plan(a, b, c)
    assert plan.transfers == ()
    assert plan.bytes_sent() == (0, 0, 0)
    assert [m.rows for m in plan.multiplies] == [(0, 2), (2, 5), (5, 10)]
    assert plan.flops == (2 * 2 * 6 * 4, 2 * 3 * 6 * 4, 2 * 5 * 6 * 4)


def test_k_split_reduce_scatters_by_accumulate_with_half_an_allreduce_of_bytes():
    n = 8
    plan = make_plan(
        Layout.cols((n, n), nranks=2), Layout.rows((n, n), nranks=2), Layout.rows((n, n), nranks=2)
    )
    assert {t.op for t in plan.transfers} == {"accumulate"}
    # Each rank sends the half of C it does not own: n*n/2 floats. An all-reduce of
    # the whole C moves at least twice that per rank.
    assert plan.bytes_sent() == (4 * n * n // 2, 4 * n * n // 2)


def test_transfers_rotate_targets_by_origin():
    n = 12
    plan = make_plan(
        Layout.cols((n, n), nranks=3), Layout.rows((n, n), nranks=3), Layout.rows((n, n), nranks=3)
    )
    for origin in range(3):
        targets = [t.target for t in plan.transfers if t.origin == origin]
        assert targets == [(origin + 1) % 3, (origin + 2) % 3]


def test_replicated_everything_computes_locally():
    plan = make_plan(*(Layout.replicated((5, 5), nranks=3) for _ in range(3)))
    assert plan.transfers == ()
    assert plan.flops == (250, 250, 250)


def test_plan_rejects_mismatched_layouts():
    with pytest.raises(ValueError, match="inner dimensions"):
        make_plan(
            Layout.rows((4, 5), nranks=2),
            Layout.rows((4, 3), nranks=2),
            Layout.rows((4, 3), nranks=2),
        )
    with pytest.raises(ValueError, match="different numbers of ranks"):
        make_plan(
            Layout.rows((4, 4), nranks=2),
            Layout.rows((4, 4), nranks=3),
            Layout.rows((4, 4), nranks=2),
        )
    with pytest.raises(ValueError, match="C layout has shape"):
        make_plan(
            Layout.rows((4, 4), nranks=2),
            Layout.rows((4, 4), nranks=2),
            Layout.rows((4, 5), nranks=2),
        )
    with pytest.raises(TypeError, match="osmm_jax.Layout"):
        make_plan(Layout.rows((4, 4), nranks=2), "rows", Layout.rows((4, 4), nranks=2))


def test_plans_are_hashable_equal_and_immutable():
    layouts = (
        Layout.rows((6, 4), nranks=2),
        Layout.replicated((4, 3), nranks=2),
        Layout.rows((6, 3), nranks=2),
    )
    p1, p2 = make_plan(*layouts), make_plan(*layouts, 0)
    assert p1 == p2 and hash(p1) == hash(p2) and p1.fingerprint == p2.fingerprint
    assert make_plan(*layouts, 7) != p1
    other = make_plan(Layout.rows((6, 4), weights=[2, 1]), layouts[1], layouts[2])
    assert other.fingerprint != p1.fingerprint
    with pytest.raises(AttributeError):
        p1.a = layouts[1]


def test_backward_plans_use_transposed_layouts():
    a, b, c = (
        Layout.rows((6, 4), nranks=2),
        Layout.replicated((4, 3), nranks=2),
        Layout.rows((6, 3), nranks=2),
    )
    plan_da, plan_db = backward_plans(make_plan(a, b, c))
    assert (plan_da.a, plan_da.b, plan_da.c) == (c, b.T, a)
    assert (plan_db.a, plan_db.b, plan_db.c) == (a.T, c, b)
    # Data-parallel: dB = A.T @ dC is a K-split product whose result every rank holds.
    assert all(t.op == "accumulate" and t.matrix == "C" for t in plan_db.transfers)


def test_describe_names_ranks_multiplies_and_transfers():
    plan = make_plan(
        Layout.cols((8, 8), nranks=2), Layout.rows((8, 8), nranks=2), Layout.rows((8, 8), nranks=2)
    )
    text = plan.describe()
    assert "over 2 ranks" in text and "rank 0:" in text and "rank 1:" in text
    assert "accumulate C[4:8, 0:8] into rank 1" in text


def test_planner_imports_neither_jax_nor_mpi():
    code = (
        "import sys; import osmm_jax._src.planner as p, osmm_jax._src.layout as l;"
        "p.make_plan(l.Layout.rows((4,4),nranks=2), l.Layout.cols((4,4),nranks=2), l.Layout.grid((4,4),(2,1)));"
        "bad = [m for m in ('jax', 'mpi4py', 'mpi4jax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("grid", [(2, 2), (2, 3), (3, 3), (2, 4)])
def test_equal_grids_balance_flops_across_ranks(grid):
    # Cells whose cheapest server is tied are shared out after every untied cell is placed,
    # to balance the ranks' time: each rank ends up with the same work.
    n = 12 * grid[0] * grid[1]
    layouts = [Layout.grid((n, n), grid) for _ in range(3)]
    plan = make_plan(*layouts)
    assert len(set(plan.flops)) == 1
    assert sum(plan.flops) == 2 * n**3
    # Each rank fetches or sends at most what owner-computes (fetch A's row and B's column
    # blocks) would move.
    block = (n // grid[0]) * (n // grid[1]) * 4
    assert max(plan.bytes_sent()) <= (grid[0] + grid[1] - 2) * block


@settings(max_examples=200, deadline=None)
@given(products())
def test_a_replicated_c_is_staged_only_when_that_moves_less(layouts):
    plan = make_plan(*layouts)
    if plan.gather_stage is None:
        return
    assert plan.c.is_replicated and plan.nranks >= 3
    split = plan.gather_stage.c
    assert not split.is_replicated
    for rank in range(plan.nranks):
        got = {t.target for t in plan.gathers_by(rank)}
        owners = {r for r in range(plan.nranks) if r != rank and min(split.local_shape(r)) > 0}
        assert got == owners, "every rank gets every other non-empty block once"
    assert set(plan.gathers) <= set(plan.transfers)


def test_data_parallel_weight_gradient_moves_like_a_ring_allreduce():
    # dW = X.T @ dY with the batch split over 4 ranks: summed directly, every rank would send
    # its whole partial to 3 others; staged, each sends 3/4 of one copy and serves 3/4 of one.
    # Staging must not move work: each rank still multiplies its own (speed-weighted) rows.
    n, batch, weights = 64, 256, [1, 1, 2, 4]
    a = Layout.cols((n, batch), weights=weights)
    b = Layout.rows((batch, n), weights=weights)
    plan = make_plan(a, b, Layout.replicated((n, n), nranks=4))
    assert plan.gather_stage is not None
    assert max(plan.bytes_sent(1, 1)) == 2 * (n * n - n * n // 4)
    assert list(plan.flops) == [2 * n * n * b.local_shape(r)[0] for r in range(4)]


# -- the passes of the schedule, one at a time -------------------------------------------------
#
# EXAMPLE: 2 ranks, A (4x6) split by rows 1:3, B (6x5) by rows 2:4, C (4x5) by columns 3:2.
# M is cut at A's rows, K at B's rows, N at C's columns; no C owner has both inputs except
# for two cells, one per rank.


def _example_layouts():
    return (
        Layout.rows((4, 6), sizes=[1, 3]),
        Layout.rows((6, 5), sizes=[2, 4]),
        Layout.cols((4, 5), sizes=[3, 2]),
    )


EXAMPLE_UNSERVED = [
    Unserved(0, 1, 0, (), (0,)),
    Unserved(0, 0, 1, (), (1,)),
    Unserved(0, 1, 1, (), (1,)),
    Unserved(1, 0, 0, (), (0,)),
    Unserved(1, 1, 0, (), (0,)),
    Unserved(1, 0, 1, (), (1,)),
]


def test_cut_cells_cuts_at_every_shared_boundary_and_tables_the_owners():
    cells = cut_cells(*_example_layouts())
    assert (cells.m, cells.k, cells.n) == (((0, 1), (1, 4)), ((0, 2), (2, 6)), ((0, 3), (3, 5)))
    assert cells.a_owners == (((0,), (0,)), ((1,), (1,)))  # [mi][ki]
    assert cells.b_owners == (((0,), (0,)), ((1,), (1,)))  # [ki][ni]
    assert cells.c_owners == (((0,), (1,)), ((0,), (1,)))  # [mi][ni]
    assert cells.nranks == 2
    assert cells.flops(1, 1, 0) == 2 * 3 * 4 * 3
    # A replicated operand: every rank owns every piece.
    rep = cut_cells(
        Layout.replicated((2, 3), nranks=2),
        Layout.replicated((3, 2), nranks=2),
        Layout.rows((2, 2), nranks=2),
    )
    assert (rep.m, rep.k, rep.n) == (((0, 1), (1, 2)), ((0, 3),), ((0, 2),))
    assert rep.a_owners == (((0, 1),), ((0, 1),)) and rep.c_owners == (((0,),), ((1,),))


def test_serve_self_assigns_owners_with_both_inputs_and_lists_the_rest():
    assignment, unserved = serve_self(cut_cells(*_example_layouts()))
    assert assignment.products == {(0, 0, 0, 0): True, (1, 1, 1, 1): True}
    assert assignment.deliveries == {(0, 0, 0, 0): [0], (1, 1, 1, 1): [1]}
    assert assignment.load == [2 * 1 * 2 * 3, 2 * 3 * 4 * 2]
    assert unserved == EXAMPLE_UNSERVED  # in (mi, ni, ki) order


def test_serve_self_makes_the_lowest_owner_primary_and_keeps_partly_served_cells():
    # Everything replicated: both ranks compute the one cell, rank 0's copy is primary.
    assignment, unserved = serve_self(
        cut_cells(*(Layout.replicated((2, 2), nranks=2) for _ in range(3)))
    )
    assert assignment.products == {(0, 0, 0, 0): True, (1, 0, 0, 0): False}
    assert assignment.deliveries == {(0, 0, 0, 0): [0], (1, 1, 0, 0): [0]}
    assert assignment.load == [16, 16] and unserved == []
    # A replicated C, A split by rows: the A owner serves itself; the other C owner waits.
    assignment, unserved = serve_self(
        cut_cells(
            Layout.rows((2, 2), nranks=2),
            Layout.replicated((2, 2), nranks=2),
            Layout.replicated((2, 2), nranks=2),
        )
    )
    assert assignment.products == {(0, 0, 0, 0): False, (1, 1, 0, 0): False}
    assert unserved == [Unserved(0, 0, 0, (0,), (1,)), Unserved(1, 0, 0, (1,), (0,))]


def test_moved_counts_missing_inputs_and_results_to_send():
    cells = cut_cells(*_example_layouts())
    cell = EXAMPLE_UNSERVED[0]  # A[0:1, 2:6] on rank 0, B[2:6, 0:3] on rank 1, C owner 0
    assert moved(cells, cell, 0) == 4 * 3  # gets B, keeps the result
    assert moved(cells, cell, 1) == 1 * 4 + 1 * 3  # gets A, sends the result to rank 0
    # A self-serving candidate still sends the cell to the other C owners.
    rep = cut_cells(
        Layout.rows((2, 2), nranks=2),
        Layout.replicated((2, 2), nranks=2),
        Layout.replicated((2, 2), nranks=2),
    )
    assert moved(rep, Unserved(0, 0, 0, (0,), (1,)), 0) == 2


def test_server_candidates():
    cells = cut_cells(*_example_layouts())
    both_on_0 = EXAMPLE_UNSERVED[1]  # A and B pieces on rank 0, C on rank 1
    split = EXAMPLE_UNSERVED[0]  # A on 0, B on 1, C on 0
    assert server_candidates(cells, both_on_0) == {0, 1}
    assert server_candidates(cells, both_on_0, compute_at_inputs=True) == {0}
    assert server_candidates(cells, split, compute_at_inputs=True) == {0, 1}  # nobody has both
    assert server_candidates(cells, Unserved(0, 0, 0, (1,), (0,))) == (1,)  # self-serving only


def test_choose_servers_picks_the_cheapest_server_and_delivers_to_the_c_owners():
    cells = cut_cells(*_example_layouts())
    assignment, unserved = serve_self(cells)
    choose_servers(cells, assignment, unserved)
    assert assignment.products == {
        (0, 0, 0, 0): True,
        (1, 1, 1, 1): True,
        (1, 0, 1, 0): True,
        (0, 0, 0, 1): True,
        (1, 0, 1, 1): True,
        (0, 1, 0, 0): True,
        (1, 1, 1, 0): True,
        (1, 1, 0, 1): True,
    }
    assert assignment.deliveries == {
        (0, 0, 0, 0): [0],
        (1, 1, 1, 1): [1, 0],
        (1, 0, 0, 0): [1],
        (0, 1, 0, 1): [0],
        (1, 1, 0, 1): [1],
        (0, 0, 1, 0): [0],
        (1, 0, 1, 0): [1],
    }
    assert assignment.load == [56, 184] and sum(assignment.load) == 2 * 4 * 6 * 5


def _tie_cells() -> Cells:
    # One C cell owned by rank 2, K cut in two: A[:, 0:1] and A[:, 1:2] on rank 0,
    # B[0:1, :] on rank 1 and B[1:2, :] on rank 0.
    return Cells(
        m=((0, 1),),
        k=((0, 1), (1, 2)),
        n=((0, 1),),
        a_owners=(((0,), (0,)),),
        b_owners=(((1,),), ((0,),)),
        c_owners=(((2,),),),
        nranks=3,
    )


def _big_tie_cells(size: int) -> Cells:
    # _tie_cells() with every interval ``size`` long: the flops of a cell (2 size^3) outweigh
    # its traffic in the balance model, as they do in real products.
    s = size
    return Cells(
        m=((0, s),),
        k=((0, s), (s, 2 * s)),
        n=((0, s),),
        a_owners=(((0,), (0,)),),
        b_owners=(((1,),), ((0,),)),
        c_owners=(((2,),),),
        nranks=3,
    )


@pytest.mark.parametrize(
    ("load", "server"),
    [
        # The least-loaded rank takes the cell.
        ([5, 0, 3], 1),
        ([4, 4, 1], 2),
        # Equal loads: the C owner, which sends no partial (its fetches are charged to the
        # owners it reads from), so the busiest rank finishes soonest.
        ([0, 0, 0], 2),
    ],
)
def test_choose_servers_gives_a_tie_to_the_rank_that_needs_the_work(load, server):
    cells = _big_tie_cells(1000)
    cell_flops = cells.flops(0, 0, 0)
    tied = Unserved(0, 0, 0, (), (2,))  # every rank moves 2 size^2 elements
    assert len({moved(cells, tied, p) for p in range(3)}) == 1
    assignment = Assignment({}, defaultdict(list), [x * cell_flops for x in load])
    choose_servers(cells, assignment, [tied])
    assert assignment.products == {(server, 0, 0, 0): True}
    assert assignment.deliveries == {(server, 2, 0, 0): [0]}


def test_choose_servers_places_untied_cells_before_tied_ones():
    # The tied cell comes first in the list, but rank 0 must first take the cell only it
    # serves cheaply; the tie then goes to a rank with no work yet, not to rank 0.
    cells = _big_tie_cells(1000)
    cell_flops = cells.flops(0, 0, 0)
    assignment = Assignment({}, defaultdict(list), [0, 0, 0])
    choose_servers(cells, assignment, [Unserved(0, 0, 0, (), (2,)), Unserved(0, 1, 0, (), (2,))])
    assert (0, 0, 1, 0) in assignment.products and (0, 0, 0, 0) not in assignment.products
    assert sorted(assignment.load) == [0, cell_flops, cell_flops]


def test_emit_schedule_fetches_missing_inputs_and_accumulates_shared_rectangles():
    cells = _tie_cells()
    assignment = Assignment(
        {(1, 0, 0, 0): True, (0, 0, 1, 0): True},
        defaultdict(list, {(1, 2, 0, 0): [0], (0, 2, 0, 0): [1]}),
        [2, 2, 0],
    )
    multiplies, transfers, local_updates = emit_schedule(cells, assignment)
    assert multiplies == (
        LocalMultiply(0, (0, 1), (1, 2), (0, 1), 0, 0, True),
        LocalMultiply(1, (0, 1), (0, 1), (0, 1), 0, 1, True),
    )
    assert transfers == (
        Transfer("get", "A", 1, 0, (0, 1), (0, 1)),
        Transfer("accumulate", "C", 0, 2, (0, 1), (0, 1), ((1, 2),)),
        Transfer("accumulate", "C", 1, 2, (0, 1), (0, 1), ((0, 1),)),
    )
    assert local_updates == ()


def test_emit_schedule_puts_sole_contributions_in_rotated_order_and_sorts_local_updates():
    # Rank 2 holds A and B and computes both rows of C: row 0 is rank 0's, row 1 rank 1's.
    # Rank 2's deliveries start at the next rank (0), then 1; each is the only contribution
    # to its rectangle, so a put. Rank 0 also adds a product of its own into its block.
    cells = Cells(
        m=((0, 1), (1, 2)),
        k=((0, 1),),
        n=((0, 1),),
        a_owners=(((0, 2),), ((2,),)),
        b_owners=(((0, 2),),),
        c_owners=(((0,),), ((1,),)),
        nranks=3,
    )
    assignment = Assignment(
        {(2, 1, 0, 0): True, (2, 0, 0, 0): False, (0, 0, 0, 0): True},
        defaultdict(list, {(2, 1, 1, 0): [0], (0, 0, 0, 0): [0]}),
        [2, 0, 4],
    )
    multiplies, transfers, local_updates = emit_schedule(cells, assignment)
    assert [(m.rank, m.rows) for m in multiplies] == [(0, (0, 1)), (2, (0, 1)), (2, (1, 2))]
    assert transfers == (Transfer("put", "C", 2, 1, (1, 2), (0, 1), ((0, 1),)),)
    assert local_updates == (LocalUpdate(0, (0, 1), (0, 1), ((0, 1),)),)
    assignment.deliveries[(2, 0, 0, 0)].append(0)
    _, transfers, _ = emit_schedule(cells, assignment)
    assert [(t.op, t.target) for t in transfers] == [("accumulate", 0), ("put", 1)]


# -- per-rank tallies ----------------------------------------------------------------------------


def test_per_rank_totals_buckets_by_the_chosen_rank():
    transfers = [
        Transfer("get", "A", 0, 1, (0, 2), (0, 3)),  # 6 elements from rank 1's memory to rank 0
        Transfer("accumulate", "C", 1, 2, (0, 1), (0, 4), ((0, 1),)),  # 4 from 1 to 2
        Transfer("put", "C", 2, 0, (0, 1), (0, 1), ((0, 1),)),  # 1 from 2 to 0
    ]
    assert per_rank_totals(transfers, 3, "sender", "elements") == (0, 10, 1)
    assert per_rank_totals(transfers, 3, "origin", "elements") == (6, 4, 1)
    assert per_rank_totals(transfers, 3, "receiver", "elements") == (7, 0, 4)
    assert per_rank_totals(transfers, 3, "sender", lambda t: t.nbytes(2, 4)) == (0, 12 + 16, 4)
    assert per_rank_totals(transfers, 3, ("sender", "receiver"), "elements") == (
        (0, 0, 0),
        (6, 0, 4),
        (1, 0, 0),
    )
    multiplies = [LocalMultiply(1, (0, 2), (0, 3), (0, 4), 1, 1, True)]
    assert per_rank_totals(multiplies, 2, "rank", "flops") == (0, 48)
    assert per_rank_totals([], 2, "rank", "flops") == (0, 0)


def test_bytes_sent_charges_the_owner_and_bytes_issued_the_rank_that_gets():
    # A (2x1) all on rank 0, C (2x4) all on rank 1: rank 1 gets A (2 elements) rather than
    # rank 0 sending the 8-element product.
    plan = make_plan(
        Layout.rows((2, 1), sizes=[2, 0]),
        Layout.replicated((1, 4), nranks=2),
        Layout.rows((2, 4), sizes=[0, 2]),
    )
    assert plan.transfers == (Transfer("get", "A", 1, 0, (0, 2), (0, 1)),)
    assert plan.bytes_sent() == (8, 0) and plan.bytes_sent(2, 8) == (4, 0)
    assert plan.bytes_issued() == (0, 8) and plan.bytes_issued(8, 4) == (0, 16)
    assert plan.flops == (0, 16)
    assert plan.expose_elements == (2, 0)


@settings(max_examples=300, deadline=None)
@given(products())
def test_owner_tables_are_the_layouts_owners(layouts):
    a, b, c = layouts
    cells = cut_cells(a, b, c)
    for table, layout, rows, cols in (
        (cells.a_owners, a, cells.m, cells.k),
        (cells.b_owners, b, cells.k, cells.n),
        (cells.c_owners, c, cells.m, cells.n),
    ):
        assert len(table) == len(rows)
        for i, r in enumerate(rows):
            assert table[i] == tuple(layout.owners(r, col) for col in cols)


def test_large_plans_are_built_without_pairwise_or_per_cell_scans():
    # 4096 ranks: the owner tables, validation and tallies are near-linear (this took ~10 s).
    import time

    start = time.perf_counter()
    plan = make_plan(
        Layout.rows((65536, 256), nranks=4096),
        Layout.replicated((256, 512), nranks=4096),
        Layout.rows((65536, 512), nranks=4096),
    )
    assert len(plan.multiplies) == 4096 and not plan.transfers
    assert "rank 4095: 1 multiplies" in plan.describe()
    assert time.perf_counter() - start < 5


def test_collector_is_restored_after_planning():
    import gc

    make_plan(
        Layout.rows((4, 4), nranks=2), Layout.cols((4, 4), nranks=2), Layout.rows((4, 4), nranks=2)
    )
    assert gc.isenabled()
    gc.disable()
    try:
        Plan = type(
            make_plan(
                Layout.rows((4, 4), nranks=2),
                Layout.rows((4, 4), nranks=2),
                Layout.rows((4, 4), nranks=2),
            )
        )
        Plan(
            Layout.rows((6, 4), nranks=2),
            Layout.rows((4, 4), nranks=2),
            Layout.rows((6, 4), nranks=2),
        )
        assert not gc.isenabled()
    finally:
        gc.enable()


@settings(max_examples=300, deadline=None)
@given(products(max_ranks=6))
def test_plan_totals_are_the_plans_own(layouts):
    from osmm_jax._src.planner import Plan, PlanTotals

    plan, totals = Plan(*layouts), PlanTotals(*layouts)
    assert totals.nranks == plan.nranks
    assert totals.flops == plan.flops
    for sizes in ((4, 4), (2, 4), (8, 8), (1, 3)):
        assert totals.bytes_sent(*sizes) == plan.bytes_sent(*sizes)
