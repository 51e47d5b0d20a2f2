"""Choose layouts for C = A @ B from the ranks' speeds, by a simple cost model.

:func:`auto_layouts` takes the product's dimensions M, K, N and one GEMM rate
per rank (GFLOP/s), builds a few candidate strategies with shares proportional
to the speeds, plans every one with the planner, and returns the
:class:`LayoutChoice` (layouts of A, B and C, and the ``reason``) of the one
with the least predicted time among those that fit the memory budget::

    predicted = max_r flops[r] / (speeds[r] * 1e9)
                + max_r (max(bytes_sent[r], bytes_received[r]) + sync_bytes) / bandwidth

``flops``, ``bytes_sent`` and ``bytes_received`` are the plan's own per-rank figures:
a rank sends the pieces other ranks get from it and the partials it delivers, and
receives the pieces it gets and the partials delivered into its C block. Its link
carries both, each way at ``bandwidth`` bytes/s, so the busier direction is what
it takes: a rank that mostly receives (the owner of a large C block that others
compute for, a rank that gets most of its inputs) is priced by what arrives.

Candidates, in this order: ``rows``, ``cols``, (with ``"synced"`` replication)
``rows, B split`` and ``cols, A split``, ``k_split``, ``grid PRxPC`` for the
:data:`GRID_CANDIDATES` grids ``P = PR * PC`` with ``PR, PC > 1`` whose ranks touch the
fewest input elements, and ``3-D PMxPKxPN`` for the
:data:`THREE_D_CANDIDATES` splits ``P = PM * PK * PN`` with ``PK > 1`` (and ``PM`` or
``PN > 1``) whose boxes have the least surface ``MK/(PM PK) + KN/(PK PN) + MN/(PM PN)``
(:func:`~osmm_jax._src.planning.work.three_d_layouts`: a rank computes a box of the multiply-adds,
gets the rest of its box's inputs and delivers its partial sum; the choice then carries the
:class:`~osmm_jax._src.planning.work.Work` split, and ``osmm_jax.plan(choice)`` plans with it).
``rows`` and ``cols`` hold one operand whole on every rank; how that is priced is
``replication``:

* ``"synced"`` (default): the operand is on every rank, as a trained weight is in
  data-parallel training, and keeping its copies equal costs what the
  bandwidth-optimal all-reduce of its gradient moves per rank, ``2 (P-1)/P``
  times its size (in the accumulation type), once per training step, whose
  three products (forward, and the two backward ones) share it: a third of that
  per product, ``sync_bytes`` (:data:`PRODUCTS_PER_SYNC`). The same strategies
  with the operand left split over K and fetched (``rows, B split``, ``cols, A
  split``) compete with them;
* ``"free"``: already on every rank, at no cost (an operand that never changes);
* ``"fetched"``: not replicated at all: split like the other operand over K, and
  fetching the pieces a rank lacks is counted by the planner.

Every candidate's memory on each rank (what it holds during a product: its A, B and C
blocks, a replicated operand whole, plus the input pieces it fetches, the partials it
computes for other ranks and the slots window, :func:`osmm_jax._src.planning.memory.memory_per_rank`)
must fit that rank's ``memory_budget`` (one number, or one per rank: the choice must be the
same on every rank, so on hosts of unequal memory pass :func:`osmm_jax.memory_budgets`, which
gathers each rank's own; default ``OSMM_MEMORY_BUDGET``, else a quarter of the host's physical
memory). A candidate whose speed shares overshoot a rank's budget is tried with that rank's
share lowered to what fits, the rest going to the others by speed.
Predictions within :data:`TIE_TOLERANCE` of the fastest tie; a tie goes to the
candidate that moves the fewest bytes, then to the earlier one.

The choice also says how far its communication is from the lower bound of any
layout (:mod:`osmm_jax._src.planning.comm_bound`): ``LayoutChoice.bound_ratio``, in the
bound's own terms (the pieces a rank gets plus the partials it delivers).

A guide for large products, not a timer: no latency, no contention, and no
credit for overlapping sends with GEMMs. The candidates, the caveats and what
the model says about which dimension to split are in docs/design.md ("Choosing
layouts"). Pure Python (no JAX, no MPI), deterministic, the same on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from osmm_jax._src import checks, config, units
from osmm_jax._src.planning import comm_bound, memory
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.plan_totals import PlanTotals
from osmm_jax._src.planning.work import Work, three_d_layouts

DEFAULT_BANDWIDTH = 5e9
"""Bytes/s one rank can send, when the caller gives none: one-sided accumulates
between two ranks on one machine (shared memory) measured 4-10 GiB/s; 5e9 is
the conservative end. Across a network, pass the link's rate."""


TIE_TOLERANCE = 1e-3
"""Predictions within this fraction of the fastest tie; a tie goes to the candidate that moves
the fewest bytes per rank, then to the earlier one (``rows`` before ``cols`` before ``k_split``
before grids), so shares rounded to whole rows do not decide between strategies the model
cannot tell apart."""

PRODUCTS_PER_SYNC = 3
"""Products that share one synchronisation of a replicated operand's copies: a training step
multiplies by a weight three times (forward, and the two backward products) and all-reduces
its gradient once."""

GRID_CANDIDATES = 5
"""How many 2-D grids :func:`auto_layouts` plans: those whose ranks touch the fewest elements of A
and B (a row band and a column band), e.g. all 5 grids of 64 ranks but 5 of the 12 of 8192,
whose most elongated ones (2 x 4096) would cost most of the choice's time and never win."""

THREE_D_CANDIDATES = 3
"""How many 3-D splits :func:`auto_layouts` plans: those whose boxes have the least surface (the
elements a rank of the box moves, when it owns little of them), ties to the earlier split in
``(PM, PK, PN)`` order. More would rarely win and would slow the choice at thousands of ranks."""

REPLICATION = ("synced", "free", "fetched")
"""How :func:`auto_layouts` prices an operand that ``rows`` / ``cols`` hold on every rank."""


class Strategy(NamedTuple):
    """One candidate of :func:`candidate_layouts`: its name, the layouts of A, B and C, and the
    :class:`Work` split that says who computes what (None: the owners of the pieces do)."""

    name: str
    a: Layout
    b: Layout
    c: Layout
    work: Work | None = None


class Candidate(NamedTuple):
    """One strategy the model considered.

    ``predicted_seconds = compute_seconds + comm_seconds``; ``compute_seconds``
    is the slowest rank's compute time, ``comm_seconds`` the time of the rank
    whose link is busiest: ``(link_bytes + sync_bytes) / bandwidth``.
    ``link_bytes``: the most bytes one rank moves per product, the larger of what
    it sends and what it receives (``link_elements``: the same in elements, a
    partial and a piece alike); ``sync_bytes``: the keeping of replicas in sync,
    per rank. ``sent_bytes`` and ``sent_elements``: the most one rank sends (the
    pieces other ranks get from it and its partials), the figure the model
    priced before received bytes were counted. ``moved_elements``: the most
    elements one rank gets and delivers (its gets and its partials, the terms of
    :func:`osmm_jax._src.planning.comm_bound.moved_elements`).
    ``memory_bytes``: the most bytes one rank holds during a product (its own A, B
    and C blocks, the input pieces it fetches and the partials it computes for other
    ranks, and in the notified mode the slots its window holds for them; not the other MPI
    windows); ``memory_per_rank``: the same for each rank; ``fits``: whether every rank's is
    within its memory budget (a candidate that does not fit is never chosen).
    ``held_back``: the ranks whose shares were lowered below their speed share to fit their
    budgets (the rest of their work went to the others in proportion to speed).
    """

    name: str
    predicted_seconds: float
    compute_seconds: float
    comm_seconds: float
    sent_bytes: int = 0
    sync_bytes: int = 0
    memory_bytes: int = 0
    fits: bool = True
    sent_elements: int = 0
    link_bytes: int = 0
    link_elements: int = 0
    moved_elements: int = 0
    memory_per_rank: tuple[int, ...] = ()
    held_back: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayoutChoice:
    """The layouts :func:`auto_layouts` picked, and why.

    Attributes:
        a, b, c: layouts of A (M x K), B (K x N) and C (M x N) over ``len(speeds)`` ranks;
            each carries ``"chosen by auto_layouts: " + reason`` as its ``Layout.reason``,
            which :meth:`Plan.describe` of their plan repeats.
        name: the winning strategy (``"rows"``, ``"cols"``, ``"k_split"``, ``"grid 2x2"``, ...).
        predicted_seconds: the model's time of one product with these layouts.
        reason: one line saying why it won, against the runner-up.
        candidates: every strategy considered, in the order considered (:class:`Candidate`).
        work: the :class:`~osmm_jax._src.planning.work.Work` split of a ``3-D`` choice (who computes
            which multiply-adds), else None; ``osmm_jax.plan(choice)`` passes it on.
        bound_ratio: the most one rank moves with these layouts in the bound's terms (the
            pieces it gets, the partials it delivers, its share of keeping replicas in sync),
            in elements, over the most any rank must move with any layout when work and data
            are shared by speed (:func:`osmm_jax._src.planning.comm_bound.rank_bounds`); 1.0 when
            neither moves anything. The bound limits what a rank must fetch and deliver, not
            what arrives at or leaves its link, so this is not the figure the model prices
            (``Candidate.link_elements``); it is the ratio ``benchmarks/layout_bounds.py``
            reports for the chosen layouts, from the plan's totals.
    """

    a: Layout
    b: Layout
    c: Layout
    name: str
    predicted_seconds: float
    reason: str
    candidates: tuple[Candidate, ...]
    bound_ratio: float = 1.0
    work: Work | None = None


def candidate_layouts(
    M: int,
    K: int,
    N: int,
    speeds,
    *,
    replication: str | None = None,
    replicated_is_free: bool | None = None,
) -> tuple[Strategy, ...]:
    """Every :class:`Strategy` (name, layouts, work split), in the order :func:`auto_layouts`
    considers them; ``replication`` (or ``replicated_is_free``) as there."""
    M, K, N = (checks.integer(v, name) for v, name in ((M, "M"), (K, "K"), (N, "N")))
    speeds = checks.speeds(speeds)
    mode = _replication(replication, replicated_is_free)
    return (
        *_one_d_strategies(M, K, N, speeds, mode),
        *_grid_strategies(M, K, N, speeds),
        *_three_d_strategies(M, K, N, speeds),
    )


def _one_d_strategies(M: int, K: int, N: int, speeds, mode: str) -> list[Strategy]:
    """``rows``, ``cols``, (``mode`` ``"synced"``) ``rows, B split`` and ``cols, A split``, and
    ``k_split``: every rank holds a band of rows or columns, in shares proportional to
    ``speeds``; ``rows`` and ``cols`` hold the other operand whole unless ``mode`` is
    ``"fetched"``."""

    def rows(shape):
        return Layout.rows(shape, weights=speeds)

    def cols(shape):
        return Layout.cols(shape, weights=speeds)

    p = len(speeds)
    replicate = mode != "fetched"
    rows_b = Layout.replicated((K, N), nranks=p) if replicate else rows((K, N))
    cols_a = Layout.replicated((M, K), nranks=p) if replicate else cols((M, K))
    out = [
        Strategy("rows", rows((M, K)), rows_b, rows((M, N))),
        Strategy("cols", cols_a, cols((K, N)), cols((M, N))),
    ]
    if mode == "synced":
        # Holding the operand whole is one choice; leaving it split and fetching what each
        # rank lacks (about half the bytes of keeping copies in sync) is the other.
        out += [
            Strategy("rows, B split", rows((M, K)), rows((K, N)), rows((M, N))),
            Strategy("cols, A split", cols((M, K)), cols((K, N)), cols((M, N))),
        ]
    out.append(Strategy("k_split", cols((M, K)), rows((K, N)), rows((M, N))))
    return out


def _grid_strategies(M: int, K: int, N: int, speeds) -> list[Strategy]:
    """One ``grid PRxPC`` per grid of :func:`_two_d_grids`: ranks in row-major order, a grid
    row's share of rows weighted by its ranks' summed speeds, a grid column's likewise."""
    out = []
    for pr, pc in _two_d_grids(M, K, N, len(speeds)):
        row_w = [math.fsum(speeds[i * pc : (i + 1) * pc]) for i in range(pr)]
        col_w = [math.fsum(speeds[j::pc]) for j in range(pc)]
        if not any(row_w) or not any(col_w):  # pragma: no cover - speeds are not all zero
            continue
        a, b, c = (
            Layout.grid(shape, (pr, pc), row_weights=row_w, col_weights=col_w)
            for shape in ((M, K), (K, N), (M, N))
        )
        out.append(Strategy(f"grid {pr}x{pc}", a, b, c))
    return out


def _three_d_strategies(M: int, K: int, N: int, speeds) -> list[Strategy]:
    """One ``3-D PMxPKxPN`` (with its :class:`Work` split) per split of :func:`_three_d_grids`."""
    return [
        Strategy(f"3-D {pm}x{pk}x{pn}", *three_d_layouts((M, K, N), (pm, pk, pn), speeds))
        for pm, pk, pn in _three_d_grids(M, K, N, len(speeds))
    ]


def _two_d_grids(M: int, K: int, N: int, p: int) -> list[tuple[int, int]]:
    """The :data:`GRID_CANDIDATES` grids ``p = pr * pc`` (both > 1) whose ranks' row band of A
    and column band of B, ``MK/pr + KN/pc`` elements, are the smallest; in ``pr`` order."""
    grids = [(pr, p // pr) for pr in range(2, p // 2 + 1) if p % pr == 0]
    best = sorted(grids, key=lambda g: (M * K / g[0] + K * N / g[1], g))[:GRID_CANDIDATES]
    return sorted(best)


def _three_d_grids(M: int, K: int, N: int, p: int) -> list[tuple[int, int, int]]:
    """The :data:`THREE_D_CANDIDATES` splits ``p = pm * pk * pn`` (``pk > 1``, not all of ``p``
    on K) whose boxes have the least surface."""
    grids = [
        (pm, pk, p // (pm * pk))
        for pm in range(1, p + 1)
        if p % pm == 0
        for pk in range(2, p // pm + 1)
        if (p // pm) % pk == 0 and pk < p
    ]
    return sorted(
        grids,
        key=lambda g: (M * K / (g[0] * g[1]) + K * N / (g[1] * g[2]) + M * N / (g[0] * g[2]), g),
    )[:THREE_D_CANDIDATES]


def predict(
    plan: Plan | PlanTotals, speeds, *, bandwidth: float = DEFAULT_BANDWIDTH, itemsize: int = 4
) -> Candidate:
    """The model's time of ``plan`` on ranks of ``speeds`` GFLOP/s (name left empty).

    ``plan`` may be a :class:`~osmm_jax._src.planning.plan_totals.PlanTotals`: only its ``nranks``,
    ``flops``, ``bytes_sent`` and ``bytes_received`` are used. ``comm_seconds`` is the
    busiest link's: the most bytes one rank sends or receives, over ``bandwidth``.

    A rank with work and speed 0 takes forever (``inf``). Partials travel in the
    accumulation type: ``max(itemsize, 4)`` bytes per element.
    """
    speeds = checks.speeds(speeds)
    bandwidth = checks.positive_real(bandwidth, "bandwidth")
    itemsize = checks.integer(itemsize, "itemsize", 1)
    if len(speeds) != plan.nranks:
        raise ValueError(f"{len(speeds)} speeds for a plan over {plan.nranks} ranks")
    compute = _compute_seconds(plan.flops, speeds)
    comm = max(plan.link_bytes(itemsize, max(itemsize, 4))) / bandwidth
    return Candidate("", compute + comm, compute, comm)


def _compute_seconds(flops, speeds) -> float:
    """The slowest rank's time for its ``flops`` at its speed (GFLOP/s); ``inf`` for a rank
    with work and speed 0."""
    return max((f / (s * 1e9) if s > 0 else math.inf) if f else 0.0 for f, s in zip(flops, speeds))


def auto_layouts(
    M: int,
    K: int,
    N: int,
    speeds,
    *,
    bandwidth: float | None = None,
    itemsize: int = 4,
    replication: str | None = None,
    memory_budget: float | None = None,
    replicated_is_free: bool | None = None,
) -> LayoutChoice:
    """Layouts for ``C[M x N] = A[M x K] @ B[K x N]`` that the cost model predicts fastest.

    Args:
        M, K, N: the product's dimensions (positive).
        speeds: one GEMM rate per rank, GFLOP/s (finite, >= 0, not all 0); the
            rank count is ``len(speeds)``. Shares are proportional to them.
        bandwidth: bytes/s a rank sends, and receives; default :data:`DEFAULT_BANDWIDTH`.
        itemsize: bytes per input element (4 for float32, 2 for bfloat16, 8 for float64).
        replication: ``"synced"`` (default), ``"free"`` or ``"fetched"``: how an
            operand held on every rank is priced (see the module docstring).
        memory_budget: bytes a rank may hold during a product (its blocks, the pieces
            it fetches, its partials for others, the slots window; ``math.inf``: no limit):
            one number for every rank, or one per rank (:func:`osmm_jax.memory_budgets`
            gathers each rank's own). A candidate whose speed shares would put a rank over
            its budget is tried again with that rank's share lowered to what fits and the
            rest given to the others by speed (``Candidate.held_back``). Default
            ``OSMM_MEMORY_BUDGET``, else a quarter of the host's memory on every rank.
        replicated_is_free: the older spelling: True is ``"free"``, False ``"fetched"``.

    Returns:
        A :class:`LayoutChoice`; the same on every rank given the same arguments.

    Raises:
        ValueError / TypeError: a dimension not positive, bad speeds, bandwidth or budget
            not positive, itemsize not a positive integer, an unknown replication; no
            candidate fits the memory budget (the message names the smallest need).
    """
    for v, name in ((M, "M"), (K, "K"), (N, "N")):
        if checks.integer(v, name) < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    speeds = checks.speeds(speeds)
    bandwidth = checks.positive_real(
        DEFAULT_BANDWIDTH if bandwidth is None else bandwidth, "bandwidth"
    )
    itemsize = checks.integer(itemsize, "itemsize", 1)
    replication = _replication(replication, replicated_is_free)
    budgets = memory.budgets_per_rank(memory_budget, len(speeds))

    strategies = list(candidate_layouts(M, K, N, speeds, replication=replication))
    scored = [_price(s, speeds, bandwidth, itemsize, replication, budgets) for s in strategies]
    for i, candidate in enumerate(scored):
        if not candidate.fits and any(candidate.memory_per_rank):
            fitted = _fitted(i, (M, K, N), speeds, bandwidth, itemsize, replication, budgets)
            if fitted is not None:
                strategies[i], scored[i] = fitted
    if not any(s.fits for s in scored):
        raise _over_budget((M, K, N), len(speeds), budgets, scored)
    pick = _pick(scored)
    best, (_, a, b, c, work) = scored[pick], strategies[pick]
    reason = _choice_reason(scored, pick, replication, bandwidth, budgets)
    # The layouts carry the reason, so the plan of them says why they were chosen.
    a, b, c = (
        dataclasses.replace(x, reason=f"chosen by auto_layouts: {reason}") for x in (a, b, c)
    )
    return LayoutChoice(
        a=a,
        b=b,
        c=c,
        name=best.name,
        predicted_seconds=best.predicted_seconds,
        reason=reason,
        candidates=tuple(scored),
        bound_ratio=_bound_ratio(M, K, N, speeds, best, itemsize, max(itemsize, 4), replication),
        work=work,
    )


def _fitted(index: int, dims, speeds, bandwidth, itemsize, replication, budgets):
    """``(strategy, candidate)``: candidate ``index`` of :func:`candidate_layouts` with its
    shares moved off the ranks over their ``budgets`` (:func:`memory.fit_shares`), priced at
    the true ``speeds``; None when no shares fit."""

    def build(weights):
        return candidate_layouts(*dims, weights, replication=replication)[index]

    def held(weights):
        return _price(
            build(weights), speeds, bandwidth, itemsize, replication, budgets
        ).memory_per_rank

    found = memory.fit_shares(held, speeds, budgets)
    if found is None:
        return None
    weights, moved = found
    strategy = build(weights)
    candidate = _price(strategy, speeds, bandwidth, itemsize, replication, budgets)
    return strategy, candidate._replace(held_back=moved)


def _price(
    strategy: Strategy, speeds, bandwidth: float, itemsize: int, replication: str, budgets
) -> Candidate:
    """The model's :class:`Candidate` for one strategy: its time, the bytes it moves and
    holds per rank, and whether it fits ``budgets`` (bytes, one per rank)."""
    layouts = (strategy.a, strategy.b, strategy.c)
    accum = max(itemsize, 4)
    # The plan's totals alone (not the cached make_plan(): trial plans must not evict the
    # user's, and their records are never needed), counted in bulk for these layouts.
    totals = PlanTotals(*layouts, strategy.work)
    sync = _sync_bytes(layouts[:2], len(speeds), accum) if replication == "synced" else 0
    compute = _compute_seconds(totals.flops, speeds)
    link = max(totals.link_bytes(itemsize, accum))
    comm = (link + sync) / bandwidth
    held = memory.memory_per_rank(layouts, totals, itemsize, accum)
    return Candidate(
        strategy.name,
        compute + comm,
        compute,
        comm,
        sent_bytes=max(totals.bytes_sent(itemsize, accum)),
        sync_bytes=sync,
        memory_bytes=max(held),
        fits=all(h <= b for h, b in zip(held, budgets)),
        sent_elements=max(totals.bytes_sent(1, 1)),
        link_bytes=link,
        link_elements=max(totals.link_bytes(1, 1)),
        moved_elements=max(totals.bytes_issued(1, 1)),
        memory_per_rank=held,
    )


def _sync_bytes(inputs, p: int, accum: int) -> int:
    """Bytes per rank and product of keeping the copies of the replicated ones of ``inputs``
    (the layouts of A and B) in sync over ``p`` ranks: the all-reduce of the gradient,
    ``2 (p-1)/p`` times its size in the accumulation type (``accum`` bytes an element), shared
    by :data:`PRODUCTS_PER_SYNC` products."""
    sync = 0
    if p > 1:
        for layout in inputs:
            if layout.is_replicated:
                rows, cols = layout.shape
                sync += 2 * (p - 1) * rows * cols * accum // (p * PRODUCTS_PER_SYNC)
    return sync


def _over_budget(dims, p: int, budgets, scored) -> ValueError:
    """The error when no candidate of ``scored`` fits ``budgets``: it names the candidate that
    overshoots least, its rank that overshoots most, what that rank needs and what it has."""
    M, K, N = dims

    def excess(candidate):
        return max((h - b, -r) for r, (h, b) in enumerate(zip(candidate.memory_per_rank, budgets)))

    least = min(scored, key=excess)
    rank = -excess(least)[1]
    return ValueError(
        f"no layout for {M} x {K} @ {K} x {N} on {p} ranks fits the memory budgets, even with "
        f"work moved off the ranks short of memory: the closest, {least.name}, needs "
        f"{units.format_bytes(least.memory_per_rank[rank])} on rank {rank} at shares by speed, "
        f"which has {units.format_bytes(budgets[rank])} (raise memory_budget or "
        f"{config.MEMORY_BUDGET}, or use more ranks)"
    )


def _pick(scored) -> int:
    """The index of the winner among the candidates of ``scored`` that fit (at least one): the
    fastest, a tie (:data:`TIE_TOLERANCE`) going to the fewest bytes per rank, then the earlier."""
    fitting = [i for i, s in enumerate(scored) if s.fits]
    fastest = min(scored[i].predicted_seconds for i in fitting)
    tied = [i for i in fitting if _ties(scored[i].predicted_seconds, fastest)]
    return min(tied, key=lambda i: (scored[i].link_bytes + scored[i].sync_bytes, i))


def _choice_reason(scored, pick: int, replication: str, bandwidth: float, budgets) -> str:
    """Why ``scored[pick]`` won, against the fastest other candidate that fits, and which
    candidates the memory budget left out."""
    rest = sorted(
        (s for i, s in enumerate(scored) if i != pick and s.fits),
        key=lambda s: s.predicted_seconds,
    )
    runner_up = rest[0] if rest else None
    reason = _reason(scored[pick], runner_up, replication, bandwidth)
    if scored[pick].held_back:
        reason += f". Shares held below speed by memory: ranks {list(scored[pick].held_back)}"
    left_out = [s.name for s in scored if not s.fits]
    if left_out:
        reason += f". Over the memory budget {_budgets_text(budgets)}: " + ", ".join(left_out)
    return reason


def _budgets_text(budgets) -> str:
    """The budgets in words: one figure when they are all equal, else one per rank."""
    words = ["no limit" if math.isinf(b) else units.format_bytes(b) for b in budgets]
    if len(set(words)) == 1:
        return f"of {words[0]} per rank"
    return "of " + ", ".join(words) + " (by rank)"


def _replication(replication: str | None, replicated_is_free: bool | None) -> str:
    if replicated_is_free is not None:
        if not isinstance(replicated_is_free, bool):
            raise TypeError(f"replicated_is_free must be True or False, got {replicated_is_free!r}")
        implied = "free" if replicated_is_free else "fetched"
        if replication is not None and replication != implied:
            raise ValueError(
                f"replication={replication!r} contradicts replicated_is_free={replicated_is_free}"
            )
        return implied
    if replication is None:
        return "synced"
    if replication not in REPLICATION:
        raise ValueError(f"replication must be one of {REPLICATION}, got {replication!r}")
    return replication


def _bound_ratio(M, K, N, speeds, best: Candidate, itemsize, accum, replication) -> float:
    """The chosen candidate's most elements moved by one rank over the lower bound's most.

    Both in the bound's terms (:mod:`osmm_jax._src.planning.comm_bound`): what a rank gets beyond the
    inputs it owns and delivers beyond the C it owns, plus its share of the sync. The bound
    limits that sum, not the larger of a rank's sent and received bytes that the model prices
    (``Candidate.link_elements`` may even be under the bound: a rank that gets ``x`` and
    delivers ``y`` moves ``x + y`` here, ``max(x, y)`` or more on its link)."""
    bound = max(comm_bound.rank_bounds(M, K, N, speeds))
    moved = best.moved_elements + best.sync_bytes / accum
    if bound <= 0:
        return 1.0 if moved == 0 else math.inf
    return moved / bound


def _describe(c: Candidate, replication: str, bandwidth: float) -> str:
    replicated = {"rows": "B", "cols": "A"}.get(c.name) if replication != "fetched" else None
    if c.comm_seconds == 0:
        comm = "no communication"
        if replicated:
            comm += f" ({replicated} assumed already on every rank)"
    else:
        comm = f"{c.comm_seconds:.3g} s moving {units.format_bytes(c.comm_seconds * bandwidth)}"
        if c.sync_bytes:
            comm += (
                f" (keeping the copies of {replicated} in sync: {units.format_bytes(c.sync_bytes)})"
            )
    return f"{c.compute_seconds:.3g} s of compute on the slowest rank, {comm}"


def _ties(seconds: float, fastest: float) -> bool:
    return seconds <= fastest * (1 + TIE_TOLERANCE)


def _reason(best: Candidate, runner_up, replication: str, bandwidth: float) -> str:
    text = f"{best.name}: {_describe(best, replication, bandwidth)}"
    if runner_up is None:
        return text + " (the only candidate)"
    if _ties(runner_up.predicted_seconds, best.predicted_seconds):
        versus = f"within {TIE_TOLERANCE:.1%}: a tie, which goes to the one moving fewer bytes"
    elif math.isinf(runner_up.predicted_seconds):
        versus = "cannot run (a rank with work has speed 0)"
    else:
        pct = 100 * (runner_up.predicted_seconds / best.predicted_seconds - 1)
        versus = f"{runner_up.predicted_seconds:.3g} s, +{pct:.0f}%"
    return (
        f"{text}; total {best.predicted_seconds:.3g} s. Runner-up {runner_up.name} ({versus}): "
        f"{_describe(runner_up, replication, bandwidth)}"
    )
