"""The two backward products of a one_sided product, fetching C's cotangent once between them.

``dA = dC @ B.T`` and ``dB = A.T @ dC`` (:func:`~osmm_jax._src.planning.plan.backward_plans`)
often need the same pieces of the cotangent ``dC`` from the same ranks: a K-split product
(A by columns, B by rows), such as a tensor-parallel row layer, computes ``dA[:, k_r]`` and
``dB[k_r, :]`` on rank r, and both multiply by the whole ``dC``. Fetched separately, the
pieces cross the network twice and a rank holds two copies of them (108 MiB each for 6144²
float32 on 4 ranks, benchmarks/results/memory.md).

So where both products fetch (:func:`shares_cotangent`), dA's product keeps its fetched
buffer for dB's, and dB's fetch leaves out every piece of ``dC`` that lies within a piece dA's
product fetched between the same two ranks (:func:`taken_on`): the owner and the getter each
see that from their own part of the plans, so they leave out the same pieces without a word.
Where that leaves dB's product nothing to fetch on any rank (:func:`fetches_nothing`, the
K-split), it runs no fetch at all. A fetch round must be run by every rank or by none: that is
decided from the plans' agreed facts, and the last from what every rank said of its own part
when :func:`osmm_jax.matmul` agreed on the plan (:func:`adopt`), else from every rank's part.
"""

from __future__ import annotations

import functools
import weakref

import jax.numpy as jnp

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.planning.records import rectangle_within
from osmm_jax._src.planning.totals import per_rank_totals
from osmm_jax._src.runtime import fetch, one_sided
from osmm_jax._src.runtime.slots import Sync, executed_plan

# Plan -> whether every rank said covered_on; dropped with the plan (a Rebalancer makes many).
_agreed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shares_cotangent(plan: Plan, sync: Sync) -> bool:
    """Whether the backward products of ``plan`` (run one_sided with ``sync``) share what they
    fetch of ``dC``: both fetch something and both run as themselves (neither staged)."""
    plan_da, plan_db = backward_plans(plan)
    if executed_plan(plan_da, sync) is not plan_da or executed_plan(plan_db, sync) is not plan_db:
        return False
    return plan_da.has_gets and plan_db.has_gets


@functools.lru_cache(maxsize=1024)
def taken_on(plan: Plan, rank: int) -> frozenset:
    """The pieces of ``dC`` that dB's product of ``plan`` leaves out of its fetch on ``rank``
    (those it gets and those it serves, as Transfers of dB's plan): each lies within a piece
    of ``dC`` that dA's product gets from the same owner for the same getter. Cached: every
    product's agreement asks (:func:`covered_on`)."""
    plan_da, plan_db = backward_plans(plan)
    mine_da, mine_db = plan_da.for_rank(rank), plan_db.for_rank(rank)
    held: dict[tuple[int, int], list] = {}
    for t in (*mine_da.gets, *mine_da.served):
        if t.matrix == "A":
            held.setdefault((t.origin, t.target), []).append((t.rows, t.cols))
    return frozenset(
        t
        for t in (*mine_db.gets, *mine_db.served)
        if t.matrix == "B"
        and any(
            rectangle_within(t.rows, t.cols, *outer) for outer in held.get((t.origin, t.target), ())
        )
    )


def _takes_on(plan: Plan, rank: int) -> bool:
    """Whether dB's product on ``rank`` gets any piece from dA's fetched buffer (rather than
    only leaving out pieces it would have served)."""
    return any(t.origin == rank for t in taken_on(plan, rank))


def covered_on(plan: Plan, rank: int) -> bool:
    """Whether dB's product of ``plan`` takes every piece ``rank`` gets from dA's fetch (reads
    ``rank``'s part of the backward plans only)."""
    taken = taken_on(plan, rank)
    return all(t in taken for t in backward_plans(plan)[1].gets_by(rank))


def adopt(plan: Plan, covered: list[bool]) -> None:
    """Record every rank's :func:`covered_on` (in rank order) for ``plan``."""
    _agreed[plan] = all(covered)


def fetches_nothing(plan: Plan, sync: Sync) -> bool:
    """Whether, the fetch shared (:func:`shares_cotangent`), dB's product has nothing left to
    fetch on any rank and runs no fetch: :func:`covered_on` holds on every rank (as agreed by
    :func:`adopt`, else read from every rank's part of the backward plans)."""
    if not shares_cotangent(plan, sync):
        return False
    covered = _agreed.get(plan)
    if covered is None:
        covered = _agreed[plan] = all(covered_on(plan, r) for r in range(plan.nranks))
    return covered


def taken_bytes(plan: Plan, sync: Sync, input_itemsize: int, accum_itemsize: int) -> tuple:
    """The bytes per rank that dB's product of ``plan`` no longer issues to fetch (those
    :func:`taken_on` leaves out): notified, what each owner would have pushed (accumulation
    dtype); fenced, what each getter would have got (input dtype). 0s unless shared."""
    if not shares_cotangent(plan, sync):
        return (0,) * plan.nranks
    gets = {t for rank in range(plan.nranks) for t in taken_on(plan, rank) if t.origin == rank}
    if sync.mode == "notify":
        return per_rank_totals(gets, plan.nranks, "target", lambda t: t.elements * accum_itemsize)
    return per_rank_totals(gets, plan.nranks, "origin", lambda t: t.elements * input_itemsize)


def d_a_and_cotangent(plan: Plan, rank: int, d_c, b_t, chunk_bytes: int, sync: Sync):
    """``(dA block, fetched)``: this rank's block of ``dA = dC @ B.T`` (``d_c``: its block of
    the cotangent, ``b_t``: of ``B.T``) and its fetched buffers (one per round,
    :func:`~.slots.fetch_rounds`), which hold the pieces of ``dC`` that :func:`d_b_from_cotangent`
    takes (empty where it takes none on this rank)."""
    plan_da, _ = backward_plans(plan)
    ahead = fetch.runs_ahead(plan_da, rank, sync, _in_accumulation_dtype(d_c))
    fetched = fetch.fetch_buffer(plan_da, rank, d_c, b_t, sync)
    pieces = fetch.pieces_in(plan_da, rank, fetched, sync.mode)
    lone = fetch.lone_pieces(plan_da, rank, sync.mode)
    d_a = one_sided.forward(plan_da, rank, d_c, b_t, chunk_bytes, sync, pieces, ahead, lone)
    if not _takes_on(plan, rank):  # hold it no longer than dA's product needs it
        fetched = tuple(jnp.zeros((0,), buffer.dtype) for buffer in fetched)
    return d_a, fetched


def d_b_from_cotangent(plan: Plan, rank: int, a_t, d_c, fetched, chunk_bytes: int, sync: Sync):
    """This rank's block of ``dB = A.T @ dC`` (``a_t``: its block of ``A.T``, ``d_c``: of the
    cotangent), taking the pieces of ``dC`` it can from ``fetched``, the buffer
    :func:`d_a_and_cotangent` returned (in the dtype of ``d_c``), and fetching the rest."""
    plan_da, plan_db = backward_plans(plan)
    taken, pieces = taken_on(plan, rank), {}
    if not fetches_nothing(plan, sync):
        own = fetch.fetch_buffer(plan_db, rank, a_t, d_c, sync, taken)
        pieces = fetch.pieces_in(plan_db, rank, own, sync.mode, taken)
    if _takes_on(plan, rank):  # dA's pieces of its A operand, dC, are pieces of dB's B operand
        for (matrix, rows, cols), piece in fetch.pieces_in(
            plan_da, rank, fetched, sync.mode
        ).items():
            if matrix == "A":
                pieces.setdefault(("B", rows, cols), piece)
    # GEMMs grouped as dB's own whole fetch would group them: the bits of two fetches.
    ahead = fetch.runs_ahead(plan_db, rank, sync, _in_accumulation_dtype(a_t))
    lone = lone_pieces_of_d_b(plan, rank, sync.mode)
    return one_sided.forward(plan_db, rank, a_t, d_c, chunk_bytes, sync, pieces, ahead, lone)


def lone_pieces_of_d_b(plan: Plan, rank: int, mode: str) -> frozenset:
    """The pieces of ``dC`` that dB's product of ``plan`` reads on ``rank`` as a whole buffer
    (:func:`~.fetch.lone_pieces`), the cotangent's fetch shared: those alone in its own
    fetch's buffers, and those it takes from dA's that are alone there."""
    plan_da, plan_db = backward_plans(plan)
    lone = set(fetch.lone_pieces(plan_db, rank, mode, taken_on(plan, rank)))
    if _takes_on(plan, rank):
        lone |= {("B", r, c) for m, r, c in fetch.lone_pieces(plan_da, rank, mode) if m == "A"}
    return frozenset(lone)


def _in_accumulation_dtype(x) -> bool:
    """Whether ``x`` (a product's A operand) is already in its accumulation dtype."""
    return x.dtype == dtypes.accumulation_dtype(x.dtype)
