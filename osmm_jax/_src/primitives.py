"""JAX primitives for the two native data-movement steps of a one-sided product.

``osmm_fetch``
    Every rank exposes the A/B blocks others need and gets the remote pieces it
    needs (MPI_Get). Inputs: this rank's A and B blocks. Output: the fetched
    pieces, concatenated flat.
``osmm_reduce``
    Every rank accumulates (MPI_Accumulate) or writes (MPI_Put) its C partials
    into their owners' windows, then adds what it received to its own local
    partial. Inputs: the outgoing partials, concatenated flat, and the local
    partial of this rank's C block. Output: the finished C block.

Both are MPI collectives over the plan's communicator: every rank must issue
them in the same order. Each carries mpi4jax's ordered effect, so one token
chain orders them against each other AND against mpi4jax calls in the same
program; XLA never reorders or overlaps them.

Section order as in mpi4jax: primitive, abstract evaluation, lowering.
Batching and differentiation are handled above, in :mod:`osmm_jax._src.matmul`
(``jax.custom_batching.custom_vmap`` and ``jax.custom_vjp``), for the whole
product: a rule at this level could not keep ranks in step, because whether a
rank's operand is batched can depend on whether its block is empty.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir
from mpi4jax._src.jax_compat import abstract_token, get_token_effect, set_token_effect
from mpi4jax._src.utils import ordered_effect

from osmm_jax._src import native

# -- primitives -----------------------------------------------------------------

osmm_fetch_p = Primitive("osmm_fetch")
osmm_reduce_p = Primitive("osmm_reduce")
for _p in (osmm_fetch_p, osmm_reduce_p):
    _p.def_impl(functools.partial(dispatch.apply_primitive, _p))


def fetch(a, b, *, comm, window_bytes, b_offset, expose_a, expose_b, gets, fetched_elements):
    """Bind ``osmm_fetch``: returns a 1-D array of ``fetched_elements`` elements of a's dtype.

    ``gets`` is a tuple of int records ``(matrix, target, offset, rows, cols,
    row0, col0, ld)``; ``window_bytes`` and ``b_offset`` are identical on every rank.
    """
    native.ensure_registered()
    return osmm_fetch_p.bind(
        a,
        b,
        comm=int(comm),
        window_bytes=int(window_bytes),
        b_offset=int(b_offset),
        expose_a=bool(expose_a),
        expose_b=bool(expose_b),
        gets=tuple(int(x) for x in gets),
        fetched_elements=int(fetched_elements),
    )


def reduce(staging, local, *, comm, window_bytes, transfers):
    """Bind ``osmm_reduce``: returns ``local`` plus everything other ranks delivered to this rank.

    ``transfers`` is a tuple of int records ``(op, target, offset, rows, cols,
    row0, col0, ld)``; ``window_bytes`` is identical on every rank.
    """
    native.ensure_registered()
    return osmm_reduce_p.bind(
        staging,
        local,
        comm=int(comm),
        window_bytes=int(window_bytes),
        transfers=tuple(int(x) for x in transfers),
    )


# -- abstract evaluation ----------------------------------------------------------


def _fetch_abstract(a, b, *, fetched_elements, **_):
    return jax.core.ShapedArray((fetched_elements,), a.dtype), {ordered_effect}


def _reduce_abstract(staging, local, **_):
    return jax.core.ShapedArray(local.shape, local.dtype), {ordered_effect}


osmm_fetch_p.def_effectful_abstract_eval(_fetch_abstract)
osmm_reduce_p.def_effectful_abstract_eval(_reduce_abstract)


# -- lowering -----------------------------------------------------------------------


def _lower_with_token(target: str, ctx, *operands, aliases=None, **attributes):
    token = get_token_effect(ctx, ordered_effect)
    ctx_with_token = ctx.replace(
        avals_in=(*ctx.avals_in, abstract_token),
        avals_out=(*ctx.avals_out, abstract_token),
    )
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=aliases)
    results = list(rule(ctx_with_token, *operands, token, **attributes))
    set_token_effect(ctx, ordered_effect, results.pop())
    return results


def _records(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _fetch_lowering(
    ctx, a, b, *, comm, window_bytes, b_offset, expose_a, expose_b, gets, fetched_elements
):
    return _lower_with_token(
        "osmm_fetch",
        ctx,
        a,
        b,
        comm=np.int64(comm),
        window_bytes=np.int64(window_bytes),
        b_offset=np.int64(b_offset),
        expose_a=np.int64(expose_a),
        expose_b=np.int64(expose_b),
        gets=_records(gets),
    )


def _reduce_lowering(ctx, staging, local, *, comm, window_bytes, transfers):
    return _lower_with_token(
        "osmm_reduce",
        ctx,
        staging,
        local,
        # The finished block is written over the local partial: no fresh output buffer.
        aliases={1: 0},
        comm=np.int64(comm),
        window_bytes=np.int64(window_bytes),
        transfers=_records(transfers),
    )


mlir.register_lowering(osmm_fetch_p, _fetch_lowering, platform="cpu")
mlir.register_lowering(osmm_reduce_p, _reduce_lowering, platform="cpu")
