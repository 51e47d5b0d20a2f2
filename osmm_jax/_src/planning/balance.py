"""How many rows each rank should own so that all ranks finish together.

:func:`balance` splits ``total`` rows (of a row layout; columns work the same)
over ranks in proportion to their speeds, in whole multiples of a granularity
(whole cache lines, vector widths or tiles), optionally capping any rank's share,
and says what it did in plain words. Its sizes feed ``Layout.rows(shape,
sizes=...)``.

The granularity is ``lcm(min_rows, align)``. Every rank's size is a multiple of
it except the last rank with rows, which also takes the remainder ``total %
granularity``: so every block STARTS at a multiple of the granularity. That rank
is the last one with nonzero speed, unless the last ranks are so slow that their
shares are below one unit: then they may be left empty and the remainder put on
an earlier rank, whichever finishes sooner. When the rows are too few for the
granularity (``total < granularity * ranks with nonzero speed``), it is lowered
to ``align``.

Guarantee (no cap binding, no noise fallback): each rank's predicted time is
less than ``ideal + granularity * flops_per_row / speed_r``, so

    imbalance < granularity * sum(speeds) / (min(positive speeds) * total)

and the predicted imbalance is at most 5% whenever
``granularity * sum(speeds) / min(positive speeds) <= 0.05 * total``
(:func:`guarantees_balance`). For example 3 ranks at 41, 41 and 85 GFLOP/s with
granularity 512 need ``total >= 41_710`` rows; at granularity 8, 652 rows.

Pure Python and numpy: no JAX, no MPI; the result is identical on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from osmm_jax._src import checks
from osmm_jax._src.planning import memory

NOISE_THRESHOLD = 0.2
"""Default largest coefficient of variation of a rank's timings still trusted as a speed."""

GUARANTEED_IMBALANCE = 0.05
"""The predicted imbalance :func:`balance` stays within when :func:`guarantees_balance` holds."""

_EPS = 1e-9


@dataclass(frozen=True)
class Balance(Sequence):
    """The outcome of :func:`balance`; identical on every rank.

    It is also the sequence of its ``sizes``, so it can be passed wherever sizes
    are taken: ``Layout.rows(shape, sizes=osmm_jax.balance(n, speeds))``,
    ``len(b)``, ``b[r]``, ``list(b)``.

    Attributes:
        sizes: rows per rank, in rank order; non-negative, summing to ``total``.
        predicted_seconds: per rank, ``sizes[r] * flops_per_row / (speeds[r] * 1e9)``
            with speeds in GFLOP/s and ``flops_per_row`` in FLOP (for C = A @ B
            split by rows of A, ``2 * K * N``): seconds. With the default
            ``flops_per_row=1.0`` only their ratios mean anything. 0 for ranks
            with no rows.
        imbalance: ``(max(predicted_seconds) - ideal) / ideal``, where ``ideal =
            total * flops_per_row / (sum(speeds) * 1e9)`` is the time if work
            divided perfectly; 0 when ``total`` is 0.
        granularity: the unit every size is a multiple of (all but the
            remainder piece): ``lcm(min_rows, align)``, or ``align`` when lowered.
        notes: what was done beyond a plain proportional split, in words
            (granularity lowered, even split for noisy speeds, caps that bound, ranks held
            back by memory).
        held_by_memory: the ranks whose memory budget held them below their speed share
            (ascending; empty without a budget).
    """

    sizes: tuple[int, ...]
    predicted_seconds: tuple[float, ...]
    imbalance: float
    granularity: int
    notes: tuple[str, ...]
    held_by_memory: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index):
        return self.sizes[index]

    def __iter__(self):
        return iter(self.sizes)

    def describe(self) -> str:
        """A few readable lines: sizes, granularity, predicted imbalance, notes."""
        lines = [
            f"rows per rank: {', '.join(map(str, self.sizes))} (granularity {self.granularity}); "
            f"predicted imbalance {self.imbalance:.1%}"
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- the split ---------------------------------------------------------------------------


def guarantees_balance(total: int, speeds, granularity: int) -> bool:
    """Whether :func:`balance` promises predicted imbalance <= 5% at this granularity.

    True when ``granularity * sum(speeds) / min(positive speeds) <= 0.05 * total``
    (and trivially when ``total`` is 0). The promise holds when no cap binds and
    speeds are trusted (no even-split fallback).
    """
    positive = [float(s) for s in speeds if float(s) > 0]
    if total == 0:
        return True
    return granularity * math.fsum(positive) / min(positive) <= GUARANTEED_IMBALANCE * total


def water_fill(total: float, weights: list[float], limits: list[float]) -> tuple[list[float], set]:
    """Shares of ``total`` proportional to ``weights``, none above its limit, excess redistributed.

    Returns (shares, the ranks held at their limit). Ranks with weight 0 get 0.
    """
    shares = [0.0] * len(weights)
    free = {r for r, w in enumerate(weights) if w > 0}
    held: set[int] = set()
    remaining = float(total)
    while free:
        weight_sum = math.fsum(weights[r] for r in free)
        for r in free:
            shares[r] = remaining * weights[r] / weight_sum
        over = {r for r in free if shares[r] > limits[r] * (1 + _EPS)}
        if not over:
            break
        for r in over:
            shares[r] = limits[r]
            remaining -= limits[r]
        free -= over
        held |= over
    return shares, held


def _round_units(targets: list[float], units_total: int, room: list[int]) -> list[int]:
    """Whole units near ``targets`` summing to ``units_total``, none above ``room``.

    Largest remainder: floor every target, then one more unit each for the largest
    fractional parts (ties to the lower rank), never past a rank's room.
    """
    units = [min(math.floor(t + _EPS), c) for t, c in zip(targets, room)]
    order = sorted(range(len(targets)), key=lambda r: (-(targets[r] - units[r]), r))
    leftover = units_total - sum(units)
    while leftover > 0:  # normally one pass, over ranks with a fractional part
        progressed = False
        for r in order:
            if leftover and units[r] < room[r] and targets[r] > 0:
                units[r] += 1
                leftover -= 1
                progressed = True
        if not progressed:
            raise AssertionError("no rank has room for the remaining rows")  # excluded by checks
    for r in reversed(order):  # only after float round-off: take back from the smallest parts
        if leftover < 0 and units[r] > 0:
            units[r] -= 1
            leftover += 1
    return units


def _split(
    total: int,
    weights: list[float],
    granularity: int,
    last: int,
    cap: float | None,
    room: tuple[float, ...] | None = None,
) -> tuple[list[int], list[int]] | None:
    """Sizes proportional to ``weights``, whole units of ``granularity``, the remainder on ``last``,
    none above its ``room`` (rows its memory budget allows, per rank; None: no limits).

    Returns (sizes, the ranks a cap or their room holds at its limit); None when the rooms
    cannot take all rows this way.
    """
    nranks = len(weights)
    units_total, remainder = divmod(total, granularity)
    # Row limits: the cap rounded down to the granularity, or up where rounding down leaves
    # rows nobody may take (less for the remainder rank, whose size is whole units plus the
    # remainder); without a cap, nothing binds.
    limit_units = [units_total + 1] * nranks
    if cap is not None:
        exact = cap * total / granularity
        cap_units = math.floor(exact + _EPS)
        holders = sum(1 for w in weights if w > 0)
        if holders * cap_units - (1 if remainder else 0) < units_total:
            cap_units = math.ceil(exact - _EPS)
        limit_units = [cap_units] * nranks
        limit_units[last] = cap_units - (1 if remainder else 0)
    if room is not None:
        limit_units = _room_units(limit_units, room, granularity, last, remainder)
        holders = [r for r, w in enumerate(weights) if w > 0]
        if min(limit_units) < 0 or sum(limit_units[r] for r in holders) < units_total:
            return None
    limits = [u * granularity + (remainder if r == last else 0) for r, u in enumerate(limit_units)]
    shares, held = water_fill(total, weights, limits)

    targets = [x / granularity for x in shares]
    targets[last] = max(0.0, (shares[last] - remainder) / granularity)
    units = _round_units(targets, units_total, limit_units)
    sizes = [u * granularity for u in units]
    sizes[last] += remainder
    return sizes, [r for r in sorted(held) if sizes[r] >= limits[r]]


def _room_units(limit_units, room, granularity: int, last: int, remainder: int) -> list[int]:
    """``limit_units`` lowered to the whole units of rows each rank has ``room`` for; the
    remainder rank ``last`` must also hold the ``remainder`` rows (-1: it cannot)."""
    out = list(limit_units)
    for r, rows in enumerate(room):
        if not math.isinf(rows):
            held = rows - (remainder if r == last else 0)
            out[r] = min(out[r], math.floor(held / granularity) if held >= 0 else -1)
    return out


def balance(
    total: int,
    speeds,
    *,
    min_rows: int = 512,
    cap: float | None = None,
    noise_threshold: float | None = NOISE_THRESHOLD,
    spread=None,
    align: int = 1,
    flops_per_row: float = 1.0,
    memory_budget=None,
    bytes_per_row: float | None = None,
    fixed_bytes=0,
) -> Balance:
    """Split ``total`` rows over ranks in proportion to ``speeds``.

    Args:
        total: rows to split (a non-negative integer).
        speeds: per rank, in rank order: GEMM rate in GFLOP/s (any common scale
            gives the same sizes), finite and >= 0; a rank with speed 0 gets no
            rows. A :class:`~osmm_jax._src.tuning.speeds.SpeedProfile` is accepted too
            (its ``spread`` is then used unless ``spread`` is given).
        min_rows: the granularity: sizes are multiples of ``lcm(min_rows,
            align)``, except the last rank with rows, which takes the remainder. Lowered to ``align`` (and said so in ``notes``) when
            ``total < granularity * number of ranks with nonzero speed``.
        cap: in (0, 1]: no rank gets more than ``cap * total`` rows, rounded
            down to a multiple of the granularity (up, where rounding down would
            leave rows that no rank may take); what a capped rank cannot take goes to
            the others in proportion to speed, repeatedly until nobody is over.
            ``ValueError`` if ``cap * (ranks with nonzero speed) < 1``.
        noise_threshold: if any rank's ``spread`` exceeds it, speeds are not
            trusted and the rows are split evenly over the ranks with nonzero
            speed. None disables the check.
        spread: per-rank coefficient of variation of the timings behind
            ``speeds`` (``SpeedProfile.spread``), or None.
        align: every size is a multiple of it (except the remainder piece),
            e.g. the vector width.
        flops_per_row: floating-point operations per row, so that
            ``predicted_seconds`` are seconds (see :class:`Balance`).
        memory_budget: bytes each rank may hold: one number for every rank or one per rank
            (``math.inf``: no limit), e.g. :func:`osmm_jax.memory_budgets`. A rank gets at most
            ``(budget - fixed_bytes) / bytes_per_row`` rows, rounded down to the granularity:
            the speed-proportional split where it fits; where a rank's share would not fit, it
            gets what fits and the rest goes to the others in proportion to their speeds (and
            ``notes`` say so). None (default): no memory limit.
        bytes_per_row: what one more row costs a rank, bytes (> 0): its rows of the inputs
            and outputs, and what the step keeps per row (activations, gradients, optimizer
            state of a tensor-parallel shard). Required with ``memory_budget``.
        fixed_bytes: what a rank holds whatever its share (a replicated weight), bytes: one
            number or one per rank.

    Returns:
        A :class:`Balance`. See the module docstring for the 5% guarantee.

    Raises:
        TypeError: a non-integer ``total``/``min_rows``/``align`` or non-numeric values.
        ValueError: negative ``total``, ``min_rows``/``align`` below 1, speeds not
            finite, negative or all zero, ``spread`` of the wrong length or
            negative, ``cap`` outside (0, 1] or too small for the ranks,
            ``flops_per_row`` not finite and positive; ``memory_budget`` without
            ``bytes_per_row`` or of the wrong length; rows that fit no split within the
            budgets (the message names the rank whose speed share overshoots most, what it
            would need and what it has: the same on every rank given the same arguments).
    """
    speeds, spread = _unpack_profile(speeds, spread)
    total = checks.integer(total, "total", 0)
    min_rows = checks.integer(min_rows, "min_rows", 1)
    align = checks.integer(align, "align", 1)
    speeds = checks.speeds(speeds)
    active = [r for r, s in enumerate(speeds) if s > 0]
    spread = _checked_spread(spread, len(speeds))
    if noise_threshold is not None:
        noise_threshold = checks.at_least(noise_threshold, "noise_threshold", 0, allow_inf=True)
    cap = _checked_cap(cap, len(active))
    flops_per_row = checks.positive_real(flops_per_row, "flops_per_row")
    room = memory.room_per_rank(memory_budget, bytes_per_row, fixed_bytes, len(speeds))

    weights, notes = _trusted_weights(speeds, spread, noise_threshold)
    granularity, lowered = _granularity(total, min_rows, align, len(active))
    found = _best_split(total, weights, granularity, active, cap, room)
    if found is None:
        raise _over_budget(total, weights, room, memory_budget, bytes_per_row, fixed_bytes)
    last, sizes, capped = found
    capped = [r for r in capped if cap is not None and (room is None or room[r] >= cap * total)]
    held = _held(active, room, granularity)
    notes += lowered + _split_notes(total, granularity, held, last, sizes, capped, cap)
    short = _short_of_memory(total, weights, sizes, room, granularity)
    notes += [
        f"rank {r} held to {sizes[r]} rows by its memory budget (room for {room[r]:.0f}; "
        f"its speed share is {share:.1f})"
        for r, share in short.items()
    ]
    seconds, imbalance = _predicted_times(sizes, speeds, total, flops_per_row)
    return Balance(tuple(sizes), tuple(seconds), imbalance, granularity, tuple(notes), tuple(short))


def _unpack_profile(speeds, spread):
    """``(speeds, spread)``, taken apart when ``speeds`` is a ``SpeedProfile``.

    A profile brings its GFLOP/s (``gflops``) and the coefficients of variation
    of its timings (``spread``); an explicit ``spread`` wins over the profile's.
    Anything else is returned unchanged (checked later).
    """
    if hasattr(speeds, "gflops") and hasattr(speeds, "spread"):  # a SpeedProfile
        spread = speeds.spread if spread is None else spread
        speeds = speeds.gflops
    return speeds, spread


def _checked_spread(spread, nranks: int) -> tuple[float, ...] | None:
    """``spread`` (per-rank coefficients of variation, unitless) checked: one per rank, >= 0."""
    if spread is None:
        return None
    spread = checks.non_negative_reals(spread, "spread")
    if len(spread) != nranks:
        raise ValueError(f"spread has {len(spread)} values but speeds has {nranks}")
    return spread


def _checked_cap(cap, holders: int) -> float | None:
    """``cap`` (a fraction of the rows) checked: in (0, 1], and ``holders`` ranks can hold all rows.

    ``holders`` is the number of ranks with nonzero speed; each may take at most
    ``cap`` of the rows, so ``cap * holders`` must reach 1.
    """
    if cap is None:
        return None
    cap = checks.real(cap, "cap")
    if not 0 < cap <= 1:
        raise ValueError(f"cap must be in (0, 1], got {cap}")
    if cap * holders < 1 - _EPS:
        raise ValueError(
            f"cap {cap} is infeasible: {holders} ranks with nonzero speed can hold at "
            f"most {cap * holders:.0%} of the rows; it must be at least {1 / holders:.4g}"
        )
    return cap


def _trusted_weights(speeds, spread, noise_threshold) -> tuple[list[float], list[str]]:
    """The weights to split by, and a note when the speeds are too noisy to trust.

    The weights are the speeds (GFLOP/s), unless some rank with nonzero speed has
    a ``spread`` (coefficient of variation of its timings) above
    ``noise_threshold``: then every rank with nonzero speed weighs 1 (an even split).
    """
    if spread is None or noise_threshold is None:
        return list(speeds), []
    noisy = [r for r, s in enumerate(speeds) if s > 0 and spread[r] > noise_threshold]
    if not noisy:
        return list(speeds), []
    detail = ", ".join(f"rank {r} CV {spread[r]:.2f}" for r in noisy)
    note = f"speeds too noisy ({detail} > {noise_threshold:g}): even split"
    return [1.0 if s > 0 else 0.0 for s in speeds], [note]


def _granularity(total: int, min_rows: int, align: int, holders: int) -> tuple[int, list[str]]:
    """The unit of the sizes (rows), and a note when it had to be lowered.

    ``lcm(min_rows, align)``, lowered to ``align`` when ``total`` rows cannot give
    each of the ``holders`` ranks with nonzero speed one unit.
    """
    granularity = math.lcm(min_rows, align)
    if granularity > align and total < granularity * holders:
        note = (
            f"total {total} < {granularity} rows x {holders} ranks: granularity lowered to {align}"
        )
        return align, [note]
    return granularity, []


def _over_budget(total, weights, room, memory_budget, bytes_per_row, fixed_bytes) -> ValueError:
    """The error of :func:`memory.over_budget_error` for a split no budget allows."""
    budgets = memory.budgets_per_rank(memory_budget, len(weights))
    shares = [total * w / math.fsum(weights) for w in weights]
    return memory.over_budget_error(total, shares, room, budgets, bytes_per_row, fixed_bytes)


def _short_of_memory(total: int, weights, sizes, room, granularity: int) -> dict[int, float]:
    """The ranks their memory budget holds below their speed share (no room for another unit
    of ``granularity`` rows): rank -> that share, in rows."""
    if room is None:
        return {}
    weight_sum = math.fsum(weights)
    short = {}
    for r, rows in enumerate(room):
        share = total * weights[r] / weight_sum
        if sizes[r] < share and sizes[r] + granularity > rows:
            short[r] = share
    return short


def _best_split(
    total: int,
    weights: list[float],
    granularity: int,
    active: list[int],
    cap: float | None,
    room: tuple[float, ...] | None = None,
) -> tuple[int, list[int], list[int]] | None:
    """``(remainder rank, sizes, capped ranks)`` of the split that finishes first.

    The remainder piece (``total % granularity`` rows) goes to the last rank with
    rows, so every block starts on the granularity. Normally that is the last of
    the ``active`` ranks (nonzero speed); but when the ranks at the end are so slow
    that their shares are below one unit, the remainder fits better on an earlier
    rank, the ones after it left empty. Finish times are rows / weight (relative). None when
    no split fits the ranks' ``room`` (rows their memory allows).
    """
    best = None
    for last in reversed(active):
        if cap is None or cap * sum(1 for r in active if r <= last) >= 1 - _EPS:
            weights_upto = [w if r <= last else 0.0 for r, w in enumerate(weights)]
            split = _split(total, weights_upto, granularity, last, cap, room)
            if split is not None:
                sizes, capped = split
                finish = max(n / w for n, w in zip(sizes, weights) if n) if total else 0.0
                if best is None or finish < best[0] * (1 - _EPS):
                    best = (finish, last, sizes, capped)
        whole = (
            total % granularity == 0 or total * weights[last] / math.fsum(weights) >= granularity
        )
        if whole and best is not None:
            break  # an earlier remainder rank would leave a whole unit's worth of work undone
    if best is None:
        return None
    _, last, sizes, capped = best
    return last, sizes, capped


def _held(active: list[int], room, granularity: int) -> list[int]:
    """The ranks of ``active`` whose memory ``room`` takes at least one unit of rows."""
    return [r for r in active if room is None or room[r] >= granularity]


def _split_notes(
    total: int, granularity: int, active: list[int], last: int, sizes, capped, cap
) -> list[str]:
    """In words: ranks left empty before the remainder rank ``last``, and caps that bound."""
    notes = []
    if active and last < active[-1]:
        empty = [r for r in active if r > last]
        notes.append(
            f"ranks {empty} left empty (their shares are below the granularity): rank {last} "
            f"takes the remainder of {total % granularity} rows"
        )
    for r in capped:
        over = " (the cap rounded up to the granularity)" if sizes[r] > cap * total else ""
        notes.append(f"rank {r} capped at {cap:.0%}: {sizes[r]} of {total} rows{over}")
    return notes


def _predicted_times(sizes, speeds, total: int, flops_per_row: float) -> tuple[list[float], float]:
    """Per-rank predicted seconds and the imbalance (see :class:`Balance`).

    A rank's seconds are ``rows * flops_per_row / (GFLOP/s * 1e9)``, 0 without
    rows; the imbalance is the slowest rank's excess over the ideal time of a
    perfect split, as a fraction of it (0 when ``total`` is 0).
    """
    seconds = [
        n * flops_per_row / (s * 1e9) if n else 0.0 for n, s in zip(sizes, speeds)
    ]  # n > 0 implies s > 0
    ideal = total * flops_per_row / (math.fsum(speeds) * 1e9)
    imbalance = (max(seconds) - ideal) / ideal if total else 0.0
    return seconds, imbalance
