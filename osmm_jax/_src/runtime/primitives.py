"""JAX primitives for the two native data-movement steps of a one-sided product.

``osmm_fetch``
    Every rank exposes the A/B blocks others need and gets the remote pieces it
    needs (MPI_Get). Inputs: this rank's A and B blocks. Output: the fetched
    pieces, concatenated flat.
``osmm_reduce_start``, ``osmm_reduce_issue``, ``osmm_reduce_finish``
    Every rank accumulates (MPI_Accumulate) or writes (MPI_Put) its C partials
    into their owners' windows, chunk by chunk, then adds what it received to
    its own local partial. ``start`` takes chunk 0 (and validates the records
    of every chunk), ``issue`` takes chunk i, ``finish`` takes the local
    partial of this rank's C block (and every chunk, to keep it alive while a
    background thread may still be sending it) and returns the finished block.
    ``start`` and ``issue`` return a ticket (an int32 scalar) that the caller
    can make the next GEMM depend on, so the chunk is on its way before that
    GEMM runs.

``osmm_allreduce``
    The element-wise sum of an array over the plan's communicator (MPI_Iallreduce): the
    all-reduce of the allreduce method and of checksum verification when mpi4jax is not
    used (:func:`allreduce_sum`). CPU only.

``osmm_fetch``, ``start``, ``finish`` and ``osmm_allreduce`` are MPI collectives over the plan's
communicator: every rank must issue them in the same order (``issue`` is local;
ranks may have different numbers of chunks). Each carries the ordered effect of
:mod:`osmm_jax._src.compat` (mpi4jax's when it is installed), so one token chain orders them
against each other AND against mpi4jax calls in the same program; XLA never reorders them.

They lower, on every platform whose handlers :mod:`osmm_jax._src.runtime.native` registered
(``native.platforms()``: the CPU, and CUDA when built), to the FFI targets of the same
names.

Section order as in mpi4jax: primitive, abstract evaluation, lowering.
Batching and differentiation are handled above, in :mod:`osmm_jax._src.runtime.matmul`
(``jax.custom_batching.custom_vmap`` and ``jax.custom_vjp``), for the whole
product: a rule at this level could not keep ranks in step, because whether a
rank's operand is batched can depend on whether its block is empty.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from osmm_jax._src import config
from osmm_jax._src.compat import (
    HAVE_MPI4JAX,
    abstract_token,
    get_token_effect,
    ordered_effect,
    recover_failed_runtime_tokens,
    set_token_effect,
)
from osmm_jax._src.runtime import native

# An error inside one rank's product must not make every later product on that rank fail at
# once (see compat.recover_failed_runtime_tokens): the other ranks would wait for it forever.
recover_failed_runtime_tokens(ordered_effect)

# -- primitives -----------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _compiled(primitive, params):
    """``primitive`` bound alone with ``params`` (sorted (name, value) pairs), jitted."""
    return jax.jit(lambda *args: primitive.bind(*args, **dict(params)))


def _eager(primitive, *args, **params):
    """Outside a trace, a primitive runs as a program of its own, compiled once per
    parameter set (what JAX does for its own primitives)."""
    return _compiled(primitive, tuple(sorted(params.items())))(*args)


osmm_fetch_p = Primitive("osmm_fetch")
osmm_reduce_start_p = Primitive("osmm_reduce_start")
osmm_reduce_issue_p = Primitive("osmm_reduce_issue")
osmm_reduce_finish_p = Primitive("osmm_reduce_finish")
osmm_reduce_start_deferred_p = Primitive("osmm_reduce_start_deferred")
osmm_reduce_finish_deferred_p = Primitive("osmm_reduce_finish_deferred")
osmm_watch_p = Primitive("osmm_watch")
osmm_allreduce_p = Primitive("osmm_allreduce")
for _p in (
    osmm_fetch_p,
    osmm_reduce_start_p,
    osmm_reduce_issue_p,
    osmm_reduce_finish_p,
    osmm_reduce_start_deferred_p,
    osmm_reduce_finish_deferred_p,
    osmm_watch_p,
    osmm_allreduce_p,
):
    _p.def_impl(functools.partial(_eager, _p))


def fetch(
    a, b, *, comm, call_id, window_bytes, b_offset, expose_a, expose_b, gets, fetched_elements
):
    """Bind ``osmm_fetch``: returns a 1-D array of ``fetched_elements`` elements of a's dtype.

    ``gets`` is a tuple of int records ``(region, target, offset, rows, cols,
    row0, col0, ld)`` (fields: :data:`native.RECORD_FIELDS`; region
    :data:`native.REGION_A` or :data:`native.REGION_B`); ``window_bytes`` and ``b_offset`` are identical on every rank.
    ``call_id`` (see :func:`call_id`) is identical on every rank and determines every
    rank's attributes: the native layer agrees across ranks once per id.
    """
    return osmm_fetch_p.bind(
        a,
        b,
        comm=int(comm),
        call_id=int(call_id),
        window_bytes=int(window_bytes),
        b_offset=int(b_offset),
        expose_a=bool(expose_a),
        expose_b=bool(expose_b),
        gets=tuple(int(x) for x in gets),
        fetched_elements=int(fetched_elements),
    )


def reduce_start(
    chunk,
    *,
    comm,
    call_id,
    window_bytes,
    local_elements,
    overlap,
    transfers,
    chunk_sizes,
    notify=(),
):
    """Bind ``osmm_reduce_start``: open the reduce epoch, send chunk 0; returns a ticket.

    ``transfers`` is one list of int records ``(op, target, offset, rows, cols,
    row0, col0, ld)`` per chunk (op :data:`native.OP_ACCUMULATE` or
    :data:`native.OP_PUT`), ``offset`` relative to that chunk;
    ``chunk_sizes`` the element count of every chunk's buffer. ``window_bytes``
    is identical on every rank. ``overlap``: send from the background thread.
    ``call_id``: as for :func:`fetch`. ``notify``: empty for the fence mode, else this rank's
    part of the notified reduce (:func:`osmm_jax._src.runtime.slots.notify_attribute`).
    """
    chunk_ends = tuple(
        int(x) for x in np.cumsum([len(r) // native.RECORD_LENGTH for r in transfers])
    )
    return osmm_reduce_start_p.bind(
        chunk,
        comm=int(comm),
        call_id=int(call_id),
        window_bytes=int(window_bytes),
        local_elements=int(local_elements),
        overlap=bool(overlap),
        transfers=tuple(int(x) for records in transfers for x in records),
        chunk_ends=chunk_ends,
        chunk_sizes=tuple(int(x) for x in chunk_sizes),
        notify=tuple(int(x) for x in notify),
    )


def reduce_deferred(chunk, local, *, comm, call_id, window_bytes, transfers, notify):
    """A notified reduce of one chunk whose finish is deferred: this rank's partials ``chunk``
    (1-D) leave by ``transfers`` (its records) now, a native waiter thread sums ``local`` (this
    rank's whole C block, complete now) with what its origins deliver, and the result (shape
    and dtype of ``local``) is waited for only by what reads it. ``osmm_reduce_start_deferred``
    is on the ordered token chain; ``osmm_reduce_finish_deferred`` is not (the ticket links it
    to its start), and is asynchronous. Same sum, bit for bit, as :func:`reduce_start` +
    :func:`reduce_finish`. Other arguments as for :func:`reduce_start`."""
    records = tuple(int(x) for x in transfers)
    ticket = osmm_reduce_start_deferred_p.bind(
        chunk,
        local,
        comm=int(comm),
        call_id=int(call_id),
        window_bytes=int(window_bytes),
        local_elements=int(local.size),
        transfers=records,
        chunk_ends=(len(records) // native.RECORD_LENGTH,),
        chunk_sizes=(int(chunk.size),),
        notify=tuple(int(x) for x in notify),
    )
    return osmm_reduce_finish_deferred_p.bind(
        ticket, shape=tuple(local.shape), dtype=np.dtype(local.dtype)
    )


def notified_round(chunks, transfers, local, *, comm, call_id, notify):
    """One notified reduce sent from the calling thread: this rank delivers ``chunks`` (1-D
    buffers of the accumulation dtype, at least one) by ``transfers`` (one record list per
    chunk, offsets within it) and returns ``local`` plus what its origins delivered, summed in
    ascending rank order. ``notify``: this rank's attribute (``runtime.slots``), whose first two
    entries size every rank's slots window. The staged plan's all-gather and the notified
    fetch are such rounds (the fetch sends its pieces straight from the blocks that hold them,
    a chunk each)."""
    reduce_start(
        chunks[0],
        comm=comm,
        call_id=call_id,
        window_bytes=(1 + notify[0]) * notify[1],
        local_elements=local.size,
        overlap=False,
        transfers=transfers,
        chunk_sizes=[int(chunk.size) for chunk in chunks],
        notify=notify,
    )
    for index, chunk in enumerate(chunks[1:], start=1):
        reduce_issue(chunk, comm=comm, index=index)
    return reduce_finish(local, list(chunks), comm=comm)


def reduce_issue(chunk, *, comm, index):
    """Bind ``osmm_reduce_issue``: send chunk ``index`` (1, 2, ...); returns a ticket."""
    return osmm_reduce_issue_p.bind(chunk, comm=int(comm), index=int(index))


def reduce_finish(local, chunks, *, comm, local_offset=None):
    """Bind ``osmm_reduce_finish``: ``local`` plus everything other ranks delivered to this rank.
    ``local_offset``: None where ``local`` is this rank's C block, else the element of
    ``local`` (flattened) where the block starts inside it; only the block is summed, the rest
    is returned as it was."""
    offset = -1 if local_offset is None else int(local_offset)  # -1: kLocalIsBlock (reduce.h)
    return osmm_reduce_finish_p.bind(local, *chunks, comm=int(comm), local_offset=offset)


def watched(run, *, comm):
    """``run()``, bracketed by two ``osmm_watch`` calls on the ordered-effect token chain, so
    that the watchdog bounds the mpi4jax collectives ``run`` issues (they share the chain) like
    its own blocking steps, reporting against the plan's communicator ``comm`` (a comm_key)."""
    marker = osmm_watch_p.bind(jnp.zeros((), jnp.int32), comm=int(comm), begin=True)
    result = run()
    osmm_watch_p.bind(marker, comm=int(comm), begin=False)
    return result


def allreduce_sum(x, *, comm):
    """The sum of ``x`` over every rank of plan communicator ``comm`` (a comm_key), inside the
    program: mpi4jax.allreduce over the communicator's in-graph twin, bracketed by the watchdog
    (:func:`watched`), or osmm_jax's own ``osmm_allreduce``, as ``OSMM_ALLREDUCE`` chooses
    (:data:`osmm_jax._src.config.ALLREDUCE`). Same shape and dtype as ``x``."""
    if config.allreduce_implementation(HAVE_MPI4JAX) == "native":
        return osmm_allreduce_p.bind(x, comm=int(comm))
    import mpi4jax
    from mpi4py import MPI

    from osmm_jax._src.runtime import communicators

    in_graph = communicators.in_graph_comm(comm)
    return watched(lambda: mpi4jax.allreduce(x, op=MPI.SUM, comm=in_graph), comm=comm)


def call_id(*parts) -> int:
    """A signed 63-bit id of a native call, from ``parts`` that are identical on every rank and
    determine every rank's attributes (plan fingerprint, step, dtype, chunking)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# -- abstract evaluation ----------------------------------------------------------


def _fetch_abstract(a, b, *, fetched_elements, **_):
    return jax.core.ShapedArray((fetched_elements,), a.dtype), {ordered_effect}


def _ticket_abstract(chunk, *_, **__):
    return jax.core.ShapedArray((), np.int32), {ordered_effect}


def _reduce_finish_abstract(local, *chunks, **_):
    return jax.core.ShapedArray(local.shape, local.dtype), {ordered_effect}


osmm_fetch_p.def_effectful_abstract_eval(_fetch_abstract)
osmm_reduce_start_p.def_effectful_abstract_eval(_ticket_abstract)
osmm_reduce_issue_p.def_effectful_abstract_eval(_ticket_abstract)
osmm_reduce_finish_p.def_effectful_abstract_eval(_reduce_finish_abstract)
osmm_reduce_start_deferred_p.def_effectful_abstract_eval(_ticket_abstract)
# Not ordered: XLA may run it beside anything; its ticket orders it after its start.
osmm_reduce_finish_deferred_p.def_abstract_eval(
    lambda ticket, *, shape, dtype: jax.core.ShapedArray(shape, dtype)
)
osmm_watch_p.def_effectful_abstract_eval(
    lambda marker, **_: (jax.core.ShapedArray((), np.int32), {ordered_effect})
)
osmm_allreduce_p.def_effectful_abstract_eval(
    lambda x, **_: (jax.core.ShapedArray(x.shape, x.dtype), {ordered_effect})
)


# -- lowering -----------------------------------------------------------------------


def _lower_with_token(target: str, ctx, *operands, token_position=None, aliases=None, **attrs):
    """Lower an FFI call with the ordered-effect token as operand ``token_position`` (default:
    last) and as the last result; ``attrs`` are the primitive's parameters, passed to the handler
    as :func:`_ffi_attribute` converts them."""
    token = get_token_effect(ctx, ordered_effect)
    position = len(operands) if token_position is None else token_position
    avals_in = list(ctx.avals_in)
    avals_in.insert(position, abstract_token)
    ctx_with_token = ctx.replace(
        avals_in=tuple(avals_in),
        avals_out=(*ctx.avals_out, abstract_token),
    )
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=aliases)
    operands = list(operands)
    operands.insert(position, token)
    attrs = {name: _ffi_attribute(value) for name, value in attrs.items()}
    results = list(rule(ctx_with_token, *operands, **attrs))
    set_token_effect(ctx, ordered_effect, results.pop())
    return results


def _ffi_attribute(value) -> np.int64 | np.ndarray:
    """A primitive's parameter as the handlers read it: a tuple of ints (records, chunk ends or
    sizes) as a flat int64 array, an int or a bool as an int64 scalar."""
    if isinstance(value, tuple):
        return np.asarray(value, dtype=np.int64).reshape(-1)
    return np.int64(value)


def _fetch_lowering(ctx, a, b, *, fetched_elements, **attrs):
    """``fetched_elements`` only shapes the output; the handler gets the other parameters of
    :func:`fetch`."""
    return _lower_with_token("osmm_fetch", ctx, a, b, **attrs)


def _reduce_start_lowering(ctx, chunk, **attrs):
    return _lower_with_token("osmm_reduce_start", ctx, chunk, **attrs)


def _reduce_issue_lowering(ctx, chunk, **attrs):
    return _lower_with_token("osmm_reduce_issue", ctx, chunk, **attrs)


def _reduce_finish_lowering(ctx, local, *chunks, comm, local_offset):
    return _lower_with_token(
        "osmm_reduce_finish",
        ctx,
        local,
        *chunks,
        token_position=1,
        # The finished block is written over the local partial: no fresh output buffer.
        aliases={0: 0},
        comm=comm,
        local_offset=local_offset,
    )


def _reduce_start_deferred_lowering(ctx, chunk, local, **attrs):
    return _lower_with_token("osmm_reduce_start_deferred", ctx, chunk, local, **attrs)


def _reduce_finish_deferred_lowering(ctx, ticket, *, shape, dtype):
    # A side effect, so that XLA neither drops nor merges it; asynchronous in the handler.
    return jax.ffi.ffi_lowering("osmm_reduce_finish_deferred", has_side_effect=True)(ctx, ticket)


def _watch_lowering(ctx, marker, *, comm, begin):
    return _lower_with_token("osmm_watch", ctx, marker, aliases={0: 0}, comm=comm, begin=begin)


def _allreduce_lowering(ctx, x, *, comm):
    # The sum is written over x: no fresh output buffer.
    return _lower_with_token("osmm_allreduce", ctx, x, aliases={0: 0}, comm=comm)


def _allreduce_unavailable(ctx, x, *, comm):
    raise NotImplementedError(
        "osmm_jax's native all-reduce runs on the CPU only: on a GPU the allreduce method and "
        "checksum verification need mpi4jax (`pip install osmm_jax[mpi4jax]`)"
    )


def _deferred_unavailable(ctx, *args, **kwargs):
    raise NotImplementedError(
        "osmm_jax defers a product's finish on the CPU only: set OSMM_DEFER=0 for GPU programs"
    )


def _watch_passthrough(ctx, marker, *, comm, begin):
    """Where the handlers are not available, the watch is not made: the token passes on."""
    set_token_effect(ctx, ordered_effect, get_token_effect(ctx, ordered_effect))
    return [marker]


_LOWERINGS = {
    osmm_fetch_p: _fetch_lowering,
    osmm_reduce_start_p: _reduce_start_lowering,
    osmm_reduce_issue_p: _reduce_issue_lowering,
    osmm_reduce_finish_p: _reduce_finish_lowering,
}


def _unavailable_lowering(platform: str):
    def lowering(ctx, *args, **kwargs):
        raise NotImplementedError(
            f"osmm_jax cannot run one-sided products on {platform}: "
            f"{native.UNAVAILABLE[platform]}. Use method='allreduce', or rebuild osmm_jax "
            "(BUILD.md, 'GPUs')."
        )

    return lowering


# Every platform whose handlers are registered lowers to them; the GPU without them lowers to
# a clear error instead of XLA's "no registered implementation".
for _platform in native.platforms():
    for _p, _rule in _LOWERINGS.items():
        mlir.register_lowering(_p, _rule, platform=_platform)
for _platform in native.platforms():
    mlir.register_lowering(osmm_watch_p, _watch_lowering, platform=_platform)
mlir.register_lowering(osmm_allreduce_p, _allreduce_lowering, platform="cpu")
mlir.register_lowering(
    osmm_reduce_start_deferred_p, _reduce_start_deferred_lowering, platform="cpu"
)
mlir.register_lowering(
    osmm_reduce_finish_deferred_p, _reduce_finish_deferred_lowering, platform="cpu"
)
for _p in (osmm_reduce_start_deferred_p, osmm_reduce_finish_deferred_p):
    mlir.register_lowering(_p, _deferred_unavailable, platform="cuda")
mlir.register_lowering(osmm_allreduce_p, _allreduce_unavailable, platform="cuda")
for _platform in native.UNAVAILABLE:
    for _p in _LOWERINGS:
        mlir.register_lowering(_p, _unavailable_lowering(_platform), platform=_platform)
    mlir.register_lowering(osmm_watch_p, _watch_passthrough, platform=_platform)
