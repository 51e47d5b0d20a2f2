"""Rebalancer without MPI: the times of all ranks come from an injected exchange."""

from __future__ import annotations

import math
import random

import pytest

from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.tuning.rebalance import Rebalancer, _shrink_targets


class Cluster:
    """Simulated ranks: a step on rank r takes rows[r] / speed[r] seconds, times (1 + jitter)."""

    def __init__(self, speeds, jitter=0.0, seed=0):
        self.speeds = list(speeds)
        self.jitter = jitter
        self.random = random.Random(seed)
        self.exchanges = 0
        self.times = None

    def exchange(self, local_seconds):
        self.exchanges += 1
        return list(self.times)

    def step(self, rb: Rebalancer) -> bool:
        self.times = [
            rows / (1000.0 * s) * (1 + self.random.uniform(-self.jitter, self.jitter))
            for rows, s in zip(rb.sizes, self.speeds)
        ]
        return rb.observe(0.0)


def _make(total=4096, speeds=(1.0,) * 4, cluster_speeds=None, **kwargs):
    cluster = Cluster(cluster_speeds or speeds, jitter=kwargs.pop("jitter", 0.0))
    return Rebalancer(total, speeds, exchange=cluster.exchange, **kwargs), cluster


def _check_quantised(sizes, total, quantum):
    assert sum(sizes) == total
    nonempty = [r for r, s in enumerate(sizes) if s]
    for r in nonempty[:-1]:
        assert sizes[r] % quantum == 0, sizes


def test_initial_sizes_follow_the_speeds_in_quanta():
    rb, _ = _make(total=4096 + 10, speeds=(1.0, 3.0, 0.0, 4.0))
    assert rb.sizes == (512, 1536, 0, 2058)
    _check_quantised(rb.sizes, 4106, 64)
    assert rb.row_slice(1) == slice(512, 2048)
    assert rb.variants == 1 and rb.rebalances == 0 and rb.recompiles == 0


@pytest.mark.parametrize("start", [1, 3, 5, 20])
def test_a_slowed_rank_is_caught_within_a_window_and_loses_a_fifth(start):
    rb, cluster = _make(window=10)
    for step in range(start + 10 + 1):
        if step == start:
            cluster.speeds[3] = 1.0 / 3
        if cluster.step(rb):
            break
    else:
        pytest.fail("the slow rank was never caught")
    assert step - start <= 10  # the window; the step the slowdown began counts as 0
    assert rb.stragglers == (3,)
    assert 0.15 <= 1 - rb.sizes[3] / 1024 <= 0.25
    assert all(rb.sizes[r] > 1024 for r in range(3))
    _check_quantised(rb.sizes, 4096, 64)
    assert rb.rebalances == 1 and rb.variants == 2
    assert "rank 3" in rb.last_event


def test_a_sudden_slowdown_is_caught_on_its_fourth_step():
    rb, cluster = _make()
    # Warm-up, then 3 steps of baseline and the 6 before a vote whose votes count beside it.
    for _ in range(10):
        assert not cluster.step(rb)
    cluster.speeds[2] = 0.5
    for _ in range(3):
        assert not cluster.step(rb)  # stands out once, twice, three times
    assert cluster.step(rb)  # four times of the last four (of seven): a straggler
    assert rb.stragglers == (2,)
    assert rb.sizes == (1088, 1088, 832, 1088)
    assert "2.00x its usual" in rb.last_event and "slow in 4 of the last 7 steps" in rb.last_event


def test_a_slowdown_does_not_raise_its_own_bar():
    """Rank 1 slows down by 1.5x and 1.3x on alternate steps: only every other step stands out
    (limit 1.4x), so its fourth vote comes on its seventh slow step. Its slow steps stay out of
    the baseline they are judged against; were they in it, after five of them they would be
    its usual time and its later steps would stand out no more, leaving it to the persistent
    rule's next look (its 10th slow step)."""
    rb, cluster = _make()
    for _ in range(11):  # warm-up, then 10 steady steps (the persistent rule looks at the 10th)
        assert not cluster.step(rb)
    for slow_step in range(1, 8):
        cluster.speeds[1] = 1 / 1.5 if slow_step % 2 else 1 / 1.3
        changed = cluster.step(rb)
        assert changed == (slow_step == 7), slow_step
    assert rb.stragglers == (1,) and "slow in 4 of the last 7 steps" in rb.last_event


def test_sizes_change_no_more_often_than_the_rules_allow():
    """After a change the window restarts: a warm-up step, then ``window`` steps (the
    persistent rule) or ``3 * confirm + 1`` (the sudden rule's baseline and votes)."""
    for window, confirm in ((10, 4), (4, 2), (20, 1)):
        rb, cluster = _make(window=window, confirm=confirm, jitter=0.05)
        changed = []
        for step in range(400):
            if step % 7 == 0:
                cluster.speeds = [cluster.random.choice([0.3, 1.0, 3.0]) for _ in range(4)]
            if cluster.step(rb):
                changed.append(step)
        gaps = [b - a for a, b in zip(changed, changed[1:])]
        assert len(changed) > 10 and min(gaps) >= 1 + min(window, 3 * confirm + 1), gaps


def test_confirm_1_acts_on_a_single_slow_step():
    rb, cluster = _make(confirm=1)
    for _ in range(4):
        assert not cluster.step(rb)
    cluster.speeds[2] = 0.5
    assert cluster.step(rb)
    assert rb.stragglers == (2,)


def test_single_slow_steps_move_nothing():
    # Every 4th step one rank (a different one each time) takes 3x as long.
    rb, cluster = _make(window=10)
    for step in range(200):
        cluster.speeds = [1.0] * 4
        if step % 4 == 3:
            cluster.speeds[step // 4 % 4] = 1.0 / 3
        assert not cluster.step(rb)
    assert rb.rebalances == 0


def test_a_persistent_imbalance_moves_rows_to_the_fast_rank():
    # Even start, ranks 0 and 1 half as fast as rank 2 (as two ranks sharing one core).
    rb, cluster = _make(
        total=3072, speeds=(1.0, 1.0, 1.0), cluster_speeds=(1.0, 1.0, 2.0), window=5
    )
    changed_at = [s for s in range(11) if cluster.step(rb)]
    # Warm-up, then two full windows: 1.33x a balanced step is over 1 + tolerance, not over
    # the 1 + 3 * tolerance that one window needs.
    assert changed_at == [10]
    assert rb.stragglers == (0, 1)
    assert rb.sizes == (832, 832, 1408)
    for _ in range(30):
        cluster.step(rb)
    times = [rows / s for rows, s in zip(rb.sizes, cluster.speeds)]
    assert max(times) / min(times) < 1.25


def test_an_imbalance_quanta_cannot_fix_moves_nothing():
    # 13 quanta over 4 equal ranks: one rank always holds 4. Moving it elsewhere gains nothing.
    rb, cluster = _make(total=13 * 64, window=3)
    assert sorted(rb.sizes) == [192, 192, 192, 256]
    for _ in range(60):
        assert not cluster.step(rb)
    assert rb.rebalances == 0


def test_nothing_moves_under_equal_times_or_small_jitter():
    for jitter in (0.0, 0.03):
        rb, cluster = _make(jitter=jitter, window=5)
        for _ in range(300):
            assert not cluster.step(rb)
        assert rb.sizes == (1024,) * 4 and rb.rebalances == 0 and rb.variants == 1


def test_a_whole_machine_slowdown_moves_nothing():
    rb, cluster = _make()
    for _ in range(4):
        cluster.step(rb)
    cluster.speeds = [0.25] * 4
    assert not cluster.step(rb)
    assert rb.sizes == (1024,) * 4


def test_rows_taken_from_a_straggler_go_first_to_the_ranks_below_a_balanced_step():
    # 4 ranks at 1000 rows/s; rank 0 slow (1.3 s for 1000 rows); ranks 2 and 3 above the
    # balanced time (0.93 s) but not stragglers, rank 1 below it: it takes every row rank 0
    # gives away.
    sizes = (1000, 500, 1000, 1000)
    seconds = {0: 1.3, 1: 0.5, 2: 1.0, 3: 1.0}
    speed = {r: sizes[r] / seconds[r] for r in range(4)}
    targets, shrinking = _shrink_targets(sizes, seconds, speed, {0: None}, 0.2)
    assert shrinking == (0,)
    assert targets[0] == pytest.approx(800) and targets[1] == pytest.approx(700)
    assert targets[2:] == [1000.0, 1000.0]
    # Several ranks below it: in proportion to the rows each lacks.
    sizes, seconds = (1000, 800, 900, 1000), {0: 2.0, 1: 0.8, 2: 0.9, 3: 1.0}
    speed = {r: sizes[r] / seconds[r] for r in range(4)}  # 500, then 1000 rows/s
    targets, _ = _shrink_targets(sizes, seconds, speed, {0: None}, 0.2)
    balanced = 3700 / 3500  # seconds
    lacking = [balanced * 1000 - rows for rows in sizes[1:]]  # 257, 157 and 57 rows
    for r in (1, 2, 3):
        assert targets[r] - sizes[r] == pytest.approx(200 * lacking[r - 1] / sum(lacking))
    assert targets[0] == pytest.approx(800) and sum(targets) == pytest.approx(3700)


def test_a_recovered_rank_wins_rows_back_and_sizes_settle():
    rb, cluster = _make(window=4)
    for _ in range(4):
        cluster.step(rb)
    cluster.speeds[1] = 0.4
    for _ in range(20):
        cluster.step(rb)
    assert rb.sizes[1] < 1024
    cluster.speeds[1] = 1.0
    for _ in range(10):
        cluster.step(rb)
    # The rows go back to the recovered rank, none to one already at a balanced step's time,
    # until the slowest rank is within the tolerance (0.15) of a balanced step.
    assert rb.sizes == (1024, 896, 1024, 1152)
    before = rb.rebalances
    for _ in range(40):
        assert not cluster.step(rb)
    assert rb.rebalances == before


def test_sizes_always_sum_to_the_total_and_stay_quantised():
    rng = random.Random(7)
    for total, quantum, nranks in [(1000, 64, 3), (4096, 32, 4), (777, 16, 5), (130, 64, 2)]:
        rb, cluster = _make(total=total, speeds=(1.0,) * nranks, quantum=quantum, window=3)
        for step in range(120):
            if step % 9 == 0:
                cluster.speeds = [rng.choice([0.3, 1.0, 2.0]) for _ in range(nranks)]
            cluster.step(rb)
            _check_quantised(rb.sizes, total, quantum)
            assert all(s >= min(quantum, total // nranks // quantum * quantum) for s in rb.sizes)


def test_min_rows_keeps_a_straggler_measurable():
    rb, cluster = _make(total=1024, speeds=(1.0, 1.0), min_rows=256, window=3)
    cluster.speeds[0] = 0.01
    for _ in range(100):
        cluster.step(rb)
    assert rb.sizes == (256, 768)


def test_the_plan_cache_is_a_bounded_lru():
    rb, cluster = _make(max_variants=2, window=3)
    plan = rb.plan(32, 16)
    assert isinstance(plan, Plan) and rb.plan(32, 16) is plan and rb.recompiles == 1
    assert plan.a.shape == (4096, 32) and plan.b.is_replicated
    assert [r1 - r0 for (r0, r1), _ in plan.a.blocks] == list(rb.sizes)
    assert rb.layouts(32, 16) == (plan.a, plan.b, plan.c)
    seen = {rb.sizes}
    for slow in (3, 0, 2, 1):
        cluster.speeds = [1.0] * 4
        cluster.speeds[slow] = 0.3
        for _ in range(4):
            if cluster.step(rb):
                seen.add(rb.sizes)
                rb.plan(32, 16)
    assert rb.variants == len(seen) >= 4
    assert len(rb.cached_variants) == 2 and rb.cached_variants[-1] == rb.sizes
    assert rb.recompiles == rb.variants
    assert rb.plan(32, 16) is rb.plan(32, 16) and rb.recompiles == rb.variants


def test_one_exchange_per_observation_and_counters():
    rb, cluster = _make(window=3)
    for _ in range(10):
        cluster.step(rb)
    assert cluster.exchanges == 10 and rb.steps == 10


def test_one_rank_never_moves():
    rb, cluster = _make(total=500, speeds=(2.0,))
    for step in range(30):
        cluster.speeds = [2.0 if step % 5 else 0.1]
        assert not cluster.step(rb)
    assert rb.sizes == (500,)


def test_every_rank_sees_the_same_bad_time():
    rb, cluster = _make()
    cluster.times = [1.0, float("nan"), 1.0, -2.0]
    with pytest.raises(ValueError, match="rank 1: nan, rank 3: -2.0"):
        rb.observe(1.0)
    rb2 = Rebalancer(64, [1.0, 1.0], exchange=lambda t: [t])
    with pytest.raises(ValueError, match="returned 1 times for 2 ranks"):
        rb2.observe(1.0)


def test_row_slice_needs_a_rank_without_mpi():
    rb, _ = _make()
    with pytest.raises(ValueError, match="give the rank"):
        rb.row_slice()
    with pytest.raises(ValueError, match="out of range"):
        rb.row_slice(4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"total_rows": 0}, ValueError, "total_rows"),
        ({"speeds": []}, ValueError, "empty"),
        ({"speeds": [1.0, float("inf")]}, ValueError, "finite"),
        ({"speeds": [0.0, 0.0]}, ValueError, "all zero"),
        ({"window": 1}, ValueError, "window"),
        ({"sigma": -1.0}, ValueError, "sigma"),
        ({"shrink": 0.0}, ValueError, "shrink"),
        ({"shrink": 1.0}, ValueError, "shrink"),
        ({"quantum": 0}, ValueError, "quantum"),
        ({"max_variants": 0}, ValueError, "max_variants"),
        ({"min_rows": -1}, ValueError, "min_rows"),
        ({"tolerance": float("nan")}, ValueError, "tolerance"),
        ({"confirm": 0}, ValueError, "confirm"),
        ({"nranks": 3}, ValueError, "3 ranks"),
        ({"exchange": 5}, TypeError, "callable"),
        ({"comm": object()}, ValueError, "not both"),
    ],
)
def test_errors(kwargs, error, match):
    args = {"total_rows": 256, "speeds": [1.0, 1.0], "exchange": lambda t: [t, t]}
    args.update(kwargs)
    total, speeds = args.pop("total_rows"), args.pop("speeds")
    with pytest.raises(error, match=match):
        Rebalancer(total, speeds, **args)


# -- the pure steps, one at a time ------------------------------------------------------------


def test_min_units_rounds_min_rows_up_to_quanta():
    from osmm_jax._src.tuning.rebalance import _min_units

    assert _min_units(None, 64) == 1
    assert [_min_units(rows, 64) for rows in (0, 1, 64, 65)] == [0, 1, 1, 2]


def test_proportional_rows():
    from osmm_jax._src.tuning.rebalance import _proportional

    assert _proportional(100, (1.0, 0.0, 3.0)) == [25.0, 0.0, 75.0]


def test_step_times_are_checked_alike_on_every_rank():
    from osmm_jax._src.tuning.rebalance import _as_seconds, _checked_times

    assert _as_seconds("0.5") == 0.5 and math.isnan(_as_seconds(None))
    assert _checked_times([1, 0.5], 2) == (1.0, 0.5)
    with pytest.raises(ValueError, match="exchange returned 1 times for 2 ranks"):
        _checked_times([1.0], 2)
    with pytest.raises(ValueError, match=r"got rank 1: nan, rank 2: -1.0$"):
        _checked_times([1.0, math.nan, -1.0], 3)


def test_the_change_event():
    from osmm_jax._src.tuning.rebalance import _change_event

    event = _change_event(7, ["rank 1 slow", "rank 2 slow"], (64, 64, 64), (128, 32, 32))
    assert event == "step 7: rank 1 slow; rank 2 slow; sizes [64, 64, 64] -> [128, 32, 32]"


def test_a_memory_budget_holds_a_rank_below_its_speed_share_from_the_start():
    rb, _ = _make(
        1024, (1.0, 1.0, 2.0), quantum=64, memory_budget=[1e9, 1e9, 300 * 100], bytes_per_row=100
    )
    assert rb.sizes == (384, 384, 256)  # rank 2 holds 300 rows: 4 quanta; the rest by speed


def test_rows_taken_from_a_straggler_never_overfill_a_rank_short_of_memory():
    budget = [1e9, 1e9, 400 * 100, 1e9]
    rb, cluster = _make(
        2048, (1.0, 1.0, 1.0, 1.0), quantum=64, memory_budget=budget, bytes_per_row=100
    )
    assert rb.sizes == (576, 576, 384, 512)
    cluster.speeds = [0.25, 1.0, 4.0, 1.0]  # rank 0 slows down, rank 2 speeds up
    changes = [step for step in range(60) if cluster.step(rb)]
    assert changes and sum(rb.sizes) == 2048
    assert rb.sizes[0] < 576 and rb.sizes[2] <= 400
    assert rb.sizes[1] > 576 or rb.sizes[3] > 512


def test_rows_that_fit_no_budget_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"1024 rows do not fit the memory budgets: rank 2 would"):
        _make(1024, (1.0, 1.0, 2.0), memory_budget=[100 * 100] * 3, bytes_per_row=100)
    with pytest.raises(ValueError, match="memory_budget needs bytes_per_row"):
        _make(1024, (1.0, 1.0, 2.0), memory_budget=1e9)
    with pytest.raises(ValueError, match="has 2 budgets but there are 3 ranks"):
        _make(1024, (1.0, 1.0, 2.0), memory_budget=[1e9, 1e9], bytes_per_row=1)
