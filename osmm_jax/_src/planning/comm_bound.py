"""The communication lower bound of a distributed matrix product, per rank (pure Python).

A rank that computes ``V`` of the ``M*K*N`` multiply-adds of ``C = A @ B`` must touch pieces of
A, B and C of ``x_A``, ``x_B``, ``x_C`` elements with ``x_A * x_B * x_C >= V**2`` (the
Loomis-Whitney inequality: the argument behind the bound of Kwasniewski et al., SC'19,
"Red-blue pebbling revisited: near optimal parallel matrix-matrix multiplication", whose value
with unlimited memory is ``3 * V**(2/3)``). A rank that owns only ``o_A``, ``o_B``, ``o_C`` of
them must receive the inputs it touches beyond its own and send out the partials it computes
beyond its own, so it moves at least

    min  sum_i max(0, x_i - o_i)   over   x_i <= |i|,  x_A * x_B * x_C >= V**2

elements. Minimising a sum under a product constraint with box bounds is solved by water
filling: every piece that must grow grows to one common size ``t`` (``x_i = clamp(t, o_i,
|i|)``), and ``t`` is the smallest value that satisfies the constraint, found by bisection.

:func:`rank_bounds` gives every rank's bound for a job whose ranks share the work and own the
matrices in proportion to weights (their speeds): the bound of the work split, independent of
any layout, to judge layouts by. :func:`moved_elements` gives what a plan really moves per rank
in the same terms, so the two can be compared (``benchmarks/layout_bounds.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_BISECTION_STEPS = 200


def moved_lower_bound(
    multiply_adds: float, sizes: Sequence[float], owned: Sequence[float]
) -> float:
    """Fewest elements a rank must move to compute ``multiply_adds`` of a product.

    Args:
        multiply_adds: ``V``, the multiply-adds the rank computes.
        sizes: ``(|A|, |B|, |C|)``, the whole matrices' elements.
        owned: ``(o_A, o_B, o_C)``, the elements of each the rank holds (at most ``sizes``).

    Returns ``sum_i (x_i - o_i)`` at the optimum (0 when what it owns already suffices).
    """
    sizes, owned = list(sizes), list(owned)
    if len(sizes) != 3 or len(owned) != 3:
        raise ValueError("sizes and owned need one entry each for A, B and C")
    if multiply_adds <= 0:
        return 0.0
    sizes = [float(s) for s in sizes]
    owned = [min(float(o), s) for o, s in zip(owned, sizes)]
    # Work in logarithms: V**2 overflows nothing there, and the constraint is a sum.
    target = 2 * math.log(multiply_adds)
    if sum(math.log(s) if s > 0 else -math.inf for s in sizes) < target * (1 - 1e-12):
        raise ValueError(
            f"{multiply_adds:g} multiply-adds do not fit in matrices of {sizes} elements"
        )

    def log_product(t: float) -> float:
        total = 0.0
        for o, s in zip(owned, sizes):
            x = min(max(t, o), s)
            if x <= 0:
                return -math.inf
            total += math.log(x)
        return total

    if log_product(0.0) >= target:
        return 0.0
    lo, hi = 0.0, max(sizes)
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if log_product(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return sum(min(max(hi, o), s) - o for o, s in zip(owned, sizes))


def rank_bounds(M: int, K: int, N: int, weights: Sequence[float]) -> tuple[float, ...]:
    """Every rank's :func:`moved_lower_bound` when rank ``r`` computes and owns the share
    ``weights[r] / sum(weights)`` of the multiply-adds and of each matrix."""
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("the weights must not all be zero")
    sizes = (M * K, K * N, M * N)
    bounds: dict[float, float] = {}  # ranks of equal weight have equal bounds
    for w in weights:
        if w not in bounds:
            bounds[w] = moved_lower_bound(
                M * K * N * w / total, sizes, [s * w / total for s in sizes]
            )
    return tuple(bounds[w] for w in weights)


def moved_elements(plan) -> tuple[int, ...]:
    """Elements each rank of ``plan`` moves in the bound's terms: the input pieces it gets
    from other ranks plus the partial sums it sends to other ranks.

    ``plan`` is a :class:`osmm_jax._src.planning.plan.Plan`. Partials a rank receives into its own
    C block are not counted (it owns those elements), as in the bound.
    """
    moved = [0] * plan.nranks
    for t in plan.transfers:
        if t.origin == t.target:
            continue
        moved[t.origin] += t.elements
    return tuple(moved)
