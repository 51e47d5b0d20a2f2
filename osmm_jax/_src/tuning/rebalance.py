"""Move rows away from ranks that fall behind, while a training loop runs.

A :class:`Rebalancer` owns the split of ``total_rows`` rows (a batch, the M of
a data-parallel product) over the ranks. Every rank reports each step's time
in seconds (:meth:`Rebalancer.observe`); the ranks exchange their times (one
small allgather) and run the same deterministic rule on the same numbers, so
all of them always hold the same sizes (``sizes``, ``row_slice()``, and the
cached ``layouts`` / ``plan`` for them) without further agreement.

A rank whose time stands out (suddenly, against its own usual time and the
other ranks', in ``confirm`` of the last ``2 * confirm - 1`` steps, or
persistently, by its median over the ``window``; :mod:`.stragglers`) loses
``shrink`` of its rows (less when less balances it, at least one ``quantum``)
to the ranks below a balanced step's time, only when that lowers the slowest
rank's predicted time by ``MIN_GAIN`` or more. Sizes change at most once every
``1 + min(window, 3 * confirm + 1)`` steps, and at most ``max_variants`` size tuples keep their
plans, so recompiles stay bounded.

What to time: this rank's own work, before the step's first communicating
operation (a step that ends in a collective lasts as long on every rank as
on the slowest). The rules in full, and why: docs/design.md ("Rebalancing
while training"). Pure Python except for the exchange: pass ``exchange=``
(and ``nranks=``) to run without MPI, as the unit tests do.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from osmm_jax._src import checks
from osmm_jax._src.planning import memory
from osmm_jax._src.planning.balance import water_fill
from osmm_jax._src.planning.layout import Layout, split_sizes
from osmm_jax._src.planning.plan import Plan, make_plan
from osmm_jax._src.runtime import metrics
from osmm_jax._src.tuning.stragglers import StragglerRules

WARMUP_STEPS = 1
"""Observations ignored after construction and after every change of sizes."""

MIN_GAIN = 0.05
"""A move must shorten the slowest rank's predicted time by at least this fraction: less is
within what the step times can tell, and not worth a recompile."""

_TINY = 1e-12  # seconds; a time of 0 (a coarse clock) must not divide by zero


def _checked_shrink(shrink) -> float:
    """``shrink``, the fraction of a straggler's rows taken away, checked: strictly in (0, 1)."""
    value = checks.real(shrink, "shrink")
    if not 0 < value < 1:
        raise ValueError(f"shrink must lie strictly between 0 and 1, got {shrink!r}")
    return value


def _min_units(min_rows, quantum: int) -> int:
    """The fewest quanta a rank with rows keeps: ``min_rows`` rounded up to quanta.

    ``min_rows`` (rows, >= 0) defaults to one quantum, so that a straggler keeps
    being measured and can win rows back.
    """
    min_rows = quantum if min_rows is None else checks.integer(min_rows, "min_rows", 0)
    return -(-min_rows // quantum)


def _local_nranks(speeds, comm, nranks, exchange) -> int:
    """The number of ranks when the times travel through ``exchange`` instead of MPI.

    ``nranks`` defaults to one per speed; ``comm`` must be None and ``exchange``
    callable, and there must be one speed per rank.
    """
    if comm is not None:
        raise ValueError("give either comm (MPI) or exchange (no MPI), not both")
    if not callable(exchange):
        raise TypeError(f"exchange must be callable, got {type(exchange).__name__}")
    nranks = len(speeds) if nranks is None else checks.integer(nranks, "nranks", 1)
    if len(speeds) != nranks:
        raise ValueError(f"speeds has {len(speeds)} entries but there are {nranks} ranks")
    return nranks


def _proportional(total: int, speeds, room=None) -> list[float]:
    """``total`` rows split in proportion to ``speeds`` (any common unit), as fractional rows,
    none above its ``room`` (rows, per rank; what a full rank cannot take goes to the others
    by speed)."""
    if room is None:
        weight = math.fsum(speeds)
        return [total * s / weight for s in speeds]
    return water_fill(total, list(speeds), list(room))[0]


def _memory_room(total: int, speeds, memory_budget, bytes_per_row, fixed_bytes):
    """The rows each rank's memory budget allows (:func:`memory.room_per_rank`), or None
    without a budget; ValueError when all ranks together cannot hold ``total`` rows."""
    room = memory.room_per_rank(memory_budget, bytes_per_row, fixed_bytes, len(speeds))
    if room is not None and math.fsum(min(r, total) for r, s in zip(room, speeds) if s > 0) < total:
        raise _over_budget(total, speeds, memory_budget, bytes_per_row, fixed_bytes)
    return room


def _memory_room_or_error(total: int, speeds, memory_budget, bytes_per_row, fixed_bytes):
    """``(room, None)`` from :func:`_memory_room`, or ``(None, error)``: on MPI the error is
    raised on every rank together, by the agreement of the settings."""
    try:
        return _memory_room(total, speeds, memory_budget, bytes_per_row, fixed_bytes), None
    except (TypeError, ValueError) as error:
        return None, error


def _over_budget(total: int, speeds, memory_budget, bytes_per_row, fixed_bytes) -> ValueError:
    """:func:`memory.over_budget_error` for ``total`` rows split by ``speeds``."""
    budgets = memory.budgets_per_rank(memory_budget, len(speeds))
    room = memory.row_limits(budgets, bytes_per_row, fixed_bytes)
    shares = _proportional(total, speeds)
    return memory.over_budget_error(total, shares, room, budgets, bytes_per_row, fixed_bytes)


def _as_seconds(step_seconds) -> float:
    """``step_seconds`` (this rank's step time, seconds) as a float; NaN when it is no number.

    A bad time is still exchanged, so that every rank raises together.
    """
    try:
        return float(step_seconds)
    except (TypeError, ValueError):
        return math.nan


def _checked_times(exchanged, nranks: int) -> tuple[float, ...]:
    """Every rank's step time in seconds, checked: one per rank, finite and >= 0.

    Raises the same ValueError on every rank, since all see the same times.
    """
    times = tuple(float(t) for t in exchanged)
    if len(times) != nranks:
        raise ValueError(f"exchange returned {len(times)} times for {nranks} ranks")
    bad = [(r, t) for r, t in enumerate(times) if not (math.isfinite(t) and t >= 0)]
    if bad:
        detail = ", ".join(f"rank {r}: {t}" for r, t in bad)
        raise ValueError(f"step times must be finite, non-negative seconds; got {detail}")
    return times


def _change_event(step: int, reasons, old, new) -> str:
    """Why and how the sizes changed at ``step``, in one readable line (for logs)."""
    return f"step {step}: " + "; ".join(reasons) + f"; sizes {list(old)} -> {list(new)}"


def _shrink_targets(sizes, seconds, speed, flagged, shrink: float):
    """Fractional rows per rank after the stragglers give rows away, and the ranks that shrink.

    ``speed``: rows/s of every rank that has rows (``sizes[r] / seconds[r]``), in rank order.
    Each rank of ``flagged`` loses ``shrink`` of its rows, or less when less brings its time
    (``seconds``) down to the balanced time (total rows over total speed). The rows removed
    go to the other ranks below the balanced time, in proportion to the rows each could take
    before reaching it: a rank already at the balanced time takes nothing. (They can take them
    all: the rows the ranks below the balanced time lack add up to the rows the ranks above it
    hold in excess, and no straggler gives away more than its excess. Memory budgets and whole
    quanta, applied by :func:`_quantise`, can still send some elsewhere.) ``([], ())`` when no
    rank would shrink or no other rank can take rows.
    """
    balanced = math.fsum(sizes) / math.fsum(speed.values())  # seconds, rows proportional to speed
    cuts = {r: min(shrink, 1 - balanced / max(seconds[r], _TINY)) for r in flagged}
    shrinking = tuple(r for r in sorted(cuts) if cuts[r] > 0)
    below = {  # rows each other rank lacks to reach the balanced time
        r: max(balanced * speed[r] - sizes[r], 0.0) for r in speed if r not in shrinking
    }
    room = math.fsum(below.values())
    if not shrinking or room <= 0:
        return [], ()
    targets = [float(s) for s in sizes]
    removed = 0.0
    for r in shrinking:
        removed += cuts[r] * targets[r]
        targets[r] *= 1 - cuts[r]
    for r, lacking in below.items():
        targets[r] += removed * lacking / room
    return targets, shrinking


def _slowest(sizes, speed) -> float:
    """The slowest rank's predicted seconds at ``sizes``: times proportional to rows at the
    measured ``speed`` (rows/s of the ranks that have rows)."""
    return max(sizes[r] / speed[r] if sizes[r] else 0.0 for r in speed)


def _quantise(
    targets, sizes, shrinking, active, *, total: int, quantum: int, min_units: int, room=None
):
    """Whole quanta near ``targets`` (fractional rows, one per rank, summing to ``total``).

    Every rank of ``active`` (those that may have rows) keeps ``min_units`` quanta (fewer when
    the rows cannot cover it, or its ``room`` does not). Ranks in ``shrinking`` get the nearest
    count of quanta but at least one fewer than in ``sizes`` (the current rows); the others
    share the rest by largest remainder, none above its ``room`` (rows its memory budget
    allows; None: no limits). The ``total % quantum`` rows left over go to the last non-empty
    rank with room for them. Returns ``sizes`` when the floors or the rooms leave no such split.
    """
    units_total, leftover = divmod(total, quantum)
    scale = units_total / total
    limit = [
        units_total if room is None else int(min(units_total, room[r] // quantum))
        for r in range(len(targets))
    ]
    floor = min(min_units, units_total // len(active))
    units = [0] * len(targets)
    for r in active:
        units[r] = min(floor, limit[r])
    for r in shrinking:
        current = sizes[r] // quantum
        units[r] = max(units[r], min(round(targets[r] * scale), current - 1))
    rest = units_total - sum(units)
    others = [r for r in active if r not in shrinking]
    if rest < 0 or not others:
        return sizes
    wanted = [max(targets[r] * scale - units[r], 0.0) for r in others]
    extra = _fill_units(rest, wanted, [max(0, limit[r] - units[r]) for r in others])
    if extra is None:
        return sizes
    for r, e in zip(others, extra):
        units[r] += e
    rows = [u * quantum for u in units]
    if leftover:
        fits = [r for r in active if room is None or rows[r] + leftover <= room[r]]
        nonempty = [r for r in fits if rows[r]]
        if not fits:
            return sizes
        rows[nonempty[-1] if nonempty else max(fits, key=lambda r: (targets[r], -r))] += leftover
    return tuple(rows)


def _fill_units(rest: int, wanted, room) -> list[int] | None:
    """``rest`` whole units shared in proportion to ``wanted`` (evenly when all are 0), none
    above its ``room``, what a full one cannot take going to the others by ``wanted``; None
    when the rooms hold fewer than ``rest``."""
    if rest == 0:
        return [0] * len(room)
    if sum(room) < rest:
        return None
    weights = list(wanted) if any(wanted) else [1.0] * len(room)
    shares, _ = water_fill(rest, weights, [float(r) for r in room])
    if math.fsum(shares) < rest - 1e-6:  # the ranks that want rows are full: the rest evenly
        shares, _ = water_fill(rest, [1.0] * len(room), [float(r) for r in room])
    return list(split_sizes(rest, len(room), shares))


class Rebalancer:
    """Per-rank row counts of ``total_rows`` rows, adapted to measured step times.

    Construct it on every rank with the same arguments (a collective when it
    runs on MPI). Typical training loop, on every rank::

        import time
        import jax
        import osmm_jax as om

        rb = om.Rebalancer(batch_rows, speeds)  # speeds: GFLOP/s per rank, a first guess
        forward = jax.jit(forward_fn, static_argnames="plan")  # one compile per plan
        finish = jax.jit(finish_fn, static_argnames="plan")
        plan = rb.plan(K, N)  # A rows x B replicated -> C rows, at rb.sizes
        for batch in batches:
            x_local = batch[rb.row_slice()]  # this rank's rows
            t0 = time.perf_counter()
            y = jax.block_until_ready(forward(x_local, w, plan=plan))  # no communication
            seconds = time.perf_counter() - t0  # this rank's own work (see "What to time")
            w = finish(y, x_local, w, plan=plan)  # backward, gradient accumulation, update
            if rb.observe(seconds):  # every rank, every step: one allgather
                plan = rb.plan(K, N)  # new sizes: a new (cached) plan

    A jitted function with the plan as a static argument compiles once per
    distinct plan; ``rb.plan`` returns the same object for a size tuple while it
    stays cached, and ``variants`` counts the size tuples used, which bounds the
    compiles per product.

    Args:
        total_rows: rows to split (> 0), e.g. the batch.
        speeds: the first guess, one weight per rank (GFLOP/s or any relative
            measure; finite, >= 0, not all 0). A rank with speed 0 never gets rows.
        comm: an mpi4py intracommunicator (default COMM_WORLD); the times travel
            on osmm_jax's private duplicate of it.
        window: steps of history per size tuple a rule judges (>= 2).
        sigma: robust standard deviations (scaled median absolute deviation) of the
            baseline's relative step times: a sudden straggler's relative time must exceed
            ``1 + sigma`` of them, a persistent one's median ``sigma`` standard errors (>= 0).
        shrink: fraction of a straggler's rows taken away (0 < shrink < 1).
        quantum: sizes are multiples of it (>= 1), so few distinct shapes occur.
        max_variants: size tuples whose layouts and plans stay cached (>= 1).
        min_rows: no rank that has rows goes below this (rounded up to a
            quantum; lowered when the rows cannot cover it). Default one quantum,
            so a straggler keeps being measured and can win rows back.
        tolerance: a persistent straggler's median must also be this fraction slower than
            a balanced step's time in two windows running, three times it in one (>= 0;
            default 0.15: ranks that share cores drift 10-15% apart for whole runs where
            nobody slowed down, benchmarks/results/straggler.md).
        confirm: a sudden straggler stands out in ``confirm`` of the last
            ``2 * confirm - 1`` steps (>= 1); 1 acts on a single slow step. Default 4 of 7:
            ranks that share cores have stretches of 3 slow steps.
        sudden: a step stands out when the rank's time over its usual time is at least
            this many times the other ranks' same ratio (> 1; default 1.4: a rank that
            slowed down 2x stands out even when its extra work also slows the ranks it shares
            cores with, scheduling noise does not).
        nranks, exchange: run without MPI: ``exchange(seconds)`` returns the list
            of all ``nranks`` ranks' times (default ``nranks = len(speeds)``);
            ``comm`` must be None then.
        memory_budget, bytes_per_row, fixed_bytes: as for :func:`osmm_jax.balance`: bytes each
            rank may hold (one number or one per rank, e.g. :func:`osmm_jax.memory_budgets`),
            what one row costs a rank, and what it holds whatever its rows. No rank is ever
            given more rows than its budget holds, neither at the start nor when it takes
            rows from a straggler; rows that fit no split raise the same ValueError on every
            rank at construction. Default: no memory limit.
    """

    def __init__(
        self,
        total_rows: int,
        speeds: Sequence[float],
        *,
        comm=None,
        window: int = 10,
        sigma: float = 3.0,
        shrink: float = 0.2,
        quantum: int = 64,
        max_variants: int = 8,
        min_rows: int | None = None,
        tolerance: float = 0.15,
        confirm: int = 4,
        sudden: float = 1.4,
        nranks: int | None = None,
        exchange: Callable[[float], Sequence[float]] | None = None,
        memory_budget=None,
        bytes_per_row: float | None = None,
        fixed_bytes=0,
    ):
        self._total = checks.integer(total_rows, "total_rows", 1)
        self._rules = StragglerRules(window, sigma, tolerance, confirm, sudden)
        self._quantum = checks.integer(quantum, "quantum", 1)
        self._max_variants = checks.integer(max_variants, "max_variants", 1)
        self._shrink = _checked_shrink(shrink)
        self._min_units = _min_units(min_rows, self._quantum)
        speeds = checks.speeds(speeds)
        self._room, room_error = _memory_room_or_error(
            self._total, speeds, memory_budget, bytes_per_row, fixed_bytes
        )
        self._connect(comm, speeds, nranks, exchange, room_error)
        self._sizes = ()  # what _quantise falls back to: no split fits
        active = [r for r, speed in enumerate(speeds) if speed > 0]
        targets = _proportional(self._total, speeds, self._room)
        self._sizes = self._quantise(targets, frozenset(), active)
        if not self._sizes:
            raise _over_budget(self._total, speeds, memory_budget, bytes_per_row, fixed_bytes)
        self._restart_window()
        self._cache: OrderedDict[tuple[int, ...], dict] = OrderedDict()
        self._seen: set[tuple[int, ...]] = set()
        self._touch(self._sizes)
        self.steps = 0
        """Observations so far (warm-up steps included)."""
        self.rebalances = 0
        """Times the sizes changed."""
        self.recompiles = 0
        """Plans this controller created (cache misses of :meth:`plan`)."""
        self.stragglers: tuple[int, ...] = ()
        """Ranks that shrank at the last change of sizes."""
        self.last_event: str | None = None
        """Why the sizes last changed, readable (for logs)."""
        self.times: tuple[float, ...] = ()
        """Every rank's time of the last observed step, seconds (for logs)."""

    def _connect(self, comm, speeds, nranks, exchange, error) -> None:
        """Set up the exchange of step times: ``exchange`` without MPI, else ``comm``'s private
        duplicate, where every rank checks the settings (and raises ``error``, the budget's,
        found on any rank) together."""
        if exchange is not None:
            self._nranks = _local_nranks(speeds, comm, nranks, exchange)
            self._comm, self.rank, self._exchange = None, None, exchange
            if error is not None:
                raise error
        elif nranks is not None:
            raise ValueError("nranks is only for exchange=; with MPI it is the comm's size")
        else:
            self._init_mpi(comm, speeds, error)

    def _init_mpi(self, comm, speeds, error=None) -> None:
        from osmm_jax._src.runtime import communicators

        private = communicators.private_comm(comm)
        self._comm, self.rank, self._nranks = private, private.Get_rank(), private.Get_size()
        self._exchange = private.allgather
        if len(speeds) != self._nranks:
            error = (
                f"speeds has {len(speeds)} entries but the communicator has {self._nranks} ranks"
            )
        settings = (self._total, speeds, self._shrink, self._quantum, self._max_variants)
        settings += (self._min_units, self._room, *self._rules.settings)
        communicators.agree(private, "osmm_jax.Rebalancer", repr(settings), error)

    # -- state ----------------------------------------------------------------

    @property
    def sizes(self) -> tuple[int, ...]:
        """Rows per rank, in rank order; sums to ``total_rows``; the same on every rank."""
        return self._sizes

    @property
    def nranks(self) -> int:
        return self._nranks

    @property
    def variants(self) -> int:
        """Distinct size tuples used so far (the initial one included)."""
        return len(self._seen)

    @property
    def cached_variants(self) -> tuple[tuple[int, ...], ...]:
        """Size tuples whose plans are cached, least recently used first."""
        return tuple(self._cache)

    def row_slice(self, rank: int | None = None) -> slice:
        """The rows of ``rank`` (default this rank, on MPI) as a slice into the global rows."""
        if rank is None:
            if self.rank is None:
                raise ValueError("give the rank: without MPI the controller has no rank of its own")
            rank = self.rank
        rank = checks.integer(rank, "rank", 0)
        if rank >= self._nranks:
            raise ValueError(f"rank {rank} is out of range for {self._nranks} ranks")
        start = sum(self._sizes[:rank])
        return slice(start, start + self._sizes[rank])

    # -- plans ----------------------------------------------------------------

    def layouts(self, K: int, N: int) -> tuple[Layout, Layout, Layout]:
        """``(a, b, c)`` at the current sizes: A (total_rows x K) by rows, B (K x N) replicated, C by rows."""
        key = ("layouts", K, N)
        entry = self._cache[self._sizes]
        if key not in entry:
            M, n = self._total, self._nranks
            entry[key] = (
                Layout.rows((M, K), sizes=self._sizes),
                Layout.replicated((K, N), nranks=n),
                Layout.rows((M, N), sizes=self._sizes),
            )
        return entry[key]

    def plan(self, K: int, N: int) -> Plan:
        """The :class:`Plan` of :meth:`layouts` (on the controller's communicator; cached).

        The same object is returned while the size tuple stays cached, so use it
        as a static argument of ``jax.jit``. Without MPI the plan is the pure
        planner's (``comm_key`` 0): for inspection, not for running.
        """
        key = ("plan", K, N)
        entry = self._cache[self._sizes]
        if key not in entry:
            a, b, c = self.layouts(K, N)
            if self._comm is None:
                entry[key] = make_plan(a, b, c)
            else:
                from osmm_jax._src.runtime.api import plan

                entry[key] = plan(a, b, c, comm=self._comm)
            self.recompiles += 1
        return entry[key]

    def _touch(self, sizes: tuple[int, ...]) -> None:
        if sizes in self._cache:
            self._cache.move_to_end(sizes)
        else:
            self._cache[sizes] = {}
            while len(self._cache) > self._max_variants:
                self._cache.popitem(last=False)
        self._seen.add(sizes)

    # -- observing ------------------------------------------------------------

    def observe(self, step_seconds: float) -> bool:
        """Report this rank's time of the last step (seconds); True if ``sizes`` changed.

        Every rank must call it once per step (one allgather of a float). The
        same ValueError is raised on every rank if any rank's time is not a
        finite, non-negative number.
        """
        local = _as_seconds(step_seconds)
        times = _checked_times(self._exchange(local), self._nranks)
        self.steps += 1
        self.times = times
        metrics.observe_step(local)
        if self._warmup:
            self._warmup -= 1
            return False
        active = [r for r in range(self._nranks) if self._sizes[r] > 0]
        flagged = self._rules.flag(times, self._sizes, active)
        if not flagged:
            return False
        new, shrunk = self._redistribute(flagged, active)
        if new == self._sizes:
            return False
        self._resize(new, shrunk, [flagged[r][1] for r in shrunk])
        return True

    def _resize(self, new, shrunk, reasons) -> None:
        """Adopt the ``new`` sizes: cache them, restart the window, count and describe the change."""
        old, self._sizes = self._sizes, new
        self._touch(new)
        self._restart_window()
        self.rebalances += 1
        metrics.increment("rebalances")
        if self.rank is not None:
            metrics.set_share(new[self.rank] / max(sum(new), 1))
        self.stragglers = shrunk
        self.last_event = _change_event(self.steps, reasons, old, new)

    def _restart_window(self) -> None:
        """Forget the step times (they were measured with other sizes) and skip the next step."""
        self._rules.restart()
        self._warmup = WARMUP_STEPS

    def _redistribute(self, flagged, active) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """New sizes and the ranks that shrank; the current sizes if no move would help.
        All stragglers shrink where the others can take their rows; where they cannot (the
        rest are short of memory), the slowest ones alone."""
        medians = self._rules.medians(active)
        seconds = {r: flagged[r][0] if r in flagged else medians[r] for r in active}
        speed = {r: self._sizes[r] / max(seconds[r], _TINY) for r in active}
        slowest_first = sorted(flagged, key=lambda r: (-seconds[r], r))
        for count in range(len(slowest_first), 0, -1):
            some = {r: flagged[r] for r in slowest_first[:count]}
            targets, shrinking = _shrink_targets(self._sizes, seconds, speed, some, self._shrink)
            if shrinking:
                new = self._quantise(targets, frozenset(shrinking), active)
                if _slowest(new, speed) < (1 - MIN_GAIN) * _slowest(self._sizes, speed):
                    return new, shrinking
        return self._sizes, ()

    def _quantise(self, targets, shrinking, active) -> tuple[int, ...]:
        """:func:`_quantise` from the current sizes, with this controller's total, quantum and
        floor."""
        return _quantise(
            targets,
            self._sizes,
            shrinking,
            active,
            total=self._total,
            quantum=self._quantum,
            min_units=self._min_units,
            room=self._room,
        )
