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

from osmm_jax._src import config, dtypes
from osmm_jax._src.compat import HAVE_MPI4JAX
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.planning.records import combine_facts
from osmm_jax._src.runtime import (
    allreduce,
    backward,
    checksum,
    communicators,
    metrics,
    one_sided,
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
    keep_fetched: bool = False  # one_sided: the forward's fetched pieces kept for the backward


def matmul(
    a_local,
    b_local,
    plan: Plan,
    *,
    method: str | None = None,
    verify: bool | None = None,
    chunk_bytes: int | None = None,
    sync: str | None = None,
    keep_fetched: bool = False,
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
        keep_fetched: ``one_sided`` only, under differentiation: keep the pieces of A and B
            this rank fetched for the product until the backward pass, where the products
            of B's and A's gradients take the pieces of ``A.T`` and ``B.T`` they need from
            them instead of fetching them again (a sequence-parallel column layer's input
            rows, gathered once a step instead of twice). Fewer rounds of communication,
            the same bits, for the memory of the fetched pieces between the passes.

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
        options, error = _resolve_options(method, verify, chunk_bytes, sync, keep_fetched), None
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
    of the backward products lets them take instead of fetching (:func:`backward.reuse_facts`).

    Sent on every call, not only until the plans have adopted the combined facts: another rank
    may hold a new, equal plan object that has not."""
    facts = tuple(p.for_rank(rank).facts for p in _executed_plans(plan, options))
    return (*facts, backward.reuse_facts(plan, rank))


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


def _resolve_options(method, verify, chunk_bytes, sync, keep_fetched=False) -> _Options:
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
        _check_keep_fetched(keep_fetched),
    )


def _check_keep_fetched(keep_fetched) -> bool:
    if not isinstance(keep_fetched, bool):
        raise TypeError(f"keep_fetched must be True or False, got {keep_fetched!r}")
    return keep_fetched


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
    differentiated, A for dB only when B is, and with ``keep_fetched`` the fetched pieces those
    products take (:mod:`osmm_jax._src.runtime.backward`).

    ``a`` and ``b`` are :class:`jax.custom_derivatives.CustomVJPPrimal` (``symbolic_zeros``):
    ``perturbed`` is False for an input no derivative is taken with respect to, such as a
    model's input batch or a frozen weight."""
    x, y = _first_order_only(a.value), _first_order_only(b.value)
    how = _reuse(plan, options, a.perturbed, b.perturbed, a.value.dtype == b.value.dtype)
    if how.keep:

        def keeping(_, rank, x, y):
            return backward.forward_keeping(
                plan, rank, x, y, options.chunk_bytes, options.sync, how
            )

        c, kept = _forward(plan, options, x, y, execute=keeping)
    else:
        c, kept = _forward(plan, options, x, y), ()
    return c, (b.value if a.perturbed else None, a.value if b.perturbed else None, kept)


def _matmul_bwd(plan: Plan, options: _Options, residuals, d_c):
    """dA = dC @ B.T and dB = A.T @ dC, each a distributed product with transposed layouts.

    Only the products whose result is needed run: the custom calls move data between ranks, so
    XLA may not drop an unused one, and an input that is not differentiated (the first layer's
    batch) would otherwise cost a whole distributed product per step. Whether an input is
    differentiated is a property of the traced program, the same on every rank."""
    b_for_da, a_for_db, kept = residuals
    if isinstance(d_c, jax.custom_derivatives.SymbolicZero):
        return None, None
    plan_da, plan_db = backward_plans(plan)
    same = b_for_da is not None and a_for_db is not None and b_for_da.dtype == a_for_db.dtype
    how = _reuse(plan, options, b_for_da is not None, a_for_db is not None, same)
    if how != backward.NONE:
        return _reusing(plan, options, b_for_da, a_for_db, d_c, kept, how)
    d_a = d_b = None
    if b_for_da is not None:
        d_a = _matmul(plan_da, options, d_c.astype(b_for_da.dtype), b_for_da.T)
    if a_for_db is not None:
        d_b = _matmul(plan_db, _deferring(options, plan_db), a_for_db.T, d_c.astype(a_for_db.dtype))
    return d_a, d_b


def _reuse(plan: Plan, options: _Options, d_a: bool, d_b: bool, same_dtype: bool):
    """What the backward products (``d_a``, ``d_b``: which run) take instead of fetching
    (:func:`backward.reuse`): one_sided only; dB from dA's fetch where both run with one
    dtype; with ``keep_fetched``, either from the forward product's fetch."""
    if options.method != "one_sided":
        return backward.NONE
    needed = tuple(p for p, runs in zip(backward.PRODUCTS, (d_a, d_b)) if runs)
    share = d_a and d_b and same_dtype
    return backward.reuse(plan, options.sync, share, options.keep_fetched, needed)


def _reusing(plan: Plan, options: _Options, b_for_da, a_for_db, d_c, kept, how):
    """dA and dB (those whose input is differentiated), taking what ``how`` says from the
    forward product's fetched buffers ``kept`` and dB from dA's. Under vmap, one example's dA
    then its dB, so that a single fetched buffer is held at a time. Like the products' own
    custom_vjp, it refuses a derivative of itself (every rank traces the same tangents, so
    every rank refuses)."""
    plan_da, plan_db = backward_plans(plan)
    chunk_bytes, d_b_options = options.chunk_bytes, _deferring(options, plan_db)
    n_kept = len(kept)

    def d_a_product(_, rank, x, y, *kept):
        return backward.d_a_product(plan, rank, x, y, kept, chunk_bytes, options.sync, how)

    def d_b_product(_, rank, x, y, *buffers):
        kept, from_d_a = buffers[:n_kept], buffers[n_kept:]
        sync = d_b_options.sync
        return backward.d_b_product(plan, rank, x, y, kept, from_d_a, chunk_bytes, sync, how)

    @_looping_over_batch
    def products(cotangent, b_t, a_t, *kept):
        d_a, from_d_a = None, ()
        if b_t is not None:
            d_a, from_d_a = _forward(plan_da, options, cotangent, b_t, *kept, execute=d_a_product)
        if a_t is None:
            return d_a
        d_b = _forward(plan_db, d_b_options, a_t, cotangent, *kept, *from_d_a, execute=d_b_product)
        return d_b if d_a is None else (d_a, d_b)

    dtype = (b_for_da if b_for_da is not None else a_for_db).dtype
    b_t = None if b_for_da is None else _first_order_only(b_for_da.T)
    a_t = None if a_for_db is None else _first_order_only(a_for_db.T)
    out = products(_first_order_only(d_c.astype(dtype)), b_t, a_t, *kept)
    if b_for_da is None or a_for_db is None:
        return (out, None) if a_for_db is None else (None, out)
    return out


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
