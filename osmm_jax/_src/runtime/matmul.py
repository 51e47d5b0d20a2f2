"""``osmm_jax.matmul``: a distributed product as a differentiable JAX operation.

Section order: public functions, input checks, batching, differentiation.

Every rank calls :func:`matmul` with the same plan and its own local blocks
(SPMD). After every rank has checked its inputs and all have agreed on the plan
and options, the product runs in one of two executors, each in its own module
(which states what it computes, what it sends and in which dtype):

* ``one_sided`` (:mod:`osmm_jax._src.runtime.one_sided`): XLA dots on static slices
  plus the native one-sided transfers (MPI_Get of remote input pieces,
  MPI_Accumulate / MPI_Put of partials straight into their owners' windows,
  overlapped with the GEMMs in chunks).
* ``allreduce`` (:mod:`osmm_jax._src.runtime.allreduce`): the baseline, which
  sums full-size products with an all-reduce (``mpi4jax.allreduce`` when mpi4jax is
  installed, else osmm_jax's own ``MPI_Iallreduce``; ``OSMM_ALLREDUCE``).

This module adds what both share: the optional checksum verification and
metrics, a vmap rule that runs a batch of products one after another (see
:func:`_batchable_forward`), and the custom_vjp whose backward products are
distributed products with transposed layouts (first order only; one_sided, they fetch the
pieces of C's cotangent both need once, :mod:`osmm_jax._src.runtime.backward`).

Accumulation precision: products and sums are formed in float32 for float32,
bfloat16 and float16 inputs, and in float64 for float64; the result is cast
back to the input dtype once, at the end. 16-bit partials therefore travel as
float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from osmm_jax._src import checks, config, dtypes
from osmm_jax._src.compat import HAVE_MPI4JAX
from osmm_jax._src.planning.memory import PeakMemory, allreduce_transient, one_sided_transient
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.planning.records import combine_facts
from osmm_jax._src.planning.totals import block_area
from osmm_jax._src.runtime import (
    allreduce,
    backward,
    checksum,
    communicators,
    fetch,
    metrics,
    one_sided,
    slots,
    watchdog,
)

# -- public function ------------------------------------------------------------------


class _Options(NamedTuple):
    """Static choices of one product, shared by its backward products."""

    method: str
    verify: bool
    chunk_bytes: int  # one_sided: overlap sends with GEMMs in chunks of this size; 0 = off
    sync: one_sided.Sync  # one_sided: how the partials are synchronised
    defer_weight_grads: bool | None = False  # one_sided: dB deferred? None: by comm (DEFER)


def matmul(
    a_local,
    b_local,
    plan: Plan,
    *,
    method: str | None = None,
    verify: bool | None = None,
    chunk_bytes: int | None = None,
    sync: str | None = None,
):
    """This rank's block of ``C = A @ B`` in ``plan``'s C layout.

    Args:
        a_local: this rank's block of A, shape ``plan.a.local_shape(rank)``.
        b_local: this rank's block of B, shape ``plan.b.local_shape(rank)``,
            same dtype as ``a_local`` (float32, float64, bfloat16 or float16).
        plan: from :func:`osmm_jax.plan`; the same on every rank.
        method: ``"one_sided"`` (default) or ``"allreduce"`` (the all-reduce
            baseline); ``None`` reads ``OSMM_USE_ALLREDUCE``.
        verify: check the result by checksum (see :mod:`osmm_jax._src.runtime.checksum`;
            a few percent of the product's cost) and raise ChecksumError, naming
            the C block and the ranks involved, if it drifts; the backward
            products are checked too. ``None`` reads ``OSMM_VERIFY``.
        chunk_bytes: ``one_sided`` only: overlap communication with computation.
            The partials other ranks receive are computed in chunks of about
            this many bytes, and each chunk is sent by a background thread as
            soon as its GEMMs finish, while the next chunk (and finally this
            rank's own part) is computed. ``0`` turns overlap off: every GEMM
            first, then all sends. ``None`` reads ``OSMM_CHUNK_BYTES``
            (default 4 MiB). The sums are the same either way; a GEMM split by
            rows may round differently in the last bits.
        sync: ``one_sided`` only: ``"notify"`` delivers each partial
            into a slot of its owner reserved for its origin and notifies the
            owner, who waits for exactly the partials it gets and sums them in
            ascending rank order: no collective per product, and the same bits
            on every run and on every rank that holds a copy. ``"fence"``
            brackets every product by collective ``MPI_Win_fence`` epochs and
            sums in arrival order. ``None`` reads ``OSMM_SYNC``, else takes
            ``"notify"``, but ``"fence"`` under Open MPI (whose accumulates
            wait for the target) and ``OSMM_CUDA_AWARE=1``; the slots' memory
            is capped by ``OSMM_SLOT_BUDGET``.

    Returns:
        A JAX array of shape ``plan.c.local_shape(rank)`` and the input dtype.

    Works eagerly, under ``jax.jit``, inside loops, under ``jax.grad`` /
    ``jax.vjp`` (the backward products are distributed products with transposed
    layouts) and under ``jax.vmap`` (a batch of distributed products, run one
    after another). Every rank must call it at the same point of the program.
    Before any MPI traffic, all ranks check together that they hold the same
    plan and method and valid blocks and options (arguments and ``OSMM_*``
    variables); otherwise every rank raises the same ValueError (TypeError when
    every failing rank had a wrong type).
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"plan must be an osmm_jax Plan (from osmm_jax.plan), got {type(plan).__name__}"
        )
    comm = communicators.comm_for_key(plan.comm_key)
    rank = comm.Get_rank()
    # A bad option (an argument, or an OSMM_* variable set on some ranks only) is agreed on
    # like a bad block, so that every rank raises it instead of the others waiting.
    try:
        options, error = _resolve_options(method, verify, chunk_bytes, sync), None
    except (TypeError, ValueError) as exc:
        options, error = None, exc
    if error is None:
        a_local, b_local, error = _check_inputs(a_local, b_local, plan, rank)
    try:
        watchdog.apply_settings()
    except (TypeError, ValueError) as exc:
        error = error or exc
    # Both executors read the plan facts (whether anyone gets or delivers).
    share = _facts_to_share(plan, options, rank) if error is None else None
    with watchdog.host_step(comm, "osmm_jax.matmul's checks"):
        shared = communicators.agree(
            comm, "osmm_jax.matmul", f"plan {plan.fingerprint} {options}", error, share=share
        )
    if share is not None:
        _adopt_facts(plan, options, shared)
    return _matmul(plan, options, a_local, b_local)


def _executed_plans(plan: Plan, options: _Options) -> tuple[Plan, ...]:
    """The plans a product of ``plan`` and its gradient run: the product and its two backward
    products, each as executed (:func:`one_sided.executed_plan`)."""
    return tuple(one_sided.executed_plan(p, options.sync) for p in (plan, *backward_plans(plan)))


def _facts_to_share(plan: Plan, options: _Options, rank: int) -> tuple:
    """This rank's :class:`~osmm_jax._src.planning.records.PlanFacts` of every executed plan (cached in
    the plans after the first product: later calls only look them up), and whether its part
    of the backward products lets them fetch C's cotangent once (:func:`backward.covered_on`).

    Sent on every call, not only until the plans have adopted the combined facts: another rank
    may hold a new, equal plan object that has not."""
    facts = tuple(p.for_rank(rank).facts for p in _executed_plans(plan, options))
    return (*facts, backward.covered_on(plan, rank))


def _adopt_facts(plan: Plan, options: _Options, shared: list[tuple]) -> None:
    """Give each executed plan the facts combined over ranks, so that running it (and its
    gradient) builds only this rank's part of the plan, never the whole schedule."""
    executed = _executed_plans(plan, options)
    for i, target in enumerate(executed):
        if not target._agreed:
            target.adopt_facts(combine_facts(rank_facts[i] for rank_facts in shared))
    if not plan._agreed:
        plan.adopt_facts(executed[0].facts)
    backward.adopt(plan, [rank_share[-1] for rank_share in shared])


def rma_bytes(
    plan: Plan,
    input_itemsize: int = 4,
    accum_itemsize: int = 4,
    *,
    direction: str = "forward",
    sync: str | None = None,
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
    product such as a row-parallel layer, :mod:`osmm_jax._src.runtime.backward`)."""
    resolved = _resolve_sync(sync)
    _check_direction(direction)
    if direction == "forward":
        return slots.bytes_issued(plan, resolved, input_itemsize, accum_itemsize)
    sizes = (resolved, input_itemsize, accum_itemsize)
    plan_da, plan_db = backward_plans(plan)
    totals = [slots.bytes_issued(p, *sizes) for p in (plan_da, plan_db)]
    totals.append([-n for n in backward.taken_bytes(plan, *sizes)])
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
) -> PeakMemory:
    """What ``rank`` is predicted to hold at the busiest moment of a product of ``plan``
    (``direction="forward"``) or of its gradient (``"backward"``: the jitted gradient with
    respect to A and B, which runs the product and both backward products), as :func:`matmul`
    runs it with ``method`` and ``sync`` (None: the defaults in force): a
    :class:`~osmm_jax._src.planning.memory.PeakMemory` of bytes, ``.total`` the peak.

    Counted: the rank's blocks (A, B and C; backward: A, B, their gradients and C's
    cotangent) in ``input_itemsize``-byte elements; the products' buffers in
    ``accum_itemsize``-byte ones (fetched and served pieces, partials for other ranks,
    operands joined for one GEMM, the all-reduce method's whole matrices; backward: the two
    backward products' at once, or the forward product's (one_sided: with the pieces the
    backward ones pack), whichever is more); and the slots of osmm_jax's windows that the
    products make resident. Not counted: the MPI library's own buffers and XLA's scheduling
    beyond that (benchmarks/results/memory.md compares this with measured peaks). Where dB's
    product takes C's cotangent from dA's fetch (:func:`rma_bytes`), its pieces count once.
    Local; builds ``rank``'s part of each plan."""
    method = config.resolve_method(method)
    resolved = _resolve_sync(sync)
    _check_direction(direction)
    rank = checks.integer(rank, "rank")
    if rank >= plan.nranks:
        raise ValueError(f"rank must be below the plan's {plan.nranks} ranks, got {rank}")
    for name, size in (("input_itemsize", input_itemsize), ("accum_itemsize", accum_itemsize)):
        checks.integer(size, name, minimum=1)
    plans = (plan,) if direction == "forward" else (plan, *backward_plans(plan))
    if method == "allreduce":
        transients = [allreduce_transient(p) for p in plans]
        packed = [0] * len(plans)
    else:
        same = input_itemsize == accum_itemsize
        shared = direction == "backward" and backward.shares_cotangent(plan, resolved)
        taken = (None, None, backward.taken_on(plan, rank) if shared else None)
        lone = (
            None,
            None,
            backward.lone_pieces_of_d_b(plan, rank, resolved.mode) if shared else None,
        )
        transposed = (None, "B", "A")  # dA's B operand is B.T, dB's A operand A.T
        runs = [
            _one_sided_run(p, rank, resolved, same, t, lone_p, tr)
            for p, t, lone_p, tr in zip(plans, taken, lone, transposed)
        ]
        transients = [transient for transient, _ in runs]
        packed = [served for _, served in runs]
    transient = transients[0]
    if direction == "backward":
        # The backward products run side by side (neither needs the other); a one_sided
        # product packs the pieces it serves from its inputs alone, which XLA may do while the
        # forward product still runs.
        transient = max(transients[0] + packed[1] + packed[2], transients[1] + transients[2])
    windows = 0
    if method == "one_sided":
        windows = max(
            slots.resident_window_bytes(p, rank, input_itemsize, accum_itemsize, resolved)
            for p in plans
        )
    blocks = [block_area(layout, rank) for layout in (plan.a, plan.b, plan.c)]
    held = sum(blocks) if direction == "forward" else 2 * (blocks[0] + blocks[1]) + blocks[2]
    return PeakMemory(held * input_itemsize, transient * accum_itemsize, windows)


def _one_sided_run(
    plan: Plan,
    rank: int,
    sync: one_sided.Sync,
    same_dtype: bool,
    taken=None,
    lone=None,
    transposed=None,
):
    """``(transient, packed)``: the elements (accumulation dtype) a one_sided product of
    ``plan`` adds on ``rank`` (planning/memory.py), and those of the pieces it packs to serve
    (``same_dtype``: the inputs are in the accumulation dtype), as ``sync`` runs it;
    ``taken``: the pieces it leaves out of its fetch (dB's, :mod:`.backward`), or None;
    ``lone``: the fetched pieces it reads as a whole buffer, None for its own fetch's;
    ``transposed``: the operand (``"A"`` or ``"B"``) that is the transpose of an input (a
    backward product's): served from its block, the block is a transposed copy XLA forms
    from the input, counted as packed."""
    executed = one_sided.executed_plan(plan, sync)
    messages = slots.uses_messages(executed, sync)
    whole_c = 0
    if executed is plan.gather_stage:  # the whole C, and its own block's staged image
        whole_c = plan.c.shape[0] * plan.c.shape[1]
        whole_c += block_area(executed.c, rank) if messages else 0
    gets, serves = fetch.moved(executed, rank, taken)
    served = 0  # the pieces packed to serve, every round's (XLA may pack them all at once)
    for matrices in slots.fetch_rounds(executed, sync.mode):
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
    if fetch.runs_ahead(executed, rank, sync, same_dtype) and not executed.has_deliveries:
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
    transient = one_sided_transient(
        executed, rank, packs, whole_c, taken or (), messages, copies, unjoined
    )
    return transient, served


# -- input checks -----------------------------------------------------------------------


def _resolve_sync(sync) -> one_sided.Sync:
    """``sync`` (or ``OSMM_SYNC``, or the default for this MPI), the slot budget, how the
    credits travel, the transport (``OSMM_TRANSPORT``) and whether a fetch runs ahead
    (``OSMM_FETCH_AHEAD``; on the CPU only), as a product runs them."""
    waiting = communicators.accumulates_wait_for_target()
    mode = config.resolve_sync(sync, waiting)
    credits = "pull" if waiting else "push"
    ahead = config.fetch_ahead() if jax.default_backend() == "cpu" else False
    return one_sided.Sync(
        mode, config.slot_budget(), credits, transport=config.transport(), fetch_ahead=ahead
    )


def _resolve_options(method, verify, chunk_bytes, sync) -> _Options:
    """The options of one product: the arguments, or the ``OSMM_*`` defaults (config.py).
    ``OSMM_ALLREDUCE`` is only checked here, with the other variables, so that a bad value is
    agreed on before any MPI traffic; primitives.allreduce_sum reads it where it is used."""
    config.allreduce_implementation(HAVE_MPI4JAX)
    resolved = _resolve_sync(sync)
    return _Options(
        config.resolve_method(method),
        config.resolve_verify(verify),
        config.resolve_chunk_bytes(chunk_bytes),
        resolved,
        config.defer_finishes()
        if resolved.mode == "notify" and jax.default_backend() == "cpu"
        else False,
    )


def _as_array(x, name):
    if isinstance(x, jax.Array) or hasattr(x, "aval"):
        return x, None
    try:
        return jnp.asarray(x), None
    except (TypeError, ValueError) as exc:
        return None, f"{name} is not an array ({type(x).__name__}: {exc})"


def _check_inputs(a_local, b_local, plan: Plan, rank: int):
    """Validate this rank's blocks; returns (a, b, error message or None)."""
    given = (getattr(a_local, "dtype", None), getattr(b_local, "dtype", None))
    a_local, err_a = _as_array(a_local, "a_local")
    b_local, err_b = _as_array(b_local, "b_local")
    if err_a or err_b:
        return a_local, b_local, err_a or err_b
    # Compare the dtypes as given: JAX would silently turn a float64 numpy array into
    # float32 when x64 is off, hiding the mismatch.
    dtype_a, dtype_b = (
        np.dtype(d) if d is not None else x.dtype for d, x in zip(given, (a_local, b_local))
    )
    if dtype_a != dtype_b:
        return a_local, b_local, f"a_local is {dtype_a} but b_local is {dtype_b}; they must match"
    if not dtypes.is_supported(a_local.dtype):
        names = ", ".join(dtypes.NAMES)
        return a_local, b_local, f"dtype {a_local.dtype} is not supported (use one of {names})"
    for name, x, layout in (("a_local", a_local, plan.a), ("b_local", b_local, plan.b)):
        expected = layout.local_shape(rank)
        if tuple(x.shape) != expected:
            return (
                a_local,
                b_local,
                (
                    f"{name} has shape {tuple(x.shape)} but the {layout.kind} layout of "
                    f"{'A' if name == 'a_local' else 'B'} {layout.shape} gives rank {rank} a block of {expected}"
                ),
            )
    return a_local, b_local, None


# -- batching -----------------------------------------------------------------------------


def _forward(plan: Plan, options: _Options, a, b, *extra, execute=None):
    return _batchable_forward(plan, options, execute)(a, b, *extra)


def _batchable_forward(plan: Plan, options: _Options, execute=None):
    """The forward product of ``plan``, with a vmap rule that loops over the batch.

    ``execute(plan, rank, a, b, *extra)`` computes this rank's C block, or a tuple of it and
    more arrays (a backward product sharing the cotangent's fetch,
    :mod:`osmm_jax._src.runtime.backward`); None: the executor of ``options.method``.

    Every rank must issue the same MPI operations in the same order. Under a
    plain vmap, whether an intermediate is batched can differ between ranks (a
    rank with an empty block has nothing batched to send), so each rank would
    issue a different number of collectives. Looping over the batch instead
    runs ``axis_size`` complete products, identically on every rank.

    A new function on every call, never cached: jax 0.12 (not 0.6.2) reuses a custom_vmap
    function's trace for as long as the function lives, and the product's trace reads process
    state (a test's injected fault, whether metrics count products, ``OSMM_ALLREDUCE``,
    whether a replicated C is staged) that must be read again whenever the caller is traced.
    """
    rank = communicators.comm_for_key(plan.comm_key).Get_rank()
    if execute is None and options.method == "allreduce":
        execute = allreduce.forward
    elif execute is None:
        execute = functools.partial(
            one_sided.forward, chunk_bytes=options.chunk_bytes, sync=options.sync
        )

    @_looping_over_batch
    def forward(a, b, *extra):
        out = execute(plan, rank, a, b, *extra)
        c, more = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        fault = checksum.injected_fault(rank)
        if fault is not None and c.size:
            c = c.at[0, 0].add(jnp.asarray(fault, c.dtype))
        if options.verify:
            checksum.check(plan, rank, a, b, c, dtypes.accumulation_dtype(a.dtype))
        if metrics.enabled():
            jax.debug.callback(metrics.count_product)
        return (c, *more) if more else c

    return forward


def _looping_over_batch(fn):
    """``fn`` (arrays in, an array or a tuple of arrays out) as a custom_vmap whose rule runs
    it once per example of the batch, in order, and stacks the results (see
    :func:`_batchable_forward` for why a batch of distributed products must not vectorise)."""
    looped = jax.custom_batching.custom_vmap(fn)

    @looped.def_vmap
    def _one_example_at_a_time(axis_size, in_batched, *args):
        outs = [
            looped(*(x[i] if batched else x for x, batched in zip(args, in_batched)))
            for i in range(axis_size)
        ]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        return stacked, jax.tree.map(lambda _: True, outs[0])

    return looped


# -- differentiation ------------------------------------------------------------------------


@jax.custom_jvp
def _first_order_only(x):
    """Identity that refuses forward-mode differentiation.

    A custom_vjp's forward pass is only differentiated when a derivative of a
    derivative is taken. The native primitives have no derivative rules, and
    mpi4jax's all-reduce transposes to the identity, which would make a
    second derivative of the baseline silently wrong: refuse clearly instead.
    """
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(
        "osmm_jax.matmul supports first-order reverse-mode differentiation (jax.grad, jax.vjp, "
        "jax.value_and_grad); forward-mode (jax.jvp) and higher-order derivatives are not supported"
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(plan: Plan, options: _Options, a, b):
    return _forward(plan, options, a, b)


def _matmul_fwd(plan: Plan, options: _Options, a, b):
    """The product, keeping what the backward products will need: B for dA only when A is
    differentiated, A for dB only when B is.

    ``a`` and ``b`` are :class:`jax.custom_derivatives.CustomVJPPrimal` (``symbolic_zeros``):
    ``perturbed`` is False for an input no derivative is taken with respect to, such as a
    model's input batch or a frozen weight."""
    c = _forward(plan, options, _first_order_only(a.value), _first_order_only(b.value))
    return c, (b.value if a.perturbed else None, a.value if b.perturbed else None)


def _matmul_bwd(plan: Plan, options: _Options, residuals, d_c):
    """dA = dC @ B.T and dB = A.T @ dC, each a distributed product with transposed layouts.

    Only the products whose result is needed run: the custom calls move data between ranks, so
    XLA may not drop an unused one, and an input that is not differentiated (the first layer's
    batch) would otherwise cost a whole distributed product per step. Whether an input is
    differentiated is a property of the traced program, the same on every rank."""
    b_for_da, a_for_db = residuals
    if isinstance(d_c, jax.custom_derivatives.SymbolicZero):
        return None, None
    plan_da, plan_db = backward_plans(plan)
    if _shares_cotangent(plan, options, b_for_da, a_for_db):
        return _sharing_cotangent(plan, options, b_for_da, a_for_db, d_c)
    d_a = d_b = None
    if b_for_da is not None:
        d_a = _matmul(plan_da, options, d_c.astype(b_for_da.dtype), b_for_da.T)
    if a_for_db is not None:
        d_b = _matmul(plan_db, _deferring(options, plan_db), a_for_db.T, d_c.astype(a_for_db.dtype))
    return d_a, d_b


def _shares_cotangent(plan: Plan, options: _Options, b_for_da, a_for_db) -> bool:
    """Whether both backward products run, one_sided, and fetch C's cotangent once
    (:func:`backward.shares_cotangent`; the cotangent then has one dtype for both)."""
    if b_for_da is None or a_for_db is None or options.method != "one_sided":
        return False
    return b_for_da.dtype == a_for_db.dtype and backward.shares_cotangent(plan, options.sync)


def _sharing_cotangent(plan: Plan, options: _Options, b_for_da, a_for_db, d_c):
    """dA and dB, dB's product taking what it can of ``d_c`` from dA's fetched buffer
    (:mod:`osmm_jax._src.runtime.backward`). Under vmap, one example's dA then its dB, so that
    a single fetched buffer is held at a time. Like the products' own custom_vjp, it refuses
    a derivative of itself (every rank traces the same tangents, so every rank refuses)."""
    plan_da, plan_db = backward_plans(plan)
    chunk_bytes = options.chunk_bytes
    d_b_options = _deferring(options, plan_db)

    def d_a_product(_, rank, x, y):
        return backward.d_a_and_cotangent(plan, rank, x, y, chunk_bytes, options.sync)

    def d_b_product(_, rank, x, y, fetched):
        sync = d_b_options.sync
        return backward.d_b_from_cotangent(plan, rank, x, y, fetched, chunk_bytes, sync)

    @_looping_over_batch
    def both(cotangent, b_t, a_t):
        d_a, fetched = _forward(plan_da, options, cotangent, b_t, execute=d_a_product)
        d_b = _forward(plan_db, d_b_options, a_t, cotangent, fetched, execute=d_b_product)
        return d_a, d_b

    inputs = (d_c.astype(b_for_da.dtype), b_for_da.T, a_for_db.T)
    return both(*(_first_order_only(x) for x in inputs))


def _deferring(options: _Options, plan: Plan) -> _Options:
    """The options of dB (``plan``), B's gradient (the weight gradient of ``x @ W``): its
    finish is deferred where ``OSMM_DEFER`` says (unset: where the communicator spans several
    nodes), since nothing but the optimizer reads it while the backward pass goes on to the
    layers before (dA, on the critical path, finishes in place)."""
    defer = options.defer_weight_grads
    if defer is None:
        defer = communicators.spans_nodes(plan.comm_key)
    if not defer:
        return options
    return options._replace(sync=options.sync._replace(defer=True))


_matmul.defvjp(_matmul_fwd, _matmul_bwd, symbolic_zeros=True)
