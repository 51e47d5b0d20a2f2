"""Memory per rank: one budget per rank, what a product holds on each rank, and the rows a
rank's budget lets it take.

Clusters mix devices of unequal memory as well as unequal speed, so a budget is one number of
bytes per rank (:func:`budgets_per_rank`; ``math.inf``: no limit). Work that is split by rows
(a data-parallel batch, a tensor-parallel layer's columns) costs a rank ``fixed_bytes`` plus
``bytes_per_row`` per row it takes; :func:`row_limits` turns the budgets into the most rows
each rank may take, and :func:`over_budget_error` is the one message, the same on every rank,
when the rows cannot fit anywhere. :func:`memory_per_rank` counts what one product holds on
each rank (the figure :func:`osmm_jax.auto_layouts` keeps within the budgets), and
:func:`one_sided_transient` / :func:`allreduce_transient` what a product's buffers add at its
busiest moment (:func:`osmm_jax.memory_bytes` sums them into a predicted peak).

Pure Python: no JAX, no MPI; every result is the same on every rank given the same arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from osmm_jax._src import checks, config, units
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.plan_totals import PlanTotals
from osmm_jax._src.planning.records import interval_size, one_gemm_over
from osmm_jax._src.planning.totals import block_area


def budgets_per_rank(memory_budget, nranks: int, name: str = "memory_budget") -> tuple:
    """``memory_budget`` as one budget per rank, bytes (``math.inf``: no limit).

    ``memory_budget``: one number for every rank, a sequence of ``nranks`` numbers in rank
    order, or None: ``OSMM_MEMORY_BUDGET`` (one number, or one per rank), else
    :func:`osmm_jax._src.config.host_memory_budget` for every rank. Each budget is positive
    (``math.inf`` allowed). ValueError / TypeError otherwise, naming ``name``.
    """
    if memory_budget is None:
        setting = config.memory_budget_setting()
        if setting is None:
            return (config.host_memory_budget(),) * nranks
        memory_budget, name = setting, config.MEMORY_BUDGET
    if isinstance(memory_budget, (str, bytes)):
        raise TypeError(f"{name} must be a number of bytes or one per rank, got {memory_budget!r}")
    if isinstance(memory_budget, Sequence) or hasattr(memory_budget, "__len__"):
        values = tuple(memory_budget)
        if len(values) != nranks:
            raise ValueError(
                f"{name} has {len(values)} budgets but there are {nranks} ranks: give one "
                "number for every rank or one per rank"
            )
        return tuple(_budget(v, f"{name}[{r}]") for r, v in enumerate(values))
    return (_budget(memory_budget, name),) * nranks


def _budget(value, name: str) -> float:
    """One budget in bytes: positive, or ``math.inf`` for no limit."""
    out = checks.real(value, name)
    if math.isinf(out) and out > 0:
        return math.inf
    return checks.positive_real(out, name)


def per_rank(value, nranks: int, name: str) -> tuple[float, ...]:
    """``value`` (bytes, >= 0) for every rank, or its ``nranks`` values given one per rank."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        values = checks.non_negative_reals(value, name)
        if len(values) != nranks:
            raise ValueError(f"{name} has {len(values)} entries but there are {nranks} ranks")
        return values
    return (checks.at_least(value, name, 0.0),) * nranks


def room_per_rank(memory_budget, bytes_per_row, fixed_bytes, nranks: int):
    """The rows each of ``nranks`` ranks' memory budgets lets it take (:func:`row_limits`), or
    None when there is no budget; the arguments as ``balance`` and the Rebalancer take them
    (a budget needs ``bytes_per_row`` and ``bytes_per_row`` a budget)."""
    if memory_budget is None:
        if bytes_per_row is not None:
            raise ValueError("bytes_per_row is only used with memory_budget; give both")
        return None
    if bytes_per_row is None:
        raise ValueError("memory_budget needs bytes_per_row: what one row costs a rank, in bytes")
    bytes_per_row = checks.positive_real(bytes_per_row, "bytes_per_row")
    budgets = budgets_per_rank(memory_budget, nranks)
    return row_limits(budgets, bytes_per_row, fixed_bytes)


def row_limits(budgets, bytes_per_row: float, fixed_bytes) -> tuple[float, ...]:
    """The most rows each rank may take: ``(budget - fixed) / bytes_per_row``, rounded down
    (``math.inf`` for a rank without a limit; 0 when even its fixed bytes do not fit).

    ``budgets``: bytes per rank; ``bytes_per_row``: what one more row costs a rank (its slice of
    the inputs and outputs, gradients, optimizer state...), > 0; ``fixed_bytes``: what a rank
    holds whatever its share (a replicated weight), one number or one per rank.
    """
    fixed = per_rank(fixed_bytes, len(budgets), "fixed_bytes")
    return tuple(
        math.inf if math.isinf(b) else float(max(0, math.floor((b - f) / bytes_per_row)))
        for b, f in zip(budgets, fixed)
    )


def over_budget_error(
    total: int, shares, limits, budgets, bytes_per_row: float, fixed_bytes, what: str = "rows"
) -> ValueError:
    """The error when ``total`` rows cannot fit: it names the rank whose speed share overshoots
    its budget most, what that share would need and what the rank has, and how many rows all
    ranks' budgets hold together."""
    fixed = per_rank(fixed_bytes, len(budgets), "fixed_bytes")
    needs = [f + s * bytes_per_row for s, f in zip(shares, fixed)]
    worst = max(range(len(budgets)), key=lambda r: (needs[r] - budgets[r], -r))
    held = math.fsum(min(limit, total) for limit in limits)
    return ValueError(
        f"{total} {what} do not fit the memory budgets: rank {worst} would need "
        f"{units.format_bytes(needs[worst])} for its speed share of {shares[worst]:.0f} {what} "
        f"but has {units.format_bytes(budgets[worst])}; all ranks together hold at most "
        f"{held:.0f} {what} at {units.format_bytes(bytes_per_row)} per row (raise the budgets, "
        "lower the bytes per row, or use more ranks)"
    )


def memory_per_rank(layouts, totals: PlanTotals, itemsize: int, accum: int) -> tuple[int, ...]:
    """The bytes each rank holds during one product of the layouts of A, B and C: its blocks
    (a replicated one whole, ``itemsize`` bytes an element), the input pieces it fetches and
    the partials it computes for other ranks (``accum`` bytes an element, kept until the reduce
    finishes), and the notified mode's slots window (:func:`slots_bytes`, the same on every
    rank). Not counted: the other MPI windows (persistent, sized by the largest block) and
    XLA's temporaries."""
    t = totals.totals
    slots = slots_bytes(layouts[2], totals, accum)
    out = []
    for rank, blocks in enumerate(zip(*(layout.blocks for layout in layouts))):
        owned = sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in blocks) * itemsize
        transient = t.received_inputs[rank] * itemsize + t.partials[rank] * accum
        out.append(owned + transient + slots)
    return tuple(out)


def slots_bytes(c: Layout, totals: PlanTotals, accum: int) -> int:
    """The notified mode's slots window, the same on every rank (``OSMM_SYNC=notify``, the
    default, counted unless ``OSMM_SYNC=fence``: the layouts do not know which MPI runs
    them). One window serves the reduce and the fetch, so it is the larger of theirs: an
    accumulator and a slot per origin, each the size of the largest C block (the reduce) or
    of the most A and B elements a rank fetches (the notified fetch,
    :mod:`osmm_jax._src.runtime.fetch`), at most ``P - 1`` slots and no more than
    ``OSMM_SLOT_BUDGET`` holds (at least one). 0 in the fence mode, or when no rank delivers
    or fetches anything."""
    if config.resolve_sync(None) != "notify":
        return 0
    t = totals.totals
    reduce = max(block_area(c, r) for r in range(c.nranks)) if any(t.received_partials) else 0
    fetch = max(t.received_inputs, default=0)
    return max(_window(reduce * accum, c.nranks), _window(fetch * accum, c.nranks))


def _window(slot: int, nranks: int) -> int:
    """Bytes of a slots window of ``slot``-byte slots (0: no window) on ``nranks`` ranks."""
    if slot == 0:
        return 0
    budget = config.slot_budget()
    slots = nranks - 1 if math.isinf(budget) else min(nranks - 1, int(budget // slot))
    return (1 + max(1, slots)) * slot


class PeakMemory(NamedTuple):
    """What one rank holds at the busiest moment of a product (or of a product and its
    gradient), in bytes: ``blocks``, its blocks of the inputs and results (and, for a
    gradient, the cotangent); ``transient``, the buffers the products add beside them;
    ``windows``, the resident part of osmm_jax's MPI windows (they stay between products)."""

    blocks: int
    transient: int
    windows: int

    @property
    def total(self) -> int:
        """The predicted peak: blocks, transient buffers and windows, bytes."""
        return self.blocks + self.transient + self.windows


def one_sided_transient(
    plan: Plan,
    rank: int,
    packed: bool,
    whole_c: int = 0,
    taken=(),
    messages: bool = False,
    ahead: int = 0,
    unjoined=frozenset(),
    kept: int = 0,
    merged: int = 0,
    in_result: bool = False,
) -> int:
    """Elements (accumulation dtype) a one_sided product of ``plan`` adds on ``rank`` beside
    its blocks, at its busiest moment, the larger of:

    - the fetch: the pieces it receives, and, when ``packed`` (the notified mode, where a rank
      packs the pieces it serves into one buffer unless it can send them from its blocks),
      the pieces it serves, packed;
    - the GEMMs and deliveries: the received pieces, or the operands of a cell summed over
      several inner ranges where they take more (set side by side for one GEMM, or cut from a
      strided block: copies either way), plus the partials it delivers (one buffer per cell,
      every chunk kept until the reduce finishes);
    - ``whole_c``: a staged plan's all-gather (``plan`` its gather stage) holds the whole
      replicated C (elements) as it assembles it; one summed in place (``in_result``, its
      partial one GEMM over the whole C, ``one_sided.sums_in_place``) assembles it in the
      result, its partials delivered from there, and holds the copy of its rows it sends.

    ``taken``: the pieces (Transfers of ``plan``) the product takes from another product's
    fetch instead of its own (dB's from dA's, :mod:`osmm_jax._src.runtime.backward`), counted
    there: it neither receives nor serves them.

    ``messages``: the notified mode's message transport (xla_ffi/notified/messages.h) stages
    a copy of what leaves: the pieces served and the partials delivered (one image per cell,
    shared by the targets of a replicated C); a staged plan's all-gather, its own block
    (counted by the caller in ``whole_c``).

    ``ahead``: elements a fetch run ahead holds on its waiter thread beside the fetch
    (xla_ffi/protocols/deferred.h: its result, and with RMA the buffer its pieces leave from).

    ``kept``: elements of the pieces among ``taken`` that it reads from the forward product's
    fetched buffers, kept until the backward pass (``keep_fetched``): held as if received.

    ``merged``: elements of the operands joined for one GEMM over the whole C block
    (:func:`merged_block_operands`), copied from the fetched pieces while they are held.

    ``unjoined``: the cells ``(rows, cols)`` whose GEMMs read their operands whole and are not
    joined (``one_sided.reads_whole``): they copy nothing, and XLA writes their partials into
    the result and where a fetched piece was (the GEMMs on fetched pieces run first).

    The product's own C block is the result XLA writes, counted with the blocks."""
    mine = plan.for_rank(rank)
    serves = sum(t.elements for t in mine.served if t not in taken)
    served = (serves if packed else 0) + (serves if messages else 0)
    fetched = sum(t.elements for t in mine.gets if t not in taken) + kept
    partials = sum({(t.rows, t.cols, t.inner): t.elements for t in mine.deliveries}.values())
    joined = _joined_operands(
        (m for m in mine.multiplies if (m.rows, m.cols) not in unjoined), plan, rank
    )
    copies = (1 if messages else 0) if in_result else (2 if messages else 1)
    compute = max(fetched, joined) + partials * copies + merged
    return max(served + fetched + ahead, compute, whole_c)


def merged_block_operands(plan: Plan, rank: int) -> int:
    """Elements of the operands a one_sided product of ``plan`` joins on ``rank`` for ONE GEMM
    that writes its whole C block (``one_sided._whole_block``, its fetch not run ahead): where
    the plan delivers nothing, each of the rank's multiplies is over one inner range, together
    they tile the block (:func:`~osmm_jax._src.planning.records.gemm_groups`) and some read
    fetched pieces. The A pieces of the block's row ranges are set one above the other, the B
    pieces of its column ranges side by side (each only where there are several): a
    sequence-parallel column layer's own rows and the rows it fetched, joined into one panel
    of every row."""
    mine = plan.for_rank(rank)
    if plan.has_deliveries or not mine.multiplies:
        return 0
    requests = [(m, m.rows) for m in mine.multiplies]
    if len({(m.rows, m.cols) for m, _ in requests}) != len(requests):
        return 0  # a cell summed over several inner ranges
    if not one_gemm_over(requests, plan.c.blocks[rank]):
        return 0
    if all(m.a_source == m.b_source == rank for m, _ in requests):
        return 0  # cut from the rank's own blocks
    inner = interval_size(requests[0][0].inner)
    rows, cols = {m.rows for m, _ in requests}, {m.cols for m, _ in requests}
    joined_a = inner * sum(interval_size(r) for r in rows) if len(rows) > 1 else 0
    joined_b = inner * sum(interval_size(c) for c in cols) if len(cols) > 1 else 0
    return joined_a + joined_b


def _joined_operands(multiplies, plan: Plan, rank: int) -> int:
    """Elements of the A and B operands of every C cell summed over several inner ranges,
    joined for one GEMM: its A pieces side by side, its B pieces one above the other. An
    operand joined from pieces of ``rank``'s own block that lie in it one after another in
    memory (inner ranges that follow one another across the block's whole width) is that
    part of the block, which XLA reads in place (a backward product's whole block of C's
    cotangent)."""
    cells: dict[tuple, list] = {}
    for m in multiplies:
        cells.setdefault((m.rows, m.cols), []).append(m)
    total = 0
    a_cols, b_cols = plan.a.blocks[rank][1], plan.b.blocks[rank][1]
    for (rows, cols), group in cells.items():
        if len(group) < 2:
            continue
        inners = sorted(m.inner for m in group)
        size = sum(interval_size(i) for i in inners)
        span = (inners[0][0], inners[-1][1])
        if not (_own_in_order(group, inners, "a_source", rank) and span == tuple(a_cols)):
            total += interval_size(rows) * size
        if not (_own_in_order(group, inners, "b_source", rank) and tuple(cols) == tuple(b_cols)):
            total += interval_size(cols) * size
    return total


def _own_in_order(group, inners, source: str, rank: int) -> bool:
    """Whether every piece of ``group`` comes from ``rank``'s own block (``source``: the
    operand's owner field) and their inner ranges follow one another: joined, they are one
    range of that block, in memory where it spans the block's whole width."""
    return all(getattr(m, source) == rank for m in group) and all(
        prev[1] == nxt[0] for prev, nxt in zip(inners, inners[1:])
    )


def allreduce_sums(plan: Plan) -> list[int]:
    """Elements of each whole matrix the all-reduce method sums over the ranks for one product
    of ``plan``: A and B, assembled when a rank lacks pieces (a replicated one passes
    through), and C; none when the plan moves nothing."""
    if not (plan.has_gets or plan.has_deliveries):
        return []
    m, k, n = plan.dims
    sums = [m * n]
    if plan.has_gets:
        wholes = ((plan.a, m * k), (plan.b, k * n))
        sums += [area for layout, area in wholes if not layout.is_replicated]
    return sums


def allreduce_transient(plan: Plan) -> int:
    """Elements (accumulation dtype) the all-reduce method adds on every rank for one product
    of ``plan``: each whole matrix it sums (:func:`allreduce_sums`) and, unless C is
    replicated (then the sum is the result), the all-reduced C it cuts the block from."""
    sums = allreduce_sums(plan)
    m, _, n = plan.dims
    return sum(sums) + (m * n if sums and not plan.c.is_replicated else 0)


FIT_ROUNDS = 12
"""Rounds :func:`fit_shares` moves work off ranks over their budget before it gives up."""


def fit_shares(held, speeds, budgets):
    """Weights near ``speeds`` whose split holds within ``budgets`` on every rank, and the
    ranks it had to hold below their speed share; None when no such split was found.

    ``held(weights)`` is what each rank holds (bytes) when the work is shared in proportion to
    ``weights``. A rank over its budget is pinned at a lower share, the other ranks share the
    rest by speed, and the split is measured again, for at most :data:`FIT_ROUNDS` rounds.
    What a rank holds grows with its share, plus a part that does not (a replicated operand):
    the first cut scales the share by ``budget / held``, later ones follow the line through the
    rank's last two measurements (a pinned share only falls). Ranks of speed 0 keep none.
    """
    weights = list(speeds)
    pinned: dict[int, float] = {}
    seen: dict[int, tuple[float, float]] = {}  # rank -> (share, bytes held) last measured
    for _ in range(FIT_ROUNDS):
        need = held(weights)
        total = math.fsum(weights)
        over = [r for r, (n, b) in enumerate(zip(need, budgets)) if n > b]
        if not over:
            return weights, tuple(sorted(pinned))
        for r in over:
            share = _share_within(weights[r] / total, need[r], budgets[r], seen.get(r))
            seen[r] = (weights[r] / total, need[r])
            pinned[r] = min(share, pinned.get(r, share))
        free = [r for r, s in enumerate(speeds) if s > 0 and r not in pinned]
        rest = 1 - math.fsum(pinned.values())
        if not free or rest <= 0:
            return None
        free_speed = math.fsum(speeds[r] for r in free)
        weights = [
            pinned.get(r, rest * s / free_speed if r in free else 0.0) for r, s in enumerate(speeds)
        ]
    return None


def _share_within(share: float, need: float, budget: float, before) -> float:
    """The share at which a rank holding ``need`` bytes at ``share`` would hold just under
    ``budget``: on the line through ``before`` (an earlier ``(share, need)``) when there is
    one with a rising slope, else scaled by ``budget / need``."""
    target = budget * (1 - 1e-6)
    if before is not None and before[0] != share:
        slope = (need - before[1]) / (share - before[0])
        if slope > 0:
            return max(0.0, share + (target - need) / slope)
    return share * target / need
