"""Load balance of the planner.

Each cell goes to a server that moves the fewest elements; among equally cheap servers the C
owner computes it (stationary C), so on equal 2-D grids every rank computes its own block of C,
as in SUMMA, at the least traffic, and with layouts whose C blocks follow the ranks' speeds the
work follows them too. The reference below is stationary C itself: every rank computes its C
block and gets the A and B pieces it lacks.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import products

from osmm_jax._src.planning.cells import EVERYONE, cut_cells, decide
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.records import FLOAT32_BYTES
from osmm_jax._src.planning.totals import rank_speeds

MIB = 2**20


def _ratio(values) -> float:
    """Largest over mean (1.0 when all are zero)."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


def _grid_plan(dims, grid) -> Plan:
    M, K, N = dims
    return Plan(Layout.grid((M, K), grid), Layout.grid((K, N), grid), Layout.grid((M, N), grid))


def _overlap(x, y) -> int:
    return max(0, min(x[1], y[1]) - max(x[0], y[0]))


def _stationary_c_elements(a: Layout, b: Layout, c: Layout) -> int:
    """Elements stationary C moves: each rank gets the parts of A's rows and B's columns of its
    C block that it does not hold."""
    K = a.shape[1]
    total = 0
    for r in range(c.nranks):
        rows, cols = c.blocks[r]
        (ar, ac), (br, bc) = a.blocks[r], b.blocks[r]
        total += _size(rows) * K - _overlap(rows, ar) * _overlap((0, K), ac)
        total += K * _size(cols) - _overlap((0, K), br) * _overlap(cols, bc)
    return total


def _size(iv) -> int:
    return iv[1] - iv[0]


# -- the cases the balance was made for ----------------------------------------------------------


@pytest.mark.parametrize(
    ("grid", "mib_before"),
    [((2, 2), 128), ((4, 4), 384), ((8, 8), 896), ((2, 4), 256), ((4, 8), 640)],
)
def test_square_products_on_2d_grids_are_balanced_at_the_same_traffic(grid, mib_before):
    # 4096^3 on A, B and C on one grid: the former rule left the busiest rank 1.25x (4x4,
    # 4x8) and 1.125x (8x8) the mean flops; SUMMA / stationary-C is even at the same bytes.
    n = 4096
    plan = _grid_plan((n, n, n), grid)
    assert _ratio(plan.flops) <= 1.05
    assert plan.balance().ratio <= 1.05
    assert _ratio(plan.bytes_issued()) <= 1.05
    assert sum(plan.bytes_sent()) <= mib_before * MIB
    # ... which is stationary-C's volume: every rank gets the A and B blocks of its row and
    # column of the grid that it lacks.
    pr, pc = grid
    assert sum(plan.bytes_sent()) == FLOAT32_BYTES * n * n * (pr + pc - 2)


def test_k_large_product_on_a_2x2_grid_keeps_the_least_traffic():
    # M = N = 2048, K = 65536, everything on a 2x2 grid. Of the 8 cells, ranks 0 and 3 hold
    # both inputs of one each; ranks 1 and 2 serve the two cells whose C owner (0 or 3) holds
    # neither input, and the four whose C owner holds one input (fetching the other) most
    # cheaply. Any other server of any of them moves a 1024x32768 input piece or a C
    # partial more: whole-cell plans at the least traffic are 1:3:3:1 in flops, and an even split
    # needs cells cut along K (one more C partial per moved cell: 4 MiB each). The planner
    # keeps the least traffic here.
    plan = Plan(
        Layout.grid((2048, 65536), (2, 2)),
        Layout.grid((65536, 2048), (2, 2)),
        Layout.grid((2048, 2048), (2, 2)),
    )
    assert sum(plan.bytes_sent()) == 776 * MIB
    assert _ratio(plan.flops) == 1.5


@pytest.mark.parametrize(
    "layouts",
    [
        # rows x replicated: no traffic, work in proportion to the rows.
        (
            Layout.rows((64, 48), weights=[1, 1, 2, 4]),
            Layout.replicated((48, 40), nranks=4),
            Layout.rows((64, 40), weights=[1, 1, 2, 4]),
        ),
        # a grid whose C blocks follow the speeds, K small enough that every C owner is
        # among the cheapest servers of its cells
        (
            Layout.grid((120, 12), (2, 2), row_weights=[1, 3], col_weights=[1, 1]),
            Layout.grid((12, 120), (2, 2), row_weights=[1, 1], col_weights=[1, 2]),
            Layout.grid((120, 120), (2, 2), row_weights=[1, 3], col_weights=[1, 2]),
        ),
    ],
    ids=["rows-replicated", "weighted-grid"],
)
def test_work_follows_the_c_blocks_and_so_the_speeds(layouts):
    plan = Plan(*layouts)
    M, K, N = plan.dims
    c = layouts[2]
    assert list(plan.flops) == [2 * K * _size(rows) * _size(cols) for rows, cols in c.blocks]
    speeds = rank_speeds(*layouts)
    per_speed = [f / s for f, s in zip(plan.flops, speeds)]
    assert max(per_speed) <= min(per_speed) * (1 + 1e-9)
    assert sum(plan.bytes_sent(1, 1)) <= _stationary_c_elements(*layouts)


# -- properties ----------------------------------------------------------------------------------


def _moved(cells, mi, ki, ni, p) -> int:
    """Elements rank ``p`` would move to serve the cell: inputs it lacks, and one result per C
    owner other than itself that does not compute the cell itself."""
    d = decide(cells, mi, ki, ni)
    m, k, n = (_size(iv) for iv in (cells.m[mi], cells.k[ki], cells.n[ni]))
    if d.c_owner == EVERYONE:
        others = cells.nranks - len(d.self_serving) - (p not in d.self_serving)
    else:
        others = int(p != d.c_owner)
    return (
        (0 if d.a_owner in (EVERYONE, p) else m * k)
        + (0 if d.b_owner in (EVERYONE, p) else k * n)
        + m * n * others
    )


@settings(max_examples=300, deadline=None)
@given(products())
def test_every_cell_goes_to_the_cheapest_of_all_ranks(layouts):
    # The server is chosen among the owners of the cell's pieces (or is the C owner that
    # computes the cell for itself anyway): no other rank is cheaper.
    cells = cut_cells(*layouts)
    for mi in range(len(cells.m)):
        for ki in range(len(cells.k)):
            for ni in range(len(cells.n)):
                d = decide(cells, mi, ki, ni)
                if d.server < 0:
                    continue
                if d.self_serving:  # computed there anyway: nobody computes it twice
                    assert d.server in d.self_serving
                    continue
                cheapest = min(_moved(cells, mi, ki, ni, p) for p in range(cells.nranks))
                assert _moved(cells, mi, ki, ni, d.server) == cheapest


@st.composite
def even_grid_products(draw):
    """A, B and C on one equal grid, block sizes equal, M, K, N with K no larger than M and N."""
    pr, pc = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    unit = math.lcm(pr, pc)
    k = unit * draw(st.integers(1, 3))
    m = k * draw(st.integers(1, 3))
    n = k * draw(st.integers(1, 3))
    return (m, k, n), (pr, pc)


@settings(max_examples=150, deadline=None)
@given(even_grid_products())
def test_equal_grids_are_balanced_within_five_percent(case):
    dims, grid = case
    # Sizes large enough that flops, not bytes, dominate a rank's time, as in real products.
    dims = tuple(d * 64 for d in dims)
    plan = _grid_plan(dims, grid)
    assert _ratio(plan.flops) <= 1.05, (dims, grid, plan.flops)
    assert plan.balance().ratio <= 1.05
    M, K, N = dims
    a, b, c = Layout.grid((M, K), grid), Layout.grid((K, N), grid), Layout.grid((M, N), grid)
    assert not plan.has_deliveries  # stationary C
    assert sum(plan.bytes_sent(1, 1)) <= _stationary_c_elements(a, b, c)


# -- the speed model and the report -------------------------------------------------------------


def test_rank_speeds_come_from_c_then_a_then_b():
    shape = (8, 8)
    assert rank_speeds(
        Layout.rows(shape, nranks=4),
        Layout.rows(shape, nranks=4),
        Layout.rows(shape, sizes=[1, 1, 2, 4]),
    ) == (0.5, 0.5, 1.0, 2.0)
    replicated = Layout.replicated(shape, nranks=2)
    assert rank_speeds(Layout.cols(shape, sizes=[2, 6]), replicated, replicated) == (0.5, 1.5)
    assert rank_speeds(replicated, replicated, replicated) == (1.0, 1.0)
    # An empty block: a hundredth of the mean, so it gets work only when nothing is cheaper.
    assert rank_speeds(replicated, replicated, Layout.rows(shape, sizes=[8, 0])) == (2.0, 0.01)


def test_balance_and_describe_report_the_busiest_rank():
    plan = _grid_plan((256, 256, 256), (2, 2))
    balance = plan.balance()
    assert balance.ratio == pytest.approx(1.0)
    assert balance.seconds == tuple(c + b for c, b in zip(balance.compute, balance.communicate))
    assert balance.compute[0] == pytest.approx(plan.flops[0] / 100e9)
    # Explicit speeds (flops/s) and bandwidth: rank 0 at half speed is the busiest.
    slow = plan.balance(speeds=[50e9, 100e9, 100e9, 100e9], bandwidth=1e9)
    assert slow.busiest == 0 and slow.ratio > 1.2
    assert slow.communicate[1] == pytest.approx(plan.bytes_sent()[1] / 1e9)
    with pytest.raises(ValueError):
        plan.balance(speeds=[1.0])
    assert "balance: busiest rank 0 at 1.00\u00d7 the mean" in plan.describe()


def test_balanced_plans_are_the_same_every_time():
    layouts = [Layout.grid((512, 512), (4, 4)) for _ in range(3)]
    first, second = Plan(*layouts), Plan(*layouts)
    assert first.multiplies == second.multiplies and first.transfers == second.transfers
