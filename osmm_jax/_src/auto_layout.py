"""Choose layouts for C = A @ B from the ranks' speeds, by a simple cost model.

:func:`auto_layouts` takes the product's dimensions M, K, N and one GEMM rate
per rank (GFLOP/s), builds a few candidate strategies with shares proportional
to the speeds, plans every one with the planner, and returns the
:class:`LayoutChoice` (layouts of A, B and C, and the ``reason``) of the one
with the least predicted time::

    predicted = max_r flops[r] / (speeds[r] * 1e9)  +  max_r bytes_sent[r] / bandwidth

``flops`` and ``bytes_sent`` are the plan's own per-rank figures (gets
included); ``bandwidth`` is bytes/s. Candidates, in this order: ``rows``,
``cols``, ``k_split`` and ``grid PRxPC`` for every ``P = PR * PC`` with ``PR,
PC > 1``. By default a replicated operand is taken to be on every rank already
(free); with ``replicated_is_free=False`` it is split like the other operand
over K instead, and fetching the pieces a rank lacks is counted.

A guide for large products, not a timer: no latency, no contention, and no
credit for overlapping sends with GEMMs. The candidates, the caveats and what
the model says about which dimension to split are in docs/design.md ("Choosing
layouts"). Pure Python (no JAX, no MPI), deterministic, the same on every rank:
predictions within :data:`TIE_TOLERANCE` of the fastest tie, and a tie goes to
the earlier candidate in the order above.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from osmm_jax._src import checks, units
from osmm_jax._src.layout import Layout
from osmm_jax._src.planner import Plan, PlanTotals

DEFAULT_BANDWIDTH = 5e9
"""Bytes/s one rank can send, when the caller gives none: one-sided accumulates
between two ranks on one machine (shared memory) measured 4-10 GiB/s; 5e9 is
the conservative end. Across a network, pass the link's rate."""


TIE_TOLERANCE = 1e-3
"""Predictions within this fraction of the fastest tie; a tie goes to the earlier candidate
(``rows`` before ``cols`` before ``k_split`` before grids), so shares rounded to whole rows
do not decide between strategies the model cannot tell apart."""


class Candidate(NamedTuple):
    """One strategy the model considered.

    ``predicted_seconds = compute_seconds + comm_seconds``; ``compute_seconds``
    is the slowest rank's compute time, ``comm_seconds`` the time of the rank
    that sends the most bytes.
    """

    name: str
    predicted_seconds: float
    compute_seconds: float
    comm_seconds: float


@dataclass(frozen=True)
class LayoutChoice:
    """The layouts :func:`auto_layouts` picked, and why.

    Attributes:
        a, b, c: layouts of A (M x K), B (K x N) and C (M x N) over ``len(speeds)`` ranks;
            each carries ``"chosen by auto_layouts: " + reason`` as its ``Layout.reason``,
            which :meth:`Plan.describe` of their plan repeats.
        name: the winning strategy (``"rows"``, ``"cols"``, ``"k_split"``, ``"grid 2x2"``, ...).
        predicted_seconds: the model's time of one product with these layouts.
        reason: one line saying why it won, against the runner-up.
        candidates: every strategy considered, in the order considered (:class:`Candidate`).
    """

    a: Layout
    b: Layout
    c: Layout
    name: str
    predicted_seconds: float
    reason: str
    candidates: tuple[Candidate, ...]


def candidate_layouts(
    M: int, K: int, N: int, speeds, *, replicated_is_free: bool = True
) -> tuple[tuple[str, Layout, Layout, Layout], ...]:
    """Every strategy's ``(name, a, b, c)`` layouts, in the order :func:`auto_layouts` considers them."""
    M, K, N = (checks.integer(v, name) for v, name in ((M, "M"), (K, "K"), (N, "N")))
    speeds = checks.speeds(speeds)
    p = len(speeds)
    rows_b = (
        Layout.replicated((K, N), nranks=p)
        if replicated_is_free
        else Layout.rows((K, N), weights=speeds)
    )
    cols_a = (
        Layout.replicated((M, K), nranks=p)
        if replicated_is_free
        else Layout.cols((M, K), weights=speeds)
    )
    out = [
        ("rows", Layout.rows((M, K), weights=speeds), rows_b, Layout.rows((M, N), weights=speeds)),
        ("cols", cols_a, Layout.cols((K, N), weights=speeds), Layout.cols((M, N), weights=speeds)),
        (
            "k_split",
            Layout.cols((M, K), weights=speeds),
            Layout.rows((K, N), weights=speeds),
            Layout.rows((M, N), weights=speeds),
        ),
    ]
    for pr in range(2, p // 2 + 1):
        if p % pr:
            continue
        pc = p // pr
        row_w = [math.fsum(speeds[i * pc : (i + 1) * pc]) for i in range(pr)]
        col_w = [math.fsum(speeds[j::pc]) for j in range(pc)]
        if not any(row_w) or not any(col_w):  # pragma: no cover - speeds are not all zero
            continue

        def grid(shape, rw=row_w, cw=col_w, g=(pr, pc)):
            return Layout.grid(shape, g, row_weights=rw, col_weights=cw)

        out.append((f"grid {pr}x{pc}", grid((M, K)), grid((K, N)), grid((M, N))))
    return tuple(out)


def predict(
    plan: Plan | PlanTotals, speeds, *, bandwidth: float = DEFAULT_BANDWIDTH, itemsize: int = 4
) -> Candidate:
    """The model's time of ``plan`` on ranks of ``speeds`` GFLOP/s (name left empty).

    ``plan`` may be a :class:`~osmm_jax._src.planner.PlanTotals`: only its ``nranks``,
    ``flops`` and ``bytes_sent`` are used.

    A rank with work and speed 0 takes forever (``inf``). Partials travel in the
    accumulation type: ``max(itemsize, 4)`` bytes per element.
    """
    speeds = checks.speeds(speeds)
    bandwidth = checks.positive_real(bandwidth, "bandwidth")
    itemsize = checks.integer(itemsize, "itemsize", 1)
    if len(speeds) != plan.nranks:
        raise ValueError(f"{len(speeds)} speeds for a plan over {plan.nranks} ranks")
    compute = max(
        (f / (s * 1e9) if s > 0 else math.inf) if f else 0.0 for f, s in zip(plan.flops, speeds)
    )
    comm = max(plan.bytes_sent(itemsize, max(itemsize, 4))) / bandwidth
    return Candidate("", compute + comm, compute, comm)


def auto_layouts(
    M: int,
    K: int,
    N: int,
    speeds,
    *,
    bandwidth: float | None = None,
    itemsize: int = 4,
    replicated_is_free: bool = True,
) -> LayoutChoice:
    """Layouts for ``C[M x N] = A[M x K] @ B[K x N]`` that the cost model predicts fastest.

    Args:
        M, K, N: the product's dimensions (positive).
        speeds: one GEMM rate per rank, GFLOP/s (finite, >= 0, not all 0); the
            rank count is ``len(speeds)``. Shares are proportional to them.
        bandwidth: bytes/s a rank sends; default :data:`DEFAULT_BANDWIDTH`.
        itemsize: bytes per input element (4 for float32, 2 for bfloat16, 8 for float64).
        replicated_is_free: whether an operand may be taken as already on every
            rank (see the module docstring); False counts fetching it.

    Returns:
        A :class:`LayoutChoice`; the same on every rank given the same arguments.

    Raises:
        ValueError / TypeError: a dimension not positive, bad speeds, bandwidth
            not positive, itemsize not a positive integer.
    """
    for v, name in ((M, "M"), (K, "K"), (N, "N")):
        if checks.integer(v, name) < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    speeds = checks.speeds(speeds)
    bandwidth = checks.positive_real(
        DEFAULT_BANDWIDTH if bandwidth is None else bandwidth, "bandwidth"
    )
    itemsize = checks.integer(itemsize, "itemsize", 1)

    scored = []
    for name, a, b, c in candidate_layouts(M, K, N, speeds, replicated_is_free=replicated_is_free):
        # The plan's totals alone (not the cached make_plan(): trial plans must not evict the
        # user's, and their records are never needed).
        cost = predict(PlanTotals(a, b, c), speeds, bandwidth=bandwidth, itemsize=itemsize)
        scored.append((cost._replace(name=name), (a, b, c)))
    fastest = min(s.predicted_seconds for s, _ in scored)
    pick = next(i for i, (s, _) in enumerate(scored) if _ties(s.predicted_seconds, fastest))
    best, (a, b, c) = scored[pick]
    rest = sorted(
        (s for i, (s, _) in enumerate(scored) if i != pick), key=lambda s: s.predicted_seconds
    )
    runner_up = rest[0] if rest else None
    reason = _reason(best, runner_up, replicated_is_free, bandwidth)
    # The layouts carry the reason, so the plan of them says why they were chosen.
    a, b, c = (
        dataclasses.replace(x, reason=f"chosen by auto_layouts: {reason}") for x in (a, b, c)
    )
    return LayoutChoice(
        a=a,
        b=b,
        c=c,
        name=best.name,
        predicted_seconds=best.predicted_seconds,
        reason=reason,
        candidates=tuple(s for s, _ in scored),
    )


def _describe(c: Candidate, replicated_is_free: bool, bandwidth: float) -> str:
    if c.comm_seconds == 0:
        comm = "no communication"
        if replicated_is_free and c.name in ("rows", "cols"):
            comm += f" ({'B' if c.name == 'rows' else 'A'} assumed already on every rank)"
    else:
        comm = f"{c.comm_seconds:.3g} s sending {units.format_bytes(c.comm_seconds * bandwidth)}"
    return f"{c.compute_seconds:.3g} s of compute on the slowest rank, {comm}"


def _ties(seconds: float, fastest: float) -> bool:
    return seconds <= fastest * (1 + TIE_TOLERANCE)


def _reason(best: Candidate, runner_up, replicated_is_free: bool, bandwidth: float) -> str:
    text = f"{best.name}: {_describe(best, replicated_is_free, bandwidth)}"
    if runner_up is None:
        return text + " (the only candidate)"
    if _ties(runner_up.predicted_seconds, best.predicted_seconds):
        versus = f"within {TIE_TOLERANCE:.1%}: a tie, which goes to the earlier candidate"
    elif math.isinf(runner_up.predicted_seconds):
        versus = "cannot run (a rank with work has speed 0)"
    else:
        pct = 100 * (runner_up.predicted_seconds / best.predicted_seconds - 1)
        versus = f"{runner_up.predicted_seconds:.3g} s, +{pct:.0f}%"
    return (
        f"{text}; total {best.predicted_seconds:.3g} s. Runner-up {runner_up.name} ({versus}): "
        f"{_describe(runner_up, replicated_is_free, bandwidth)}"
    )
