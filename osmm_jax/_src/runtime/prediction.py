"""What a product of a plan will move and hold on each rank, before it runs:
:func:`rma_bytes` (bytes issued by its RMA operations) and :func:`memory_bytes` (its peak),
as :func:`osmm_jax.matmul` runs it with the settings in force. Local: each reads only the
given rank's part of the plans (and the sizes agreed on when every rank built them).
"""

from __future__ import annotations

from osmm_jax._src import checks, config
from osmm_jax._src.planning.memory import (
    PeakMemory,
    allreduce_transient,
    merged_block_operands,
    one_sided_transient,
)
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.planning.totals import block_area
from osmm_jax._src.runtime import allreduce, backward, communicators, fetch, one_sided, slots
from osmm_jax._src.runtime.matmul import _check_keep_fetched, _resolve_sync


def rma_bytes(
    plan: Plan,
    input_itemsize: int = 4,
    accum_itemsize: int = 4,
    *,
    direction: str = "forward",
    sync: str | None = None,
    keep_fetched: bool = False,
) -> tuple[int, ...]:
    """Bytes each rank's RMA operations move per product of ``plan``, as :func:`matmul` runs
    it with ``sync`` (``None``: its default here, see :func:`matmul`): what this rank's
    ``osmm_jax.stats()["rma_bytes"]`` grows by, per rank. ``input_itemsize``: bytes of an A
    or B element; ``accum_itemsize``: of the accumulation dtype (4 for float32, bfloat16 and
    float16, 8 for float64). The fence mode's figure is :meth:`Plan.bytes_issued`; the
    notified mode pushes what the fence mode gets, so its ranks issue what leaves them.

    ``direction="backward"``: the bytes of both backward products of a gradient with respect
    to A and B (the forward product's are ``"forward"``'s), where dB's product leaves out of
    its fetch the pieces of C's cotangent that dA's product fetched (all of them for a K-split
    product such as a row-parallel layer, :mod:`osmm_jax._src.runtime.backward`) and, with
    ``keep_fetched`` (as given to :func:`matmul`), both leave out what they take from the
    forward product's fetch."""
    resolved = _resolve_sync(sync)
    _check_direction(direction)
    if direction == "forward":
        return slots.bytes_issued(plan, resolved, input_itemsize, accum_itemsize)
    sizes = (resolved, input_itemsize, accum_itemsize)
    plan_da, plan_db = backward_plans(plan)
    totals = [slots.bytes_issued(p, *sizes) for p in (plan_da, plan_db)]
    how = backward.reuse(plan, resolved, True, _check_keep_fetched(keep_fetched))
    totals.append([-n for n in backward.taken_bytes(plan, *sizes, how)])
    return tuple(sum(per_rank) for per_rank in zip(*totals))


def _check_direction(direction) -> None:
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")


def memory_bytes(
    plan: Plan,
    rank: int,
    input_itemsize: int = 4,
    accum_itemsize: int = 4,
    *,
    method: str | None = None,
    direction: str = "forward",
    sync: str | None = None,
    keep_fetched: bool = False,
) -> PeakMemory:
    """What ``rank`` is predicted to hold at the busiest moment of a product of ``plan``
    (``direction="forward"``) or of its gradient (``"backward"``: the jitted gradient with
    respect to A and B, which runs the product and both backward products), as :func:`matmul`
    runs it with ``method`` and ``sync`` (None: the defaults in force): a
    :class:`~osmm_jax._src.planning.memory.PeakMemory` of bytes, ``.total`` the peak.

    Counted: the rank's blocks (A, B and C; backward: A, B, their gradients and C's
    cotangent) in ``input_itemsize``-byte elements; the products' buffers in
    ``accum_itemsize``-byte ones (fetched and served pieces, partials for other ranks,
    operands joined for one GEMM; backward: the two backward products' at once, or the forward
    product's (one_sided: with the pieces the backward ones pack), whichever is more); and the
    slots of osmm_jax's windows that the products make resident. The all-reduce method's buffers
    are what XLA assigns to the program it runs on ``rank``, compiled here (not run; a few
    seconds for large blocks) where the plan's communicator is in this process, else its whole
    matrices counted from the plan; with MPI's receive buffer for its largest sum. Not counted
    for one_sided: the MPI library's own buffers and XLA's scheduling beyond the above
    (benchmarks/results/memory.md compares this with measured peaks); the
    operands a backward product joins for one GEMM over its whole block (a K-split's dA, whose
    joined rows of ``dC`` XLA shares with dB's joined product, which is counted). Where dB's
    product takes C's cotangent from dA's fetch (:func:`rma_bytes`), its pieces count once;
    with ``keep_fetched`` (as given to :func:`matmul`) the pieces a backward product takes from
    the forward product's fetched buffers count as received by it, not fetched again.
    Local; builds ``rank``'s part of each plan."""
    method = config.resolve_method(method)
    resolved = _resolve_sync(sync)
    _check_direction(direction)
    rank = checks.integer(rank, "rank")
    if rank >= plan.nranks:
        raise ValueError(f"rank must be below the plan's {plan.nranks} ranks, got {rank}")
    for name, size in (("input_itemsize", input_itemsize), ("accum_itemsize", accum_itemsize)):
        checks.integer(size, name, minimum=1)
    blocks = [block_area(layout, rank) for layout in (plan.a, plan.b, plan.c)]
    held = sum(blocks) if direction == "forward" else 2 * (blocks[0] + blocks[1]) + blocks[2]
    if method == "allreduce":
        transient = _allreduce_buffers(plan, rank, input_itemsize, accum_itemsize, direction)
        return PeakMemory(held * input_itemsize, transient, 0)
    plans = (plan,) if direction == "forward" else (plan, *backward_plans(plan))
    itemsizes = (input_itemsize, accum_itemsize)
    how = backward.NONE
    if direction == "backward":
        how = backward.reuse(plan, resolved, True, _check_keep_fetched(keep_fetched))
    transposed = (None, "B", "A")  # dA's B operand is B.T, dB's A operand A.T
    runs = [
        _one_sided_run(p, rank, resolved, itemsizes, tr, product, plan, how)
        for p, tr, product in zip(plans, transposed, (None, *backward.PRODUCTS))
    ]
    transients = [transient for transient, _ in runs]
    packed = [served for _, served in runs]
    transient = transients[0]
    if direction == "backward":
        # The backward products run side by side (neither needs the other); a one_sided
        # product packs the pieces it serves from its inputs alone, which XLA may do while the
        # forward product still runs.
        transient = max(transients[0] + packed[1] + packed[2], transients[1] + transients[2])
    windows = max(
        slots.resident_window_bytes(p, rank, input_itemsize, accum_itemsize, resolved)
        for p in plans
    )
    return PeakMemory(held * input_itemsize, transient * accum_itemsize, windows)


def _allreduce_buffers(plan: Plan, rank: int, input_itemsize: int, accum_itemsize: int, direction):
    """Bytes the all-reduce method holds on ``rank`` beside the blocks: XLA's temporaries for
    its program, read from XLA's buffer assignment where the plan's communicator is in this
    process (:func:`.allreduce.compiled_temporaries`), else counted from the plan (its whole
    matrices, :func:`~osmm_jax._src.planning.memory.allreduce_transient`: the backward products
    side by side, or the forward product alone where that holds more); and the MPI library's
    buffer for its largest sum (:func:`.allreduce.mpi_buffer_bytes`)."""
    mpi = allreduce.mpi_buffer_bytes(plan, rank, accum_itemsize, direction)
    dtype = allreduce.dtype_of(input_itemsize, accum_itemsize)
    if dtype is not None and communicators.is_known(plan.comm_key):
        return allreduce.compiled_temporaries(plan, rank, dtype, direction) + mpi
    elements = allreduce_transient(plan)
    if direction == "backward":
        both = sum(allreduce_transient(p) for p in backward_plans(plan))
        elements = max(elements, both)
    return elements * accum_itemsize + mpi


def _gathered(plan: Plan, executed: Plan, rank: int, sync, messages: bool, accum_itemsize: int):
    """``(whole_c, in_place)`` for :func:`one_sided_transient`: what a staged plan's all-gather
    holds (the whole C, and with messages its own block's staged image; in place the whole C
    is the result, and it holds the copy of its rows it sends), and whether it runs in place
    (``one_sided.sums_in_place``). ``(0, False)`` for a plan run as itself."""
    if executed is not plan.gather_stage:
        return 0, False
    in_place = one_sided.sums_in_place(plan, rank, sync, accum_itemsize) is not None
    block = block_area(executed.c, rank)
    whole_c = block if in_place else plan.c.shape[0] * plan.c.shape[1]
    return whole_c + (block if messages else 0), in_place


def _one_sided_run(
    plan: Plan,
    rank: int,
    sync: one_sided.Sync,
    itemsizes: tuple[int, int],
    transposed=None,
    product=None,
    of=None,
    how=backward.NONE,
):
    """``(transient, packed)``: the elements (accumulation dtype) a one_sided product of
    ``plan`` adds on ``rank`` (planning/memory.py), and those of the pieces it packs to serve
    (``itemsizes``: bytes of an input element and of an accumulation one), as ``sync`` runs it;
    ``transposed``: the operand (``"A"`` or ``"B"``) that is the transpose of an input (a
    backward product's): served from its block, the block is a transposed copy XLA forms
    from the input, counted as packed; ``product``: ``"dA"`` or ``"dB"`` of plan ``of``,
    reusing fetched pieces as ``how`` says (:mod:`.backward`)."""
    input_itemsize, accum_itemsize = itemsizes
    same_dtype = input_itemsize == accum_itemsize
    taken = lone = None
    skip = frozenset()
    if product is not None:
        taken, skip = backward.taken(of, rank, product, how), backward.skipped(of, product, how)
        lone = backward.lone_pieces(of, rank, product, how, sync.mode)
    executed = one_sided.executed_plan(plan, sync)
    messages = slots.uses_messages(executed, sync)
    whole_c, in_place = _gathered(plan, executed, rank, sync, messages, accum_itemsize)
    gets, serves = fetch.moved(executed, rank, taken)
    served = 0  # the pieces packed to serve, every round's (XLA may pack them all at once)
    for matrices in fetch.rounds(executed, sync.mode, skip):
        if sync.mode == "notify" and fetch.packs_pieces(
            executed, rank, same_dtype, taken, matrices
        ):
            served += sum(t.elements for t in serves if t.matrix in matrices)
    packs = served > 0
    copies = 0
    if sync.mode == "notify" and transposed and not packs:
        if any(t.matrix == transposed for t in serves):
            copies = block_area(executed.a if transposed == "A" else executed.b, rank)
            served += copies
    ahead = fetch.runs_ahead(executed, rank, sync, same_dtype)  # its GEMMs kept apart
    if ahead and not executed.has_deliveries:
        # The GEMMs on own and fetched pieces are apart, so no one GEMM writes the C block
        # whole (one_sided._whole_block): it is summed from theirs.
        copies += block_area(executed.c, rank)
    if fetch.runs_ahead(executed, rank, sync, same_dtype, taken):
        # The waiter's result, and with RMA its copy of what the pieces leave from.
        copies += sum(t.elements for t in gets)
        if not messages:
            layouts = {"A": executed.a, "B": executed.b}
            blocks = sum(block_area(layouts[m], rank) for m in {t.matrix for t in serves})
            copies += served if packs else blocks
    if lone is None:
        lone = fetch.lone_pieces(executed, rank, sync.mode, taken) if executed.has_gets else ()
    unjoined = fetch.whole_cells(executed, rank, frozenset(lone))
    kept = backward.kept_elements(of, rank, product, how) if product is not None else 0
    merged = 0  # not for a backward product: see memory_bytes
    if product is None and not ahead:
        merged = merged_block_operands(executed, rank)
    fetched = sum(t.elements for t in gets)
    fits = fetched * accum_itemsize <= block_area(executed.c, rank) * input_itemsize
    if merged and not executed.has_deliveries and fits:
        # The fetched pieces are joined before the one GEMM writes the result, which they
        # fit: XLA lends them the result's memory (seen on 2 ranks, where they are as large).
        merged -= fetched
    counts = (packs, whole_c, taken or (), messages, copies, unjoined, kept, merged, in_place)
    return one_sided_transient(executed, rank, *counts), served
