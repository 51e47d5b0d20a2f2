"""Checksum verification of a distributed product (algorithm-based fault tolerance).

For C = A @ B, the column sums of any band of C's rows equal the column sums of
the same rows of A, multiplied by B: ``1ᵀ C[R, :] = (1ᵀ A[R, :]) B``. osmm_jax
checks this for every rank's C block, distributedly and at a cost far below the
product's: each rank sums its A block's rows per C row band (O(MK) work), the
bands' sums are combined with one all-reduce of a (bands x K) array, multiplied
by each rank's B block (O(bands·K·N)), combined with one all-reduce of a
(bands x N) array, and each rank compares its C block's column sums against
its band's reference. The drift is measured relative to the same check run on
absolute values, ``(1ᵀ|A[R, :]|) |B|``, so it is independent of scale.

A drift above the dtype's tolerance (:func:`osmm_jax._src.dtypes.checksum_tolerance`) raises :class:`ChecksumError`
(a ValueError) naming the C block and the ranks that contributed to it. Under
``jax.jit`` the error surfaces as a ``JaxRuntimeError`` carrying that message
when the result is used.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import primitives

_faults: dict[int, float] = {}


class ChecksumError(ValueError):
    """The checksum of a distributed product's result does not match its inputs."""


@contextlib.contextmanager
def inject_fault(rank: int, value: float = 1.0):
    """Fault injection for tests: products traced inside this block add ``value`` to
    element (0, 0) of ``rank``'s C block before it is verified (and returned)."""
    _faults[rank] = value
    try:
        yield
    finally:
        _faults.pop(rank, None)


def injected_fault(rank: int) -> float | None:
    """The value :func:`inject_fault` asks ``rank`` to add, if any (read at trace time)."""
    return _faults.get(rank)


def _row_bands(plan: Plan) -> list[tuple[int, int]]:
    return sorted({rows for rows, _ in plan.c.blocks if rows[1] > rows[0]})


def _counts(layout, rank: int) -> bool:
    """Whether ``rank``'s block enters the sums (a replicated matrix is counted once, from rank 0)."""
    return rank == 0 or not layout.is_replicated


def check(plan: Plan, rank: int, a, b, c, accumulate_dtype) -> None:
    """Verify ``c`` (this rank's C block) against ``a`` and ``b`` (its A and B blocks).

    Collective over the plan's communicator (two all-reduces of small arrays and one of a
    per-rank vector); raises ChecksumError on every rank, through a host
    callback, if any rank's block drifts beyond the tolerance.
    """
    M, K, N = plan.dims
    bands = _row_bands(plan)
    acc, input_dtype = accumulate_dtype, c.dtype
    a, b, c = a.astype(acc), b.astype(acc), c.astype(acc)

    row_sums = jnp.zeros((2, max(len(bands), 1), K), acc)
    if _counts(plan.a, rank):
        (ar0, ar1), (ac0, ac1) = plan.a.blocks[rank]
        for i, (r0, r1) in enumerate(bands):
            lo, hi = max(r0, ar0), min(r1, ar1)
            if lo < hi and ac1 > ac0:
                piece = a[lo - ar0 : hi - ar0]
                row_sums = row_sums.at[0, i, ac0:ac1].add(piece.sum(axis=0))
                row_sums = row_sums.at[1, i, ac0:ac1].add(jnp.abs(piece).sum(axis=0))
    row_sums = primitives.allreduce_sum(row_sums, comm=plan.comm_key)

    reference = jnp.zeros((2, max(len(bands), 1), N), acc)
    if _counts(plan.b, rank):
        (br0, br1), (bc0, bc1) = plan.b.blocks[rank]
        if br1 > br0 and bc1 > bc0:
            reference = reference.at[0, :, bc0:bc1].set(row_sums[0, :, br0:br1] @ b)
            reference = reference.at[1, :, bc0:bc1].set(row_sums[1, :, br0:br1] @ jnp.abs(b))
    reference = primitives.allreduce_sum(reference, comm=plan.comm_key)

    (cr0, cr1), (cc0, cc1) = plan.c.blocks[rank]
    drift = jnp.zeros((), acc)
    if cr1 > cr0 and cc1 > cc0:
        band = bands.index((cr0, cr1))
        got = c.sum(axis=0)
        expected, scale = reference[0, band, cc0:cc1], reference[1, band, cc0:cc1]
        tiny = jnp.finfo(acc).tiny
        relative = jnp.abs(got - expected) / jnp.maximum(scale, tiny)
        # A column whose inputs hold a NaN or Inf has no finite checksum to compare against:
        # non-finite inputs are the user's data, not a fault of the product. A non-finite
        # result from finite inputs still gives a NaN drift, which fails.
        drift = jnp.max(jnp.where(jnp.isfinite(scale), relative, 0))
    drifts = jnp.zeros((plan.nranks,), acc).at[rank].set(drift)
    drifts = primitives.allreduce_sum(drifts, comm=plan.comm_key)
    jax.debug.callback(functools.partial(raise_on_drift, plan, input_dtype), drifts)


def raise_on_drift(plan: Plan, input_dtype, drifts) -> None:
    """Host side: raise ChecksumError if any rank's drift exceeds the dtype's tolerance."""
    tolerance = dtypes.checksum_tolerance(input_dtype)
    drifts = np.asarray(drifts, dtype=np.float64)
    bad = [r for r in range(plan.nranks) if not drifts[r] <= tolerance]  # NaN counts as bad
    if not bad:
        return
    from osmm_jax._src.runtime import metrics

    metrics.increment("checksum_failures")
    lines = []
    for r in bad:
        (r0, r1), (c0, c1) = plan.c.blocks[r]
        part = plan.for_rank(r)
        contributors = sorted(
            {t.origin for t in part.received} | {u.rank for u in part.local_updates}
        )
        lines.append(
            f"C block [{r0}:{r1}, {c0}:{c1}] on rank {r}: relative drift {drifts[r]:.3g} "
            f"(tolerance {tolerance:g}); its partials came from ranks {contributors}"
        )
    raise ChecksumError("osmm_jax checksum verification failed:\n  " + "\n  ".join(lines))
