"""Memory budgets per rank, rows a budget allows and the shares fitted to budgets: no MPI."""

from __future__ import annotations

import math

import pytest

from osmm_jax._src import config
from osmm_jax._src.planning import memory
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan


def test_a_budget_is_one_number_for_every_rank_or_one_per_rank(monkeypatch):
    monkeypatch.delenv(config.MEMORY_BUDGET, raising=False)
    assert memory.budgets_per_rank(2**30, 3) == (2**30,) * 3
    assert memory.budgets_per_rank([1, 2.5, math.inf], 3) == (1.0, 2.5, math.inf)
    assert memory.budgets_per_rank((4,), 1) == (4.0,)
    host = memory.budgets_per_rank(None, 2)
    assert host[0] == host[1] == config.host_memory_budget() > 0


@pytest.mark.parametrize(
    "text, expected",
    [("1GiB", (2**30,) * 3), ("1GiB, 2 GiB,512MiB", (2**30, 2**31, 2**29)), ("0,none,8", None)],
)
def test_the_environment_gives_one_budget_or_one_per_rank(monkeypatch, text, expected):
    monkeypatch.setenv(config.MEMORY_BUDGET, text)
    if expected is None:
        expected = (math.inf, math.inf, 8.0)
    assert memory.budgets_per_rank(None, 3) == expected


def test_bad_budgets_are_refused_with_their_name(monkeypatch):
    with pytest.raises(ValueError, match=r"memory_budget has 2 budgets but there are 3 ranks"):
        memory.budgets_per_rank([1, 2], 3)
    with pytest.raises(ValueError, match=r"memory_budget\[1\] must be finite and > 0"):
        memory.budgets_per_rank([1, 0, 2], 3)
    with pytest.raises(ValueError, match=r"memory_budget must be finite and > 0"):
        memory.budgets_per_rank(-5, 3)
    with pytest.raises(TypeError, match="memory_budget must be a number"):
        memory.budgets_per_rank("8GiB", 3)
    with pytest.raises(TypeError, match=r"memory_budget\[0\] must be a number"):
        memory.budgets_per_rank([None, 1], 2)
    monkeypatch.setenv(config.MEMORY_BUDGET, "1GiB,2GiB")
    with pytest.raises(ValueError, match=r"OSMM_MEMORY_BUDGET has 2 budgets but there are 3"):
        memory.budgets_per_rank(None, 3)
    monkeypatch.setenv(config.MEMORY_BUDGET, "1GiB,lots")
    with pytest.raises(ValueError, match="OSMM_MEMORY_BUDGET entry must be a number of bytes"):
        memory.budgets_per_rank(None, 3)


def test_row_limits_subtract_the_fixed_bytes_and_round_down():
    assert memory.row_limits((1000, math.inf, 50), 100, 0) == (10, math.inf, 0)
    assert memory.row_limits((1050, 1000), 100, [99, 2000]) == (9, 0)
    with pytest.raises(ValueError, match="fixed_bytes has 1 entries but there are 2 ranks"):
        memory.row_limits((1, 2), 1, [0])
    with pytest.raises(ValueError, match="fixed_bytes must be finite and at least 0"):
        memory.row_limits((1, 2), 1, -1)


def test_the_over_budget_error_names_the_rank_its_need_and_what_it_has():
    error = memory.over_budget_error(
        1000, [250, 250, 500], (400, 400, 100), (4e4, 4e4, 1e4), 100, 0
    )
    text = str(error)
    assert "1000 rows do not fit the memory budgets: rank 2 would need 48.8 KiB" in text
    assert "its speed share of 500 rows but has 9.77 KiB" in text
    assert "all ranks together hold at most 900 rows" in text


def _affine(fixed, per_share):
    """What each rank holds at weights w: fixed[r] + per_share * its share of the work."""

    def held(weights):
        total = math.fsum(weights)
        return [f + per_share * w / total for f, w in zip(fixed, weights)]

    return held


def test_fitted_shares_hold_a_rank_at_its_budget_and_give_the_rest_by_speed():
    held = _affine([64.0, 64.0, 64.0], 256.0)
    speeds = [1.0, 1.0, 2.0]
    weights, moved = memory.fit_shares(held, speeds, [1e9, 1e9, 120.0])
    assert moved == (2,)
    need = held(weights)
    assert need[2] <= 120.0 and need[2] > 119.9  # at its budget, not far below it
    assert weights[0] == pytest.approx(weights[1])  # the others keep their speed ratio
    assert memory.fit_shares(held, speeds, [1e9] * 3) == (speeds, ())


def test_fitted_shares_are_refused_when_nothing_fits():
    speeds = [1.0, 1.0]
    assert memory.fit_shares(_affine([64.0, 64.0], 256.0), speeds, [100.0, 100.0]) is None
    assert memory.fit_shares(_affine([200.0, 0.0], 10.0), speeds, [100.0, 1e9]) is None


def _grid(n=8):
    return Plan(*(Layout.grid((n, n), (2, 2)) for _ in range(3)))


def _k_split(n=8, nranks=4):
    return Plan(
        Layout.cols((n, n), nranks=nranks),
        Layout.rows((n, n), nranks=nranks),
        Layout.rows((n, n), nranks=nranks),
    )


def test_a_grid_product_holds_the_operands_it_joins_for_one_gemm():
    """2x2 grid, 8^3: every rank gets two 4x4 pieces (32 elements) and serves two; its C cell
    is summed over two inner ranges, whose operands (4x4 of A and 4x4 of B each) are set side
    by side for one GEMM: 64 elements, more than the fetch's 32 + 32 packed."""
    plan = _grid()
    assert [memory.one_sided_transient(plan, r, packed=True) for r in range(4)] == [64] * 4
    assert [memory.one_sided_transient(plan, r, packed=False) for r in range(4)] == [64] * 4


def test_an_operand_joined_from_the_rank_s_whole_own_block_is_read_in_place():
    """A sequence-parallel column layer's dB = A.T @ dC (A.T by columns, dC and dB by
    columns): each rank's dB block is summed over every rank's rows of dC, its A.T pieces
    (8 x 2 each, three fetched) joined side by side, a copy (64 elements), its dC pieces one
    above the other, which is its own whole block of dC (2 wide, every row), read in place
    (the K-split's A.T, its whole block too: tests/runtime/test_backward.py)."""
    n, p = 8, 4
    sequence = Plan(
        Layout.rows((n, n), nranks=p), Layout.cols((n, n), nranks=p), Layout.cols((n, n), nranks=p)
    )
    _, d_b = sequence.backward()
    for rank in range(p):
        fetched = sum(t.elements for t in d_b.for_rank(rank).gets)
        assert fetched == 3 * n * 2
        assert memory.one_sided_transient(d_b, rank, False) == n * n  # not n * n + n * 2


def test_a_k_split_holds_the_partials_it_delivers_and_a_staged_plan_the_whole_c():
    plan = _k_split()  # each rank's partial of C is 8x8; 3 blocks of 2x8 go to the others
    assert [memory.one_sided_transient(plan, r, packed=True) for r in range(4)] == [48] * 4
    assert memory.one_sided_transient(plan, 0, packed=True, whole_c=1000) == 1000


def test_a_product_that_moves_nothing_adds_nothing():
    plan = Plan(
        Layout.rows((8, 8), nranks=4),
        Layout.replicated((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
    )
    assert [memory.one_sided_transient(plan, r, packed=True) for r in range(4)] == [0] * 4
    assert memory.allreduce_transient(plan) == 0


def test_the_allreduce_method_holds_whole_matrices():
    # grid: whole A and B assembled (64 each), the whole C summed and its all-reduced copy
    assert memory.allreduce_transient(_grid()) == 4 * 64
    # K-split: nothing to assemble, the whole C twice
    assert memory.allreduce_transient(_k_split()) == 2 * 64
    # a replicated C is the all-reduced sum itself
    replicated = Plan(
        Layout.cols((8, 8), nranks=4),
        Layout.rows((8, 8), nranks=4),
        Layout.replicated((8, 8), nranks=4),
    )
    assert memory.allreduce_transient(replicated) == 64


def test_a_peak_is_the_sum_of_its_parts():
    peak = memory.PeakMemory(blocks=3, transient=4, windows=5)
    assert peak.total == 12


def test_a_gemm_over_the_whole_block_joins_the_fetched_rows_with_the_own_ones():
    """A sequence-parallel column layer (A by rows, B and C by columns): each rank's C block is
    one GEMM over every row of A, its own and the fetched ones joined into one panel."""
    n, p = 8, 4
    plan = Plan(
        Layout.rows((n, n), nranks=p), Layout.cols((n, n), nranks=p), Layout.cols((n, n), nranks=p)
    )
    for rank in range(p):
        assert memory.merged_block_operands(plan, rank) == n * n  # every row of A, K wide
        fetched = sum(t.elements for t in plan.for_rank(rank).gets)
        assert (
            memory.one_sided_transient(
                plan, rank, False, merged=memory.merged_block_operands(plan, rank)
            )
            == fetched + n * n
        )
    # Nothing joined where the plan delivers (a K-split) or reads only the rank's own blocks.
    k_split = Plan(
        Layout.cols((n, n), nranks=p), Layout.rows((n, n), nranks=p), Layout.rows((n, n), nranks=p)
    )
    data_parallel = Plan(
        Layout.rows((n, n), nranks=p),
        Layout.replicated((n, n), nranks=p),
        Layout.rows((n, n), nranks=p),
    )
    assert all(memory.merged_block_operands(k_split, r) == 0 for r in range(p))
    assert all(memory.merged_block_operands(data_parallel, r) == 0 for r in range(p))
