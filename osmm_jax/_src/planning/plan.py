"""Plans: the schedule of one distributed product, and one rank's part of it.

:class:`Plan` is what :func:`osmm_jax.plan` returns. Made from the layouts of A, B and C (and
optionally a :class:`~osmm_jax._src.planning.work.Work` split), it computes nothing until asked:
one rank's part (:class:`RankPlan`, :meth:`Plan.for_rank`) is built from the cells that rank
owns a piece of, the whole schedule only when it is read. How the product is cut into cells and
who computes each one is explained in :mod:`osmm_jax._src.planning.cells`; the records are built
by :mod:`osmm_jax._src.planning.schedule` and counted by :mod:`osmm_jax._src.planning.totals`.

A replicated C may be summed in a gather stage instead ("reduce-scatter, then all-gather",
:attr:`Plan.gather_stage`): the one decision that looks at every cell. :func:`make_plan`
caches plans (every product looks its plan up), :func:`backward_plans` makes the plans of the
two backward products.

Pure Python, deterministic and identical on every rank; imports neither JAX nor MPI.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import astuple

from osmm_jax._src.planning.cells import (
    Cells,
    c_owners_compute_every_cell,
    cells_of_rank,
    check_layouts,
    check_work,
    check_work_type,
    cut_cells,
)
from osmm_jax._src.planning.describe import describe_plan
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.records import (
    FLOAT32_BYTES,
    LocalMultiply,
    LocalUpdate,
    PlanFacts,
    Transfer,
)
from osmm_jax._src.planning.schedule import build_schedule, collector_paused, gather_gets
from osmm_jax._src.planning.totals import (
    NOMINAL_BANDWIDTH,
    NOMINAL_SPEED,
    Balance,
    Totals,
    block_area,
    larger,
    modelled_balance,
    per_rank_totals,
    rank_speeds,
    schedule_totals,
    transfer_bytes,
    transfers_facts,
    with_gathers,
)
from osmm_jax._src.planning.work import Work, owner_boxes


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
        with collector_paused():
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
            self.gathers = gather_gets(split, origins=(rank,))
            self.gathered = gather_gets(split, owner=rank)
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
                block_area(target.a, self.rank) if expose_a else 0,
                block_area(target.b, self.rank) if expose_b else 0,
            ),
            len(self.origins),
            sum(t.elements for t in self.gets),
            len({t.target for t in self.gets}),
            max(self.elements_by_owner().values(), default=0),
        )

    def elements_by_owner(self) -> dict[int, int]:
        """The A and B elements this rank gets from each owner: ``{owner: elements}``."""
        by_owner: dict[int, int] = {}
        for t in self.gets:
            by_owner[t.target] = by_owner.get(t.target, 0) + t.elements
        return by_owner

    @functools.cached_property
    def origins(self) -> tuple[int, ...]:
        """The ranks that deliver partials into this rank's C block, ascending."""
        return tuple(sorted({t.origin for t in self.received}))


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
        staged: False for a plan that never has a ``gather_stage`` (see
            :func:`direct_plan`).
        work: a :class:`~osmm_jax._src.planning.work.Work` saying which rank computes each cell
            that a C owner does not compute for itself (e.g. the 3-D split of
            :func:`~osmm_jax._src.planning.work.three_d_layouts`), or None: the owners of its
            pieces do (see :func:`~osmm_jax._src.planning.cells.decide`).
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
        staged: bool = True,
    ):
        check_layouts(a, b, c)
        check_work(work, a, b)
        self.a, self.b, self.c = a, b, c
        self.comm_key = int(comm_key)
        self.compute_at_inputs = bool(compute_at_inputs)
        self.staged = bool(staged)
        self.work = work
        self._rank_plans: dict[int, RankPlan] = {}
        self._agreed: list[PlanFacts] = []

    # -- identity -----------------------------------------------------------

    def _key(self):
        key = (self.a, self.b, self.c, self.comm_key, self.compute_at_inputs, self.work)
        return (*key, self.staged)

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
        fields = [f for x in (self.a, self.b, self.c) for f in (x.shape, x.blocks, x.is_replicated)]
        fields += [self.compute_at_inputs, None if self.work is None else astuple(self.work)]
        if not self.staged:
            fields.append("direct")
        return hashlib.sha256(repr(tuple(fields)).encode()).hexdigest()[:16]

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
        """The cells of the product and who owns their pieces (see
        :func:`~osmm_jax._src.planning.cells.cut_cells`)."""
        return cut_cells(self.a, self.b, self.c, self.work)

    @functools.cached_property
    def gather_stage(self) -> Plan | None:
        """For a replicated C, the plan into an even split of C when summing that way is
        cheaper (see :func:`_gather_stage`); else None (always with a :attr:`work` split: the
        boxes say who computes what)."""
        return None if self.work is not None or not self.staged else _gather_stage(self)

    @functools.cached_property
    def _totals(self) -> Totals:
        """Every rank's :class:`Totals` of this plan's own cells (a staged plan's direct sum)."""
        with collector_paused():
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
        with collector_paused():
            schedule = build_schedule(cells, cells.every_cell(), None, self.compute_at_inputs)
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
        return gather_gets(self.gather_stage.c) if self.gather_stage is not None else ()

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
        nbytes = transfer_bytes(input_itemsize, accum_itemsize)
        return per_rank_totals(self.transfers, self.nranks, "sender", nbytes)

    def bytes_received(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes arriving in each rank's memory per product, counted at the RECEIVER: the A/B
        pieces (and, staged, C blocks) it gets and the C partials delivered into its block.
        Item sizes as in :meth:`bytes_sent`, whose totals over all ranks are the same."""
        nbytes = transfer_bytes(input_itemsize, accum_itemsize)
        return per_rank_totals(self.transfers, self.nranks, "receiver", nbytes)

    def bytes_issued(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes moved by the RMA operations each rank issues per product, counted at the ISSUER.

        A rank is charged for its own gets (the pieces it reads from other ranks) and for
        the C partials it accumulates or puts; nothing for what others get from it. This is
        what ``osmm_jax.stats()['rma_bytes']`` measures per product in the fence mode;
        :func:`osmm_jax.rma_bytes` gives it for either mode (the notified mode pushes the
        pieces and a staged plan's gathered blocks from their owners, and sums a small
        replicated C directly). Item sizes as in :meth:`bytes_sent`, whose totals over all
        ranks are the same.
        """
        nbytes = transfer_bytes(input_itemsize, accum_itemsize)
        return per_rank_totals(self.transfers, self.nranks, "origin", nbytes)

    def link_bytes(
        self, input_itemsize: int = FLOAT32_BYTES, accum_itemsize: int = FLOAT32_BYTES
    ) -> tuple[int, ...]:
        """Bytes on the busier direction of each rank's link per product: the larger of its
        :meth:`bytes_sent` and :meth:`bytes_received` (how :meth:`balance` and
        :func:`osmm_jax.auto_layouts` price a link)."""
        return larger(
            self.bytes_sent(input_itemsize, accum_itemsize),
            self.bytes_received(input_itemsize, accum_itemsize),
        )

    @functools.cached_property
    def speeds(self) -> tuple[float, ...]:
        """The relative speed (mean 1) the layouts were made for: see
        :func:`~osmm_jax._src.planning.totals.rank_speeds`."""
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

        ``speeds`` are flops/s per rank; by default :attr:`speeds` times
        :data:`~osmm_jax._src.planning.totals.NOMINAL_SPEED`.
        """
        if speeds is None:
            speeds = [s * NOMINAL_SPEED for s in self.speeds]
        link = self.link_bytes(input_itemsize, accum_itemsize)
        return modelled_balance(self.flops, link, speeds, bandwidth)

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
        return transfers_facts(self.transfers, self.a, self.b)

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
        return max(block_area(self.c, r) for r in range(self.nranks))

    # -- the backward products, reporting ------------------------------------------------

    def backward(self) -> tuple[Plan, Plan]:
        """The plans of the backward products ``(dA = dC @ B.T, dB = A.T @ dC)``."""
        return backward_plans(self)

    def describe(self, max_lines: int = 40) -> str:
        """A readable summary: layouts, who multiplies what, who sends how much to whom."""
        return describe_plan(self, max_lines)

    def plot(self, **kwargs):
        """A matplotlib Figure of the A, B and C tilings and the bytes each rank sends to each
        other rank; see :func:`osmm_jax.plot_plan` (needs matplotlib: the ``plot`` extra)."""
        from osmm_jax._src.planning.plot import plot_plan  # with matplotlib, on first use

        return plot_plan(self, **kwargs)


def _gather_stage(plan: Plan) -> Plan | None:
    """For a replicated C, the plan of the same product into an even split of C when summing
    that way is cheaper, or None.

    Summing a replicated C directly makes every contributing rank send its whole partial to
    every other rank: (P - 1) copies of C per rank. Reducing into an even split first and then
    getting the other blocks moves about 2 (P - 1) / P copies, like a ring all-reduce, and
    leaves every rank with bit-identical values. The stage keeps the products where the
    inputs are (``compute_at_inputs``), so the split of work the layouts chose (e.g. batch
    rows in proportion to speed) stays. The stage is kept only if its busiest link (the larger
    of what a rank sends and receives) carries less and no rank computes more than summing the
    replicated C directly.
    """
    c = plan.c
    if not c.is_replicated or c.nranks < 3:
        return None
    M, N = c.shape
    if M >= N:
        split = Layout.rows(c.shape, nranks=c.nranks)
    else:
        split = Layout.cols(c.shape, nranks=c.nranks)
    stage = Plan(plan.a, plan.b, split, plan.comm_key, compute_at_inputs=True)
    direct, staged = plan._totals, with_gathers(stage._totals, stage.c)
    cheaper = max(staged.link()) < max(direct.link())
    if cheaper and all(s <= d for s, d in zip(staged.flops, direct.flops)):
        return stage
    return None


def totals_as_run(plan: Plan) -> Totals:
    """Every rank's :class:`Totals` of ``plan`` as it runs: of its own cells, or, when it is
    staged, of its gather stage with the gathers."""
    stage = plan.gather_stage
    return plan._totals if stage is None else with_gathers(stage._totals, stage.c)


def make_plan(a: Layout, b: Layout, c: Layout, comm_key: int = 0, work: Work | None = None) -> Plan:
    """The (cached) plan of ``C = A @ B`` for the given layouts (and :class:`Work` split)."""
    check_work_type(work)  # before the cache, which would call a list unhashable
    # Layouts that differ only in their reasons are equal, so the reasons join the cache key:
    # the plan returned holds the very layouts asked for, and describe() tells their reason.
    reasons = tuple(getattr(layout, "reason", "") for layout in (a, b, c))
    return _cached_plan(a, b, c, comm_key, work, reasons)


@functools.lru_cache(maxsize=256)
def _cached_plan(a: Layout, b: Layout, c: Layout, comm_key: int, work, _reasons) -> Plan:
    return Plan(a, b, c, comm_key, work=work)


@functools.lru_cache(maxsize=256)
def direct_plan(plan: Plan) -> Plan:
    """``plan`` summing a replicated C directly, never staged (see :func:`_gather_stage`):
    every contributing rank delivers its partial to every other rank."""
    if not plan.staged:
        return plan
    return Plan(
        plan.a,
        plan.b,
        plan.c,
        plan.comm_key,
        compute_at_inputs=plan.compute_at_inputs,
        work=plan.work,
        staged=False,
    )


def _stationary_c(plan: Plan) -> bool:
    """Whether every cell of ``plan`` (no work split) is computed by the owner of its C block,
    with no operand replicated. Looks at every cell; asked only where C's blocks tile a 2-D
    grid (:func:`owner_boxes`)."""
    if plan.a.is_replicated or plan.b.is_replicated:
        return False
    return c_owners_compute_every_cell(plan.cells)


@functools.lru_cache(maxsize=256)
def backward_plans(plan: Plan) -> tuple[Plan, Plan]:
    """Plans of the two backward products of ``plan``.

    ``dA = dC @ B.T`` (layouts C, B.T -> A) and ``dB = A.T @ dC`` (layouts A.T,
    C -> B): both are ordinary distributed products with transposed layouts, and the same
    boxes of work (a rank computes the gradients of the multiply-adds it computed): those of
    ``plan.work``, or, for a product of partitioned operands on a 2-D grid of C blocks whose
    every rank computes its own block (stationary C), those blocks (:func:`owner_boxes`).
    Decided cell by cell instead, a grid's backward products fall to the ranks holding both
    pieces of a cell: on a 2 x 2 grid two ranks then compute three GEMMs each and two
    compute one.
    """
    work = plan.work
    if work is None:
        boxes = owner_boxes(plan.c, plan.dims[1])
        work = boxes if boxes is not None and _stationary_c(plan) else None
    work_a = None if work is None else work.permuted((0, 2, 1))
    work_b = None if work is None else work.permuted((1, 0, 2))
    d_a = make_plan(plan.c, plan.b.T, plan.a, plan.comm_key, work_a)
    d_b = make_plan(plan.a.T, plan.c, plan.b, plan.comm_key, work_b)
    return d_a, d_b
