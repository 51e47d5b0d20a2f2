"""The two backward products of a one_sided product, fetching what they share once.

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

With ``keep_fetched`` (:func:`osmm_jax.matmul`), the forward product's fetched buffers are kept
until the backward pass as well, and dA's product takes the pieces of ``B.T`` that lie,
transposed, within a piece of ``B`` the forward product fetched between the same two ranks, dB's
those of ``A.T`` (:func:`kept_on`): a sequence-parallel column layer's weight gradient then
fetches neither its input's rows nor its kernel's columns again.

A round of a fetch (one matrix's pieces, :func:`~.fetch.rounds`) runs on every rank or on
none: it is left out where no rank has a piece of its matrices left to get (:func:`skipped`),
decided from what every rank said of its own part when :func:`osmm_jax.matmul` agreed on the
plan (:func:`adopt`), else from every rank's part.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import jax.numpy as jnp

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.planning.records import rectangle_within
from osmm_jax._src.planning.totals import per_rank_totals
from osmm_jax._src.runtime import fetch, one_sided
from osmm_jax._src.runtime.slots import Sync, executed_plan

PRODUCTS = ("dA", "dB")
_OPERAND = {"dA": "B", "dB": "A"}  # the forward matrix whose transpose each one multiplies

# Plan -> {(product, Reuse): the matrices no rank has left to fetch}; dropped with the plan (a
# Rebalancer makes many).
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
    product's agreement asks (:func:`reuse_facts`)."""
    plan_da, plan_db = backward_plans(plan)
    return _within(plan_da.for_rank(rank), "A", plan_db.for_rank(rank), "B", transposed=False)


def _within(outer, outer_matrix: str, inner, inner_matrix: str, transposed: bool) -> frozenset:
    """The Transfers of ``inner_matrix`` that a rank's part ``inner`` of one plan gets or
    serves, each lying (``transposed``: transposed) within a Transfer of ``outer_matrix`` that
    its part ``outer`` of another plan gets or serves between the same getter and owner."""
    held: dict[tuple[int, int], list] = {}
    for t in (*outer.gets, *outer.served):
        if t.matrix == outer_matrix:
            rectangle = (t.cols, t.rows) if transposed else (t.rows, t.cols)
            held.setdefault((t.origin, t.target), []).append(rectangle)
    return frozenset(
        t
        for t in (*inner.gets, *inner.served)
        if t.matrix == inner_matrix
        and any(
            rectangle_within(t.rows, t.cols, *outer) for outer in held.get((t.origin, t.target), ())
        )
    )


def _takes_on(plan: Plan, rank: int) -> bool:
    """Whether dB's product on ``rank`` gets any piece from dA's fetched buffer (rather than
    only leaving out pieces it would have served)."""
    return any(t.origin == rank for t in taken_on(plan, rank))


def _backward_plan(plan: Plan, product: str) -> Plan:
    return backward_plans(plan)[PRODUCTS.index(product)]


@functools.lru_cache(maxsize=1024)
def kept_on(plan: Plan, rank: int, product: str) -> frozenset:
    """The pieces of ``product``'s (``"dA"`` or ``"dB"``) transposed operand (``B.T``, its
    "B"; ``A.T``, its "A") that it takes on ``rank`` from the forward product's fetch (those it
    gets and those it serves, as Transfers of its plan): each lies, transposed, within a piece
    of that matrix the forward product fetched between the same owner and getter."""
    matrix = _OPERAND[product]
    mine = _backward_plan(plan, product).for_rank(rank)
    return _within(plan.for_rank(rank), matrix, mine, matrix, transposed=True)


def _kept_gets(plan: Plan, rank: int, product: str) -> list:
    """The pieces of :func:`kept_on` that ``rank`` gets (rather than serves)."""
    return [t for t in kept_on(plan, rank, product) if t.origin == rank]


class Reuse(NamedTuple):
    """What the backward products of one product take instead of fetching (the same on every
    rank): ``share``, dB takes dC's pieces from dA's fetch; ``keep``, the products (``"dA"``,
    ``"dB"``) that take their transposed operand's pieces from the forward product's fetch."""

    share: bool = False
    keep: frozenset = frozenset()


NONE = Reuse()


def reuse(plan: Plan, sync: Sync, share: bool, keep_fetched: bool, needed=PRODUCTS) -> Reuse:
    """What the backward products of ``plan`` (run one_sided with ``sync``) of those
    ``needed`` take: dB dC's pieces from dA's fetch where ``share`` (both run and have one
    dtype) and :func:`shares_cotangent`; with ``keep_fetched``, each needed product run as
    itself the pieces of its transposed operand from the forward product's fetch, where the
    forward product runs as itself and fetches."""
    keep = frozenset()
    if keep_fetched and executed_plan(plan, sync) is plan and plan.has_gets:
        keep = frozenset(
            p
            for p in needed
            if executed_plan(_backward_plan(plan, p), sync) is _backward_plan(plan, p)
        )
    return Reuse(share and shares_cotangent(plan, sync), keep)


def taken(plan: Plan, rank: int, product: str, how: Reuse):
    """The pieces ``product``'s fetch leaves out on ``rank`` as ``how`` reuses (a set, maybe
    empty), or None where it reuses nothing (the fetch's call id says which)."""
    sets = []
    if product in how.keep:
        sets.append(kept_on(plan, rank, product))
    if product == "dB" and how.share:
        sets.append(taken_on(plan, rank))
    return frozenset().union(*sets) if sets else None


_CONFIGS = (
    ("dA", Reuse(False, frozenset({"dA"}))),
    ("dB", Reuse(True, frozenset())),
    ("dB", Reuse(False, frozenset({"dB"}))),
    ("dB", Reuse(True, frozenset({"dB"}))),
)


def _config(product: str, how: Reuse) -> tuple:
    """``(product, how)`` with only what ``product``'s fetch depends on (a :data:`_CONFIGS`
    entry, or ``NONE``)."""
    return product, Reuse(how.share and product == "dB", how.keep & {product})


def reuse_facts(plan: Plan, rank: int) -> tuple:
    """What ``rank`` says of its own part of the backward plans when :func:`osmm_jax.matmul`
    agrees on ``plan``: for each way a product may reuse (:data:`_CONFIGS`), the matrices of
    which it gets nothing left to fetch."""
    return tuple(covered(plan, rank, product, how) for product, how in _CONFIGS)


def covered(plan: Plan, rank: int, product: str, how: Reuse) -> frozenset:
    """The matrices (of "A", "B") of which ``product``'s plan leaves ``rank`` no piece to
    get, its fetch reusing as ``how`` says."""
    gets = _backward_plan(plan, product).gets_by(rank)
    out = taken(plan, rank, product, how) or frozenset()
    return frozenset(m for m in ("A", "B") if all(t in out for t in gets if t.matrix == m))


def adopt(plan: Plan, facts: list[tuple]) -> None:
    """Record every rank's :func:`reuse_facts` (in rank order) for ``plan``."""
    _agreed[plan] = {
        key: frozenset.intersection(*(rank_facts[i] for rank_facts in facts))
        for i, key in enumerate(_CONFIGS)
    }


def skipped(plan: Plan, product: str, how: Reuse) -> frozenset:
    """The matrices whose fetch round ``product``'s plan runs on no rank, reusing as ``how``
    says: no rank has a piece of them left to get (agreed by :func:`adopt`, else read from
    every rank's part of the plans)."""
    key = _config(product, how)
    if key[1] == NONE:
        return frozenset()
    agreed = _agreed.setdefault(plan, {})
    if key not in agreed:
        agreed[key] = frozenset.intersection(
            *(covered(plan, r, product, how) for r in range(plan.nranks))
        )
    return agreed[key]


def fetches_nothing(plan: Plan, sync: Sync) -> bool:
    """Whether, the fetch shared (:func:`shares_cotangent`), dB's product has nothing left to
    fetch on any rank and runs no fetch."""
    if not shares_cotangent(plan, sync):
        return False
    return skipped(plan, "dB", Reuse(True)) == frozenset({"A", "B"})


def taken_bytes(plan: Plan, sync: Sync, input_itemsize: int, accum_itemsize: int, how=None):
    """The bytes per rank that the backward products of ``plan`` no longer issue to fetch
    reusing as ``how`` says (default: dB sharing dA's fetch where it can): notified, what each
    owner would have pushed (accumulation dtype); fenced, what each getter would have got
    (input dtype)."""
    how = Reuse(shares_cotangent(plan, sync)) if how is None else how
    gets = [
        t
        for product in PRODUCTS
        for rank in range(plan.nranks)
        for t in (taken(plan, rank, product, how) or ())
        if t.origin == rank
    ]
    if sync.mode == "notify":
        return per_rank_totals(gets, plan.nranks, "target", lambda t: t.elements * accum_itemsize)
    return per_rank_totals(gets, plan.nranks, "origin", lambda t: t.elements * input_itemsize)


def _keeps_on(plan: Plan, rank: int, how: Reuse) -> bool:
    """Whether a backward product takes, on ``rank``, a piece the forward product got here."""
    return any(_kept_gets(plan, rank, p) for p in how.keep)


def kept_elements(plan: Plan, rank: int, product: str, how: Reuse) -> int:
    """The elements of the pieces ``product`` reads on ``rank`` from the forward product's
    fetched buffers (:func:`forward_keeping`) instead of fetching them: held from the forward
    pass until it runs."""
    if product not in how.keep:
        return 0
    return sum(t.elements for t in _kept_gets(plan, rank, product))


def forward_keeping(plan: Plan, rank: int, a, b, chunk_bytes: int, sync: Sync, how: Reuse):
    """``(C block, fetched)``: this rank's block of ``plan``'s product and its fetched buffers
    (one per round), kept for the backward products :func:`kept_on` says take from them (empty
    where none takes anything on this rank)."""
    fetched = _fetched_for(plan, rank, a, b, sync, None, frozenset())
    lone = fetch.lone_pieces(plan, rank, sync.mode)
    c = _product(plan, rank, a, b, chunk_bytes, sync, fetched, None, frozenset(), {}, lone)
    if not _keeps_on(plan, rank, how):
        fetched = _emptied(fetched)
    return c, fetched


def d_a_product(plan: Plan, rank: int, d_c, b_t, kept, chunk_bytes: int, sync: Sync, how):
    """``(dA block, fetched)``: this rank's block of ``dA = dC @ B.T`` (``d_c``: its block of
    the cotangent, ``b_t``: of ``B.T``), taking what ``how`` says from the forward product's
    fetched buffers ``kept``, and its own fetched buffers (one per round), which hold the
    pieces of ``dC`` that dB's product takes where ``how.share`` (empty where it takes none on
    this rank)."""
    plan_da = _backward_plan(plan, "dA")
    took, skip = taken(plan, rank, "dA", how), skipped(plan, "dA", how)
    fetched = _fetched_for(plan_da, rank, d_c, b_t, sync, took, skip, _part("dA", how))
    extra = _transposed(plan, rank, "dA", kept, sync.mode) if "dA" in how.keep else {}
    lone = lone_pieces(plan, rank, "dA", how, sync.mode)
    d_a = _product(plan_da, rank, d_c, b_t, chunk_bytes, sync, fetched, took, skip, extra, lone)
    if not (how.share and _takes_on(plan, rank)):  # hold it no longer than dA needs it
        fetched = _emptied(fetched)
    return d_a, fetched


def d_b_product(plan: Plan, rank: int, a_t, d_c, kept, from_d_a, chunk_bytes, sync, how):
    """This rank's block of ``dB = A.T @ dC`` (``a_t``: its block of ``A.T``, ``d_c``: of the
    cotangent), taking what ``how`` says from the forward product's fetched buffers ``kept``
    and dA's ``from_d_a`` (:func:`d_a_product`'s), and fetching the rest."""
    plan_da, plan_db = backward_plans(plan)
    took, skip = taken(plan, rank, "dB", how), skipped(plan, "dB", how)
    fetched = _fetched_for(plan_db, rank, a_t, d_c, sync, took, skip, _part("dB", how))
    extra = _transposed(plan, rank, "dB", kept, sync.mode) if "dB" in how.keep else {}
    if how.share and _takes_on(plan, rank):  # dA's pieces of its A operand, dC: dB's B
        for (matrix, rows, cols), piece in fetch.pieces_in(
            plan_da,
            rank,
            from_d_a,
            sync.mode,
            taken(plan, rank, "dA", how),
            skipped(plan, "dA", how),
        ).items():
            if matrix == "A":
                extra.setdefault(("B", rows, cols), piece)
    lone = lone_pieces(plan, rank, "dB", how, sync.mode)
    return _product(plan_db, rank, a_t, d_c, chunk_bytes, sync, fetched, took, skip, extra, lone)


def _fetched_for(executed, rank, x, y, sync, took, skip, part="part") -> tuple:
    """``executed``'s own fetched buffers on ``rank`` (none where it fetches nothing);
    ``part``: which reuse leaves ``took`` out, for the call id."""
    if not executed.has_gets:
        return ()
    return fetch.fetch_buffer(executed, rank, x, y, sync, took, skip, part)


def _part(product: str, how: Reuse) -> str:
    """What ``product``'s fetch leaves out, for its call id: a rank that leaves nothing out
    under two ways of reusing sends the same records under both, which another rank may not."""
    _, used = _config(product, how)
    return "part" + (" kept" if used.keep else "") + (" shared" if used.share else "")


def _product(executed, rank, x, y, chunk_bytes, sync, fetched, took, skip, extra, lone):
    """``executed``'s block on ``rank`` from its own ``fetched`` buffers and the pieces
    ``extra`` another product fetched (``lone``: those that are a whole buffer), its GEMMs
    grouped as its own whole fetch would group them (ahead or not: the same bits)."""
    if not executed.has_gets:
        return one_sided.forward(executed, rank, x, y, chunk_bytes, sync)
    pieces = {**fetch.pieces_in(executed, rank, fetched, sync.mode, took, skip)}
    for key, piece in extra.items():
        pieces.setdefault(key, piece)
    ahead = fetch.runs_ahead(executed, rank, sync, _in_accumulation_dtype(x))
    return one_sided.forward(executed, rank, x, y, chunk_bytes, sync, pieces, ahead, lone)


def _transposed(plan: Plan, rank: int, product: str, kept: tuple, mode: str) -> dict:
    """The forward product's fetched pieces of ``product``'s transposed operand's matrix, as
    pieces of that operand (transposed, keyed by its rows and columns)."""
    matrix = _OPERAND[product]
    if not _kept_gets(plan, rank, product):
        return {}
    return {
        (m, cols, rows): piece.T
        for (m, rows, cols), piece in fetch.pieces_in(plan, rank, kept, mode).items()
        if m == matrix
    }


def _emptied(fetched: tuple) -> tuple:
    return tuple(jnp.zeros((0,), buffer.dtype) for buffer in fetched)


def lone_pieces(plan: Plan, rank: int, product: str, how: Reuse, mode: str) -> frozenset:
    """The pieces ``product``'s plan reads on ``rank`` as a whole buffer
    (:func:`~.fetch.lone_pieces`), which decide how its GEMMs are grouped: those alone in its
    own fetch's buffers and, where dB shares dA's fetch, those it takes from dA's that are
    alone there. Pieces kept from the forward product do not change them: the GEMMs are
    grouped as without ``keep_fetched``, so the bits are the same."""
    how = Reuse(how.share)
    executed = _backward_plan(plan, product)
    took, skip = taken(plan, rank, product, how), skipped(plan, product, how)
    lone = set(fetch.lone_pieces(executed, rank, mode, took, skip))
    if product == "dB" and how.share and _takes_on(plan, rank):
        plan_da = _backward_plan(plan, "dA")
        lone |= {("B", r, c) for m, r, c in fetch.lone_pieces(plan_da, rank, mode) if m == "A"}
    return frozenset(lone)


def _in_accumulation_dtype(x) -> bool:
    """Whether ``x`` (a product's A operand) is already in its accumulation dtype."""
    return x.dtype == dtypes.accumulation_dtype(x.dtype)
