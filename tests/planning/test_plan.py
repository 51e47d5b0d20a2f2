"""Plans, without MPI or JAX: exact results, flop and byte accounting, identity, staging and
one rank's part of a plan."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from fresh_process import modules_loaded_by
from hypothesis import given, settings
from plan_simulation import simulate
from strategies import products

from osmm_jax._src.planning.cells import cells_of_rank
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, backward_plans, make_plan
from osmm_jax._src.planning.records import PlanFacts, Transfer, combine_facts

JAX_AND_MPI = ("jax", "mpi4py", "mpi4jax")


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


def test_replicated_everything_computes_locally():
    plan = make_plan(*(Layout.replicated((5, 5), nranks=3) for _ in range(3)))
    assert plan.transfers == ()
    assert plan.flops == (250, 250, 250)


@pytest.mark.parametrize(
    "shapes, nranks, error, match",
    [
        (((4, 5), (4, 3), (4, 3)), (2, 2, 2), ValueError, "inner dimensions"),
        (((4, 4), (4, 4), (4, 4)), (2, 3, 2), ValueError, "different numbers of ranks"),
        (((4, 4), (4, 4), (4, 5)), (2, 2, 2), ValueError, "C layout has shape"),
    ],
)
def test_plan_rejects_mismatched_layouts(shapes, nranks, error, match):
    with pytest.raises(error, match=match):
        make_plan(*(Layout.rows(shape, nranks=n) for shape, n in zip(shapes, nranks)))


def test_plan_rejects_what_is_not_a_layout():
    with pytest.raises(TypeError, match="osmm_jax.Layout"):
        make_plan(Layout.rows((4, 4), nranks=2), "rows", Layout.rows((4, 4), nranks=2))


def _rows_by_replicated():
    """A by rows, B replicated, C by rows on 2 ranks: the data-parallel forward product."""
    return (
        Layout.rows((6, 4), nranks=2),
        Layout.replicated((4, 3), nranks=2),
        Layout.rows((6, 3), nranks=2),
    )


def test_plans_are_hashable_equal_and_immutable():
    layouts = _rows_by_replicated()
    p1, p2 = make_plan(*layouts), make_plan(*layouts, 0)
    assert p1 == p2 and hash(p1) == hash(p2) and p1.fingerprint == p2.fingerprint
    assert make_plan(*layouts, 7) != p1
    other = make_plan(Layout.rows((6, 4), weights=[2, 1]), layouts[1], layouts[2])
    assert other.fingerprint != p1.fingerprint
    with pytest.raises(AttributeError):
        p1.a = layouts[1]


def test_backward_plans_use_transposed_layouts():
    a, b, c = _rows_by_replicated()
    plan_da, plan_db = backward_plans(make_plan(a, b, c))
    assert (plan_da.a, plan_da.b, plan_da.c) == (c, b.T, a)
    assert (plan_db.a, plan_db.b, plan_db.c) == (a.T, c, b)
    # Data-parallel: dB = A.T @ dC is a K-split product whose result every rank holds; on
    # two ranks each receives the other's partial only, so it is written, not accumulated.
    assert all(t.op == "put" and t.matrix == "C" for t in plan_db.transfers)


def test_plan_imports_neither_jax_nor_mpi():
    code = (
        "import osmm_jax._src.planning.plan as p, osmm_jax._src.planning.layout as l\n"
        "p.make_plan(l.Layout.rows((4,4),nranks=2), l.Layout.cols((4,4),nranks=2), l.Layout.grid((4,4),(2,1)))"
    )
    assert not modules_loaded_by(code, JAX_AND_MPI)


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
        "import osmm_jax as om\n"
        "s = (65536, 65536)\n"
        "part = om.plan(om.Layout.cols(s, nranks=8192), om.Layout.rows(s, nranks=8192),"
        " om.Layout.rows(s, nranks=8192), rank=5)\n"
        "assert isinstance(part, om.RankPlan) and part.rank == 5\n"
        "assert len(part.deliveries) == len(part.received) == 8191\n"
    )
    assert not modules_loaded_by(code, JAX_AND_MPI)


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
    # Each rank gets a 4 x 4 piece of A and one of B, from two owners (16 elements from each).
    assert facts == PlanFacts(True, False, (16, 16), 0, 32, 2, 16)
    plan.adopt_facts(facts)
    plan.adopt_facts(PlanFacts(False, False, (0, 0)))  # ignored: facts do not change
    assert plan.has_gets and not plan.has_deliveries and plan.expose_elements == (16, 16)
    assert plan.receive_elements == 0


# -- per-rank tallies ----------------------------------------------------------------------------


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
