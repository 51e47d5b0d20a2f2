"""The slots of the notified reduce (``OSMM_SYNC=notify``, see xla_ffi/notified/notify.h).

Every rank's slots window holds an accumulator and ``S`` slots, each the size of the largest C
block of the plan (so the window is the same size on every rank). The origins that deliver
into one rank's block are numbered in ascending rank order; origin number ``i`` writes into
slot ``i % S`` in round ``i // S``. ``S`` is the most origins any rank has
(:attr:`~osmm_jax._src.planning.records.PlanFacts.max_origins`), capped by the slot budget
(``OSMM_SLOT_BUDGET``) but at least one: above the budget a rank sums its origins in rounds,
still in ascending rank order, so the result does not depend on the budget.

:class:`Sync` is the synchronisation a product runs with, and :func:`executed_plan` the plan
it then runs (in the notified mode a replicated C is summed directly unless staging saves many
bytes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from osmm_jax._src.planning.plan import Plan, direct_plan
from osmm_jax._src.planning.totals import block_area
from osmm_jax._src.runtime import communicators, native


def slot_bytes(plan: Plan, itemsize: int) -> int:
    """Bytes of one slot: the largest C block of ``plan`` in ``itemsize``-byte elements, aligned."""
    return _aligned(plan.receive_elements * itemsize)


def slot_count(plan: Plan, itemsize: int, budget: float) -> int:
    """``S``: the slots per rank, the same on every rank (``budget``: bytes, may be inf)."""
    return _count(plan.facts.max_origins, slot_bytes(plan, itemsize), budget)


def _count(wanted: int, nbytes: int, budget: float) -> int:
    """``wanted`` slots of ``nbytes`` each, as many as ``budget`` holds, at least one."""
    wanted = max(1, wanted)
    if math.isinf(budget):
        return wanted
    return max(1, min(wanted, int(budget // nbytes)))


def _aligned(nbytes: int) -> int:
    """A slot's bytes: ``nbytes`` aligned, at least one alignment unit."""
    return max(native.WINDOW_ALIGN, native.aligned(nbytes))


def two_set_count(plan: Plan, itemsize: int, budget: float) -> int:
    """``S`` of two sets of slots (product p uses set p % 2: a deferred product may deliver
    while its target still sums the product before, xla_ffi/notified/notify.h), even, as
    many as ``budget`` holds up to twice the most origins; 0 if it holds fewer than two."""
    count = _count(2 * plan.facts.max_origins, slot_bytes(plan, itemsize), budget)
    return 0 if count < 2 else count - count % 2


def window_bytes(plan: Plan, itemsize: int, budget: float) -> int:
    """Bytes of every rank's slots window: the accumulator and ``S`` slots."""
    return (1 + slot_count(plan, itemsize, budget)) * slot_bytes(plan, itemsize)


def reduce_call_parts(plan: Plan, acc, chunk_bytes, sync: Sync, notify: tuple) -> tuple:
    """What names a product's reduce on every rank (``primitives.call_id`` of it): ``plan``,
    the accumulation dtype ``acc``, the chunk size asked for, the synchronisation and the
    window's shape (``notify[:3]``). The same whichever way a rank sends its partials (chunk by
    chunk, or in place from the whole C: ``one_sided.sums_in_place``), which each rank decides
    alone, from the plan, the same way on every call (so that every rank meets a new call
    signature, and agrees on it, on the same call)."""
    return (plan.fingerprint, "reduce", str(acc), chunk_bytes, sync.mode, notify[:3])


def notify_attribute(plan: Plan, rank: int, itemsize: int, sync: Sync) -> tuple[int, ...]:
    """The ``notify`` attribute of ``osmm_reduce_start`` for ``rank``: ``(S, slot_bytes,
    flags, n_origins, *origins, n_targets, *targets)``, from ``rank``'s own part of the plan
    only (flags: 1 when ``sync.credits`` is ``"pull"``, 2 for two sets of slots, which a
    deferred product (``sync.defer``) uses where the budget holds them). (Its number among
    each target's origins, which picks its slot there, the native layer learns from the
    targets the first time the product runs.)"""
    origins = plan.for_rank(rank).origins
    targets = sorted({t.target for t in plan.deliveries_from(rank)})
    messages = uses_messages(plan, sync)
    two = two_set_count(plan, itemsize, sync.slot_budget) if sync.defer and not messages else 0
    count = two or slot_count(plan, itemsize, sync.slot_budget)
    return _attribute(
        count,
        slot_bytes(plan, itemsize),
        sync,
        origins,
        targets,
        two_sets=two > 0,
        messages=messages,
    )


def uses_messages(plan: Plan, sync: Sync) -> bool:
    """Whether a notified product of ``plan`` moves its data as two-sided messages
    (``sync.transport``: ``"messages"``, or ``"auto"`` where ``plan``'s communicator spans
    several nodes, see ``config.TRANSPORT``), the same answer on every rank. A deferred
    product needs no second set of slots then: a target posts its receives only once it has
    summed the product before. A plan made without a communicator (``comm_key`` 0, planning
    alone) counts as one node's."""
    if sync.mode != "notify" or sync.transport == "rma" or plan.nranks == 1:
        return False
    if sync.transport == "messages":
        return True
    return plan.comm_key != 0 and communicators.spans_nodes(plan.comm_key)


FETCH_AHEAD_MAX_ELEMENTS = 1 << 22
"""Unless ``OSMM_FETCH_AHEAD`` says otherwise, a rank fetches ahead while it gets at most this
many elements in a product (16 MiB of float32). A fetch ahead holds, beside the fetched buffer
XLA owns, the waiter's copy of it (and, with RMA, a copy of the buffer its pieces leave from)
until the result is collected. Measured (benchmarks/results/overlap.md, section 9), the
sequence-parallel Transformer step, whose ranks get about 4 MiB per layer, was 1.03-1.07x
faster fetching ahead on 3 ranks of speeds 1:1:2, 1.00-1.01x on 3 and 4 emulated hosts and
0.97x on 2; the memory benchmark's products, which get 72 MiB and more, would hold that much
more for at most such a gain."""


def fetches_ahead(plan: Plan, rank: int, sync: Sync) -> bool:
    """Whether ``rank`` fetches the pieces of a product of ``plan`` ahead of its GEMMs (a
    waiter thread receives them while the GEMMs on this rank's own pieces run,
    ``config.FETCH_AHEAD``): ``sync.fetch_ahead`` if True or False, else (None) while it gets
    at most :data:`FETCH_AHEAD_MAX_ELEMENTS`. Only in the notified mode, on several ranks, for
    a rank that gets pieces."""
    gets = sum(t.elements for t in plan.for_rank(rank).gets) if plan.has_gets else 0
    if sync.mode != "notify" or plan.nranks == 1 or gets == 0:
        return False
    if sync.fetch_ahead is not None:
        return sync.fetch_ahead
    return gets <= FETCH_AHEAD_MAX_ELEMENTS


def _attribute(
    count: int,
    nbytes: int,
    sync: Sync,
    origins,
    targets,
    bases=None,
    two_sets=False,
    extents=None,
    messages=False,
):
    """The ``notify`` attribute's layout (see :func:`notify_attribute`), with ``bases`` (bytes
    into this rank's slot for each origin where that origin's records land) if given; with
    ``extents`` too (the bytes each origin sends), in placement (flag 4): each origin's records
    land at the start of its slot and are copied to byte ``base`` of this rank's block, not
    added over all of it (xla_ffi/notified/notify.h); ``messages``: flag 8, the message
    transport (xla_ffi/notified/messages.h)."""
    placing = extents is not None
    flags = int(sync.credits == "pull") | (2 if two_sets else 0) | (4 if placing else 0)
    flags |= 8 if messages else 0
    tail = () if bases is None else (len(bases), *bases)
    if placing:
        tail += (len(extents), *extents)
    return (count, nbytes, flags, len(origins), *origins, len(targets), *targets, *tail)


def fetch_attribute(
    plan: Plan, itemsize: int, sync: Sync, owners, getters, bases, extents
) -> tuple[int, ...]:
    """The ``notify`` attribute of the notified fetch (:mod:`osmm_jax._src.runtime.fetch`) on one
    rank, in placement: its ``owners`` (the ranks it gets pieces from) are its origins, its
    ``getters`` (the ranks that get pieces from it) its targets, ``bases`` says where in this
    rank's fetched buffer each owner's pieces start and ``extents`` how many bytes they take. A slot holds the most A and B
    elements one rank gets from one owner, in ``itemsize``-byte elements; ``S`` is the most
    owners any rank has, capped by the slot budget."""
    count, nbytes = _fetch_slots(plan, itemsize, sync.slot_budget)
    messages = uses_messages(plan, sync)
    return _attribute(
        count, nbytes, sync, owners, getters, bases, extents=extents, messages=messages
    )


def fetch_rounds(plan: Plan, mode: str) -> tuple[tuple[str, ...], ...]:
    """The matrices of each round of ``plan``'s fetch (:mod:`osmm_jax._src.runtime.fetch`) in
    synchronisation ``mode``, the same on every rank (from the agreed facts): ``(("A",),
    ("B",))`` in the notified mode where some rank serves pieces of A and some of B, else
    ``(("A", "B"),)``. A round touches the slots of its own owners only."""
    exposes_a, exposes_b = plan.expose_elements
    if mode == "notify" and exposes_a and exposes_b:
        return (("A",), ("B",))
    return (("A", "B"),)


def _fetch_slots(plan: Plan, itemsize: int, budget: float) -> tuple[int, int]:
    """``(S, slot bytes)`` of ``plan``'s notified fetch, the same on every rank: a slot holds
    the most A and B elements one rank gets from one owner; ``S`` is the most owners any rank
    has, capped by ``budget``."""
    facts = plan.facts
    nbytes = _aligned(facts.owner_elements * itemsize)
    return _count(facts.max_owners, nbytes, budget), nbytes


class GatherSlots(NamedTuple):
    """Staged ``plan``'s notified all-gather on one rank (:func:`gather_slots`)."""

    notify: tuple[int, ...]  # the ``notify`` attribute of osmm_reduce_start
    targets: tuple[int, ...]  # the ranks this rank sends its block to (none if it owns none)


def gather_slots(plan: Plan, rank: int, itemsize: int, sync: Sync) -> GatherSlots:
    """The notified all-gather of staged ``plan`` on ``rank``
    (:mod:`osmm_jax._src.runtime.gather`): every owner of a block of the even split delivers
    it to every other rank, whose block is the whole C. ``itemsize``: of the accumulation
    dtype. A row split's blocks are contiguous in C: they are placed (a slot the size of the
    largest block, copied to where the block starts); a column split's are not: a slot is the
    whole C, the blocks added over zeros."""
    split = plan.gather_stage.c
    area = [split.local_shape(r)[0] * split.local_shape(r)[1] for r in range(plan.nranks)]
    owners = [r for r in range(plan.nranks) if area[r]]
    origins = [o for o in owners if o != rank]
    targets = [t for t in range(plan.nranks) if t != rank] if rank in owners else []
    # The most origins any rank has: every owner, for a rank that owns no block.
    most = len(owners) - (len(owners) == plan.nranks)
    if split.kind == "rows":  # the same on every rank, as the attribute's flags must be
        nbytes = _aligned(max(area) * itemsize)
        width = plan.c.shape[1]
        bases = [split.blocks[o][0][0] * width * itemsize for o in origins]
        extents = [area[o] * itemsize for o in origins]
    else:
        nbytes = _aligned(plan.c.shape[0] * plan.c.shape[1] * itemsize)
        bases = extents = None
    count = _count(most, nbytes, sync.slot_budget)
    messages = uses_messages(plan, sync)
    notify = _attribute(
        count, nbytes, sync, origins, targets, bases, extents=extents, messages=messages
    )
    return GatherSlots(notify, tuple(targets))


class Sync(NamedTuple):
    """How the partials are synchronised: ``mode`` ``"fence"`` (collective fence epochs,
    arrival-order sums) or ``"notify"`` (per-origin slots and notifications, sums in ascending
    rank order: see :mod:`osmm_jax._src.runtime.slots`), the slot budget in bytes, and how an
    origin learns that its slot at a target is free again (notify only): ``"push"``, the
    target writes it into the origin's window once it has summed the slot; ``"pull"``, the
    origin reads the target's progress when it needs the slot. Pull is for MPIs whose RMA
    calls wait for the target to make MPI progress
    (``communicators.accumulates_wait_for_target``): there a push would hold the target,
    its own part done, until the origin next calls MPI. ``defer``: whether this product, if its
    partials leave in one chunk, is finished by a native waiter thread while the program goes
    on (set for weight gradients under ``OSMM_DEFER``, see ``matmul._deferring``).
    ``transport``: how the partials travel (:func:`uses_messages`). ``fetch_ahead``: whether
    a fetch runs ahead of the GEMMs (:func:`fetches_ahead`)."""

    mode: str = "fence"
    slot_budget: float = float("inf")
    credits: str = "push"
    defer: bool = False  # notify only: finish on a waiter (weight gradients, config.DEFER)
    transport: str = "rma"  # notify only: "rma", "messages" or "auto" (config.TRANSPORT)
    fetch_ahead: bool | None = False  # notify only: None by size (config.FETCH_AHEAD)


FENCE = Sync("fence")

DIRECT_EXTRA_ELEMENTS = 1 << 19
"""In the notified mode a replicated C is summed directly (every rank's partial to every other
rank, one notified round) rather than staged (reduce-scatter, then the notified all-gather:
two rounds) while the direct sum sends at most this many elements per rank more than staging
(:func:`direct_extra_elements`). Measured over TCP between 3 and 4 emulated hosts
(benchmarks/results/sync_staged.md): the extra round costs about as much as 400-700 thousand
extra elements; below that the direct sum was up to 1.7x faster, above it staging up to 1.3x.
That is with the RMA transport; with messages see :data:`DIRECT_EXTRA_ELEMENTS_MESSAGES`."""

DIRECT_EXTRA_ELEMENTS_MESSAGES = 1 << 18
""":data:`DIRECT_EXTRA_ELEMENTS` where the partials travel as messages (:func:`uses_messages`).
Measured over TCP (benchmarks/results/sync_staged.md, "With messages", three runs): the
direct sum was as fast or faster up to 175 thousand extra elements (3 hosts, d=512), staging
1.2-1.6x faster from 393 thousand on (4 hosts, d=512 and 1024); between them, at 699
thousand (3 hosts, d=1024), the runs split."""


def direct_extra_elements(plan: Plan) -> int:
    """How many more elements each rank sends summing replicated C directly than staged, with
    even blocks: ``(P - 1) * N`` against ``2 * (P - 1) / P * N`` (``N``: elements of C)."""
    p, elements = plan.nranks, plan.c.shape[0] * plan.c.shape[1]
    return elements * (p - 1) * (p - 2) // p


def executed_plan(plan: Plan, sync: Sync) -> Plan:
    """The plan :func:`forward` runs for ``plan``: its gather stage, the direct plan (a
    replicated C in the notified mode whose direct sum costs few extra bytes, see
    :data:`DIRECT_EXTRA_ELEMENTS` and :data:`DIRECT_EXTRA_ELEMENTS_MESSAGES`), or ``plan``
    itself."""
    if plan.gather_stage is None:
        return plan
    if sync.mode != "notify":
        return plan.gather_stage
    limit = DIRECT_EXTRA_ELEMENTS_MESSAGES if uses_messages(plan, sync) else DIRECT_EXTRA_ELEMENTS
    if direct_extra_elements(plan) <= limit:
        return direct_plan(plan)
    return plan.gather_stage


def bytes_issued(
    plan: Plan, sync: Sync, input_itemsize: int, accum_itemsize: int
) -> tuple[int, ...]:
    """Bytes each rank's RMA operations move per product of ``plan`` run with ``sync``: what
    ``stats()["rma_bytes"]`` grows by. Fenced, the plan's own figure (its gets, and its
    partials and gathered blocks by accumulate or put: :meth:`Plan.bytes_issued`). Notified,
    every rank sends instead of getting: the owners push the A and B pieces (in the
    accumulation dtype) and a staged plan's gathered blocks, so a rank issues what leaves it
    (:meth:`Plan.bytes_sent`) of the plan it runs (:func:`executed_plan`)."""
    if sync.mode != "notify":
        return plan.bytes_issued(input_itemsize, accum_itemsize)
    executed = executed_plan(plan, sync)
    sending = plan if executed is plan.gather_stage else executed
    return sending.bytes_sent(accum_itemsize, accum_itemsize)


def _accumulates(attribute, rank: int) -> bool:
    """Whether the notified reduce of ``attribute`` (:func:`notify_attribute`) on ``rank``
    moves a sum into the window's accumulator: some round of ``S`` slots (a product's:
    half the slots with two sets) holds only origins below ``rank``, and another follows.
    The native layer counts each such product (``osmm_jax.stats()["accumulator_folds"]``)."""
    slots, flags, count = attribute[0], attribute[2], attribute[3]
    per_round = slots // 2 if flags & 2 else slots
    below = sum(1 for origin in attribute[4 : 4 + count] if origin < rank)
    return count > per_round and below >= per_round


def resident_window_bytes(plan: Plan, rank: int, itemsize: int, accum: int, sync: Sync) -> int:
    """Bytes of osmm_jax's windows that one product of ``plan`` makes resident on ``rank``
    (``itemsize``: of an input element, ``accum``: of the accumulation dtype), the largest of
    its uses (one window per communicator serves them all, one after another). Notified: the
    slots this rank's origins write (a slot per origin up to ``S``, of the reduce, the fetch or
    a staged plan's all-gather), and a reduce's accumulator where a round of its origins,
    all ranked below this rank, is followed by another: the fixed-order sum adds those
    origins' slots before this rank's own partial, holding their sum in a slot while the
    round lasts and in the accumulator after it (xla_ffi/notified/ordered_sum.h). The fetch
    and the all-gather place their pieces without it. Fenced: the reduce window (the largest
    C block), the fetch's exposed blocks and the all-gather's (the largest block of the split
    C)."""
    executed = executed_plan(plan, sync)
    mine = executed.for_rank(rank)
    uses = []
    if sync.mode == "notify":
        if executed.has_deliveries and plan.nranks > 1:
            attribute = notify_attribute(executed, rank, accum, sync)
            accumulator = int(_accumulates(attribute, rank))
            uses.append((min(attribute[0], attribute[3]) + accumulator) * attribute[1])
        if executed.has_gets:
            # A round of the fetch (fetch.rounds) touches the slots of its own owners.
            count, nbytes = _fetch_slots(executed, accum, sync.slot_budget)
            for matrices in fetch_rounds(executed, sync.mode):
                owners = len({t.target for t in mine.gets if t.matrix in matrices})
                uses.append(min(owners, count) * nbytes)
        if executed is plan.gather_stage:
            notify = gather_slots(plan, rank, accum, sync).notify
            uses.append(min(notify[0], notify[3]) * notify[1])
        return max(uses, default=0)
    if executed.has_deliveries:
        uses.append(executed.receive_elements * accum)
    if executed.has_gets:
        uses.append(sum(executed.expose_elements) * itemsize)
    if executed is plan.gather_stage:  # the blocks of the split C, in the input dtype
        uses.append(max(block_area(executed.c, r) for r in range(plan.nranks)) * itemsize)
    return max(uses, default=0)
