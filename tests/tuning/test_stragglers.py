"""The straggler rules on their own: relative times, the robust spread, majority votes, and
noise that must move nothing."""

from __future__ import annotations

import inspect
import random

import pytest

from osmm_jax._src.tuning.rebalance import Rebalancer
from osmm_jax._src.tuning.stragglers import StragglerRules, relative_times, robust_spread


def test_relative_times_cancel_a_slowdown_of_the_whole_machine():
    base = {0: 1.0, 1: 2.0, 2: 4.0}
    assert relative_times((3.0, 6.0, 12.0), base, ALL) == {0: 1.0, 1: 1.0, 2: 1.0}
    alone = relative_times((1.0, 2.0, 8.0), base, ALL)
    assert alone == pytest.approx({0: 2 / 3, 1: 2 / 3, 2: 2.0})
    assert relative_times((2.0, 1.0), {0: 1.0, 1: 1.0}, [0, 1]) == {0: 2.0, 1: 0.5}


def test_robust_spread_ignores_outliers():
    assert robust_spread([1.0]) == 0.0
    assert robust_spread([1.0] * 9 + [50.0]) == 0.0
    assert robust_spread([0.9, 1.0, 1.1]) == pytest.approx(1.4826 * 0.1)


EVEN, ALL = (100, 100, 100), [0, 1, 2]  # rows per rank, the ranks that have rows


def _rules(**kwargs):
    settings = {"window": 10, "sigma": 2.5, "tolerance": 0.1, "confirm": 3}
    settings["sudden"] = 1.5
    return StragglerRules(**{**settings, **kwargs})


def test_a_slowdown_counts_in_two_of_three_steps_even_with_a_fast_step_between():
    rules = _rules(confirm=2)
    for _ in range(5):  # 3 steps of baseline, then the 2 whose votes count beside a new one's
        assert rules.flag((1.0, 1.0, 1.0), EVEN, ALL) == {}
    assert rules.flag((1.0, 1.0, 2.0), EVEN, ALL) == {}  # one vote
    assert rules.flag((1.0, 1.0, 1.0), EVEN, ALL) == {}  # a fast step: still one of three
    flagged = rules.flag((1.0, 1.0, 2.2), EVEN, ALL)
    assert list(flagged) == [2]
    assert flagged[2][0] == pytest.approx(2.1)  # the median of its slow steps
    assert "slow in 2 of the last 3 steps" in flagged[2][1]


def test_a_slowdown_of_every_rank_flags_nobody():
    rules = _rules()
    for _ in range(4):
        rules.flag((1.0, 1.0, 1.0), EVEN, ALL)
    for _ in range(3):
        assert rules.flag((2.0, 2.1, 1.9), EVEN, ALL) == {}


def test_a_noisy_window_needs_a_clearer_slowdown():
    """1.6x stands out of a steady window (above ``sudden``) but not of one whose relative
    times spread by +-30 %."""
    rng = random.Random(1)
    noisy = _rules(window=20)
    for _ in range(12):
        noisy.flag(tuple(1.0 + rng.uniform(-0.3, 0.3) for _ in range(3)), EVEN, ALL)
    for _ in range(3):
        assert noisy.flag((1.0, 1.0, 1.6), EVEN, ALL) == {}  # within the window's own noise
    quiet = _rules(window=20)
    for _ in range(12):
        quiet.flag((1.0, 1.0, 1.0), EVEN, ALL)
    for _ in range(2):
        assert quiet.flag((1.0, 1.0, 1.6), EVEN, ALL) == {}
    assert list(quiet.flag((1.0, 1.0, 1.6), EVEN, ALL)) == [2]


def _default_rules():
    """The rules with the Rebalancer's default settings."""
    defaults = inspect.signature(Rebalancer).parameters
    return StragglerRules(
        **{name: defaults[name].default for name in ("window", "sigma", "tolerance", "confirm")},
        sudden=defaults["sudden"].default,
    )


def test_heavy_tailed_noise_flags_nobody_and_a_2x_slowdown_is_caught_within_10_steps():
    """Times with the noise of ranks that outnumber cores: within +-20 %, and one step in ten
    2-10x longer on a random rank. Over 100 seeded runs with the default settings, at most 3
    flag a rank before the slowdown (four spikes on one rank within seven steps look like a
    slowdown; none did when this was written), and the 2x slowdown is caught within 10 steps
    in at least 95 (within 5, by the sudden rule, in 90; all 100 and 94 when written)."""
    caught, false = [], []
    for seed in range(100):
        rng = random.Random(seed)
        rules = _default_rules()
        for step in range(40):
            times = [rng.uniform(0.8, 1.2) for _ in range(3)]
            if rng.random() < 1 / 10:
                times[rng.randrange(3)] *= rng.uniform(2, 10)
            if step >= 20:
                times[2] *= 2
            flagged = rules.flag(tuple(times), EVEN, ALL)
            if flagged:
                if step >= 20 and list(flagged) == [2]:
                    caught.append(step - 20)
                else:
                    false.append((seed, step, flagged))
                break
    assert len(false) <= 3, false
    assert sum(1 for delay in caught if delay <= 5) >= 90, caught
    assert sum(1 for delay in caught if delay <= 10) >= 95, caught


def test_a_rank_slow_over_the_whole_window_is_persistent_a_noisy_median_is_not():
    rules = _rules(window=5)
    for _step in range(5):
        flagged = rules.flag((1.0, 1.0, 1.5), EVEN, ALL)
    assert list(flagged) == [2] and "median" in flagged[2][1]
    rng = random.Random(3)
    rules = _rules(window=5)
    for _ in range(5):
        flagged = rules.flag(tuple(rng.uniform(0.5, 1.5) for _ in range(3)), EVEN, ALL)
    assert flagged == {}


@pytest.mark.parametrize("slow, flagged_at", [(1.6, 10), (1.2, 20), (1.05, None)])
def test_a_large_imbalance_counts_in_one_window_a_small_one_in_two_running(slow, flagged_at):
    """Even rows, the last rank ``slow`` times slower from the start: ``slow * (2 + 1 / slow)
    / 3`` times a balanced step (1.4, over ``1 + 3 * tolerance``, for 1.6; 1.13, over ``1 +
    tolerance`` only, for 1.2; 1.03 for 1.05)."""
    rules = _rules()
    first = None
    for step in range(1, 31):
        if rules.flag((1.0, 1.0, slow), EVEN, ALL) and first is None:
            first = step
    assert first == flagged_at
