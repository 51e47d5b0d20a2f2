"""The planner: which rank multiplies which sub-blocks, and where results go.

Given the layouts of A (M x K), B (K x N) and C (M x N), the planner cuts each
dimension at every block boundary of the two layouts that share it (M at A's
and C's row boundaries, K at A's column and B's row boundaries, N at B's and
C's column boundaries). Every resulting cell ``(m, k, n)`` is one sub-product
``A[m, k] @ B[k, n]`` that contributes to ``C[m, n]``; inside a cell each
operand piece has a fixed set of owners (one rank, or all ranks when
replicated). This is the index arithmetic ("slicing") of Brock & Golin,
arXiv 2510.08874.

For each cell and each rank that must end up with ``C[m, n]``:

* a C owner that also owns both input pieces computes the cell for itself;
* the other C owners are served by ONE rank that delivers the cell by
  one-sided RMA: one of the self-serving owners if there are any (so no cell is
  computed twice just to save a send), otherwise a candidate (an owner of A,
  B or C) that moves the fewest elements (inputs it lacks, fetched by ``get``,
  plus results it must send). Among equally cheap candidates the choice
  minimises the busiest rank's modelled time, its flops at its speed plus the
  bytes it sends at the link's bandwidth (see :func:`choose_servers`): on equal
  2-D grids every rank then does the same work, as in SUMMA or stationary-C,
  at no more traffic. The plan knows no measured speeds; it takes them from
  the layouts (:func:`rank_speeds`).

Partials a rank delivers to the same C rectangle of the same target are summed
locally first, so each (origin, target, C cell) pair costs one transfer: a
``put`` when it is the only contribution that rectangle receives, else an
``accumulate``.

Pure Python, deterministic and identical on every rank; imports neither JAX
nor MPI.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import hashlib
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from osmm_jax._src.layout import Interval, Layout

FLOAT32_BYTES = 4

NOMINAL_SPEED = 100e9
"""Flops/s the balance model gives a rank of relative speed 1 (XLA's CPU dot measured 90-160
GFLOP/s here). Only its ratio to :data:`NOMINAL_BANDWIDTH` steers the plan."""

NOMINAL_BANDWIDTH = 5e9
"""Bytes/s the balance model gives every rank's outgoing link (one-sided accumulates measured
4-10 GiB/s between ranks of one machine; the same default as :func:`osmm_jax.auto_layouts`)."""


def _size(iv: Interval) -> int:
    return iv[1] - iv[0]


def _fmt(iv: Interval) -> str:
    return f"{iv[0]}:{iv[1]}"


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class LocalMultiply:
    """One GEMM on ``rank``: ``A[rows, inner] @ B[inner, cols]`` (global indices).

    ``a_source``/``b_source`` is the rank whose block holds the input piece:
    ``rank`` itself when it is local, otherwise the piece is fetched by a ``get``
    first. ``primary`` marks the one product of each cell that the all-reduce
    path counts (one-sided plans may compute a cell on several ranks when each
    of them needs it and owns its inputs).
    """

    rank: int
    rows: Interval
    inner: Interval
    cols: Interval
    a_source: int
    b_source: int
    primary: bool

    @property
    def flops(self) -> int:
        return 2 * _size(self.rows) * _size(self.inner) * _size(self.cols)


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class Transfer:
    """One one-sided RMA operation, issued by ``origin`` on ``target``'s window.

    ``op`` is ``"get"`` (origin reads ``matrix`` ``"A"``/``"B"`` from target's
    block), ``"accumulate"`` or ``"put"`` (origin adds / writes its partial of
    C into target's C block). ``rows``/``cols`` are the global rectangle;
    ``inner`` lists the K ranges whose products the origin sums into a C
    partial before sending it (empty for gets).
    """

    op: str
    matrix: str
    origin: int
    target: int
    rows: Interval
    cols: Interval
    inner: tuple[Interval, ...] = ()

    @property
    def elements(self) -> int:
        return _size(self.rows) * _size(self.cols)

    @property
    def sender(self) -> int:
        """The rank whose memory the data leaves (the owner, for a get)."""
        return self.target if self.op == "get" else self.origin

    @property
    def receiver(self) -> int:
        """The rank whose memory the data arrives in (the rank that gets, for a get)."""
        return self.origin if self.op == "get" else self.target

    def nbytes(self, input_itemsize: int, accum_itemsize: int) -> int:
        """Bytes moved: gets carry ``input_itemsize`` bytes per element, C partials
        (accumulate, put) ``accum_itemsize``."""
        return self.elements * (input_itemsize if self.op == "get" else accum_itemsize)


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class LocalUpdate:
    """``rank`` adds the sum of its products over ``inner`` into its own C block at ``rows x cols``."""

    rank: int
    rows: Interval
    cols: Interval
    inner: tuple[Interval, ...]


def rank_speeds(a: Layout, b: Layout, c: Layout) -> tuple[float, ...]:
    """The relative speed (mean 1) the planner assumes for each rank: its share of C's area.

    A plan is a function of its layouts alone (equal layouts, equal plan, on every rank and in
    every cache), so it is not told the ranks' measured speeds. Layouts made from speeds
    (:func:`osmm_jax.balance`, :func:`osmm_jax.auto_layouts`) already carry them: each rank's
    block of the output is in proportion to its speed, and stationary-C work (each rank
    computes its own block of C) is then balanced. So a rank's speed is taken as its C area
    over the mean; when C is replicated, from A's areas, then B's; equal when every operand is
    replicated or uniform. A rank with an empty block is taken as a hundredth of the mean, so
    it is given work only when nothing cheaper is possible. Equal-sized 2-D grids therefore
    balance plain flops.
    """
    nranks = a.nranks
    for layout in (c, a, b):
        if layout.is_replicated:
            continue
        areas = [_area(layout, r) for r in range(nranks)]
        total = sum(areas)
        if total:
            return tuple(max(x * nranks / total, 0.01) for x in areas)
    return (1.0,) * nranks


class Balance(NamedTuple):
    """The modelled time of each rank of a plan (see :meth:`Plan.balance`).

    ``compute[r]`` is rank ``r``'s flops at its speed, ``communicate[r]`` its bytes sent at the
    link's bandwidth, ``seconds[r]`` their sum; ``busiest`` the rank with the largest sum and
    ``ratio`` that sum over the mean (1.0 when nothing is done).
    """

    compute: tuple[float, ...]
    communicate: tuple[float, ...]
    seconds: tuple[float, ...]
    busiest: int
    ratio: float


class Plan:
    """The complete schedule of one distributed product C = A @ B.

    Immutable, hashable and identical on every rank; equality and hashing use
    the three layouts and the communicator key only (everything else derives
    from them). Build it with :func:`osmm_jax.plan`.

    Attributes:
        a, b, c: the layouts of A (M x K), B (K x N) and C (M x N).
        comm_key: identifies the communicator the plan runs on (0 = none).
        multiplies: every :class:`LocalMultiply`, ordered by rank.
        transfers: every :class:`Transfer` (gets, then C deliveries), ordered by
            origin; each origin's deliveries start at the next rank and wrap
            around, so ranks do not all target the same owner at once.
        local_updates: every :class:`LocalUpdate`.
        gather_stage: for a replicated C that is cheaper to sum as "reduce-scatter,
            then all-gather": the plan of the same product into an even row (or
            column) split of C, whose multiplies, deliveries and local updates
            this plan runs; None otherwise.
        compute_at_inputs: whether cells are computed where both inputs are
            (set on gather stages).
        gathers: the C blocks each rank then gets from their owners in
            ``gather_stage`` (``Transfer("get", "C", ...)``, also listed in
            ``transfers``); empty unless staged.
    """

    def __init__(
        self, a: Layout, b: Layout, c: Layout, comm_key: int = 0, *, compute_at_inputs=False
    ):
        _check_layouts(a, b, c)
        self.a, self.b, self.c = a, b, c
        self.comm_key = int(comm_key)
        self.compute_at_inputs = bool(compute_at_inputs)
        multiplies, transfers, local_updates = _schedule(a, b, c, self.compute_at_inputs)
        gather_stage, gathers = None, ()
        stage = _gather_stage(a, b, c, self.comm_key)
        if stage is not None:
            # Reduce-scatter, then all-gather: C is summed into an even split first (the
            # stage's own schedule), and every rank then gets the blocks it lacks.
            staged_gathers = _gathers(stage.c)
            staged = per_rank_totals(
                stage.transfers + staged_gathers, a.nranks, "sender", "elements"
            )
            direct = per_rank_totals(transfers, a.nranks, "sender", "elements")
            direct_flops = per_rank_totals(multiplies, a.nranks, "rank", "flops")
            if max(staged) < max(direct) and all(s <= d for s, d in zip(stage.flops, direct_flops)):
                gather_stage, gathers = stage, staged_gathers
                multiplies, local_updates = stage.multiplies, stage.local_updates
                transfers = stage.transfers + staged_gathers
        self.multiplies, self.transfers, self.local_updates = multiplies, transfers, local_updates
        self.gather_stage: Plan | None = gather_stage
        self.gathers: tuple[Transfer, ...] = gathers

    # -- identity -----------------------------------------------------------

    def _key(self):
        return (self.a, self.b, self.c, self.comm_key, self.compute_at_inputs)

    def __eq__(self, other):
        return isinstance(other, Plan) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __setattr__(self, name, value):
        if name in self.__dict__:
            raise AttributeError(f"Plan is immutable: cannot set {name!r}")
        super().__setattr__(name, value)

    def __repr__(self):
        M, K, N = self.dims
        return f"Plan(C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {self.nranks} ranks, {self.a.kind}/{self.b.kind}/{self.c.kind})"

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the layouts, equal on two ranks iff they built the same plan."""
        text = repr(
            (
                self.a.shape,
                self.a.blocks,
                self.a.is_replicated,
                self.b.shape,
                self.b.blocks,
                self.b.is_replicated,
                self.c.shape,
                self.c.blocks,
                self.c.is_replicated,
                self.compute_at_inputs,
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- sizes --------------------------------------------------------------

    @property
    def nranks(self) -> int:
        return self.a.nranks

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(M, K, N)``."""
        return (self.a.shape[0], self.a.shape[1], self.b.shape[1])

    @functools.cached_property
    def flops(self) -> tuple[int, ...]:
        """Floating-point operations (2 per multiply-add) each rank performs."""
        return per_rank_totals(self.multiplies, self.nranks, "rank", "flops")

    def bytes_sent(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes leaving each rank's memory per product, counted at the SENDER.

        A rank is charged for the C partials it accumulates or puts into other ranks'
        blocks and for the A/B pieces other ranks get from its blocks (a get is charged
        to the owner, not to the rank that issues it). This is the load on each rank's
        outgoing link, the figure :func:`osmm_jax.auto_layouts` and :func:`osmm_jax.plot_plan`
        use. A/B pieces count ``input_itemsize`` bytes per element, C partials
        ``accum_itemsize`` (the accumulation type: 4 for float32/bfloat16/float16, 8 for
        float64); both default to float32. For what each rank's own RMA calls move, see
        :meth:`bytes_issued`.
        """
        return per_rank_totals(
            self.transfers, self.nranks, "sender", _nbytes(input_itemsize, accum_itemsize)
        )

    @functools.cached_property
    def speeds(self) -> tuple[float, ...]:
        """The relative speed (mean 1) the plan was balanced for: see :func:`rank_speeds`."""
        return rank_speeds(self.a, self.b, self.c)

    def balance(
        self,
        speeds=None,
        bandwidth: float = NOMINAL_BANDWIDTH,
        input_itemsize: int = FLOAT32_BYTES,
        accum_itemsize: int = FLOAT32_BYTES,
    ) -> Balance:
        """Each rank's modelled time: its flops at its speed plus its :meth:`bytes_sent` at
        ``bandwidth`` bytes/s, the quantity whose maximum the planner keeps low.

        ``speeds`` are flops/s per rank; by default :attr:`speeds` times :data:`NOMINAL_SPEED`.
        """
        if speeds is None:
            speeds = [s * NOMINAL_SPEED for s in self.speeds]
        if len(speeds) != self.nranks:
            raise ValueError(f"{len(speeds)} speeds for a plan over {self.nranks} ranks")
        compute = tuple(
            (f / s if s > 0 else float("inf")) if f else 0.0 for f, s in zip(self.flops, speeds)
        )
        communicate = tuple(b / bandwidth for b in self.bytes_sent(input_itemsize, accum_itemsize))
        seconds = tuple(x + y for x, y in zip(compute, communicate))
        busiest = max(range(self.nranks), key=lambda r: (seconds[r], -r))
        mean = sum(seconds) / self.nranks
        return Balance(
            compute, communicate, seconds, busiest, seconds[busiest] / mean if mean else 1.0
        )

    def plot(self, **kwargs):
        """A matplotlib Figure of the A, B and C tilings and the bytes each rank sends to each
        other rank; see :func:`osmm_jax.plot_plan` (needs matplotlib: the ``plot`` extra)."""
        from osmm_jax._src.plot import plot_plan  # lazily: plot imports this module

        return plot_plan(self, **kwargs)

    def backward(self) -> tuple[Plan, Plan]:
        """The plans of the backward products ``(dA = dC @ B.T, dB = A.T @ dC)``."""
        return backward_plans(self)

    def bytes_issued(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes moved by the RMA operations each rank issues per product, counted at the ISSUER.

        A rank is charged for its own gets (the pieces it reads from other ranks) and for
        the C partials it accumulates or puts; nothing for what others get from it. This is
        what ``osmm_jax.stats()['rma_bytes']`` measures per product. Item sizes as in
        :meth:`bytes_sent`, whose totals over all ranks are the same.
        """
        return per_rank_totals(
            self.transfers, self.nranks, "origin", _nbytes(input_itemsize, accum_itemsize)
        )

    # -- per-rank views used by the executors -------------------------------

    def multiplies_on(self, rank: int) -> tuple[LocalMultiply, ...]:
        return tuple(m for m in self.multiplies if m.rank == rank)

    def gets_by(self, rank: int) -> tuple[Transfer, ...]:
        """The A and B pieces ``rank`` gets before it multiplies."""
        return tuple(
            t for t in self.transfers if t.op == "get" and t.matrix != "C" and t.origin == rank
        )

    def deliveries_from(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.op != "get" and t.origin == rank)

    def local_updates_on(self, rank: int) -> tuple[LocalUpdate, ...]:
        return tuple(u for u in self.local_updates if u.rank == rank)

    @functools.cached_property
    def has_gets(self) -> bool:
        """Whether any rank gets A or B pieces (the gathers of a staged plan do not count)."""
        return any(t.op == "get" and t.matrix != "C" for t in self.transfers)

    @functools.cached_property
    def has_deliveries(self) -> bool:
        return any(t.op != "get" for t in self.transfers)

    def exposes(self, rank: int) -> tuple[bool, bool]:
        """Whether other ranks get pieces of ``rank``'s A block, and of its B block."""
        gets = [t for t in self.transfers if t.op == "get" and t.target == rank]
        return (any(t.matrix == "A" for t in gets), any(t.matrix == "B" for t in gets))

    def gathers_by(self, rank: int) -> tuple[Transfer, ...]:
        """The C blocks ``rank`` gets after the reduction of a staged plan (see ``gather_stage``)."""
        return tuple(t for t in self.gathers if t.origin == rank)

    @functools.cached_property
    def expose_elements(self) -> tuple[int, int]:
        """Largest A block and largest B block any rank exposes (sizes every rank's window to fit)."""
        largest = []
        for matrix, layout in (("A", self.a), ("B", self.b)):
            gets = (t for t in self.transfers if t.op == "get" and t.matrix == matrix)
            served = per_rank_totals(gets, self.nranks, "target", lambda t: 1)
            exposed = [_area(layout, r) for r in range(self.nranks) if served[r]]
            largest.append(max(exposed, default=0))
        return (largest[0], largest[1])

    @functools.cached_property
    def receive_elements(self) -> int:
        """Largest C block of any rank (sizes every rank's reduce window; 0 if nothing is delivered).

        Every rank's window must hold its own C block, receiver or not: the
        native reduce adds the window to the local partial.
        """
        if not self.has_deliveries:
            return 0
        return max(_area(self.c, r) for r in range(self.nranks))

    # -- reporting ----------------------------------------------------------

    def describe(self, max_lines: int = 40) -> str:
        """A readable summary: layouts, who multiplies what, who sends how much to whom."""
        M, K, N = self.dims
        lines = [
            f"C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {self.nranks} ranks",
            f"  A: {self.a.kind}   B: {self.b.kind}   C: {self.c.kind}",
            f"  total {sum(self.flops) / 1e9:.3f} GFLOP, {sum(self.bytes_sent()) / 2**20:.2f} MiB sent (float32)",
        ]
        balance = self.balance()
        r = balance.busiest
        lines.append(
            f"  balance: busiest rank {r} at {balance.ratio:.2f}\u00d7 the mean "
            f"(flops {balance.compute[r]:.3g} s + bytes {balance.communicate[r]:.3g} s at "
            f"{NOMINAL_SPEED / 1e9:g} GFLOP/s x relative speed, {NOMINAL_BANDWIDTH / 1e9:g} GB/s)"
        )
        reasons = {self.a.reason, self.b.reason, self.c.reason}
        if len(reasons) == 1 and reasons != {""}:  # chosen together, e.g. by auto_layouts
            lines.append(f"  {reasons.pop()}")
        pair_bytes: dict[tuple[int, int, str], int] = defaultdict(int)
        for t in self.transfers:
            pair_bytes[(t.sender, t.receiver, t.op)] += t.nbytes(FLOAT32_BYTES, FLOAT32_BYTES)
        sent = self.bytes_sent()
        # One pass over the plan for all ranks (not one per rank: P times the plan's size).
        sends_by: list[list[str]] = [[] for _ in range(self.nranks)]
        for (src, dst, op), nbytes in sorted(pair_bytes.items()):
            sends_by[src].append(f"{op} -> {dst}: {nbytes / 2**20:.2f} MiB")
        counts = per_rank_totals(self.multiplies, self.nranks, "rank", lambda m: 1)
        for r in range(self.nranks):
            sends = ", ".join(sends_by[r])
            lines.append(
                f"  rank {r}: {counts[r]} multiplies, {self.flops[r] / 1e9:.3f} GFLOP, "
                f"sends {sent[r] / 2**20:.2f} MiB" + (f" ({sends})" if sends else "")
            )
        detail = ["  multiplies:"] + [
            f"    rank {m.rank}: A[{_fmt(m.rows)}, {_fmt(m.inner)}]{_src(m.a_source, m.rank)} @ "
            f"B[{_fmt(m.inner)}, {_fmt(m.cols)}]{_src(m.b_source, m.rank)} -> C[{_fmt(m.rows)}, {_fmt(m.cols)}]"
            for m in self.multiplies
        ]
        if self.transfers:
            detail += ["  transfers:"] + [
                f"    rank {t.origin} {t.op} {t.matrix}[{_fmt(t.rows)}, {_fmt(t.cols)}] "
                f"{'from' if t.op == 'get' else 'into'} rank {t.target} ({t.elements} elements)"
                for t in self.transfers
            ]
        if len(detail) > max_lines:
            detail = detail[:max_lines] + [f"  ... {len(detail) - max_lines} more lines"]
        return "\n".join(lines + detail)


def _src(source: int, rank: int) -> str:
    return "" if source == rank else f"(from {source})"


def _area(layout: Layout, rank: int) -> int:
    rows, cols = layout.local_shape(rank)
    return rows * cols


def per_rank_totals(
    items: Iterable, nranks: int, by: str | tuple[str, ...], amount: str | Callable[[Any], int]
) -> tuple:
    """Sum a per-item quantity into one bucket per rank.

    ``by`` names the item attribute that holds the bucket's rank: ``"rank"`` of a
    :class:`LocalMultiply`; ``"sender"``, ``"receiver"``, ``"origin"`` (the issuer) or
    ``"target"`` of a :class:`Transfer`. ``amount`` is an attribute name (``"flops"``,
    ``"elements"``) or a function of the item. Returns ``nranks`` totals; with two names, e.g.
    ``("sender", "receiver")``, an ``nranks x nranks`` table as a tuple of rows.
    """
    names = (by,) if isinstance(by, str) else tuple(by)
    value = operator.attrgetter(amount) if isinstance(amount, str) else amount
    totals = [0] * nranks ** len(names)
    for item in items:
        index = 0
        for name in names:
            index = index * nranks + getattr(item, name)
        totals[index] += value(item)
    for _ in names[1:]:
        totals = [tuple(totals[i : i + nranks]) for i in range(0, len(totals), nranks)]
    return tuple(totals)


def _nbytes(input_itemsize: int, accum_itemsize: int) -> Callable[[Transfer], int]:
    return lambda t: t.nbytes(input_itemsize, accum_itemsize)


def _gather_stage(a: Layout, b: Layout, c: Layout, comm_key: int) -> Plan | None:
    """For a replicated C, the plan of the same product into an even split of C, or None.

    Summing a replicated C directly makes every contributing rank send its whole partial to
    every other rank: (P - 1) copies of C per rank. Reducing into an even split first and then
    getting the other blocks moves about 2 (P - 1) / P copies, like a ring all-reduce, and
    leaves every rank with bit-identical values. The stage keeps the products where the
    inputs are (``compute_at_inputs``), so the split of work the layouts chose (e.g. batch
    rows in proportion to speed) stays; the caller keeps the stage only if it moves less and
    gives no rank more work.
    """
    if not c.is_replicated or c.nranks < 3:
        return None
    M, N = c.shape
    if M >= N:
        split = Layout.rows(c.shape, nranks=c.nranks)
    else:
        split = Layout.cols(c.shape, nranks=c.nranks)
    return Plan(a, b, split, comm_key, compute_at_inputs=True)


def _gathers(split: Layout) -> tuple[Transfer, ...]:
    """Every rank gets every other rank's block of ``split`` (rotated by origin, as deliveries)."""
    n = split.nranks
    gathers = []
    for origin in range(n):
        for step in range(1, n):
            owner = (origin + step) % n
            rows, cols = split.blocks[owner]
            if rows[1] > rows[0] and cols[1] > cols[0]:
                gathers.append(Transfer("get", "C", origin, owner, rows, cols))
    return tuple(gathers)


def _check_layouts(a: Layout, b: Layout, c: Layout) -> None:
    for name, layout in (("a_layout", a), ("b_layout", b), ("c_layout", c)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{name} must be an osmm_jax.Layout, got {type(layout).__name__}")
    if not (a.nranks == b.nranks == c.nranks):
        raise ValueError(
            f"the layouts are for different numbers of ranks: A {a.nranks}, B {b.nranks}, C {c.nranks}"
        )
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"inner dimensions do not match: A is {M}x{K} but B is {K2}x{N}")
    if c.shape != (M, N):
        raise ValueError(f"C layout has shape {c.shape} but A @ B is {M}x{N}")


def _cuts(extent: int, *bounds_lists) -> tuple[Interval, ...]:
    points = {0, extent}
    for bounds in bounds_lists:
        for lo, hi in bounds:
            points.update((lo, hi))
    points = sorted(points)
    return tuple((lo, hi) for lo, hi in zip(points, points[1:]) if hi > lo)


def _owner_table(layout: Layout, row_cells, col_cells) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``layout.owners(r, c)`` for every cell ``r x c`` of the cuts, in O(cells + P log P).

    The cuts include every block bound of ``layout``, so each (non-empty) cell lies inside
    whole blocks: all ranks for a replicated layout, else exactly one non-empty block. Each
    block fills the cells it covers (found by bisection) instead of every cell scanning every
    block; equal entries are one shared tuple.
    """
    if not row_cells or not col_cells:
        return tuple(() for _ in row_cells)
    if layout.is_replicated:
        row = (tuple(range(layout.nranks)),) * len(col_cells)
        return (row,) * len(row_cells)
    row_starts = [lo for lo, _ in row_cells]
    col_starts = [lo for lo, _ in col_cells]
    table: list[list[tuple[int, ...] | None]] = [[None] * len(col_cells) for _ in row_cells]
    for rank, ((r0, r1), (c0, c1)) in enumerate(layout.blocks):
        if r0 == r1 or c0 == c1:
            continue  # an empty block holds no (non-empty) cell
        i0, i1 = bisect.bisect_left(row_starts, r0), bisect.bisect_left(row_starts, r1)
        j0, j1 = bisect.bisect_left(col_starts, c0), bisect.bisect_left(col_starts, c1)
        fill = [(rank,)] * (j1 - j0)
        for i in range(i0, i1):
            table[i][j0:j1] = fill
    return tuple(
        tuple(
            layout.owners(r, c) if owners is None else owners
            for c, owners in zip(col_cells, table_row)
        )
        for r, table_row in zip(row_cells, table)
    )


def _as_set(owners: tuple[int, ...], memo: dict) -> frozenset[int]:
    """``frozenset(owners)``, made once per table entry while ``memo`` lives."""
    found = memo.get(id(owners))
    if found is None:
        found = memo[id(owners)] = (owners, frozenset(owners))
    return found[1]


def _lookup(owners: tuple[int, ...], memo: dict) -> tuple[int, ...] | frozenset[int]:
    """A container with the ranks of ``owners`` and fast ``in``: the tuple itself when short, else
    a set (made once per table entry; owner tables share equal entries, so a replicated operand
    makes one)."""
    return owners if len(owners) <= 8 else _as_set(owners, memo)


# The schedule is built in four passes, each a function of the previous ones' results:
# cut_cells (the cells and who owns each operand piece), serve_self (cells whose C owner holds
# both inputs), choose_servers (one server for each cell some C owner cannot compute) and
# emit_schedule (the multiplies, transfers and local updates, in executor order).


@dataclass(frozen=True)
class Cells:
    """The cells of ``C = A @ B``: each dimension cut at every block boundary of the layouts that
    share it, and the ranks holding each operand piece.

    ``m``, ``k``, ``n`` are the cut intervals of M, K and N; cell ``(mi, ki, ni)`` is the
    sub-product ``A[m[mi], k[ki]] @ B[k[ki], n[ni]]``. ``a_owners[mi][ki]`` are the ranks whose
    A block holds ``A[m[mi], k[ki]]``, ``b_owners[ki][ni]`` likewise for B, and
    ``c_owners[mi][ni]`` the ranks that must end up with ``C[m[mi], n[ni]]``.
    """

    m: tuple[Interval, ...]
    k: tuple[Interval, ...]
    n: tuple[Interval, ...]
    a_owners: tuple[tuple[tuple[int, ...], ...], ...]
    b_owners: tuple[tuple[tuple[int, ...], ...], ...]
    c_owners: tuple[tuple[tuple[int, ...], ...], ...]
    nranks: int

    def flops(self, mi: int, ki: int, ni: int) -> int:
        return 2 * _size(self.m[mi]) * _size(self.k[ki]) * _size(self.n[ni])


@dataclass
class Assignment:
    """Who computes which cell and where its partial goes, as the passes decide it.

    Attributes:
        products: ``(rank, mi, ki, ni) -> primary``: ``rank`` computes the cell; ``primary``
            marks the one copy of each cell the all-reduce path counts.
        deliveries: ``(origin, target, mi, ni) -> [ki, ...]``: the K cells whose products
            ``origin`` sums into ``target``'s ``C[m[mi], n[ni]]`` (``origin == target``: a
            local update), in the order they were assigned.
        load: the flops each rank has been given so far.
    """

    products: dict[tuple[int, int, int, int], bool]
    deliveries: defaultdict[tuple[int, int, int, int], list[int]]
    load: list[int]


class Unserved(NamedTuple):
    """A cell that some of its C owners cannot compute themselves (they lack an input).

    ``self_serving``: the C owners that hold both inputs and compute it for themselves;
    ``remaining``: the C owners the chosen server must deliver it to.
    """

    mi: int
    ki: int
    ni: int
    self_serving: tuple[int, ...]
    remaining: tuple[int, ...]


def cut_cells(a: Layout, b: Layout, c: Layout) -> Cells:
    """Pass 1: the cells of the product and the owner tables of its three operands."""
    M, K = a.shape
    N = b.shape[1]
    m = _cuts(M, [blk[0] for blk in a.blocks], [blk[0] for blk in c.blocks])
    k = _cuts(K, [blk[1] for blk in a.blocks], [blk[0] for blk in b.blocks])
    n = _cuts(N, [blk[1] for blk in b.blocks], [blk[1] for blk in c.blocks])
    return Cells(
        m, k, n, _owner_table(a, m, k), _owner_table(b, k, n), _owner_table(c, m, n), a.nranks
    )


def serve_self(cells: Cells) -> tuple[Assignment, list[Unserved]]:
    """Pass 2: every C owner that holds both inputs of a cell computes it for itself.

    Returns the assignment so far and the cells left to :func:`choose_servers`, in
    ``(mi, ni, ki)`` order. A cell every C owner computes itself is primary on the lowest of
    them. Counting all of this load first lets the next pass break cost ties by the work ranks
    really end up with.
    """
    assignment = Assignment({}, defaultdict(list), [0] * cells.nranks)
    products, deliveries, load = assignment.products, assignment.deliveries, assignment.load
    unserved = []
    memo: dict = {}
    k_sizes = [_size(k) for k in cells.k]
    for mi, ni in itertools.product(range(len(cells.m)), range(len(cells.n))):
        owners_c = cells.c_owners[mi][ni]
        if not owners_c:
            continue
        a_row, mn = cells.a_owners[mi], 2 * _size(cells.m[mi]) * _size(cells.n[ni])
        for ki in range(len(cells.k)):
            in_a, in_b = _lookup(a_row[ki], memo), _lookup(cells.b_owners[ki][ni], memo)
            self_serving = tuple(r for r in owners_c if r in in_a and r in in_b)
            if self_serving:
                flops = mn * k_sizes[ki]
                for r in self_serving:
                    products[(r, mi, ki, ni)] = False
                    deliveries[(r, r, mi, ni)].append(ki)
                    load[r] += flops
                if len(self_serving) == len(owners_c):
                    products[(min(self_serving), mi, ki, ni)] = True
                    continue
                serving = self_serving if len(self_serving) <= 8 else frozenset(self_serving)
                remaining = tuple(r for r in owners_c if r not in serving)
            else:
                remaining = owners_c
            unserved.append(Unserved(mi, ki, ni, self_serving, remaining))
    return assignment, unserved


def moved(cells: Cells, cell: Unserved, server: int) -> int:
    """Elements ``server`` moves to serve ``cell``: the inputs it lacks (fetched by ``get``)
    plus one result per remaining C owner other than itself."""
    m, k, n = cells.m[cell.mi], cells.k[cell.ki], cells.n[cell.ni]
    fetch = (0 if server in cells.a_owners[cell.mi][cell.ki] else _size(m) * _size(k)) + (
        0 if server in cells.b_owners[cell.ki][cell.ni] else _size(k) * _size(n)
    )
    return fetch + _size(m) * _size(n) * sum(1 for r in cell.remaining if r != server)


def server_candidates(
    cells: Cells, cell: Unserved, compute_at_inputs: bool = False, memo: dict | None = None
):
    """The ranks that may serve ``cell``.

    Its self-serving owners if there are any (the cell is computed there anyway: fetching its
    inputs elsewhere would compute it twice); with ``compute_at_inputs`` the ranks holding both
    inputs, if any; otherwise every owner of its A, B or C piece. ``memo`` (a dict the caller
    keeps while ``cells`` lives) lets a large owner set, e.g. a replicated operand's, be made
    once instead of once per cell.
    """
    if cell.self_serving:
        return cell.self_serving
    memo = {} if memo is None else memo
    holders_a = _as_set(cells.a_owners[cell.mi][cell.ki], memo)
    holders_b = _as_set(cells.b_owners[cell.ki][cell.ni], memo)
    if compute_at_inputs:
        holders = holders_a & holders_b
        if holders:
            return holders
    return holders_a | holders_b | _as_set(cells.c_owners[cell.mi][cell.ni], memo)


def choose_servers(
    cells: Cells,
    assignment: Assignment,
    unserved: list[Unserved],
    compute_at_inputs: bool = False,
    speeds: tuple[float, ...] | None = None,
) -> None:
    """Pass 3: one server per unserved cell, added to ``assignment`` (in place).

    Each cell may only go to a candidate (:func:`server_candidates`) that moves the fewest
    elements (:func:`moved`), so the total traffic is the least this cell-by-cell choice can
    give. Among those equally cheap candidates the choice balances the ranks' modelled time,
    ``flops / speed + bytes sent / bandwidth`` (as :meth:`Plan.balance` reports it; ``speeds``
    are the relative speeds of :func:`rank_speeds`, equal when omitted; the bandwidth is
    :data:`NOMINAL_BANDWIDTH` against :data:`NOMINAL_SPEED`):

    1. cells with a single cheapest candidate are placed first (work nobody can avoid);
    2. the tied cells each go to the candidate with the largest shortfall (mean time minus its
       time so far) relative to the tied work it could still take, so that a rank only a few
       cells can feed gets them before ranks with many options; the cells a tight rank can
       take come first, then the largest (on a square 2-D grid this alone mostly reproduces
       stationary-C's perfect balance);
    3. while the busiest rank can hand one of its tied cells to another candidate, directly or
       along a chain of ranks that each pass one of theirs on, so that it finishes sooner and
       every rank involved whose time grows still finishes before the busiest did, it does;
    4. the result is compared with giving each tied cell in turn to its least-loaded
       candidate, and kept only if its busiest rank finishes sooner and the traffic it really
       makes (a piece fetched once per rank, partials of one C rectangle summed before they
       are sent) is no more.

    Ties go to the lower rank; every step is the same arithmetic on the same inputs, so all
    ranks make the same choice.
    """
    nranks = cells.nranks
    speeds = (1.0,) * nranks if speeds is None else speeds
    memo: dict = {}

    def costs(cell: Unserved) -> list[tuple[int, int]]:
        """``(moved(cells, cell, p), p)`` for every candidate ``p``, computed in one go."""
        m, k, n = _size(cells.m[cell.mi]), _size(cells.k[cell.ki]), _size(cells.n[cell.ni])
        in_a = _lookup(cells.a_owners[cell.mi][cell.ki], memo)
        in_b = _lookup(cells.b_owners[cell.ki][cell.ni], memo)
        remaining = cell.remaining
        in_remaining = remaining if len(remaining) <= 8 else frozenset(remaining)
        result = m * n
        return [
            (
                (0 if p in in_a else m * k)
                + (0 if p in in_b else k * n)
                + result * (len(remaining) - (p in in_remaining)),
                p,
            )
            for p in server_candidates(cells, cell, compute_at_inputs, memo)
        ]

    a_owners, b_owners, c_owners = cells.a_owners, cells.b_owners, cells.c_owners
    m_sizes = [_size(iv) for iv in cells.m]
    k_sizes = [_size(iv) for iv in cells.k]
    n_sizes = [_size(iv) for iv in cells.n]
    unique: list[tuple[Unserved, int]] = []
    tied: list[tuple[Unserved, list[int]]] = []
    for cell in unserved:
        mi, ki, ni, self_serving, remaining = cell
        owners_a, owners_b = a_owners[mi][ki], b_owners[ki][ni]
        if self_serving or len(owners_a) != 1 or len(owners_b) != 1 or len(remaining) != 1:
            options = costs(cell)
        else:
            # One owner of each piece, and the one C owner lacks an input (the common case
            # of partitioned layouts): the same costs as costs(), without the sets.
            (a,), (b,), (c,) = owners_a, owners_b, remaining
            m, k, n = m_sizes[mi], k_sizes[ki], n_sizes[ni]
            if compute_at_inputs and a == b:
                candidates: Iterable[int] = (a,)
            else:
                candidates = {a, b, *c_owners[mi][ni]}
            options = [
                (
                    (0 if p == a else m * k) + (0 if p == b else k * n) + (0 if p == c else m * n),
                    p,
                )
                for p in candidates
            ]
        if len(options) == 1:
            unique.append((cell, options[0][1]))
            continue
        cheapest = min(options)[0]
        best = [p for cost, p in options if cost == cheapest]
        if len(best) == 1:
            unique.append((cell, best[0]))
        else:
            tied.append((cell, sorted(best)))

    load, products, deliveries = assignment.load, assignment.products, assignment.deliveries
    per_byte = NOMINAL_SPEED / NOMINAL_BANDWIDTH * FLOAT32_BYTES  # flops per element sent
    inverse_speed = [1.0 / s for s in speeds]

    def charges(cell: Unserved, server: int) -> list[tuple[int, float]]:
        """The time ``server`` serving ``cell`` adds to each rank, in flops at relative speed
        1: the flops on ``server``, each input it lacks on the owner it is fetched from (as
        :func:`emit_schedule` picks it), its partials on itself."""
        mi, ki, ni, self_serving, remaining = cell
        m, k, n = m_sizes[mi], k_sizes[ki], n_sizes[ni]
        owners_a, owners_b = a_owners[mi][ki], b_owners[ki][ni]
        own = 0.0 if server in self_serving else 2 * m * k * n * inverse_speed[server]
        sent = m * n * (len(remaining) - (server in remaining))
        out = [(server, own + sent * per_byte)]
        if server not in (owners_a if len(owners_a) <= 8 else _as_set(owners_a, memo)):
            out.append((owners_a[0], m * k * per_byte))
        if server not in (owners_b if len(owners_b) <= 8 else _as_set(owners_b, memo)):
            out.append((owners_b[0], k * n * per_byte))
        return out

    def place(cell: Unserved, server: int) -> None:
        key = (server, cell.mi, cell.ki, cell.ni)
        if key not in products:
            load[server] += cells.flops(cell.mi, cell.ki, cell.ni)
        products[key] = True
        for r in cell.remaining:
            deliveries[(server, r, cell.mi, cell.ni)].append(cell.ki)

    # The time each rank has so far: the flops serve_self gave it, then the unique cells.
    times = [f * s for f, s in zip(load, inverse_speed)]
    for cell, server in unique:
        place(cell, server)
        for r, t in charges(cell, server):
            times[r] += t
    if not tied:
        return

    # Step 2: shortfall-first greedy over the tied cells.
    base_times = list(times)
    options = [{p: charges(cell, p) for p in best} for cell, best in tied]
    potential = [0.0] * nranks  # tied time each rank could still be given
    total = sum(times)
    for option in options:
        cheapest_total = math.inf
        for p, charge in option.items():
            potential[p] += charge[0][1]
            whole = 0.0
            for _, t in charge:
                whole += t
            cheapest_total = min(cheapest_total, whole)
        total += cheapest_total
    mean = total / nranks
    # Cells a tight rank (one whose possible tied work barely covers its shortfall) can take
    # come first, while the others still have room elsewhere; then the largest first.
    slack = [room / (mean - t) if mean > t else math.inf for room, t in zip(potential, times)]
    sizes = [m_sizes[cell[0]] * k_sizes[cell[1]] * n_sizes[cell[2]] for cell, _ in tied]
    tightest = [min(slack[p] for p in best) for _, best in tied]
    order = sorted(range(len(tied)), key=lambda i: (tightest[i], -sizes[i]))
    chosen = [0] * len(tied)
    for i in order:
        option = options[i]
        server, best_key = -1, None
        for p in option:  # candidates in rank order
            room = potential[p]
            key = (-(mean - times[p]) / room if room > 0 else 0.0, times[p])
            if best_key is None or key < best_key:
                server, best_key = p, key
        chosen[i] = server
        for p, charge in option.items():
            potential[p] -= charge[0][1]
        for r, t in option[server]:
            times[r] += t

    # Step 3: the busiest rank hands a tied cell on, directly or along a chain of ranks that
    # each pass one on (found breadth-first), while the busiest rank involved finishes sooner.
    held: list[list[int]] = [[] for _ in range(nranks)]
    for i, server in enumerate(chosen):
        held[server].append(i)

    def change(i: int, source: int, target: int, into: dict[int, float]) -> None:
        for r, t in options[i][source]:
            into[r] = into.get(r, 0.0) - t
        for r, t in options[i][target]:
            into[r] = into.get(r, 0.0) + t

    def shorter_chain(busiest: int, limit: float):
        """The moves ``[(cell, from, to), ...]`` of the first chain from ``busiest`` after
        which ``busiest`` finishes sooner and every other rank it touches either does not
        finish later or still finishes below ``limit`` (so the number of ranks at the largest
        time only falls: the search ends), and the change in each touched rank's time; or
        None."""
        parent: dict[int, tuple[int, int]] = {busiest: (-1, -1)}
        frontier = [busiest]
        while frontier:
            following = []
            for u in frontier:
                for i in held[u]:
                    for p in options[i]:
                        if p in parent:
                            continue
                        parent[p] = (u, i)
                        following.append(p)
                        if times[p] + options[i][p][0][1] >= limit:
                            continue  # the last rank of this chain would not finish sooner
                        moves, v = [], p
                        while v != busiest:
                            w, j = parent[v]
                            moves.append((j, w, v))
                            v = w
                        after: dict[int, float] = {}
                        for j, w, v in moves:
                            change(j, w, v, after)
                        if times[busiest] + after[busiest] < limit and all(
                            d <= 0 or times[r] + d < limit for r, d in after.items()
                        ):
                            return moves, after
            frontier = following
        return None

    for _ in range(4 * len(tied)):
        busiest = max(range(nranks), key=lambda r: (times[r], -r))
        found = shorter_chain(busiest, times[busiest] * (1 - 1e-9))
        if found is None:
            break
        moves, after = found
        for r, d in after.items():
            times[r] += d
        for i, source, target in moves:
            held[source].remove(i)
            held[target].append(i)
            chosen[i] = target

    # Step 4: the model above counts every fetch and partial once per cell, but a rank fetches a
    # piece once for all its cells and sums the partials of one C rectangle before sending. So
    # the choices are compared with giving each tied cell, in turn, to the least-loaded of its
    # candidates; the balanced ones stand only if they finish sooner and move no more.
    plain = []
    plain_load = list(load)
    for cell, best in tied:
        server = min(best, key=lambda p: (plain_load[p], p))
        if (server, cell.mi, cell.ki, cell.ni) not in products:
            plain_load[server] += 2 * m_sizes[cell.mi] * k_sizes[cell.ki] * n_sizes[cell.ni]
        plain.append(server)
    if plain != chosen:
        plain_times = base_times
        for option, server in zip(options, plain):
            for r, t in option[server]:
                plain_times[r] += t
        if max(plain_times) <= max(times) or _more_traffic(
            cells, unique, tied, chosen, plain, memo
        ):
            chosen = plain
    for (cell, _best), server in zip(tied, chosen):
        place(cell, server)


def _more_traffic(
    cells: Cells,
    placed: list[tuple[Unserved, int]],
    tied: list[tuple[Unserved, list[int]]],
    servers: list[int],
    other: list[int],
    memo: dict,
) -> bool:
    """Whether serving the ``tied`` cells by ``servers`` makes more transfer elements than by
    ``other``, given the ``placed`` cells' transfers, counting as :func:`emit_schedule` makes
    them: one fetch of an input piece per rank, one partial per target and C rectangle.

    Only the fetches and partials of cells whose server differs can differ; the rest (placed
    cells, and tied cells served alike) only decide which of those are already made.
    """
    a_owners, b_owners = cells.a_owners, cells.b_owners
    m_sizes = [_size(iv) for iv in cells.m]
    k_sizes = [_size(iv) for iv in cells.k]
    n_sizes = [_size(iv) for iv in cells.n]

    def transfers(cell: Unserved, server: int) -> list[tuple[tuple[int, ...], int]]:
        mi, ki, ni, _self_serving, remaining = cell
        out = []
        if server not in _lookup(a_owners[mi][ki], memo):
            out.append(((server, -1, mi, ki), m_sizes[mi] * k_sizes[ki]))
        if server not in _lookup(b_owners[ki][ni], memo):
            out.append(((server, -2, ki, ni), k_sizes[ki] * n_sizes[ni]))
        result = m_sizes[mi] * n_sizes[ni]
        out.extend(((server, r, mi, ni), result) for r in remaining if r != server)
        return out

    made: list[dict] = [{}, {}]
    for (cell, _best), first, second in zip(tied, servers, other):
        if first != second:
            for choice, server in zip(made, (first, second)):
                choice.update(transfers(cell, server))
    wanted = made[0].keys() | made[1].keys()
    # Which of those the other cells make anyway: a key is only built when it could match
    # (whether the server lacks the piece need not be checked: a key in ``wanted`` is a fetch
    # of a piece that server lacks).
    made_anyway = set()
    common = itertools.chain(
        placed,
        (
            (cell, first)
            for (cell, _), first, second in zip(tied, servers, other)
            if first == second
        ),
    )
    for (mi, ki, ni, _self_serving, remaining), server in common:
        for key in ((server, -1, mi, ki), (server, -2, ki, ni)):
            if key in wanted:
                made_anyway.add(key)
        for r in remaining:
            key = (server, r, mi, ni)
            if r != server and key in wanted:
                made_anyway.add(key)
    first_total, second_total = (
        sum(size for key, size in choice.items() if key not in made_anyway) for choice in made
    )
    return first_total > second_total


def emit_schedule(
    cells: Cells, assignment: Assignment
) -> tuple[tuple[LocalMultiply, ...], tuple[Transfer, ...], tuple[LocalUpdate, ...]]:
    """Pass 4: the multiplies, transfers and local updates of a finished assignment.

    Multiplies are ordered by ``(rank, mi, ki, ni)``; each takes an input piece from its own
    block when it has it, else from the piece's first owner by a ``get``. Transfers are the
    gets, then the C deliveries, each ordered by origin and, within an origin, by target
    starting at the next rank (see :class:`Plan`); a delivery is a ``put`` when it is the only
    contribution its rectangle receives, else an ``accumulate``. Local updates are ordered by
    ``(rank, rows, cols)``.
    """
    multiplies = []
    gets = {}
    memo: dict = {}
    products = assignment.products
    for key in sorted(products):  # the keys alone: no (key, value) pair per product
        rank, mi, ki, ni = key
        m, k, n = cells.m[mi], cells.k[ki], cells.n[ni]
        owners_a, owners_b = cells.a_owners[mi][ki], cells.b_owners[ki][ni]
        # A lone owner is the source whoever multiplies; else the rank itself if it owns one.
        if len(owners_a) == 1 or rank not in _lookup(owners_a, memo):
            a_src = owners_a[0]
        else:
            a_src = rank
        if len(owners_b) == 1 or rank not in _lookup(owners_b, memo):
            b_src = owners_b[0]
        else:
            b_src = rank
        if a_src != rank and (rank, "A", m, k) not in gets:
            gets[(rank, "A", m, k)] = Transfer("get", "A", rank, a_src, m, k)
        if b_src != rank and (rank, "B", k, n) not in gets:
            gets[(rank, "B", k, n)] = Transfer("get", "B", rank, b_src, k, n)
        multiplies.append(LocalMultiply(rank, m, k, n, a_src, b_src, products[key]))

    deliveries = assignment.deliveries
    senders_per_cell: dict[tuple[int, int, int], int] = defaultdict(int)
    for _origin, target, mi, ni in deliveries:
        senders_per_cell[(target, mi, ni)] += 1

    nranks, n_m, n_n = cells.nranks, len(cells.m), len(cells.n)

    def rotated_index(key: tuple[int, int, int, int]) -> int:
        # (origin, target counted from origin + 1, rows, cols) as one integer: cut intervals
        # are disjoint and increasing, so their indices order them like the intervals do.
        origin, target, mi, ni = key
        return ((origin * nranks + (target - origin) % nranks) * n_m + mi) * n_n + ni

    lone_k = [(iv,) for iv in cells.k]  # one shared tuple per K cell for one-term sums
    c_transfers, local_updates = [], []
    for key in sorted(deliveries, key=rotated_index):
        origin, target, mi, ni = key
        kis = deliveries[key]
        inner = lone_k[kis[0]] if len(kis) == 1 else tuple(cells.k[ki] for ki in sorted(kis))
        if origin == target:
            local_updates.append(LocalUpdate(origin, cells.m[mi], cells.n[ni], inner))
        else:
            op = "put" if senders_per_cell[(target, mi, ni)] == 1 else "accumulate"
            c_transfers.append(Transfer(op, "C", origin, target, cells.m[mi], cells.n[ni], inner))

    def rotated(t: Transfer):
        return (t.origin, (t.target - t.origin) % nranks, t.rows, t.cols)

    get_list = sorted(gets.values(), key=rotated)
    return tuple(multiplies), tuple(get_list) + tuple(c_transfers), tuple(local_updates)


def _schedule(a: Layout, b: Layout, c: Layout, compute_at_inputs: bool = False):
    """Multiplies, transfers and local updates of C = A @ B for the layouts.

    ``compute_at_inputs``: a cell's product is computed by a rank that holds both of its
    inputs whenever there is one (partials move, inputs do not), whatever the bytes.
    """
    with _collector_paused():
        cells = cut_cells(a, b, c)
        assignment, unserved = serve_self(cells)
        choose_servers(cells, assignment, unserved, compute_at_inputs, rank_speeds(a, b, c))
        del unserved  # freed before the schedule's records are made
        return emit_schedule(cells, assignment)


class PlanTotals:
    """The per-rank figures of ``Plan(a, b, c)`` that a cost model needs, without its records.

    ``flops`` and :meth:`bytes_sent` equal the plan's own; the multiplies and transfers are
    never made (most of the time and memory of a large plan), so trying many candidate
    layouts (:func:`osmm_jax.auto_layouts`) costs the server choice alone. A replicated C,
    whose plan may be staged (see :attr:`Plan.gather_stage`), is planned in full.
    """

    def __init__(self, a: Layout, b: Layout, c: Layout):
        _check_layouts(a, b, c)
        self.nranks = a.nranks
        if c.is_replicated:
            plan = Plan(a, b, c)
            self.flops = plan.flops
            self._inputs = per_rank_totals(
                (t for t in plan.transfers if t.op == "get"), self.nranks, "sender", "elements"
            )
            self._partials = per_rank_totals(
                (t for t in plan.transfers if t.op != "get"), self.nranks, "sender", "elements"
            )
            return
        with _collector_paused():
            cells = cut_cells(a, b, c)
            assignment, unserved = serve_self(cells)
            choose_servers(cells, assignment, unserved, speeds=rank_speeds(a, b, c))
            del unserved
            # Each rank's load is the flops of the distinct products it was given.
            self.flops = tuple(assignment.load)
            self._inputs, self._partials = _sent_elements(cells, assignment)

    def bytes_sent(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_sent`."""
        return tuple(
            i * input_itemsize + p * accum_itemsize for i, p in zip(self._inputs, self._partials)
        )


def _sent_elements(cells: Cells, assignment: Assignment) -> tuple[list[int], list[int]]:
    """Elements each rank sends as A/B pieces others get from it, and as C partials: the
    senders' totals of the transfers :func:`emit_schedule` would make."""
    inputs, partials = [0] * cells.nranks, [0] * cells.nranks
    memo: dict = {}
    fetched = set()
    for rank, mi, ki, ni in assignment.products:
        owners_a, owners_b = cells.a_owners[mi][ki], cells.b_owners[ki][ni]
        if rank not in _lookup(owners_a, memo) and (rank, "A", mi, ki) not in fetched:
            fetched.add((rank, "A", mi, ki))
            inputs[owners_a[0]] += _size(cells.m[mi]) * _size(cells.k[ki])
        if rank not in _lookup(owners_b, memo) and (rank, "B", ki, ni) not in fetched:
            fetched.add((rank, "B", ki, ni))
            inputs[owners_b[0]] += _size(cells.k[ki]) * _size(cells.n[ni])
    for origin, target, mi, ni in assignment.deliveries:
        if origin != target:
            partials[origin] += _size(cells.m[mi]) * _size(cells.n[ni])
    return inputs, partials


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector while a schedule is built.

    A plan of P ranks allocates up to millions of tuples and records, none of them in a
    reference cycle; each allocation burst triggers a collection that walks every object still
    alive, which more than doubles the time of large plans. Restored on exit (even on error)
    unless it was already off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def make_plan(a: Layout, b: Layout, c: Layout, comm_key: int = 0) -> Plan:
    """The (cached) plan of ``C = A @ B`` for the given layouts."""
    # Layouts that differ only in their reasons are equal, so the reasons join the cache key:
    # the plan returned holds the very layouts asked for, and describe() tells their reason.
    reasons = tuple(getattr(layout, "reason", "") for layout in (a, b, c))
    return _cached_plan(a, b, c, comm_key, reasons)


@functools.lru_cache(maxsize=256)
def _cached_plan(a: Layout, b: Layout, c: Layout, comm_key: int, _reasons) -> Plan:
    return Plan(a, b, c, comm_key)


@functools.lru_cache(maxsize=256)
def backward_plans(plan: Plan) -> tuple[Plan, Plan]:
    """Plans of the two backward products of ``plan``.

    ``dA = dC @ B.T`` (layouts C, B.T -> A) and ``dB = A.T @ dC`` (layouts A.T,
    C -> B): both are ordinary distributed products with transposed layouts.
    """
    d_a = make_plan(plan.c, plan.b.T, plan.a, plan.comm_key)
    d_b = make_plan(plan.a.T, plan.c, plan.b, plan.comm_key)
    return d_a, d_b
