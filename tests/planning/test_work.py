"""Work splits (who computes which multiply-adds) and the 3-D layouts, without MPI or JAX."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_simulation import simulate
from strategies import worked_products

from osmm_jax._src.planning import comm_bound
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, backward_plans, make_plan
from osmm_jax._src.planning.work import Work, owner_boxes, three_d_layouts


def test_a_grid_gives_each_rank_one_box_and_finds_the_rank_of_any_point():
    work = Work.grid((6, 4, 9), (2, 2, 3), m_weights=[1, 2], n_weights=[1, 1, 1])
    assert work.shape == (2, 2, 3) and work.nranks == 12
    assert work.m == ((0, 2), (2, 6)) and work.k == ((0, 2), (2, 4))
    assert work.n == ((0, 3), (3, 6), (6, 9))
    for rank in range(12):
        i, ki, j = work.index(rank)
        assert rank == (i * 2 + ki) * 3 + j
        rows, inner, cols = work.box(rank)
        assert work.rank_at(rows[0], inner[0], cols[0]) == rank
        assert work.rank_at(rows[1] - 1, inner[1] - 1, cols[1] - 1) == rank
    # Every multiply-add is in exactly one box.
    seen = {work.rank_at(x, y, z) for x, y, z in itertools.product(range(6), range(4), range(9))}
    assert seen == set(range(12))


def test_ranks_may_be_numbered_in_any_order():
    work = Work.grid((4, 4, 4), (2, 1, 2), ranks=[3, 1, 0, 2])
    assert work.box(3) == ((0, 2), (0, 4), (0, 2))
    assert work.index(2) == (1, 0, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dims=(4, 4, 4), m=((0, 4),), k=((0, 3),), n=((0, 4),), ranks=(0,)), "cover"),
        (
            dict(dims=(4, 4, 4), m=((0, 2), (1, 4)), k=((0, 4),), n=((0, 4),), ranks=(0, 1)),
            "consecutive",
        ),
        (
            dict(dims=(4, 4, 4), m=((0, 2), (2, 4)), k=((0, 4),), n=((0, 4),), ranks=(0, 0)),
            "permutation",
        ),
        (
            dict(dims=(4, 4, 4), m=((0, 2), (2, 4)), k=((0, 4),), n=((0, 4),), ranks=(0,)),
            "permutation",
        ),
    ],
)
def test_bad_splits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Work(**kwargs)


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match=r"grid\[0\] must be at least 1"):
        Work.grid((4, 4, 4), (0, 1, 1))
    for dims in ((4, 4), (4, 4, 4, 4)):
        with pytest.raises(ValueError, match="dims must be a triple"):
            Work.grid(dims, (1, 1, 1))
        with pytest.raises(ValueError, match="dims must be a triple"):
            three_d_layouts(dims, (1, 1, 1))
    with pytest.raises(TypeError, match="dims must be a triple"):
        Work.grid(4, (1, 1, 1))
    with pytest.raises(TypeError, match=r"dims\[1\] must be an integer"):
        three_d_layouts((4, 4.0, 4), (1, 1, 1))
    with pytest.raises(ValueError, match=r"dims\[0\] must be at least 0"):
        three_d_layouts((-1, 4, 4), (1, 1, 1))
    with pytest.raises(ValueError, match=r"grid\[1\] must be at least 1"):
        three_d_layouts((4, 4, 4), (1, 0, 2))
    with pytest.raises(ValueError, match="weights"):
        Work.grid((4, 4, 4), (2, 1, 1), m_weights=[1, 2, 3])
    with pytest.raises(TypeError, match=r"m\[0\]\[1\] must be an integer"):
        Work((4, 4, 4), ((0, 1.5), (1.5, 4)), ((0, 4),), ((0, 4),), (0, 1))
    with pytest.raises(ValueError, match="dims must be a triple"):
        Work((4, 4, 4, 4), ((0, 4),), ((0, 4),), ((0, 4),), (0,))


def test_queries_refuse_ranks_points_and_axes_out_of_range():
    work = Work.grid((4, 4, 4), (2, 1, 2))
    for rank in (-1, 4):
        with pytest.raises(ValueError, match="rank"):
            work.box(rank)
    for point in ((-1, 0, 0), (4, 0, 0), (0, 4, 0), (0, 0, 9)):
        with pytest.raises(ValueError, match="outside"):
            work.rank_at(*point)
    with pytest.raises(ValueError, match="permutation"):
        work.permuted((0, 1, 1))
    assert "ranks [1, 0, 2, 3]" in repr(Work.grid((4, 4, 4), (2, 1, 2), ranks=[1, 0, 2, 3]))


@settings(max_examples=100, deadline=None)
@given(st.permutations(range(12)), st.sampled_from([(0, 2, 1), (1, 0, 2), (2, 1, 0)]))
def test_a_permuted_split_keeps_every_multiply_add_on_its_rank(ranks, axes):
    work = Work.grid((5, 7, 6), (3, 2, 2), m_weights=[1, 0, 2], ranks=ranks)
    moved = work.permuted(axes)
    assert moved.dims == tuple(work.dims[a] for a in axes)
    for point in itertools.product(range(5), range(7), range(6)):
        assert moved.rank_at(*(point[a] for a in axes)) == work.rank_at(*point)


@pytest.mark.parametrize("grid", [(2, 2, 2), (1, 4, 1), (3, 1, 2), (2, 3, 1)])
@pytest.mark.parametrize("speeds", ["equal", "uneven"])
def test_three_d_layouts_nest_each_ranks_blocks_in_its_box(grid, speeds):
    p = int(np.prod(grid))
    weights = None if speeds == "equal" else [1.0 + (r % 3) for r in range(p)]
    a, b, c, work = three_d_layouts((24, 30, 18), grid, weights)
    for layout in (a, b, c):
        Layout(layout.shape, layout.blocks)  # a partition: checked by the constructor
    for rank in range(p):
        rows, inner, cols = work.box(rank)
        for (r0, r1), (c0, c1), (lo_r, hi_r), (lo_c, hi_c) in (
            (*a.blocks[rank], rows, inner),
            (*b.blocks[rank], inner, cols),
            (*c.blocks[rank], rows, cols),
        ):
            assert lo_r <= r0 <= r1 <= hi_r and lo_c <= c0 <= c1 <= hi_c


def test_three_d_layouts_refuse_speeds_for_another_grid():
    with pytest.raises(ValueError, match="speeds"):
        three_d_layouts((8, 8, 8), (2, 2, 2), [1.0] * 4)


@settings(max_examples=300, deadline=None)
@given(worked_products())
def test_a_plan_with_a_work_split_computes_the_product_exactly(layouts):
    a_layout, b_layout, c_layout, work = layouts
    plan = make_plan(a_layout, b_layout, c_layout, work=work)
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, a_layout.shape).astype(np.float64)
    b = rng.integers(-4, 5, b_layout.shape).astype(np.float64)
    for rank, block in enumerate(simulate(plan, a, b)):
        np.testing.assert_array_equal(block, c_layout.shard(a @ b, rank))
    # The backward products split the same multiply-adds the same way.
    d_c = rng.integers(-4, 5, c_layout.shape).astype(np.float64)
    plan_da, plan_db = backward_plans(plan)
    assert plan_da.work == work.permuted((0, 2, 1)) and plan_db.work == work.permuted((1, 0, 2))
    for rank, block in enumerate(simulate(plan_da, d_c, b.T)):
        np.testing.assert_array_equal(block, a_layout.shard(d_c @ b.T, rank))
    for rank, block in enumerate(simulate(plan_db, a.T, d_c)):
        np.testing.assert_array_equal(block, b_layout.shard(a.T @ d_c, rank))


@pytest.mark.parametrize("grid", [(2, 2), (2, 3), (3, 2), (3, 3)])
def test_a_grid_product_s_gradients_are_computed_where_its_product_was(grid):
    """A product on a grid of C blocks (stationary C) hands its backward products the boxes
    of its own blocks: each rank does the multiply-adds of the forward product in each (on
    a 2x2 grid, deciding each cell alone gave two ranks 3 GEMMs and two ranks 1), and the
    products stay exact."""
    shape = (12, 12)
    layout = Layout.grid(shape, grid)
    plan = make_plan(layout, layout, layout)
    assert not plan.has_deliveries
    work = owner_boxes(plan.c, 12)
    assert work is not None and work.shape == (grid[0], 1, grid[1])
    for rank in range(plan.nranks):
        rows_, inner, cols = work.box(rank)
        assert (rows_, cols) == plan.c.blocks[rank] and inner == (0, 12)
    plan_da, plan_db = backward_plans(plan)
    assert plan_da.work == work.permuted((0, 2, 1)) and plan_db.work == work.permuted((1, 0, 2))

    def flops(p, rank):
        return sum(m.flops for m in p.for_rank(rank).multiplies)

    for rank in range(plan.nranks):
        assert flops(plan_da, rank) == flops(plan_db, rank) == flops(plan, rank)
    rng = np.random.default_rng(1)
    a, b, d_c = (rng.integers(-4, 5, shape).astype(np.float64) for _ in range(3))
    for rank, block in enumerate(simulate(plan_da, d_c, b.T)):
        np.testing.assert_array_equal(block, plan.a.shard(d_c @ b.T, rank))
    for rank, block in enumerate(simulate(plan_db, a.T, d_c)):
        np.testing.assert_array_equal(block, plan.b.shard(a.T @ d_c, rank))


def test_only_a_2d_grid_of_c_blocks_gives_owner_boxes():
    """Rows or columns of C (a 1-D split: deciding each cell alone already balances it) and a
    replicated operand keep the cell-by-cell decision."""
    shape = (8, 8)
    assert owner_boxes(Layout.rows(shape, nranks=4), 8) is None
    assert owner_boxes(Layout.cols(shape, nranks=4), 8) is None
    grid = Layout.grid(shape, (2, 2))
    replicated = make_plan(Layout.replicated(shape, nranks=4), grid, grid)
    assert all(p.work is None for p in backward_plans(replicated))


@settings(max_examples=200, deadline=None)
@given(worked_products())
def test_cells_a_c_owner_cannot_compute_alone_go_to_the_rank_of_their_box(layouts):
    a_layout, b_layout, c_layout, work = layouts
    plan = Plan(a_layout, b_layout, c_layout, work=work)
    for m in plan.multiplies:
        if c_layout.is_replicated:
            continue
        owner = c_layout.owners(m.rows, m.cols)[0]
        holds_inputs = all(
            layout.is_replicated or owner in layout.owners(rows, cols)
            for layout, rows, cols in ((a_layout, m.rows, m.inner), (b_layout, m.inner, m.cols))
        )
        if not (m.rank == owner and holds_inputs):
            assert m.rank == work.rank_at(m.rows[0], m.inner[0], m.cols[0])
    # Each rank's own part is exactly the whole plan's records for it.
    parts = [plan.for_rank(r) for r in range(plan.nranks)]
    assert [x for p in parts for x in p.multiplies] == list(plan.multiplies)
    assert [t for p in parts for t in p.deliveries] == [t for t in plan.transfers if t.op != "get"]
    assert [t for p in parts for t in p.gets] == [t for t in plan.transfers if t.op == "get"]


def test_plans_with_and_without_a_work_split_differ_and_say_so():
    a, b, c, work = three_d_layouts((16, 16, 16), (2, 2, 2))
    with_work, without = Plan(a, b, c, work=work), Plan(a, b, c)
    assert with_work != without and with_work.fingerprint != without.fingerprint
    assert with_work == Plan(a, b, c, work=work) and hash(with_work) == hash(
        Plan(a, b, c, work=work)
    )
    assert "work: Work(2x2x2" in with_work.describe()
    assert make_plan(a, b, c, work=work) is make_plan(a, b, c, work=work)
    with pytest.raises(TypeError, match="work must be"):
        Plan(a, b, c, work=(2, 2, 2))
    with pytest.raises(TypeError, match="work must be"):
        make_plan(a, b, c, work=[2, 2, 2])  # unhashable: refused before the plan cache
    with pytest.raises(ValueError, match="product"):
        Plan(a, b, c, work=Work.grid((16, 16, 8), (2, 2, 2)))
    with pytest.raises(ValueError, match="ranks"):
        Plan(a, b, c, work=Work.grid((16, 16, 16), (2, 2, 1)))


def test_the_3d_split_moves_its_boxes_surface_which_meets_the_bound():
    # 64 ranks as 4 x 4 x 4 on a square product: each rank gets 3/4 of a block of A and of B
    # and delivers 3/4 of a block of C: 9/64 N^2 elements, the Loomis-Whitney bound, where the
    # 8 x 8 grid moves 14/64 N^2.
    n = 256
    a, b, c, work = three_d_layouts((n, n, n), (4, 4, 4))
    plan = Plan(a, b, c, work=work)
    moved = comm_bound.moved_elements(plan)
    assert max(moved) == min(moved) == 9 * n * n // 64
    assert set(plan.flops) == {2 * n**3 // 64}
    bound = max(comm_bound.rank_bounds(n, n, n, [1.0] * 64))
    assert max(moved) == pytest.approx(bound, rel=1e-6)
    grid = [Layout.grid((n, n), (8, 8)) for _ in range(3)]
    assert max(comm_bound.moved_elements(Plan(*grid))) == 14 * n * n // 64


def test_a_3d_rank_gets_each_owners_pieces_in_one_get():
    # 4 x 4 x 4: a box's A block is held in row slices by 4 ranks and cut along K by B's 4
    # slices; the pieces from one owner are joined, so 3 gets of A and 3 of B per rank.
    n = 256
    a, b, c, work = three_d_layouts((n, n, n), (4, 4, 4))
    plan = Plan(a, b, c, work=work)
    for rank in (0, 5, 63):
        gets = plan.for_rank(rank).gets
        assert sorted(t.matrix for t in gets) == ["A"] * 3 + ["B"] * 3
        assert len({(t.matrix, t.target) for t in gets}) == 6
        assert sum(t.elements for t in gets) == 2 * 3 * (n // 16) * (n // 4)  # 3/4 of a box


def test_plan_takes_a_layout_choice_with_its_work_split():
    import osmm_jax as om

    choice = om.auto_layouts(256, 256, 256, [1.0] * 8, memory_budget=float("inf"))
    assert choice.name.startswith("3-D") and choice.work is not None
    part = om.plan(choice, rank=3)
    assert part.plan == make_plan(choice.a, choice.b, choice.c, work=choice.work)
    with pytest.raises(ValueError, match="LayoutChoice alone"):
        om.plan(choice, choice.b, choice.c, rank=0)
    with pytest.raises(ValueError, match="LayoutChoice alone"):
        om.plan(choice, work=choice.work, rank=0)
    with pytest.raises(TypeError, match="three layouts"):
        om.plan(choice.a, rank=0)
