"""Telling a rank that slowed down from scheduling noise: the :class:`~.rebalance.Rebalancer`'s
straggler rules (docs/design.md, "Rebalancing while training").

Step times on a shared machine are heavy-tailed: a rank descheduled for a moment takes several
times its usual time once, and ranks that outnumber cores take turns. A slowdown worth moving
rows for is different in two ways: it lasts, and it is the rank's own, not the machine's. So
each rank's time is compared with *its own* baseline (its median over the window's steps
before the last few), divided by the same ratio of the other ranks (a machine-wide slowdown
cancels out), and a rank counts as a straggler when that relative time stands out in most of
the last few steps (a majority, not a run: one fast step amid slow ones does not reset the
count). Where the limit lies comes from the baseline's steps: a robust spread (median absolute
deviation) of their relative times, so that a noisy machine needs a clearer slowdown and a
quiet one a smaller. The steps being voted on are kept out of the baseline, so a slowdown
never raises its own bar (its slow steps would widen the spread and, after a few, become the
rank's usual time).

Pure Python, deterministic: every rank runs it on the same exchanged times.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from osmm_jax._src import checks

MIN_BASELINE_STEPS = 3
"""Steps the sudden rule's baseline must hold before it judges a step (so a ``window`` below
this many steps leaves the persistent rule alone)."""

MAD_SCALE = 1.4826
"""Median absolute deviation times this estimates a normal distribution's standard deviation."""

_TINY = 1e-12  # seconds; a time of 0 (a coarse clock) must not divide by zero


def relative_times(times, base, active) -> dict[int, float]:
    """Each rank of ``active``'s time over its ``base`` (seconds), divided by the median of the
    other active ranks' same ratio: about 1 in a steady run, 2 for a rank that alone slowed
    down 2x, still about 1 for every rank when the whole machine slowed down."""
    ratio = {r: times[r] / max(base[r], _TINY) for r in active}
    return {
        r: ratio[r] / max(statistics.median(ratio[o] for o in active if o != r), _TINY)
        for r in active
    }


def balanced_seconds(times, sizes, active) -> float:
    """A step's time with its rows split in proportion to each rank's speed that step
    (``sizes[r] / times[r]`` rows per second): all rows over all speeds."""
    speed = math.fsum(sizes[r] / max(times[r], _TINY) for r in active)
    return math.fsum(sizes[r] for r in active) / max(speed, _TINY)


def robust_spread(values) -> float:
    """A standard deviation that a few outliers do not inflate: the scaled median absolute
    deviation from the median (0 for fewer than two values)."""
    values = list(values)
    if len(values) < 2:
        return 0.0
    centre = statistics.median(values)
    return MAD_SCALE * statistics.median(abs(v - centre) for v in values)


class StragglerRules:
    """The window of step times since the last change of sizes, and who stands out in it.

    Every setting is checked here (a ValueError or TypeError naming it); ``settings`` holds
    them, checked, for the ranks to agree on.

    Args:
        window: steps a rule judges (>= 2): the persistent rule the last ``window``, the
            sudden rule up to ``window`` before the steps it votes on (it judges nothing with
            a window below :data:`MIN_BASELINE_STEPS`).
        sigma: robust standard deviations of the baseline's relative times: a step stands out
            above ``1 + sigma`` of them (and above ``sudden``), a median above ``sigma``
            standard errors of itself (and above its limit from ``tolerance``).
        tolerance: a persistent straggler's median is at least this fraction above a
            balanced step's time in two windows running, or three times it in one.
        confirm: a sudden straggler stands out in ``confirm`` of the last ``2 * confirm - 1``
            steps (1: a single step).
        sudden: the least relative time that stands out (> 1).
    """

    def __init__(self, window: int, sigma: float, tolerance: float, confirm: int, sudden: float):
        self._window = checks.integer(window, "window", 2)
        self._sigma = checks.at_least(sigma, "sigma", 0.0)
        self._tolerance = checks.at_least(tolerance, "tolerance", 0.0)
        self._confirm = checks.integer(confirm, "confirm", 1)
        self._sudden = checks.real(sudden, "sudden")
        if not self._sudden > 1:
            raise ValueError(f"sudden must be greater than 1, got {sudden!r}")
        self.settings = (self._window, self._sigma, self._tolerance, self._confirm, self._sudden)
        self._span = 2 * self._confirm - 1  # the steps whose votes count
        self.restart()

    def restart(self) -> None:
        """Forget every step (the sizes changed: old times say nothing about the new ones)."""
        # The window, and the votes' steps after it: the sudden rule's baseline is the window
        # before the steps it votes on, the persistent rule's the last ``window`` steps.
        self._history: deque[tuple[float, ...]] = deque(maxlen=self._window + self._span - 1)
        self._votes: deque[dict[int, tuple[float, str]]] = deque(maxlen=self._span)
        self._steps = 0
        self._suspects: set[int] = set()  # over 1 + tolerance at the last window's end

    def flag(self, times, sizes, active) -> dict[int, tuple[float, str]]:
        """This step's stragglers among ``active`` (ranks with rows, ``sizes[r]`` each), rank
        -> (seconds it is taken to need, why); records the step. Sudden stragglers first;
        each time the window has filled with new steps (every ``window`` steps), persistent
        ones are added (a rank flagged both ways keeps its sudden time). Judging each window's
        medians once, not at every step of a sliding window, keeps noise from getting many
        chances at the same steps."""
        standing_out = self._stand_out(times, active) if len(active) > 1 else {}
        self._votes.append(standing_out)
        flagged = {}
        for r in active:
            slow = [v[r] for v in self._votes if r in v]
            if len(slow) >= self._confirm:
                flagged[r] = (
                    statistics.median(t for t, _ in slow),
                    f"{slow[-1][1]}; slow in {len(slow)} of the last {len(self._votes)} steps",
                )
        self._history.append(tuple(times))
        self._steps += 1
        if self._steps % self._window == 0 and len(active) > 1:
            for r, found in self._persistent(sizes, active).items():
                flagged.setdefault(r, found)
        return flagged

    def medians(self, active) -> dict[int, float]:
        """Each active rank's median time over the window (seconds)."""
        return {r: statistics.median(step[r] for step in self._window_steps()) for r in active}

    def _window_steps(self) -> list[tuple[float, ...]]:
        """The last ``window`` steps."""
        return list(self._history)[-self._window :]

    def _stand_out(self, times, active) -> dict[int, tuple[float, str]]:
        """Ranks whose relative time this step exceeds the baseline's limit: rank -> (seconds,
        why). The baseline is the steps before the ``2 * confirm - 2`` whose votes still
        count beside this one's (at most ``window`` of them, at least
        :data:`MIN_BASELINE_STEPS`); medians and the median absolute deviation keep the few
        slow ones it may hold from moving it."""
        steps = list(self._history)
        baseline = steps[: max(len(steps) - (self._span - 1), 0)]
        if len(baseline) < MIN_BASELINE_STEPS:
            return {}
        base = {r: statistics.median(step[r] for step in baseline) for r in active}
        spread = robust_spread(
            q for step in baseline for q in relative_times(step, base, active).values()
        )
        limit = max(self._sudden, 1 + self._sigma * spread)
        now = relative_times(times, base, active)
        return {
            r: (
                times[r],
                f"rank {r} took {times[r]:.3g} s, {now[r]:.2f}x its usual {base[r]:.3g} s "
                f"against the others' (limit {limit:.2f}x over {len(baseline)} steps)",
            )
            for r in active
            if now[r] > limit
        }

    def _persistent(self, sizes, active) -> dict[int, tuple[float, str]]:
        """Ranks slower than a balanced split over the whole window: rank -> (median seconds,
        why). A rank's median time over the window against the balanced time of the medians
        (:func:`balanced_seconds`; medians, not each step's balanced time: noise lowers a
        step's balanced time below its typical one, the fastest rank that step setting the
        pace, which would make every rank look slow). The limit is ``sigma`` standard errors
        of the difference of two medians of that many steps (``sqrt(2) * 1.25 spread /
        sqrt(steps)``, the spread pooled over the ranks), and at least ``1 + 3 * tolerance``
        in one window or ``1 + tolerance`` in two windows running: ranks that outnumber cores
        take turns unevenly for a window's worth of steps, seldom for two."""
        medians = self.medians(active)
        balanced = balanced_seconds(medians, sizes, active)
        window = self._window_steps()
        n = len(window)
        spread = robust_spread(  # pooled: every rank sees the same machine's noise
            step[r] / max(medians[r], _TINY) for step in window for r in active
        )
        noise = self._sigma * math.sqrt(2) * 1.25 * spread / math.sqrt(n)
        suspects, self._suspects = self._suspects, set()
        found = {}
        for r in active:
            centre = medians[r] / max(balanced, _TINY)
            if centre <= 1 + max(self._tolerance, noise):
                continue
            self._suspects.add(r)
            windows = 2 if r in suspects else 1
            limit = 1 + max(self._tolerance * (1 if windows == 2 else 3), noise)
            if centre > limit:
                found[r] = (
                    medians[r],
                    f"rank {r}'s median {medians[r]:.3g} s is {centre:.2f}x a balanced step's "
                    f"(limit {limit:.2f}x over {n} steps, {windows} window(s) running)",
                )
        return found
