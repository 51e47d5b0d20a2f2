"""Choose layouts for C = A @ B from the ranks' speeds, by a simple cost model.

:func:`auto_layouts` builds a few candidate strategies, each with shares
proportional to the ranks' speeds, plans every one with the planner, and keeps
the one the model predicts fastest::

    predicted = max_r flops[r] / (speeds[r] * 1e9)  +  max_r bytes_sent[r] / bandwidth

``flops`` and ``bytes_sent`` are the plan's own per-rank figures (what the
executor really multiplies and sends, gets included), ``speeds`` are GFLOP/s
and ``bandwidth`` bytes/s. Compute and communication are added, not
overlapped: the one-sided executor multiplies, then sends. The model has no
per-message latency and no contention, so it is a guide for large products,
not a timer.

Candidates (``P`` ranks, weights = speeds):

* ``rows``: A split by rows, B replicated, C split by rows (data parallel);
* ``cols``: A replicated, B split by columns, C split by columns;
* ``k_split``: A split by columns and B by rows over K, C split by rows: each
  rank computes a full M x N partial and delivers the other ranks' rows;
* ``grid PRxPC``: A, B and C on a 2-D grid, for every factorisation
  ``P = PR * PC`` with ``PR, PC > 1``. Rank ``i*PC + j`` owns block ``(i, j)``
  (:meth:`Layout.grid`'s numbering). A block's area is ``row_weight[i] *
  col_weight[j]``; with row weight = the sum of the speeds of grid row ``i``
  and column weight = the sum of grid column ``j``, the area is exactly
  proportional to the rank's speed whenever the speeds, read as a PR x PC
  matrix, are an outer product (equal speeds; one slow grid row; ...), and is
  the marginal (independence) fit otherwise. The inputs' K splits use the same
  band weights so each rank also holds a matching share of A and B.

By default replication is free. ``rows`` and ``cols`` assume the replicated
operand (B, resp. A) is already on every rank, as with weights in data-parallel
training; the cost of putting it there is not counted. With
``replicated_is_free=False`` the replicated operand is instead split like the
other one over K (B by rows, resp. A by columns, weighted), and the planner's
gets of the pieces a rank lacks are counted.

What the model says about "split B by columns when K >> M". Four equal ranks
of 100 GFLOP/s, 5e9 B/s, float32, M=256, K=16384, N=4096 (8.6 GFLOP, 0.0859 s
of compute per rank in every strategy):

=========  ============================  ============================
strategy   replicated operand is free    every input starts sharded
=========  ============================  ============================
rows       0.0859 s (no communication)   0.0872 s (sends 6 MiB)
cols       0.0859 s (no communication)   0.0884 s (sends 12 MiB)
k_split    0.0865 s (sends 3 MiB)        0.0865 s (sends 3 MiB)
grid 2x2   0.0878 s (sends 9 MiB)        0.0878 s (sends 9 MiB)
=========  ============================  ============================

The model does not support the rule. With the replicated operand free, rows
and cols do the same flops with no communication, so K >> M has nothing to
decide (ties go to ``rows``). With sharded inputs the column split of B is the
worst of the four here: every rank must fetch the three quarters of A it
lacks (A is M x K, which grows with K), while ``k_split`` moves only the M x N partials and wins. What
the model does say: the cheapest strategy moves the smallest of the three
matrices, i.e. splits the largest dimension: M largest -> ``rows`` (moves B or
less: the planner ships A pieces and partials when that is cheaper), N
largest -> ``cols`` (moves A; e.g. M=256, K=4096, N=16384: cols 0.0865 s,
3 MiB, against k_split 0.0884 s, 12 MiB), K largest -> ``k_split`` (moves C).
Column-split B is right when N, not K, is the large dimension.

Pure Python (no JAX, no MPI), deterministic: predictions within
:data:`TIE_TOLERANCE` of the fastest tie, and a tie goes to the earlier
candidate in the order above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from osmm_jax._src import checks, units
from osmm_jax._src.layout import Layout
from osmm_jax._src.planner import Plan, record_choice

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
        a, b, c: layouts of A (M x K), B (K x N) and C (M x N) over ``len(speeds)`` ranks.
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
    plan: Plan, speeds, *, bandwidth: float = DEFAULT_BANDWIDTH, itemsize: int = 4
) -> Candidate:
    """The model's time of ``plan`` on ranks of ``speeds`` GFLOP/s (name left empty).

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
        # Plan() directly, not the cached make_plan(): trial plans must not evict the user's.
        cost = predict(Plan(a, b, c), speeds, bandwidth=bandwidth, itemsize=itemsize)
        scored.append((cost._replace(name=name), (a, b, c)))
    fastest = min(s.predicted_seconds for s, _ in scored)
    pick = next(i for i, (s, _) in enumerate(scored) if _ties(s.predicted_seconds, fastest))
    best, (a, b, c) = scored[pick]
    rest = sorted(
        (s for i, (s, _) in enumerate(scored) if i != pick), key=lambda s: s.predicted_seconds
    )
    runner_up = rest[0] if rest else None
    reason = _reason(best, runner_up, replicated_is_free, bandwidth)
    record_choice(a, b, c, f"chosen by auto_layouts: {reason}")
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
