"""The planner, without MPI or JAX: coverage, flop and byte accounting, exact results."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from plan_simulation import simulate
from strategies import products

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.planner import (
    EVERYONE,
    Decision,
    LocalMultiply,
    LocalUpdate,
    Plan,
    PlanFacts,
    Transfer,
    backward_plans,
    cells_of_rank,
    combine_facts,
    cut_cells,
    decide,
    make_plan,
    per_rank_totals,
)


def _size(iv):
    return iv[1] - iv[0]


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


def _inside(rows, cols, get) -> bool:
    """Whether the rectangle ``rows x cols`` lies in ``get``'s ``(.., .., rows, cols, ..)``."""
    return (
        get[2][0] <= rows[0]
        and rows[1] <= get[2][1]
        and get[3][0] <= cols[0]
        and cols[1] <= get[3][1]
    )


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

    # Adjacent pieces from one owner are joined into one get: each needed piece lies in
    # exactly one get from its owner, and each get is tiled by the pieces it holds.
    def held_by(get):
        origin, matrix, _, _, owner = get
        return [
            piece
            for piece in needed
            if (piece[0], piece[1], piece[4]) == (origin, matrix, owner)
            and _inside(piece[2], piece[3], get)
        ]

    holders = Counter(piece for get in gets for piece in held_by(get))
    assert set(holders) == needed, "every remote piece is fetched"
    assert all(count == 1 for count in holders.values()), "no piece is fetched twice"
    for get in gets:
        area = sum(_size(piece[2]) * _size(piece[3]) for piece in held_by(get))
        assert area == _size(get[2]) * _size(get[3]), "every fetched element feeds a multiply"
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
    for ts in receivers.values():
        # The target's own partial is added outside the window, so it may have one too.
        assert {t.op for t in ts} == ({"put"} if len(ts) == 1 else {"accumulate"}), (
            "a rectangle's only delivery is a put, and only then"
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


def test_k_split_reduce_scatters_with_half_an_allreduce_of_bytes():
    n = 8
    plan = make_plan(
        Layout.cols((n, n), nranks=2), Layout.rows((n, n), nranks=2), Layout.rows((n, n), nranks=2)
    )
    # Each rank's C rows receive one partial, the other rank's: written, not accumulated.
    assert {t.op for t in plan.transfers} == {"put"}
    # Each rank sends the half of C it does not own: n*n/2 floats. An all-reduce of
    # the whole C moves at least twice that per rank.
    assert plan.bytes_sent() == (4 * n * n // 2, 4 * n * n // 2)
    n = 12
    three = [Layout.cols((n, n), nranks=3), Layout.rows((n, n), nranks=3)]
    plan = make_plan(*three, Layout.rows((n, n), nranks=3))
    # Each rank's C rows receive the partials of both other ranks: added where they land.
    assert {t.op for t in plan.transfers if t.matrix == "C"} == {"accumulate"}


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
    # Data-parallel: dB = A.T @ dC is a K-split product whose result every rank holds; on
    # two ranks each receives the other's partial only, so it is written, not accumulated.
    assert all(t.op == "put" and t.matrix == "C" for t in plan_db.transfers)


def test_describe_names_ranks_multiplies_and_transfers():
    plan = make_plan(
        Layout.cols((8, 8), nranks=2), Layout.rows((8, 8), nranks=2), Layout.rows((8, 8), nranks=2)
    )
    text = plan.describe()
    assert "over 2 ranks" in text and "rank 0:" in text and "rank 1:" in text
    assert "put C[4:8, 0:8] into rank 1" in text


def test_planner_imports_neither_jax_nor_mpi():
    code = (
        "import sys; import osmm_jax._src.planning.planner as p, osmm_jax._src.planning.layout as l;"
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


# -- the decisions, one cell at a time ------------------------------------------------------------
#
# EXAMPLE: 2 ranks, A (4x6) split by rows 1:3, B (6x5) by rows 2:4, C (4x5) by columns 3:2.
# M is cut at A's rows, K at B's rows, N at C's columns: cell (mi, ki, ni) has its A piece on
# rank mi, its B piece on rank ki and its C piece on rank ni.


def _example_layouts():
    return (
        Layout.rows((4, 6), sizes=[1, 3]),
        Layout.rows((6, 5), sizes=[2, 4]),
        Layout.cols((4, 5), sizes=[3, 2]),
    )


def test_cut_cells_cuts_at_every_shared_boundary_and_looks_up_the_owners():
    cells = cut_cells(*_example_layouts())
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


def test_a_c_owner_holding_both_inputs_computes_the_cell_itself():
    cells = cut_cells(*_example_layouts())
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


def test_decide_picks_the_server_that_moves_the_fewest_elements():
    cells = cut_cells(*_example_layouts())
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


def test_example_schedule_gets_once_and_sums_partials_per_rectangle():
    plan = make_plan(*_example_layouts())
    assert plan.transfers == (
        Transfer("get", "A", 0, 1, (1, 4), (0, 2)),
        Transfer("get", "A", 1, 0, (0, 1), (2, 6)),  # once, for two cells
        Transfer("get", "B", 1, 0, (0, 2), (3, 5)),
        # Each rectangle receives one partial (its owner's own is added outside the window).
        Transfer("put", "C", 0, 1, (0, 1), (3, 5), ((0, 2),)),
        Transfer("put", "C", 1, 0, (0, 1), (0, 3), ((2, 6),)),
        Transfer("put", "C", 1, 0, (1, 4), (0, 3), ((2, 6),)),
    )
    assert plan.local_updates == (
        LocalUpdate(0, (0, 1), (0, 3), ((0, 2),)),
        LocalUpdate(0, (1, 4), (0, 3), ((0, 2),)),
        LocalUpdate(1, (0, 1), (3, 5), ((2, 6),)),
        LocalUpdate(1, (1, 4), (3, 5), ((0, 2), (2, 6))),
    )
    assert [(m.rank, m.rows, m.inner, m.cols, m.a_source, m.b_source) for m in plan.multiplies] == [
        (0, (0, 1), (0, 2), (0, 3), 0, 0),
        (0, (0, 1), (0, 2), (3, 5), 0, 0),
        (0, (1, 4), (0, 2), (0, 3), 1, 0),
        (1, (0, 1), (2, 6), (0, 3), 0, 1),
        (1, (0, 1), (2, 6), (3, 5), 0, 1),
        (1, (1, 4), (0, 2), (3, 5), 1, 0),
        (1, (1, 4), (2, 6), (0, 3), 1, 1),
        (1, (1, 4), (2, 6), (3, 5), 1, 1),
    ]
    assert sum(plan.flops) == 2 * 4 * 6 * 5


def test_a_product_with_one_k_cell_puts_and_rotates_targets():
    # Rank 2 holds all of A and B and computes every row of C: row 0 is rank 0's, row 1
    # rank 1's, each the only contribution to its rectangle (one K cell), so a put; rank 2's
    # deliveries start at the next rank (0), then 1.
    a = Layout.rows((2, 1), sizes=[0, 0, 2])
    b = Layout.rows((1, 1), sizes=[0, 0, 1])
    c = Layout.rows((2, 1), sizes=[1, 1, 0])
    plan = make_plan(a, b, c)
    assert plan.transfers == (
        Transfer("put", "C", 2, 0, (0, 1), (0, 1), ((0, 1),)),
        Transfer("put", "C", 2, 1, (1, 2), (0, 1), ((0, 1),)),
    )
    assert plan.local_updates == ()


# -- one rank's part of a plan ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(products())
def test_rank_plans_are_exactly_the_whole_plans_records(layouts):
    plan = Plan(*layouts)
    parts = [plan.for_rank(r) for r in range(plan.nranks)]
    assert [m for p in parts for m in p.multiplies] == list(plan.multiplies)
    assert [u for p in parts for u in p.local_updates] == list(plan.local_updates)
    gets = [t for t in plan.transfers if t.op == "get" and t.matrix != "C"]
    deliveries = [t for t in plan.transfers if t.op != "get"]
    assert [t for p in parts for t in p.gets] == gets
    assert Counter(t for p in parts for t in p.served) == Counter(gets)
    assert [t for p in parts for t in p.deliveries] == deliveries
    assert Counter(t for p in parts for t in p.received) == Counter(deliveries)
    assert [t for p in parts for t in p.gathers] == list(plan.gathers)
    assert Counter(t for p in parts for t in p.gathered) == Counter(plan.gathers)
    assert tuple(p.flops for p in parts) == plan.flops
    for sizes in ((4, 4), (2, 8)):
        assert tuple(p.bytes_sent(*sizes) for p in parts) == plan.bytes_sent(*sizes)
        assert tuple(p.bytes_issued(*sizes) for p in parts) == plan.bytes_issued(*sizes)
    assert combine_facts(p.facts for p in parts) == plan.facts
    assert tuple(plan.exposes(r) for r in range(plan.nranks)) == tuple(p.exposes for p in parts)


def test_a_rank_plan_visits_only_the_cells_it_owns_a_piece_of():
    # K-split over P ranks has P^2 cells; one rank's part comes from the 2P - 1 it owns.
    p = 256
    shape = (p * 4, p * 4)
    a, b, c = (
        Layout.cols(shape, nranks=p),
        Layout.rows(shape, nranks=p),
        Layout.rows(shape, nranks=p),
    )
    plan = Plan(a, b, c)
    assert len(plan.cells.m) * len(plan.cells.k) == p * p
    assert len(cells_of_rank(plan.cells, a, b, c, 7)) == 2 * p - 1
    part = plan.for_rank(7)
    assert len(part.deliveries) == len(part.received) == p - 1 and not part.gets
    assert part.flops == 2 * (p * 4) * 4 * (p * 4)
    # On a 16 x 16 grid a rank's part comes from its own row and column of blocks.
    grid = [Layout.grid(shape, (16, 16)) for _ in range(3)]
    plan = Plan(*grid)
    assert len(cells_of_rank(plan.cells, *grid, 7)) == 3 * 16 - 2
    part = plan.for_rank(7)
    assert len(part.multiplies) == 16 and len(part.gets) == 30 and not part.deliveries


def test_plan_for_one_rank_needs_no_mpi():
    code = (
        "import sys, osmm_jax as om\n"
        "s = (65536, 65536)\n"
        "part = om.plan(om.Layout.cols(s, nranks=8192), om.Layout.rows(s, nranks=8192),"
        " om.Layout.rows(s, nranks=8192), rank=5)\n"
        "assert isinstance(part, om.RankPlan) and part.rank == 5\n"
        "assert len(part.deliveries) == len(part.received) == 8191\n"
        "bad = [m for m in ('jax', 'mpi4py', 'mpi4jax') if m in sys.modules]; assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_for_one_rank_refuses_a_comm_and_a_rank_out_of_range():
    import osmm_jax as om

    layouts = [om.Layout.rows((4, 4), nranks=2) for _ in range(3)]
    with pytest.raises(ValueError, match="out of range"):
        om.plan(*layouts, rank=2)
    with pytest.raises(ValueError, match="not both"):
        om.plan(*layouts, rank=0, comm=object())


def test_agreed_facts_are_adopted_once():
    plan = Plan(*(Layout.grid((8, 8), (2, 2)) for _ in range(3)))
    facts = combine_facts(plan.for_rank(r).facts for r in range(4))
    assert facts == PlanFacts(True, False, (16, 16))
    plan.adopt_facts(facts)
    plan.adopt_facts(PlanFacts(False, False, (0, 0)))  # ignored: facts do not change
    assert plan.has_gets and not plan.has_deliveries and plan.expose_elements == (16, 16)
    assert plan.receive_elements == 0


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
    from osmm_jax._src.planning.planner import Plan, PlanTotals, _nbytes, per_rank_totals

    plan, totals = Plan(*layouts), PlanTotals(*layouts)
    assert totals.nranks == plan.nranks
    assert totals.flops == plan.flops
    for sizes in ((4, 4), (2, 4), (8, 8), (1, 3)):
        assert totals.bytes_sent(*sizes) == plan.bytes_sent(*sizes)
        assert totals.bytes_issued(*sizes) == plan.bytes_issued(*sizes)
        # What arrives at each rank: its gets (and a staged plan's gathers) and the partials
        # delivered into its block, counted from the plan's own transfers.
        received = per_rank_totals(plan.transfers, plan.nranks, "receiver", _nbytes(*sizes))
        assert totals.bytes_received(*sizes) == received
