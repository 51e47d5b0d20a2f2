"""balance(), declared speeds and the rank-prefixed logger, without MPI or JAX."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from osmm_jax._src.planning.balance import Balance, balance, guarantees_balance

SPEED_VALUES = [0.0, 0.5, 1.0, 2.0, 41.0, 85.0, 125.0, 300.0]


@st.composite
def speed_lists(draw, max_ranks: int = 6):
    """Non-negative speeds, at least one positive, sometimes with zeros."""
    speeds = draw(st.lists(st.sampled_from(SPEED_VALUES), min_size=1, max_size=max_ranks))
    if not any(speeds):
        speeds[draw(st.integers(0, len(speeds) - 1))] = 1.0
    return speeds


@st.composite
def problems(draw):
    """(total, speeds, min_rows, align) over a range of scales."""
    speeds = draw(speed_lists())
    min_rows = draw(st.sampled_from([1, 3, 8, 64, 100, 512]))
    align = draw(st.sampled_from([1, 2, 8, 16]))
    total = draw(st.one_of(st.integers(0, 5000), st.integers(0, 2_000_000)))
    return total, speeds, min_rows, align


def _remainder_rank(sizes) -> int | None:
    nonempty = [r for r, n in enumerate(sizes) if n]
    return nonempty[-1] if nonempty else None


def _check_structure(result: Balance, total: int, speeds, min_rows: int, align: int) -> None:
    """Sum, sign, granularity (multiples except the remainder piece) and zero-speed ranks."""
    sizes, g = result.sizes, result.granularity
    assert len(sizes) == len(speeds) and sum(sizes) == total
    assert all(isinstance(n, int) and n >= 0 for n in sizes)
    assert g in (math.lcm(min_rows, align), align)
    last = _remainder_rank(sizes)
    for r, n in enumerate(sizes):
        if r != last:
            assert n % g == 0, (r, sizes, g)
            assert n % align == 0
        if speeds[r] == 0:
            assert n == 0
    if last is not None:
        assert sizes[last] % g == total % g
    assert len(result.predicted_seconds) == len(speeds)


@settings(max_examples=250, deadline=None)
@given(problems())
def test_sizes_sum_to_total_in_whole_units(problem):
    total, speeds, min_rows, align = problem
    result = balance(total, speeds, min_rows=min_rows, align=align)
    _check_structure(result, total, speeds, min_rows, align)
    g = math.lcm(min_rows, align)
    lowered = g > align and total < g * sum(1 for s in speeds if s > 0)
    assert any("granularity lowered" in n for n in result.notes) == lowered
    assert result.granularity == (align if lowered else g)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_imbalance_is_below_one_unit_of_the_slowest_rank(problem):
    """The bound behind the guarantee: imbalance < granularity * sum(s) / (min(s) * total)."""
    total, speeds, min_rows, align = problem
    assume(total > 0)
    result = balance(total, speeds, min_rows=min_rows, align=align)
    positive = [s for s in speeds if s > 0]
    bound = result.granularity * math.fsum(positive) / (min(positive) * total)
    assert result.imbalance < bound + 1e-12, (bound, result)


@settings(max_examples=200, deadline=None)
@given(problems(), st.floats(1.0, 50.0))
def test_imbalance_within_five_percent_when_the_granularity_allows(problem, scale):
    _, speeds, min_rows, align = problem
    g = math.lcm(min_rows, align)
    positive = [s for s in speeds if s > 0]
    total = math.ceil(scale * g * math.fsum(positive) / min(positive) / 0.05)
    assert guarantees_balance(total, speeds, g)
    result = balance(total, speeds, min_rows=min_rows, align=align)
    assert result.granularity == g and result.notes == ()
    assert result.imbalance <= 0.05, result


@settings(max_examples=200, deadline=None)
@given(speed_lists(), st.sampled_from([1, 8, 512]))
def test_the_guarantee_is_reached_at_its_stated_total(speeds, granularity):
    """At the smallest total the condition allows, the bound holds (it is not vacuous)."""
    positive = [s for s in speeds if s > 0]
    total = math.ceil(granularity * math.fsum(positive) / min(positive) / 0.05)
    assert guarantees_balance(total, speeds, granularity)
    result = balance(total, speeds, min_rows=granularity)
    assert result.granularity == granularity
    assert result.imbalance <= 0.05 + 1e-12


@settings(max_examples=200, deadline=None)
@given(problems(), st.sampled_from([None, 0.3, 0.5, 0.75, 1.0]))
def test_faster_ranks_never_get_fewer_rows_by_more_than_one_unit(problem, cap):
    total, speeds, min_rows, align = problem
    active = sum(1 for s in speeds if s > 0)
    assume(cap is None or cap * active >= 1)
    result = balance(total, speeds, min_rows=min_rows, align=align, cap=cap)
    sizes, g = result.sizes, result.granularity
    for i, si in enumerate(speeds):
        for j, sj in enumerate(speeds):
            if si > sj:
                assert sizes[i] >= sizes[j] - g, (i, j, result)


@settings(max_examples=200, deadline=None)
@given(problems(), st.floats(0.05, 1.0))
def test_cap_is_respected(problem, cap):
    total, speeds, min_rows, align = problem
    active = sum(1 for s in speeds if s > 0)
    if cap * active < 1 - 1e-9:
        with pytest.raises(ValueError, match="cap .* is infeasible"):
            balance(total, speeds, min_rows=min_rows, align=align, cap=cap)
        return
    result = balance(total, speeds, min_rows=min_rows, align=align, cap=cap)
    _check_structure(result, total, speeds, min_rows, align)
    g = result.granularity
    limit = math.ceil(cap * total / g - 1e-9) * g
    assert max(result.sizes) <= limit, (limit, result)


def test_cap_moves_the_excess_to_the_others_in_proportion():
    result = balance(3000, [10.0, 1.0, 2.0], min_rows=1, cap=0.4)
    assert result.sizes == (1200, 600, 1200)
    assert result.notes == ("rank 0 capped at 40%: 1200 of 3000 rows",)
    # Capping is iterative: once rank 0 is capped, rank 2 would exceed the cap too.
    result = balance(1000, [10.0, 1.0, 9.0], min_rows=1, cap=0.4)
    assert result.sizes == (400, 200, 400)
    with pytest.raises(ValueError, match=r"cap 0\.3 is infeasible: 3 ranks"):
        balance(1000, [1.0, 1.0, 1.0], cap=0.3)
    with pytest.raises(ValueError, match=r"cap 0\.5 is infeasible: 1 ranks"):
        balance(1000, [1.0, 0.0], cap=0.5)


def test_examples_in_words():
    # The emulated heterogeneous machine: two ranks on one core, one alone.
    result = balance(4096, [41.0, 41.0, 85.0])
    assert result.sizes == (1024, 1024, 2048) and result.granularity == 512
    assert result.notes == ()
    result = balance(300, [41.0, 41.0, 85.0])
    assert sum(result.sizes) == 300 and result.granularity == 1
    assert result.notes == ("total 300 < 512 rows x 3 ranks: granularity lowered to 1",)
    result = balance(4096, [4, 4, 4], align=128, min_rows=1)
    assert result.sizes == (1408, 1408, 1280)
    assert "rows per rank: 1408, 1408, 1280" in result.describe()


def test_slow_tail_ranks_are_left_empty_rather_than_take_the_remainder():
    # Rank 2's share is 50 rows; the remainder (272) lands on rank 1 instead.
    result = balance(10_000, [100.0, 100.0, 1.0])
    assert result.sizes == (5120, 4880, 0)
    assert result.imbalance < 0.05
    assert any("ranks [2] left empty" in n for n in result.notes)


def test_noisy_speeds_fall_back_to_an_even_split():
    result = balance(3000, [41.0, 41.0, 85.0], min_rows=1, spread=[0.01, 0.02, 0.35])
    assert result.sizes == (1000, 1000, 1000)
    assert result.notes == ("speeds too noisy (rank 2 CV 0.35 > 0.2): even split",)
    # At or under the threshold, or with the check off, the speeds are used.
    assert balance(3000, [1, 1, 2], min_rows=1, spread=[0.2, 0, 0]).sizes == (750, 750, 1500)
    assert balance(3000, [1, 1, 2], min_rows=1, spread=[0.9, 0, 0], noise_threshold=None).sizes == (
        750,
        750,
        1500,
    )
    # Zero-speed ranks stay empty in the even split.
    assert balance(3000, [1, 0, 2], min_rows=1, spread=[0.5, 0, 0]).sizes == (1500, 0, 1500)


@settings(max_examples=200, deadline=None)
@given(problems(), st.lists(st.floats(0, 1), min_size=6, max_size=6))
def test_noise_fallback_is_even_over_ranks_with_speed(problem, spread):
    total, speeds, min_rows, align = problem
    spread = spread[: len(speeds)]
    result = balance(total, speeds, min_rows=min_rows, align=align, spread=spread)
    _check_structure(result, total, speeds, min_rows, align)
    noisy = any(c > 0.2 for c, s in zip(spread, speeds) if s > 0)
    assert noisy == any("too noisy" in n for n in result.notes)
    if noisy:
        even = balance(total, [1.0 if s else 0.0 for s in speeds], min_rows=min_rows, align=align)
        assert result.sizes == even.sizes


def test_predicted_seconds_and_imbalance_units():
    # 2 * K * N flops per row of A for C = A @ B with B of K x N.
    k = n = 1000
    result = balance(3000, [100.0, 200.0], min_rows=1, flops_per_row=2 * k * n)
    assert result.sizes == (1000, 2000)
    assert result.predicted_seconds == pytest.approx((0.02, 0.02))
    assert result.imbalance == pytest.approx(0.0, abs=1e-12)
    result = balance(3000, [100.0, 200.0], min_rows=1000)
    assert result.sizes == (1000, 2000)
    assert balance(0, [1.0, 2.0]).imbalance == 0.0
    assert balance(0, [1.0, 2.0]).sizes == (0, 0)


def test_accepts_a_speed_profile():
    from osmm_jax._src.tuning.speeds import SpeedProfile

    profile = SpeedProfile([41.0, 41.0, 85.0], [0.01, 0.5, 0.0], "measured")
    assert balance(3000, profile, min_rows=1).sizes == (1000, 1000, 1000)
    assert balance(3000, profile, min_rows=1, spread=[0, 0, 0]).sizes[2] > 1000


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"total": -1}, ValueError, "total must be at least 0"),
        ({"total": 2.5}, TypeError, "total must be an integer"),
        ({"total": True}, TypeError, "total must be an integer"),
        ({"speeds": []}, ValueError, "speeds is empty"),
        ({"speeds": [0, 0]}, ValueError, "all zero"),
        ({"speeds": [1, -1]}, ValueError, r"speeds\[1\] is -1.0: speeds must be non-negative"),
        ({"speeds": [1, float("nan")]}, ValueError, r"speeds\[1\] is nan: speeds must be finite"),
        ({"speeds": [1, float("inf")]}, ValueError, "must be finite"),
        ({"speeds": [1, "fast"]}, TypeError, r"speeds\[1\] must be a number"),
        ({"speeds": "12"}, TypeError, "speeds must be a sequence"),
        ({"min_rows": 0}, ValueError, "min_rows must be at least 1"),
        ({"align": 0}, ValueError, "align must be at least 1"),
        ({"align": 1.5}, TypeError, "align must be an integer"),
        ({"cap": 0}, ValueError, r"cap must be in \(0, 1\]"),
        ({"cap": 1.5}, ValueError, r"cap must be in \(0, 1\]"),
        ({"cap": "half"}, TypeError, "cap must be a number"),
        ({"spread": [0.1]}, ValueError, "spread has 1 values but speeds has 2"),
        ({"spread": [0.1, -0.1]}, ValueError, "spread must be non-negative"),
        ({"noise_threshold": -1}, ValueError, "noise_threshold must be at least 0"),
        ({"flops_per_row": 0}, ValueError, "flops_per_row must be finite and > 0"),
    ],
)
def test_validation_names_the_problem(kwargs, error, match):
    args = {"total": 100, "speeds": [1.0, 2.0], **kwargs}
    total, speeds = args.pop("total"), args.pop("speeds")
    with pytest.raises(error, match=match):
        balance(total, speeds, **args)


def test_a_balance_is_the_sequence_of_its_sizes():
    from osmm_jax._src.planning.layout import Layout

    result = balance(1000, [1.0, 1.0, 2.0], min_rows=8)
    assert len(result) == 3
    assert list(result) == list(result.sizes)
    assert result[2] == result.sizes[2] and result[-1] == result.sizes[-1]
    assert tuple(result) == result.sizes
    layout = Layout.rows((1000, 16), sizes=result)
    assert [layout.local_shape(r)[0] for r in range(3)] == list(result.sizes)
    grid = Layout.grid((1000, 40), (3, 1), row_sizes=result)
    assert [grid.local_shape(r)[0] for r in range(3)] == list(result.sizes)
    assert result.describe().startswith("rows per rank")  # the extra fields stay


# -- the steps of balance(), one at a time -------------------------------------------------


def test_unpack_profile_prefers_an_explicit_spread():
    from osmm_jax._src.planning.balance import _unpack_profile
    from osmm_jax._src.tuning.speeds import SpeedProfile

    profile = SpeedProfile([1.0, 2.0], [0.1, 0.2], "measured")
    speeds, spread = _unpack_profile(profile, None)
    assert list(speeds) == [1.0, 2.0] and list(spread) == [0.1, 0.2]
    assert _unpack_profile(profile, [0.0, 0.0])[1] == [0.0, 0.0]
    assert _unpack_profile([3.0], None) == ([3.0], None)


def test_checked_spread_and_cap():
    from osmm_jax._src.planning.balance import _checked_cap, _checked_spread

    assert _checked_spread(None, 3) is None
    assert _checked_spread([0, 0.5], 2) == (0.0, 0.5)
    with pytest.raises(ValueError, match="spread has 1 values but speeds has 2"):
        _checked_spread([0.1], 2)
    assert _checked_cap(None, 1) is None
    assert _checked_cap(0.5, 2) == 0.5
    with pytest.raises(ValueError, match="cap must be in"):
        _checked_cap(1.5, 2)
    with pytest.raises(ValueError, match="must be at least 0.3333"):
        _checked_cap(0.3, 3)


def test_trusted_weights_are_the_speeds_unless_a_rank_with_speed_is_noisy():
    from osmm_jax._src.planning.balance import _trusted_weights

    speeds = (0.0, 1.0, 3.0)
    assert _trusted_weights(speeds, None, 0.2) == ([0.0, 1.0, 3.0], [])
    assert _trusted_weights(speeds, (0.9, 0.1, 0.1), None) == ([0.0, 1.0, 3.0], [])
    assert _trusted_weights(speeds, (0.9, 0.1, 0.1), 0.2) == ([0.0, 1.0, 3.0], [])  # rank 0 idle
    weights, notes = _trusted_weights(speeds, (0.0, 0.1, 0.3), 0.2)
    assert weights == [0.0, 1.0, 1.0]
    assert notes == ["speeds too noisy (rank 2 CV 0.30 > 0.2): even split"]


def test_granularity_is_lowered_to_align_when_rows_are_few():
    from osmm_jax._src.planning.balance import _granularity

    assert _granularity(1000, 100, 8, 2) == (200, [])
    assert _granularity(399, 100, 8, 2) == (
        8,
        ["total 399 < 200 rows x 2 ranks: granularity lowered to 8"],
    )
    assert _granularity(10, 4, 8, 3) == (8, [])  # already align: nothing to lower


def test_best_split_puts_the_remainder_before_a_slow_tail():
    from osmm_jax._src.planning.balance import _best_split, _split_notes

    last, sizes, capped = _best_split(1005, [100.0, 100.0, 0.01], 10, [0, 1, 2], None)
    assert (last, sizes, capped) == (1, [500, 505, 0], [])
    notes = _split_notes(1005, 10, [0, 1, 2], last, sizes, capped, None)
    assert notes == [
        "ranks [2] left empty (their shares are below the granularity): rank 1 takes the remainder of 5 rows"
    ]
    last, sizes, capped = _best_split(1000, [1.0, 3.0], 10, [0, 1], 0.6)
    assert (last, sizes, capped) == (1, [400, 600], [1])
    assert _split_notes(1000, 10, [0, 1], last, sizes, capped, 0.6) == [
        "rank 1 capped at 60%: 600 of 1000 rows"
    ]


def test_predicted_times_in_seconds():
    from osmm_jax._src.planning.balance import _predicted_times

    seconds, imbalance = _predicted_times([100, 300, 0], [1.0, 2.0, 1.0], 400, 2e9)
    assert seconds == pytest.approx([200.0, 300.0, 0.0])
    assert imbalance == pytest.approx(300.0 / 200.0 - 1)  # ideal 400 * 2 / 4 = 200 s
    assert _predicted_times([0, 0], [1.0, 1.0], 0, 1.0) == ([0.0, 0.0], 0.0)


# -- memory budgets ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(problems(), st.lists(st.integers(0, 3000), min_size=6, max_size=6), st.booleans())
def test_a_memory_budget_is_never_exceeded_and_binds_only_where_it_must(problem, rooms, cap):
    total, speeds, min_rows, align = problem
    total = min(total, 8000)
    bytes_per_row = 16.0
    budgets = [math.inf if r == 3000 else (r + 0.5) * bytes_per_row for r in rooms[: len(speeds)]]
    kwargs = {"min_rows": min_rows, "align": align, "cap": 1.0 if cap else None}
    try:
        result = balance(
            total, speeds, memory_budget=budgets, bytes_per_row=bytes_per_row, **kwargs
        )
    except ValueError as error:
        assert "do not fit the memory budgets" in str(error)
        room = [total if r == 3000 else min(total, r) for r in rooms[: len(speeds)]]
        held = sum(n for n, s in zip(room, speeds) if s > 0)
        # Refused only when whole units of the granularity (and the remainder) cannot fit.
        assert held < total + math.lcm(min_rows, align) * len(speeds)
        return
    assert sum(result.sizes) == total
    for r, n in enumerate(result.sizes):
        assert n * bytes_per_row <= budgets[r]
        assert n == 0 or speeds[r] > 0
    if all(b == math.inf for b in budgets):
        assert result.sizes == balance(total, speeds, **kwargs).sizes


def test_a_budget_holds_a_fast_rank_below_its_share_and_the_rest_goes_by_speed():
    budgets = [math.inf, math.inf, 300 * 100, math.inf]
    result = balance(1200, [1, 1, 4, 2], min_rows=1, memory_budget=budgets, bytes_per_row=100)
    assert result.sizes == (225, 225, 300, 450)
    assert result.notes == (
        "rank 2 held to 300 rows by its memory budget (room for 300; its speed share is 600.0)",
    )
    assert result.held_by_memory == (2,)
    # A budget with room to spare changes nothing; fixed bytes count against the budget.
    plain = balance(1200, [1, 1, 4, 2], min_rows=1)
    roomy = balance(1200, [1, 1, 4, 2], min_rows=1, memory_budget=1e9, bytes_per_row=100)
    assert roomy.sizes == plain.sizes and roomy.notes == () and roomy.held_by_memory == ()
    fixed = balance(
        1200,
        [1, 1, 4, 2],
        min_rows=1,
        memory_budget=budgets,
        bytes_per_row=100,
        fixed_bytes=[0, 0, 100 * 100, 0],
    )
    assert fixed.sizes[2] == 200


def test_a_rank_whose_budget_holds_no_unit_gets_no_rows():
    result = balance(
        4096, [1, 1, 2], min_rows=512, memory_budget=[1e9, 1e9, 511 * 8], bytes_per_row=8
    )
    assert result.sizes[2] == 0 and sum(result.sizes) == 4096
    assert "rank 2 held to 0 rows by its memory budget" in result.describe()


def test_an_infeasible_budget_names_the_rank_its_need_and_what_it_has():
    with pytest.raises(ValueError) as error:
        balance(1000, [1, 1, 2], min_rows=8, memory_budget=[3e4, 3e4, 3e4], bytes_per_row=100)
    assert str(error.value) == (
        "1000 rows do not fit the memory budgets: rank 2 would need 48.8 KiB for its speed "
        "share of 500 rows but has 29.3 KiB; all ranks together hold at most 900 rows at "
        "100 B per row (raise the budgets, lower the bytes per row, or use more ranks)"
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"memory_budget": 1e9}, ValueError, "memory_budget needs bytes_per_row"),
        ({"bytes_per_row": 8}, ValueError, "bytes_per_row is only used with memory_budget"),
        ({"memory_budget": [1e9], "bytes_per_row": 8}, ValueError, "has 1 budgets but there are 2"),
        ({"memory_budget": 1e9, "bytes_per_row": 0}, ValueError, "bytes_per_row must be finite"),
        ({"memory_budget": 0, "bytes_per_row": 8}, ValueError, "memory_budget must be finite"),
    ],
)
def test_memory_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        balance(100, [1, 1], **kwargs)
