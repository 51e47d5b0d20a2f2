"""The planner: which rank multiplies which sub-blocks, and where results go.

Given the layouts of A (M x K), B (K x N) and C (M x N), the planner cuts each
dimension at every block boundary of the two layouts that share it (M at A's
and C's row boundaries, K at A's column and B's row boundaries, N at B's and
C's column boundaries). Every resulting cell ``(m, k, n)`` is one sub-product
``A[m, k] @ B[k, n]`` that contributes to ``C[m, n]``; inside a cell each
operand piece has a fixed set of owners (one rank, or all ranks when
replicated). This is the index arithmetic ("slicing") of Brock & Golin,
arXiv 2510.08874.

Each cell is decided from that cell alone (:func:`decide`), so that any rank can decide any
cell by itself:

* a C owner that also owns both input pieces computes the cell for itself;
* the other C owners are served by ONE rank that delivers the cell by one-sided RMA: one of
  the self-serving owners if there are any (so no cell is computed twice just to save a
  send), otherwise the owner of one of its pieces (A, B or C) that moves the fewest elements
  (inputs it lacks, fetched by ``get``, plus results it must send). Equally cheap owners: the
  C owner (stationary C: on equal 2-D grids every rank computes its own block, as in SUMMA,
  balanced at the least traffic), else they take turns by the cell's position.

Partials a rank delivers to the same C rectangle of the same target are summed locally
first, so each (origin, target, C cell) pair costs one transfer: a ``put`` when it is the
only transfer into its rectangle (the target's own partial is added outside the window),
else an ``accumulate``.

Because the decisions are local, one rank's part of the plan (:meth:`Plan.for_rank`) is built
from the cells it owns a piece of, in time and memory that grow with its share of the
product, not with the rank count: that is what each rank of a job builds for itself
(:func:`osmm_jax.plan`, with ``rank=`` to inspect any rank's part without MPI). The few facts
all ranks must share (whether anyone gets or delivers, the largest exposed block) are
combined in the agreement every product starts with (:class:`PlanFacts`). The whole schedule
(``multiplies``, ``transfers``, ``describe()``, ``plot()``) is built only when asked for.
Whether a replicated C is summed in a gather stage is the one decision that looks at every
cell (:attr:`Plan.gather_stage`).

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
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, replace
from typing import Any, NamedTuple

from osmm_jax._src.planning.layout import Interval, Layout
from osmm_jax._src.planning.work import Work

FLOAT32_BYTES = 4

NOMINAL_SPEED = 100e9
"""Flops/s :meth:`Plan.balance` gives a rank of relative speed 1 (XLA's CPU dot measured 90-160
GFLOP/s here), for reporting how even a plan is."""

NOMINAL_BANDWIDTH = 5e9
"""Bytes/s :meth:`Plan.balance` gives every rank's link, each way (one-sided accumulates measured
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
    """The relative speed (mean 1) each rank was given work for, read from the layouts: its
    share of C's area.

    A plan is a function of its layouts alone (equal layouts, equal plan, on every rank and in
    every cache), so it is not told the ranks' measured speeds. Layouts made from speeds
    (:func:`osmm_jax.balance`, :func:`osmm_jax.auto_layouts`) already carry them: each rank's
    block of the output is in proportion to its speed, and stationary-C work (each rank
    computes its own block of C) is then balanced. So a rank's speed is taken as its C area
    over the mean; when C is replicated, from A's areas, then B's; equal when every operand is
    replicated or uniform. A rank with an empty block is taken as a hundredth of the mean.
    :meth:`Plan.balance` reports each rank's modelled time at these speeds.
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

    ``compute[r]`` is rank ``r``'s flops at its speed, ``communicate[r]`` the busier direction
    of its link (the larger of the bytes it sends and receives) at the link's bandwidth,
    ``seconds[r]`` their sum; ``busiest`` the rank with the largest sum and
    ``ratio`` that sum over the mean (1.0 when nothing is done).
    """

    compute: tuple[float, ...]
    communicate: tuple[float, ...]
    seconds: tuple[float, ...]
    busiest: int
    ratio: float


class PlanFacts(NamedTuple):
    """What every rank must agree on to run a plan, beyond its own records.

    ``has_gets``: some rank gets an A or B piece (everyone then opens the fetch window);
    ``has_deliveries``: some rank delivers a C partial (everyone opens the reduce window);
    ``expose_elements``: the largest A block and the largest B block any rank exposes to gets
    (sizes every rank's fetch window, so that B starts at the same offset everywhere).
    """

    has_gets: bool
    has_deliveries: bool
    expose_elements: tuple[int, int]


class RankPlan:
    """One rank's part of a plan: built from the cells that rank owns a piece of, without the
    rest of the plan (see :meth:`Plan.for_rank`).

    Attributes:
        rank: the rank.
        multiplies: its :class:`LocalMultiply` records, ordered by ``(rows, inner, cols)``.
        gets: the A and B pieces it gets from other ranks (``Transfer("get", ...)``).
        deliveries: the C partials it accumulates or puts into other ranks' blocks.
        local_updates: the sums it adds into its own C block.
        served: the gets other ranks make from its A and B blocks.
        received: the deliveries other ranks make into its C block.
        gathers: for a staged plan (a replicated C), the C blocks it then gets from their owners.
        gathered: for a staged plan, the gets other ranks make of its block of the split C.
    """

    def __init__(self, plan: Plan, rank: int):
        self.rank = rank
        self.plan = plan
        target = plan.gather_stage if plan.gather_stage is not None else plan
        with _collector_paused():
            cells = target.cells
            schedule = build_schedule(
                cells,
                cells_of_rank(cells, target.a, target.b, target.c, rank, target.work),
                rank,
                target.compute_at_inputs,
            )
        self.multiplies = schedule.multiplies
        self.gets = tuple(t for t in schedule.gets if t.origin == rank)
        self.served = tuple(t for t in schedule.gets if t.target == rank)
        self.deliveries = tuple(t for t in schedule.deliveries if t.origin == rank)
        self.received = tuple(t for t in schedule.deliveries if t.target == rank)
        self.local_updates = schedule.local_updates
        if plan.gather_stage is not None:
            split = plan.gather_stage.c
            self.gathers = _gathers(split, origins=(rank,))
            self.gathered = _gathers(split, owner=rank)
        else:
            self.gathers = self.gathered = ()

    @functools.cached_property
    def flops(self) -> int:
        """Floating-point operations (2 per multiply-add) this rank performs."""
        return sum(m.flops for m in self.multiplies)

    def bytes_sent(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> int:
        """Bytes leaving this rank's memory per product (see :meth:`Plan.bytes_sent`)."""
        out = self.served + self.deliveries + self.gathered
        return sum(t.nbytes(input_itemsize, accum_itemsize) for t in out)

    def bytes_issued(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> int:
        """Bytes moved by the RMA operations this rank issues (see :meth:`Plan.bytes_issued`)."""
        issued = self.gets + self.deliveries + self.gathers
        return sum(t.nbytes(input_itemsize, accum_itemsize) for t in issued)

    @functools.cached_property
    def exposes(self) -> tuple[bool, bool]:
        """Whether other ranks get pieces of this rank's A block, and of its B block."""
        return (
            any(t.matrix == "A" for t in self.served),
            any(t.matrix == "B" for t in self.served),
        )

    @functools.cached_property
    def facts(self) -> PlanFacts:
        """This rank's share of :class:`PlanFacts` (combined over ranks by :func:`combine_facts`)."""
        target = self.plan.gather_stage if self.plan.gather_stage is not None else self.plan
        expose_a, expose_b = self.exposes
        return PlanFacts(
            bool(self.gets),
            bool(self.deliveries),
            (
                _area(target.a, self.rank) if expose_a else 0,
                _area(target.b, self.rank) if expose_b else 0,
            ),
        )


def combine_facts(facts: Iterable[PlanFacts]) -> PlanFacts:
    """The facts of a whole plan from every rank's own (any rank gets, any delivers, largest)."""
    facts = list(facts)
    return PlanFacts(
        any(f.has_gets for f in facts),
        any(f.has_deliveries for f in facts),
        (
            max((f.expose_elements[0] for f in facts), default=0),
            max((f.expose_elements[1] for f in facts), default=0),
        ),
    )


class Plan:
    """The schedule of one distributed product C = A @ B.

    Immutable, hashable and the same on every rank; equality and hashing use the three layouts
    and the communicator key only (everything else derives from them). Build it with
    :func:`osmm_jax.plan`. Making a plan computes nothing: each rank's part is built when first
    asked for (:meth:`for_rank`, from the cells that rank owns a piece of), and the whole
    schedule (:attr:`multiplies`, :attr:`transfers`, :attr:`local_updates`, and what is
    computed from them: :meth:`describe`, :meth:`plot`, :meth:`bytes_sent`, ...) only when one
    of those is read.

    Attributes:
        a, b, c: the layouts of A (M x K), B (K x N) and C (M x N).
        comm_key: identifies the communicator the plan runs on (0 = none).
        multiplies: every :class:`LocalMultiply`, ordered by rank.
        transfers: every :class:`Transfer` (gets, then C deliveries), ordered by
            origin; each origin's transfers start at the next rank and wrap
            around, so ranks do not all target the same owner at once.
        local_updates: every :class:`LocalUpdate`.
        gather_stage: for a replicated C that is cheaper to sum as "reduce-scatter,
            then all-gather": the plan of the same product into an even row (or
            column) split of C, whose multiplies, deliveries and local updates
            this plan runs; None otherwise.
        compute_at_inputs: whether cells are computed where both inputs are
            (set on gather stages).
        work: a :class:`~osmm_jax._src.planning.work.Work` saying which rank computes each cell
            that a C owner does not compute for itself (e.g. the 3-D split of
            :func:`~osmm_jax._src.planning.work.three_d_layouts`), or None: the owners of its
            pieces do (see :func:`decide`).
        gathers: the C blocks each rank then gets from their owners in
            ``gather_stage`` (``Transfer("get", "C", ...)``, also listed in
            ``transfers``); empty unless staged.
    """

    def __init__(
        self,
        a: Layout,
        b: Layout,
        c: Layout,
        comm_key: int = 0,
        *,
        compute_at_inputs=False,
        work: Work | None = None,
    ):
        _check_layouts(a, b, c)
        _check_work(work, a, b)
        self.a, self.b, self.c = a, b, c
        self.comm_key = int(comm_key)
        self.compute_at_inputs = bool(compute_at_inputs)
        self.work = work
        self._rank_plans: dict[int, RankPlan] = {}
        self._agreed: list[PlanFacts] = []

    # -- identity -----------------------------------------------------------

    def _key(self):
        return (self.a, self.b, self.c, self.comm_key, self.compute_at_inputs, self.work)

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
        work = "" if self.work is None else f", work {self.work!r}"
        return f"Plan(C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {self.nranks} ranks, {self.a.kind}/{self.b.kind}/{self.c.kind}{work})"

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the layouts and the work split, equal on two ranks iff they built the
        same plan."""
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
                None if self.work is None else astuple(self.work),
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

    # -- the cells, the stage, one rank's part --------------------------------

    @functools.cached_property
    def cells(self) -> Cells:
        """The cells of the product and who owns their pieces (see :func:`cut_cells`)."""
        return cut_cells(self.a, self.b, self.c, self.work)

    @functools.cached_property
    def gather_stage(self) -> Plan | None:
        """For a replicated C, the plan into an even split of C when summing that way is
        cheaper (see :func:`_gather_stage`); else None (always with a :attr:`work` split: the
        boxes say who computes what)."""
        if self.work is not None:
            return None
        stage = _gather_stage(self.a, self.b, self.c, self.comm_key)
        if stage is None:
            return None
        # Reduce-scatter, then all-gather: kept only if its busiest link (the larger of what a
        # rank sends and receives) carries less and no rank computes more than summing the
        # replicated C directly.
        direct, staged = self._totals, _with_gathers(stage)
        cheaper = max(staged.link()) < max(direct.link())
        if cheaper and all(s <= d for s, d in zip(staged.flops, direct.flops)):
            return stage
        return None

    @functools.cached_property
    def _totals(self) -> Totals:
        """Every rank's :class:`Totals` of this plan's own cells (a staged plan's direct sum)."""
        with _collector_paused():
            return schedule_totals(self.cells, self.compute_at_inputs)

    def for_rank(self, rank: int) -> RankPlan:
        """``rank``'s part of the plan (its multiplies, the transfers it issues, serves and
        receives), built from the cells it owns a piece of and cached: for the usual layouts its
        time and memory grow with that rank's share of the product, not with the whole plan.
        The records are exactly the whole plan's records for that rank."""
        rank = self.c._check_rank(rank)
        found = self._rank_plans.get(rank)
        if found is None:
            found = self._rank_plans[rank] = RankPlan(self, rank)
        return found

    # -- the whole schedule, on demand -----------------------------------------

    @functools.cached_property
    def _schedule(self) -> tuple[tuple, tuple, tuple]:
        if self.gather_stage is not None:
            stage = self.gather_stage
            return stage.multiplies, stage.transfers + self.gathers, stage.local_updates
        cells = self.cells
        with _collector_paused():
            every = itertools.product(range(len(cells.m)), range(len(cells.k)), range(len(cells.n)))
            schedule = build_schedule(cells, every, None, self.compute_at_inputs)
        return schedule.multiplies, schedule.gets + schedule.deliveries, schedule.local_updates

    @property
    def multiplies(self) -> tuple[LocalMultiply, ...]:
        return self._schedule[0]

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return self._schedule[1]

    @property
    def local_updates(self) -> tuple[LocalUpdate, ...]:
        return self._schedule[2]

    @functools.cached_property
    def gathers(self) -> tuple[Transfer, ...]:
        return _gathers(self.gather_stage.c) if self.gather_stage is not None else ()

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
        outgoing link, what :func:`osmm_jax.plot_plan` draws; :func:`osmm_jax.auto_layouts`
        and :meth:`balance` take the larger of it and :meth:`bytes_received`. A/B pieces
        count ``input_itemsize`` bytes per element, C partials ``accum_itemsize`` (the
        accumulation type: 4 for float32/bfloat16/float16, 8 for float64); both default to
        float32. For what each rank's own RMA calls move, see
        :meth:`bytes_issued`.
        """
        return per_rank_totals(
            self.transfers, self.nranks, "sender", _nbytes(input_itemsize, accum_itemsize)
        )

    def bytes_received(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes arriving in each rank's memory per product, counted at the RECEIVER: the A/B
        pieces (and, staged, C blocks) it gets and the C partials delivered into its block.
        Item sizes as in :meth:`bytes_sent`, whose totals over all ranks are the same."""
        return per_rank_totals(
            self.transfers, self.nranks, "receiver", _nbytes(input_itemsize, accum_itemsize)
        )

    def link_bytes(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes on the busier direction of each rank's link per product: the larger of its
        :meth:`bytes_sent` and :meth:`bytes_received` (how :meth:`balance` and
        :func:`osmm_jax.auto_layouts` price a link)."""
        return _larger(
            self.bytes_sent(input_itemsize, accum_itemsize),
            self.bytes_received(input_itemsize, accum_itemsize),
        )

    @functools.cached_property
    def speeds(self) -> tuple[float, ...]:
        """The relative speed (mean 1) the layouts were made for: see :func:`rank_speeds`."""
        return rank_speeds(self.a, self.b, self.c)

    def balance(
        self,
        speeds=None,
        bandwidth: float = NOMINAL_BANDWIDTH,
        input_itemsize: int = FLOAT32_BYTES,
        accum_itemsize: int = FLOAT32_BYTES,
    ) -> Balance:
        """Each rank's modelled time: its flops at its speed plus the larger of its
        :meth:`bytes_sent` and its bytes received at ``bandwidth`` bytes/s each way (as
        :func:`osmm_jax.auto_layouts` prices a link); :meth:`describe` reports the busiest rank.

        ``speeds`` are flops/s per rank; by default :attr:`speeds` times :data:`NOMINAL_SPEED`.
        """
        if speeds is None:
            speeds = [s * NOMINAL_SPEED for s in self.speeds]
        if len(speeds) != self.nranks:
            raise ValueError(f"{len(speeds)} speeds for a plan over {self.nranks} ranks")
        compute = tuple(
            (f / s if s > 0 else float("inf")) if f else 0.0 for f, s in zip(self.flops, speeds)
        )
        communicate = tuple(b / bandwidth for b in self.link_bytes(input_itemsize, accum_itemsize))
        seconds = tuple(x + y for x, y in zip(compute, communicate))
        busiest = max(range(self.nranks), key=lambda r: (seconds[r], -r))
        mean = sum(seconds) / self.nranks
        return Balance(
            compute, communicate, seconds, busiest, seconds[busiest] / mean if mean else 1.0
        )

    def plot(self, **kwargs):
        """A matplotlib Figure of the A, B and C tilings and the bytes each rank sends to each
        other rank; see :func:`osmm_jax.plot_plan` (needs matplotlib: the ``plot`` extra)."""
        from osmm_jax._src.planning.plot import plot_plan  # lazily: plot imports this module

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

    # -- per-rank views used by the executors (from for_rank: no whole schedule) ----------

    def multiplies_on(self, rank: int) -> tuple[LocalMultiply, ...]:
        return self.for_rank(rank).multiplies

    def gets_by(self, rank: int) -> tuple[Transfer, ...]:
        """The A and B pieces ``rank`` gets before it multiplies."""
        return self.for_rank(rank).gets

    def deliveries_from(self, rank: int) -> tuple[Transfer, ...]:
        return self.for_rank(rank).deliveries

    def local_updates_on(self, rank: int) -> tuple[LocalUpdate, ...]:
        return self.for_rank(rank).local_updates

    def exposes(self, rank: int) -> tuple[bool, bool]:
        """Whether other ranks get pieces of ``rank``'s A block, and of its B block."""
        return self.for_rank(rank).exposes

    def gathers_by(self, rank: int) -> tuple[Transfer, ...]:
        """The C blocks ``rank`` gets after the reduction of a staged plan (see ``gather_stage``)."""
        return self.for_rank(rank).gathers

    # -- what all ranks must agree on -------------------------------------------------

    def adopt_facts(self, facts: PlanFacts) -> None:
        """Take the :class:`PlanFacts` the ranks agreed on (:func:`combine_facts` of every
        rank's :attr:`RankPlan.facts`), so that running the plan never builds the whole
        schedule. The facts are a function of the layouts: adopting them changes no result."""
        if not self._agreed:
            self._agreed.append(facts)

    @property
    def facts(self) -> PlanFacts:
        """The adopted :class:`PlanFacts`, else those of the whole schedule."""
        return self._agreed[0] if self._agreed else self._schedule_facts

    @functools.cached_property
    def _schedule_facts(self) -> PlanFacts:
        largest = []
        for matrix, layout in (("A", self.a), ("B", self.b)):
            gets = (t for t in self.transfers if t.op == "get" and t.matrix == matrix)
            served = per_rank_totals(gets, self.nranks, "target", lambda t: 1)
            exposed = [_area(layout, r) for r in range(self.nranks) if served[r]]
            largest.append(max(exposed, default=0))
        return PlanFacts(
            any(t.op == "get" and t.matrix != "C" for t in self.transfers),
            any(t.op != "get" for t in self.transfers),
            (largest[0], largest[1]),
        )

    @property
    def has_gets(self) -> bool:
        """Whether any rank gets A or B pieces (the gathers of a staged plan do not count)."""
        return self.facts.has_gets

    @property
    def has_deliveries(self) -> bool:
        return self.facts.has_deliveries

    @property
    def expose_elements(self) -> tuple[int, int]:
        """Largest A block and largest B block any rank exposes (sizes every rank's window to fit)."""
        return self.facts.expose_elements

    @property
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
            f"  A: {self.a.kind}   B: {self.b.kind}   C: {self.c.kind}"
            + ("" if self.work is None else f"   work: {self.work!r}"),
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


def _gathers(split: Layout, origins: Iterable[int] | None = None, owner: int | None = None):
    """Every rank of ``origins`` (default: all) gets every other rank's block of ``split``, or
    only ``owner``'s block; rotated by origin, as deliveries."""
    n = split.nranks
    gathers = []
    for origin in range(n) if origins is None else origins:
        steps = range(1, n) if owner is None else ((owner - origin) % n,)
        for step in steps:
            if step == 0:
                continue
            block_owner = (origin + step) % n
            rows, cols = split.blocks[block_owner]
            if rows[1] > rows[0] and cols[1] > cols[0]:
                gathers.append(Transfer("get", "C", origin, block_owner, rows, cols))
    return tuple(gathers)


def _gathered_elements(split: Layout) -> list[int]:
    """Elements each rank sends in the gathers of ``split`` (:func:`_gathers`, counted at the
    owner): its block, once to every other rank."""
    others = split.nranks - 1
    return [_area(split, r) * others for r in range(split.nranks)]


def _gathered_received(split: Layout) -> list[int]:
    """Elements each rank gets in the gathers of ``split`` (:func:`_gathers`, counted at the
    rank that gets): every other rank's block."""
    areas = [_area(split, r) for r in range(split.nranks)]
    total = sum(areas)
    return [total - own for own in areas]


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


EVERYONE = -1
"""The owner code of a piece of a replicated operand: every rank holds it."""


class OwnerIndex:
    """Which rank holds the piece of one operand at a given point: ``at(row, col)`` in O(log P).

    A partitioned layout is kept as row bands (between consecutive distinct row bounds of its
    blocks), each with the column starts of the blocks crossing it, so a lookup is two
    bisections; a replicated layout answers :data:`EVERYONE`. Building it is O(P log P) for the
    usual layouts (rows, columns, grids: every block lies in one band of its own rows).
    """

    def __init__(self, layout: Layout):
        self.replicated = layout.is_replicated
        self._band_starts: list[int] = []
        self._col_starts: list[list[int]] = []
        self._ranks: list[list[int]] = []
        if self.replicated:
            return
        nonempty = [
            (rank, block)
            for rank, block in enumerate(layout.blocks)
            if block[0][0] < block[0][1] and block[1][0] < block[1][1]
        ]
        bounds = sorted({x for _, ((r0, r1), _) in nonempty for x in (r0, r1)})
        bands: list[list[tuple[int, int]]] = [[] for _ in bounds[:-1]]
        for rank, ((r0, r1), (c0, _)) in nonempty:
            for i in range(bisect.bisect_left(bounds, r0), bisect.bisect_left(bounds, r1)):
                bands[i].append((c0, rank))
        self._band_starts = bounds[:-1]
        for band in bands:
            band.sort()
            self._col_starts.append([c0 for c0, _ in band])
            self._ranks.append([rank for _, rank in band])

    def at(self, row: int, col: int) -> int:
        """The rank whose block holds element ``(row, col)`` (:data:`EVERYONE` if replicated)."""
        if self.replicated:
            return EVERYONE
        i = bisect.bisect_right(self._band_starts, row) - 1
        j = bisect.bisect_right(self._col_starts[i], col) - 1
        return self._ranks[i][j]


@dataclass(frozen=True)
class Cells:
    """The cells of ``C = A @ B``: each dimension cut at every block boundary of the layouts that
    share it, and who holds each operand's piece of a cell.

    ``m``, ``k``, ``n`` are the cut intervals of M, K and N; cell ``(mi, ki, ni)`` is the
    sub-product ``A[m[mi], k[ki]] @ B[k[ki], n[ni]]``. Every cell lies inside one block of each
    partitioned layout, so :meth:`a_owner`, :meth:`b_owner` and :meth:`c_owner` each name one
    rank, or :data:`EVERYONE` for a replicated operand.
    """

    m: tuple[Interval, ...]
    k: tuple[Interval, ...]
    n: tuple[Interval, ...]
    a: OwnerIndex
    b: OwnerIndex
    c: OwnerIndex
    nranks: int
    work: Work | None = None

    def a_owner(self, mi: int, ki: int) -> int:
        return self.a.at(self.m[mi][0], self.k[ki][0])

    def b_owner(self, ki: int, ni: int) -> int:
        return self.b.at(self.k[ki][0], self.n[ni][0])

    def c_owner(self, mi: int, ni: int) -> int:
        return self.c.at(self.m[mi][0], self.n[ni][0])

    def box_rank(self, mi: int, ki: int, ni: int) -> int:
        """The rank whose :class:`Work` box holds the cell (only with a ``work`` split)."""
        assert self.work is not None, "box_rank needs a work split"
        return self.work.rank_at(self.m[mi][0], self.k[ki][0], self.n[ni][0])

    def flops(self, mi: int, ki: int, ni: int) -> int:
        return 2 * _size(self.m[mi]) * _size(self.k[ki]) * _size(self.n[ni])


def cut_cells(a: Layout, b: Layout, c: Layout, work: Work | None = None) -> Cells:
    """The cells of the product and the owner lookups of its three operands (each dimension
    also cut at the boxes of ``work``, so that every cell lies in one box)."""
    M, K = a.shape
    N = b.shape[1]
    boxes = ([], [], []) if work is None else (work.m, work.k, work.n)
    m = _cuts(M, [blk[0] for blk in a.blocks], [blk[0] for blk in c.blocks], boxes[0])
    k = _cuts(K, [blk[1] for blk in a.blocks], [blk[0] for blk in b.blocks], boxes[1])
    n = _cuts(N, [blk[1] for blk in b.blocks], [blk[1] for blk in c.blocks], boxes[2])
    return Cells(m, k, n, OwnerIndex(a), OwnerIndex(b), OwnerIndex(c), a.nranks, work)


def _check_work_type(work) -> None:
    if work is not None and not isinstance(work, Work):
        raise TypeError(f"work must be an osmm_jax.Work or None, got {type(work).__name__}")


def _check_work(work, a: Layout, b: Layout) -> None:
    _check_work_type(work)
    if work is None:
        return
    dims = (a.shape[0], a.shape[1], b.shape[1])
    if work.dims != dims:
        raise ValueError(f"work splits a {work.dims} product but the layouts make {dims}")
    if work.nranks != a.nranks:
        raise ValueError(f"work is for {work.nranks} ranks but the layouts for {a.nranks}")


class Decision(NamedTuple):
    """Who computes one cell and where its product goes (see :func:`decide`).

    ``self_serving``: the C owners that hold both inputs and compute the cell for themselves
    (``(EVERYONE,)`` when every rank does); ``server``: the rank that computes it for the
    other C owners and delivers it to them, or -1 when no C owner is left; ``primary``: the one
    copy the all-reduce path counts; ``a_owner``, ``b_owner``, ``c_owner``: the cell's owner
    codes (a rank, or :data:`EVERYONE`).
    """

    self_serving: tuple[int, ...]
    server: int
    primary: int
    a_owner: int
    b_owner: int
    c_owner: int


def decide(cells: Cells, mi: int, ki: int, ni: int, compute_at_inputs: bool = False) -> Decision:
    """The server of one cell, from that cell alone (so every rank can decide any cell by itself).

    1. Every C owner that holds both inputs computes the cell for itself.
    2. If a C owner is left, ONE rank computes the cell for all of them and delivers it: the
       self-serving owner if there is one (nothing is computed twice just to save a send);
       otherwise the candidate that moves the fewest elements, the inputs it lacks (got by
       ``get``) plus one partial per C owner other than itself. The candidates are the
       owners of the cell's pieces of partitioned operands (any other rank lacks every piece
       they hold, so it always moves more); with ``compute_at_inputs``, the ranks holding both
       inputs when there are any; with a :class:`Work` split (``cells.work``), the rank whose
       box holds the cell, alone.
    3. Among equally cheap candidates, the C owner (stationary C: on equal 2-D grids every rank
       then computes its own block, as in SUMMA, balanced at the least traffic, and no partial
       is sent); else the candidates take turns by the cell's position, so that repeated ties
       spread over them.
    """
    a = cells.a_owner(mi, ki)
    b = cells.b_owner(ki, ni)
    c = cells.c_owner(mi, ni)
    # Which C owner holds both inputs: a partitioned operand has one holder per piece.
    if a == EVERYONE and b == EVERYONE:
        both = EVERYONE
    elif a == EVERYONE or a == b:
        both = b
    elif b == EVERYONE:
        both = a
    else:
        both = None  # no rank holds both pieces
    if c != EVERYONE:
        if both == EVERYONE or both == c:
            return Decision((c,), -1, c, a, b, c)  # the one C owner computes it
        self_serving: tuple[int, ...] = ()
    elif both == EVERYONE:
        return Decision((EVERYONE,), -1, 0, a, b, c)  # every rank computes it; rank 0's counts
    elif both is not None:
        # A replicated C: the holder of both inputs computes it and delivers it to the others.
        return Decision((both,), both, both, a, b, c)
    else:
        self_serving = ()
    candidates = sorted({x for x in (a, b, c) if x != EVERYONE})
    if compute_at_inputs and both is not None:
        candidates = [both]
    if cells.work is not None:
        candidates = [cells.box_rank(mi, ki, ni)]
    m, k, n = _size(cells.m[mi]), _size(cells.k[ki]), _size(cells.n[ni])
    # C owners the server delivers to (all but itself): one, or every other rank.
    others = 1 if c != EVERYONE else cells.nranks - 1
    best_cost, tied = None, []
    for p in candidates:
        cost = (0 if a in (EVERYONE, p) else m * k) + (0 if b in (EVERYONE, p) else k * n)
        cost += m * n * (others if c == EVERYONE or p != c else 0)
        if best_cost is None or cost < best_cost:
            best_cost, tied = cost, [p]
        elif cost == best_cost:
            tied.append(p)
    if c in tied:
        server = c
    else:
        server = tied[(mi + ki + ni) % len(tied)]
    return Decision(self_serving, server, server, a, b, c)


def cells_of_rank(
    cells: Cells, a: Layout, b: Layout, c: Layout, rank: int, work: Work | None = None
):
    """The cells ``rank`` can take part in: those inside its block of a partitioned operand
    or its box of ``work`` (all of them when C is replicated: every rank then owns every C
    piece).

    A rank serves, gets from, or receives a delivery of a cell only if it owns a piece of it:
    :func:`decide` picks servers among the owners of partitioned pieces, or a self-serving C
    owner. So ``rank``'s part of the plan comes from these cells alone: for the usual layouts a
    few cells per rank of the other dimension, not the whole product.
    """
    if c.is_replicated:
        return itertools.product(range(len(cells.m)), range(len(cells.k)), range(len(cells.n)))
    keys: set[tuple[int, int, int]] = set()
    starts = {
        "m": [lo for lo, _ in cells.m],
        "k": [lo for lo, _ in cells.k],
        "n": [lo for lo, _ in cells.n],
    }

    def span(dim: str, iv: Interval) -> range:
        s = starts[dim]
        return range(bisect.bisect_left(s, iv[0]), bisect.bisect_left(s, iv[1]))

    everything = {dim: range(len(s)) for dim, s in starts.items()}
    for layout, dims in ((a, ("m", "k", "n")), (b, ("k", "n", "m")), (c, ("m", "n", "k"))):
        if layout.is_replicated:
            continue
        rows, cols = layout.blocks[rank]
        if rows[0] == rows[1] or cols[0] == cols[1]:
            continue
        ranges = {
            dims[0]: span(dims[0], rows),
            dims[1]: span(dims[1], cols),
            dims[2]: everything[dims[2]],
        }
        keys.update(itertools.product(ranges["m"], ranges["k"], ranges["n"]))
    if work is not None:
        rows, inner, cols = work.box(rank)
        if rows[0] < rows[1] and inner[0] < inner[1] and cols[0] < cols[1]:
            keys.update(itertools.product(span("m", rows), span("k", inner), span("n", cols)))
    return keys


class Schedule(NamedTuple):
    """The records of a plan, or of one rank's part of it (see :func:`build_schedule`)."""

    multiplies: tuple[LocalMultiply, ...]
    gets: tuple[Transfer, ...]
    deliveries: tuple[Transfer, ...]
    local_updates: tuple[LocalUpdate, ...]


def build_schedule(
    cells: Cells, keys: Iterable[tuple[int, int, int]], rank: int | None, compute_at_inputs: bool
) -> Schedule:
    """The multiplies, gets, deliveries and local updates of the cells ``keys``: all of them
    (``rank`` None), or only those ``rank`` performs, serves or receives.

    Each cell is decided by :func:`decide` alone, so the records of one rank are exactly those
    the whole plan has for it. A server sums its partials of one C rectangle for one target
    over the K cells before sending. A delivery is a ``put`` when it is the only one its
    rectangle receives (:func:`_sole_origin`; the target's own partial is added at the end,
    outside the window), else an ``accumulate``.

    Ordering: multiplies by ``(rank, mi, ki, ni)``; gets and deliveries each by origin and,
    within an origin, by target starting at the next rank (so ranks do not all target the same
    owner at once), then by rectangle; local updates by ``(rank, rows, cols)``. Each input
    piece is got once per rank, from its owner.
    """
    nranks = cells.nranks
    everyone = range(nranks)
    products: dict[tuple[int, int, int, int], tuple[bool, int, int]] = {}
    gets: dict[tuple[int, str, Interval, Interval], Transfer] = {}
    deliveries: defaultdict[tuple[int, int, int, int], list[int]] = defaultdict(list)
    for mi, ki, ni in keys:
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        a, b, c = d.a_owner, d.b_owner, d.c_owner
        self_serving = everyone if d.self_serving == (EVERYONE,) else d.self_serving
        for r in self_serving if rank is None else ((rank,) if rank in self_serving else ()):
            products[(r, mi, ki, ni)] = (r == d.primary, r, r)
            deliveries[(r, r, mi, ni)].append(ki)
        s = d.server
        if s < 0:
            continue
        involved = rank is None or rank == s
        a_src = s if a in (EVERYONE, s) else a
        b_src = s if b in (EVERYONE, s) else b
        if involved:
            products[(s, mi, ki, ni)] = (True, a_src, b_src)
        for matrix, src, rows, cols in (
            ("A", a_src, cells.m[mi], cells.k[ki]),
            ("B", b_src, cells.k[ki], cells.n[ni]),
        ):
            if src != s and (involved or rank == src):
                key = (s, matrix, rows, cols)
                if key not in gets:
                    gets[key] = Transfer("get", matrix, s, src, rows, cols)
        if c != EVERYONE:
            targets: Iterable[int] = (c,)
        else:
            targets = (t for t in (everyone if involved else (rank,)) if _delivered_to(d, t))
        for t in targets:
            if involved or rank == t:
                if t == s and s in d.self_serving:
                    continue  # already added: the server computes the cell for itself too
                deliveries[(s, t, mi, ni)].append(ki)

    multiplies = tuple(
        LocalMultiply(r, cells.m[mi], cells.k[ki], cells.n[ni], a_src, b_src, primary)
        for (r, mi, ki, ni), (primary, a_src, b_src) in sorted(products.items())
    )

    def rotated(origin: int, target: int) -> int:
        return origin * nranks + (target - origin) % nranks

    get_list = tuple(
        sorted(
            _joined_gets(gets.values()),
            key=lambda t: (rotated(t.origin, t.target), t.rows, t.cols, t.matrix),
        )
    )
    sole: dict[tuple[int, int, int], bool] = {}  # (target, mi, ni) -> one origin delivers
    lone_k = [(iv,) for iv in cells.k]  # one shared tuple per K cell for one-term sums
    c_transfers, local_updates = [], []
    for origin, target, mi, ni in sorted(
        deliveries, key=lambda key: (rotated(key[0], key[1]), key[2], key[3])
    ):
        kis = deliveries[(origin, target, mi, ni)]
        inner = lone_k[kis[0]] if len(kis) == 1 else tuple(cells.k[ki] for ki in sorted(kis))
        if origin == target:
            local_updates.append(LocalUpdate(origin, cells.m[mi], cells.n[ni], inner))
        else:
            if (target, mi, ni) not in sole:
                sole[(target, mi, ni)] = _sole_origin(cells, target, mi, ni, compute_at_inputs)
            op = "put" if sole[(target, mi, ni)] else "accumulate"
            c_transfers.append(Transfer(op, "C", origin, target, cells.m[mi], cells.n[ni], inner))
    return Schedule(multiplies, get_list, tuple(c_transfers), tuple(local_updates))


def _joined_gets(gets: Iterable[Transfer]) -> list[Transfer]:
    """``gets`` with the pieces one rank gets from one owner joined where they tile a larger
    rectangle: first side by side (same rows, adjacent columns), then one above the other.

    A rank's box of a :class:`Work` split needs, from the owner of a slice of A, pieces that
    B's slices cut along K (4 x 4 x 4 ranks: 12 gets of A where 3 do). One MPI_Get of a strided
    rectangle costs one message instead of several. The result depends only on the pieces of
    each (origin, owner, matrix), which a rank's own part of a plan holds whole, on both sides.
    """
    groups: defaultdict[tuple[int, int, str], list[Transfer]] = defaultdict(list)
    for t in gets:
        groups[(t.origin, t.target, t.matrix)].append(t)
    joined: list[Transfer] = []
    for group in groups.values():
        if len(group) > 1:
            group = _join_adjacent(group, along_cols=True)
            group = _join_adjacent(group, along_cols=False)
        joined += group
    return joined


def _join_adjacent(gets: list[Transfer], along_cols: bool) -> list[Transfer]:
    """Runs of gets with the same rows (``along_cols``) or columns whose other extents meet
    end to start, each joined into one get."""

    def extents(t: Transfer) -> tuple[Interval, Interval]:
        return (t.rows, t.cols) if along_cols else (t.cols, t.rows)

    out: list[Transfer] = []
    for t in sorted(gets, key=extents):
        if out:
            same, last = extents(out[-1])
            fixed, span = extents(t)
            if fixed == same and span[0] == last[1]:
                joined = (last[0], span[1])
                out[-1] = replace(out[-1], **({"cols": joined} if along_cols else {"rows": joined}))
                continue
        out.append(t)
    return out


def _sole_origin(cells: Cells, target: int, mi: int, ni: int, compute_at_inputs: bool) -> bool:
    """Whether exactly one rank other than ``target`` delivers a partial of the C rectangle
    ``(mi, ni)`` into ``target``'s window (found from the rectangle's cells alone, so a rank's
    own part of a plan says the same as the whole plan).

    Such a delivery is a ``put``: the window is all zeros when the epoch opens and nothing else
    lands on that rectangle, so writing the partial is adding it to zero. Over a network a put
    is a plain remote write, while MPICH completes an accumulate with an active message that
    the target must process (2048^3 K-split on 2 ranks over TCP: closing fence 11 -> 3 ms).
    """
    origin = -1
    for ki in range(len(cells.k)):
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        s = d.server
        if s < 0 or s == target or not _delivered_to(d, target):
            continue
        if origin >= 0 and s != origin:
            return False
        origin = s
    return origin >= 0


def _delivered_to(d: Decision, rank: int) -> bool:
    """Whether the server of a decided cell (``d.server >= 0``) delivers its product to
    ``rank``: the C owner, or, for a replicated C, every rank that does not compute the cell
    for itself, and the server itself."""
    if d.c_owner != EVERYONE:
        return rank == d.c_owner
    return rank not in d.self_serving or rank == d.server


class Totals(NamedTuple):
    """Per-rank figures of a plan, without its records: ``flops``; ``inputs``, the A/B elements
    other ranks get from each rank; ``partials``, the C elements each rank delivers;
    ``received_inputs``, the A/B elements each rank gets from other ranks; ``received_partials``,
    the C elements other ranks deliver into each rank's block. Every transfer is counted once
    at its sender and once at its receiver, so both pairs have the same sum over ranks."""

    flops: tuple[int, ...]
    inputs: tuple[int, ...]
    partials: tuple[int, ...]
    received_inputs: tuple[int, ...] = ()
    received_partials: tuple[int, ...] = ()

    def sent(self) -> tuple[int, ...]:
        """Elements leaving each rank: the pieces others get from it and its partials."""
        return tuple(i + p for i, p in zip(self.inputs, self.partials))

    def received(self) -> tuple[int, ...]:
        """Elements arriving at each rank: the pieces it gets and the partials delivered to it."""
        return tuple(i + p for i, p in zip(self.received_inputs, self.received_partials))

    def link(self) -> tuple[int, ...]:
        """Elements on the busier direction of each rank's link: the larger of sent and
        received."""
        return _larger(self.sent(), self.received())


def _larger(xs, ys) -> tuple[int, ...]:
    """The larger of ``xs[r]`` and ``ys[r]`` for every rank ``r``."""
    return tuple(max(x, y) for x, y in zip(xs, ys))


def _with_gathers(stage: Plan) -> Totals:
    """The totals of a gather stage's plan with its gathers added: the gathered C blocks
    travel like the A/B pieces (in the input dtype), each owner's block to every other rank."""
    totals = stage._totals
    gathered, got = _gathered_elements(stage.c), _gathered_received(stage.c)
    return totals._replace(
        inputs=tuple(i + g for i, g in zip(totals.inputs, gathered)),
        received_inputs=tuple(i + g for i, g in zip(totals.received_inputs, got)),
    )


def schedule_totals(cells: Cells, compute_at_inputs: bool = False) -> Totals:
    """The :class:`Totals` of every rank of a whole (unstaged) plan, as :func:`build_schedule`
    would make them: a piece is got once per rank, a partial sent once per target and C
    rectangle."""
    nranks = cells.nranks
    flops, inputs, partials = [0] * nranks, [0] * nranks, [0] * nranks
    received_inputs, received_partials = [0] * nranks, [0] * nranks
    # Partials of a replicated C reach every rank but their server: summed once, the server's
    # own taken off at the end.
    to_everyone, own_to_everyone = 0, [0] * nranks
    fetched, delivered = set(), set()
    for mi, ki, ni in itertools.product(
        range(len(cells.m)), range(len(cells.k)), range(len(cells.n))
    ):
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        f = cells.flops(mi, ki, ni)
        if d.self_serving == (EVERYONE,):
            for r in range(nranks):
                flops[r] += f
            continue
        for r in d.self_serving:
            flops[r] += f
        s = d.server
        if s < 0:
            continue
        if s not in d.self_serving:
            flops[s] += f
        m, k, n = _size(cells.m[mi]), _size(cells.k[ki]), _size(cells.n[ni])
        if d.a_owner not in (EVERYONE, s) and (s, 0, mi, ki) not in fetched:
            fetched.add((s, 0, mi, ki))
            inputs[d.a_owner] += m * k
            received_inputs[s] += m * k
        if d.b_owner not in (EVERYONE, s) and (s, 1, ki, ni) not in fetched:
            fetched.add((s, 1, ki, ni))
            inputs[d.b_owner] += k * n
            received_inputs[s] += k * n
        if (s, mi, ni) not in delivered:
            delivered.add((s, mi, ni))
            if d.c_owner == EVERYONE:
                partials[s] += m * n * (nranks - 1)
                to_everyone += m * n
                own_to_everyone[s] += m * n
            elif d.c_owner != s:
                partials[s] += m * n
                received_partials[d.c_owner] += m * n
    if to_everyone:
        received_partials = [
            r + to_everyone - own for r, own in zip(received_partials, own_to_everyone)
        ]
    return Totals(
        tuple(flops),
        tuple(inputs),
        tuple(partials),
        tuple(received_inputs),
        tuple(received_partials),
    )


class PlanTotals:
    """The per-rank figures of ``Plan(a, b, c)`` that a cost model needs, without its records.

    ``flops``, :meth:`bytes_sent` and :meth:`bytes_issued` equal the plan's own, and
    :meth:`bytes_received` is what the plan's transfers bring to each rank; the multiplies and
    transfers are never made, so trying many candidate layouts (:func:`osmm_jax.auto_layouts`)
    costs the server decisions alone, and for the layouts of its candidate strategies not even
    those one by one (:mod:`osmm_jax._src.planning.family_totals`).
    """

    def __init__(self, a: Layout, b: Layout, c: Layout, work: Work | None = None):
        from osmm_jax._src.planning.family_totals import family_totals  # it builds on this module

        _check_layouts(a, b, c)
        _check_work(work, a, b)
        self.nranks = a.nranks
        totals = family_totals(a, b, c, work)
        if totals is None:
            plan = Plan(a, b, c, work=work)
            stage = plan.gather_stage
            totals = plan._totals if stage is None else _with_gathers(stage)
        self.totals = totals
        self.flops = totals.flops
        self._inputs, self._partials = totals.inputs, totals.partials

    def bytes_sent(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_sent`."""
        return tuple(
            i * input_itemsize + p * accum_itemsize for i, p in zip(self._inputs, self._partials)
        )

    def bytes_received(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_received`."""
        t = self.totals
        return tuple(
            i * input_itemsize + p * accum_itemsize
            for i, p in zip(t.received_inputs, t.received_partials)
        )

    link_bytes = Plan.link_bytes  # the same rule, over these totals' sent and received bytes

    def bytes_issued(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """As :meth:`Plan.bytes_issued`: the pieces each rank gets and the partials it
        delivers (what :func:`osmm_jax._src.planning.comm_bound.moved_elements` counts)."""
        t = self.totals
        return tuple(
            i * input_itemsize + p * accum_itemsize for i, p in zip(t.received_inputs, t.partials)
        )


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


def make_plan(a: Layout, b: Layout, c: Layout, comm_key: int = 0, work: Work | None = None) -> Plan:
    """The (cached) plan of ``C = A @ B`` for the given layouts (and :class:`Work` split)."""
    _check_work_type(work)  # before the cache, which would call a list unhashable
    # Layouts that differ only in their reasons are equal, so the reasons join the cache key:
    # the plan returned holds the very layouts asked for, and describe() tells their reason.
    reasons = tuple(getattr(layout, "reason", "") for layout in (a, b, c))
    return _cached_plan(a, b, c, comm_key, work, reasons)


@functools.lru_cache(maxsize=256)
def _cached_plan(a: Layout, b: Layout, c: Layout, comm_key: int, work, _reasons) -> Plan:
    return Plan(a, b, c, comm_key, work=work)


@functools.lru_cache(maxsize=256)
def backward_plans(plan: Plan) -> tuple[Plan, Plan]:
    """Plans of the two backward products of ``plan``.

    ``dA = dC @ B.T`` (layouts C, B.T -> A) and ``dB = A.T @ dC`` (layouts A.T,
    C -> B): both are ordinary distributed products with transposed layouts, and the same
    boxes of work (a rank computes the gradients of the multiply-adds it computed).
    """
    work = plan.work
    work_a = None if work is None else work.permuted((0, 2, 1))
    work_b = None if work is None else work.permuted((1, 0, 2))
    d_a = make_plan(plan.c, plan.b.T, plan.a, plan.comm_key, work_a)
    d_b = make_plan(plan.a.T, plan.c, plan.b, plan.comm_key, work_b)
    return d_a, d_b
