"""A plan in words: what :meth:`Plan.describe` returns.

:func:`describe_plan` writes the product and its layouts (with the reason they were chosen), the
total flops and bytes, the busiest rank of the balance model, a line per rank (its multiplies,
flops and the bytes it sends to each other rank), then every multiply and transfer up to a
number of lines. :mod:`osmm_jax._src.planning.plot` draws the same plan as pictures.

The plan is an argument, not an import: :class:`~osmm_jax._src.planning.plan.Plan` calls this
module, so it may not import the plan's module. Pure Python; imports neither JAX nor MPI.
"""

from __future__ import annotations

from collections import defaultdict

from osmm_jax._src.planning.layout import Interval
from osmm_jax._src.planning.records import FLOAT32_BYTES
from osmm_jax._src.planning.totals import NOMINAL_BANDWIDTH, NOMINAL_SPEED, per_rank_totals

MIB = 2**20


def describe_plan(plan, max_lines: int = 40) -> str:
    """A readable summary of ``plan`` (a :class:`~osmm_jax.Plan`): layouts, who multiplies
    what, who sends how much to whom; the list of records is cut after ``max_lines`` lines."""
    return "\n".join(_summary(plan) + _rank_lines(plan) + _record_lines(plan, max_lines))


def _summary(plan) -> list[str]:
    """The product, its layouts, its totals, its busiest rank and the layouts' shared reason."""
    M, K, N = plan.dims
    lines = [
        f"C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {plan.nranks} ranks",
        f"  A: {plan.a.kind}   B: {plan.b.kind}   C: {plan.c.kind}"
        + ("" if plan.work is None else f"   work: {plan.work!r}"),
        f"  total {sum(plan.flops) / 1e9:.3f} GFLOP, {sum(plan.bytes_sent()) / MIB:.2f} MiB sent (float32)",
    ]
    balance = plan.balance()
    r = balance.busiest
    lines.append(
        f"  balance: busiest rank {r} at {balance.ratio:.2f}\u00d7 the mean "
        f"(flops {balance.compute[r]:.3g} s + bytes {balance.communicate[r]:.3g} s at "
        f"{NOMINAL_SPEED / 1e9:g} GFLOP/s x relative speed, {NOMINAL_BANDWIDTH / 1e9:g} GB/s)"
    )
    reasons = {plan.a.reason, plan.b.reason, plan.c.reason}
    if len(reasons) == 1 and reasons != {""}:  # chosen together, e.g. by auto_layouts
        lines.append(f"  {reasons.pop()}")
    return lines


def _rank_lines(plan) -> list[str]:
    """One line per rank: its multiplies, its flops and what it sends to whom (float32)."""
    pair_bytes: dict[tuple[int, int, str], int] = defaultdict(int)
    for t in plan.transfers:
        pair_bytes[(t.sender, t.receiver, t.op)] += t.nbytes(FLOAT32_BYTES, FLOAT32_BYTES)
    sent = plan.bytes_sent()
    # One pass over the plan for all ranks (not one per rank: P times the plan's size).
    sends_by: list[list[str]] = [[] for _ in range(plan.nranks)]
    for (src, dst, op), nbytes in sorted(pair_bytes.items()):
        sends_by[src].append(f"{op} -> {dst}: {nbytes / MIB:.2f} MiB")
    counts = per_rank_totals(plan.multiplies, plan.nranks, "rank", lambda m: 1)
    lines = []
    for r in range(plan.nranks):
        sends = ", ".join(sends_by[r])
        lines.append(
            f"  rank {r}: {counts[r]} multiplies, {plan.flops[r] / 1e9:.3f} GFLOP, "
            f"sends {sent[r] / MIB:.2f} MiB" + (f" ({sends})" if sends else "")
        )
    return lines


def _record_lines(plan, max_lines: int) -> list[str]:
    """Every multiply and transfer, one a line, cut after ``max_lines`` lines."""
    detail = ["  multiplies:"] + [
        f"    rank {m.rank}: A[{_fmt(m.rows)}, {_fmt(m.inner)}]{_src(m.a_source, m.rank)} @ "
        f"B[{_fmt(m.inner)}, {_fmt(m.cols)}]{_src(m.b_source, m.rank)} -> C[{_fmt(m.rows)}, {_fmt(m.cols)}]"
        for m in plan.multiplies
    ]
    if plan.transfers:
        detail += ["  transfers:"] + [
            f"    rank {t.origin} {t.op} {t.matrix}[{_fmt(t.rows)}, {_fmt(t.cols)}] "
            f"{'from' if t.op == 'get' else 'into'} rank {t.target} ({t.elements} elements)"
            for t in plan.transfers
        ]
    if len(detail) > max_lines:
        detail = detail[:max_lines] + [f"  ... {len(detail) - max_lines} more lines"]
    return detail


def _fmt(iv: Interval) -> str:
    return f"{iv[0]}:{iv[1]}"


def _src(source: int, rank: int) -> str:
    return "" if source == rank else f"(from {source})"
