"""The planner: which rank multiplies which sub-blocks, and where results go.

Given the layouts of A (M x K), B (K x N) and C (M x N), the planner cuts each
dimension at every block boundary of the two layouts that share it (M at A's
and C's row boundaries, K at A's column and B's row boundaries, N at B's and
C's column boundaries). Every resulting cell ``(m, k, n)`` is one sub-product
``A[m, k] @ B[k, n]`` that contributes to ``C[m, n]``; inside a cell each
operand piece has a fixed set of owners (one rank, or all ranks when
replicated). This is the index arithmetic ("slicing") of Brock & Golin,
arXiv 2510.08874.

Each cell is decided from that cell alone (:func:`decide`), so that any rank can decide any
cell by itself:

* a C owner that also owns both input pieces computes the cell for itself;
* the other C owners are served by ONE rank that delivers the cell by one-sided RMA: one of
  the self-serving owners if there are any (so no cell is computed twice just to save a
  send), otherwise the owner of one of its pieces (A, B or C) that moves the fewest elements
  (inputs it lacks, fetched by ``get``, plus results it must send). Equally cheap owners: the
  C owner (stationary C: on equal 2-D grids every rank computes its own block, as in SUMMA,
  balanced at the least traffic), else they take turns by the cell's position.

Partials a rank delivers to the same C rectangle of the same target are summed locally
first, so each (origin, target, C cell) pair costs one transfer: a ``put`` when it is the
only transfer into its rectangle (the target's own partial is added outside the window),
else an ``accumulate``.

Because the decisions are local, one rank's part of the plan (:meth:`Plan.for_rank`) is built
from the cells it owns a piece of, in time and memory that grow with its share of the
product, not with the rank count: that is what each rank of a job builds for itself
(:func:`osmm_jax.plan`, with ``rank=`` to inspect any rank's part without MPI). The few facts
all ranks must share (whether anyone gets or delivers, the largest exposed block) are
combined in the agreement every product starts with (:class:`PlanFacts`). The whole schedule
(``multiplies``, ``transfers``, ``describe()``, ``plot()``) is built only when asked for.
Whether a replicated C is summed in a gather stage is the one decision that looks at every
cell (:attr:`Plan.gather_stage`).

This module holds the cells and their decisions: :func:`cut_cells` (and the owner lookups,
:class:`OwnerIndex`), :func:`decide`, the cells one rank takes part in (:func:`cells_of_rank`)
and the checks of the layouts and work split a plan is made from. The records the decisions
make are built in :mod:`osmm_jax._src.planning.schedule`, counted in
:mod:`osmm_jax._src.planning.totals`; the plan itself is :mod:`osmm_jax._src.planning.plan`.

Pure Python, deterministic and identical on every rank; imports neither JAX
nor MPI.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from osmm_jax._src.planning.layout import Interval, Layout
from osmm_jax._src.planning.records import interval_size
from osmm_jax._src.planning.work import Work

EVERYONE = -1
"""The owner code of a piece of a replicated operand: every rank holds it."""


def cuts(extent: int, *bounds_lists) -> tuple[Interval, ...]:
    """The intervals ``[0, extent)`` is cut into at every bound of every list of intervals."""
    points = {0, extent}
    for bounds in bounds_lists:
        for lo, hi in bounds:
            points.update((lo, hi))
    points = sorted(points)
    return tuple((lo, hi) for lo, hi in zip(points, points[1:]) if hi > lo)


class OwnerIndex:
    """Which rank holds the piece of one operand at a given point: ``at(row, col)`` in O(log P).

    A partitioned layout is kept as row bands (between consecutive distinct row bounds of its
    blocks), each with the column starts of the blocks crossing it, so a lookup is two
    bisections; a replicated layout answers :data:`EVERYONE`. Building it is O(P log P) for the
    usual layouts (rows, columns, grids: every block lies in one band of its own rows).
    """

    def __init__(self, layout: Layout):
        self.replicated = layout.is_replicated
        self._band_starts: list[int] = []
        self._col_starts: list[list[int]] = []
        self._ranks: list[list[int]] = []
        if self.replicated:
            return
        nonempty = [
            (rank, block)
            for rank, block in enumerate(layout.blocks)
            if block[0][0] < block[0][1] and block[1][0] < block[1][1]
        ]
        bounds = sorted({x for _, ((r0, r1), _) in nonempty for x in (r0, r1)})
        bands: list[list[tuple[int, int]]] = [[] for _ in bounds[:-1]]
        for rank, ((r0, r1), (c0, _)) in nonempty:
            for i in range(bisect.bisect_left(bounds, r0), bisect.bisect_left(bounds, r1)):
                bands[i].append((c0, rank))
        self._band_starts = bounds[:-1]
        for band in bands:
            band.sort()
            self._col_starts.append([c0 for c0, _ in band])
            self._ranks.append([rank for _, rank in band])

    def at(self, row: int, col: int) -> int:
        """The rank whose block holds element ``(row, col)`` (:data:`EVERYONE` if replicated)."""
        if self.replicated:
            return EVERYONE
        i = bisect.bisect_right(self._band_starts, row) - 1
        j = bisect.bisect_right(self._col_starts[i], col) - 1
        return self._ranks[i][j]


@dataclass(frozen=True)
class Cells:
    """The cells of ``C = A @ B``: each dimension cut at every block boundary of the layouts that
    share it, and who holds each operand's piece of a cell.

    ``m``, ``k``, ``n`` are the cut intervals of M, K and N; cell ``(mi, ki, ni)`` is the
    sub-product ``A[m[mi], k[ki]] @ B[k[ki], n[ni]]``. Every cell lies inside one block of each
    partitioned layout, so :meth:`a_owner`, :meth:`b_owner` and :meth:`c_owner` each name one
    rank, or :data:`EVERYONE` for a replicated operand.
    """

    m: tuple[Interval, ...]
    k: tuple[Interval, ...]
    n: tuple[Interval, ...]
    a: OwnerIndex
    b: OwnerIndex
    c: OwnerIndex
    nranks: int
    work: Work | None = None

    def a_owner(self, mi: int, ki: int) -> int:
        return self.a.at(self.m[mi][0], self.k[ki][0])

    def b_owner(self, ki: int, ni: int) -> int:
        return self.b.at(self.k[ki][0], self.n[ni][0])

    def c_owner(self, mi: int, ni: int) -> int:
        return self.c.at(self.m[mi][0], self.n[ni][0])

    def box_rank(self, mi: int, ki: int, ni: int) -> int:
        """The rank whose :class:`Work` box holds the cell (only with a ``work`` split)."""
        assert self.work is not None, "box_rank needs a work split"
        return self.work.rank_at(self.m[mi][0], self.k[ki][0], self.n[ni][0])

    def every_cell(self) -> Iterator[tuple[int, int, int]]:
        """Every cell's ``(mi, ki, ni)``, in that order."""
        return itertools.product(range(len(self.m)), range(len(self.k)), range(len(self.n)))

    def flops(self, mi: int, ki: int, ni: int) -> int:
        return 2 * interval_size(self.m[mi]) * interval_size(self.k[ki]) * interval_size(self.n[ni])


def cut_cells(a: Layout, b: Layout, c: Layout, work: Work | None = None) -> Cells:
    """The cells of the product and the owner lookups of its three operands (each dimension
    also cut at the boxes of ``work``, so that every cell lies in one box)."""
    M, K = a.shape
    N = b.shape[1]
    boxes = ([], [], []) if work is None else (work.m, work.k, work.n)
    m = cuts(M, [blk[0] for blk in a.blocks], [blk[0] for blk in c.blocks], boxes[0])
    k = cuts(K, [blk[1] for blk in a.blocks], [blk[0] for blk in b.blocks], boxes[1])
    n = cuts(N, [blk[1] for blk in b.blocks], [blk[1] for blk in c.blocks], boxes[2])
    return Cells(m, k, n, OwnerIndex(a), OwnerIndex(b), OwnerIndex(c), a.nranks, work)


def check_layouts(a: Layout, b: Layout, c: Layout) -> None:
    """Raise unless ``a``, ``b`` and ``c`` are layouts of one product ``C = A @ B`` over the same
    ranks."""
    for name, layout in (("a_layout", a), ("b_layout", b), ("c_layout", c)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{name} must be an osmm_jax.Layout, got {type(layout).__name__}")
    if not (a.nranks == b.nranks == c.nranks):
        raise ValueError(
            f"the layouts are for different numbers of ranks: A {a.nranks}, B {b.nranks}, C {c.nranks}"
        )
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"inner dimensions do not match: A is {M}x{K} but B is {K2}x{N}")
    if c.shape != (M, N):
        raise ValueError(f"C layout has shape {c.shape} but A @ B is {M}x{N}")


def check_work_type(work) -> None:
    """Raise unless ``work`` is a :class:`Work` or None."""
    if work is not None and not isinstance(work, Work):
        raise TypeError(f"work must be an osmm_jax.Work or None, got {type(work).__name__}")


def check_work(work, a: Layout, b: Layout) -> None:
    """Raise unless ``work`` is None or splits the product of ``a`` and ``b`` over their ranks."""
    check_work_type(work)
    if work is None:
        return
    dims = (a.shape[0], a.shape[1], b.shape[1])
    if work.dims != dims:
        raise ValueError(f"work splits a {work.dims} product but the layouts make {dims}")
    if work.nranks != a.nranks:
        raise ValueError(f"work is for {work.nranks} ranks but the layouts for {a.nranks}")


class Decision(NamedTuple):
    """Who computes one cell and where its product goes (see :func:`decide`).

    ``self_serving``: the C owners that hold both inputs and compute the cell for themselves
    (``(EVERYONE,)`` when every rank does); ``server``: the rank that computes it for the
    other C owners and delivers it to them, or -1 when no C owner is left; ``primary``: the one
    copy the all-reduce path counts; ``a_owner``, ``b_owner``, ``c_owner``: the cell's owner
    codes (a rank, or :data:`EVERYONE`).
    """

    self_serving: tuple[int, ...]
    server: int
    primary: int
    a_owner: int
    b_owner: int
    c_owner: int


def decide(cells: Cells, mi: int, ki: int, ni: int, compute_at_inputs: bool = False) -> Decision:
    """The server of one cell, from that cell alone (so every rank can decide any cell by itself).

    1. Every C owner that holds both inputs computes the cell for itself.
    2. If a C owner is left, ONE rank computes the cell for all of them and delivers it: the
       self-serving owner if there is one (nothing is computed twice just to save a send);
       otherwise the candidate that moves the fewest elements, the inputs it lacks (got by
       ``get``) plus one partial per C owner other than itself. The candidates are the
       owners of the cell's pieces of partitioned operands (any other rank lacks every piece
       they hold, so it always moves more); with ``compute_at_inputs``, the ranks holding both
       inputs when there are any; with a :class:`Work` split (``cells.work``), the rank whose
       box holds the cell, alone.
    3. Among equally cheap candidates, the C owner (stationary C: on equal 2-D grids every rank
       then computes its own block, as in SUMMA, balanced at the least traffic, and no partial
       is sent); else the candidates take turns by the cell's position, so that repeated ties
       spread over them.
    """
    a = cells.a_owner(mi, ki)
    b = cells.b_owner(ki, ni)
    c = cells.c_owner(mi, ni)
    # Which C owner holds both inputs: a partitioned operand has one holder per piece.
    if a == EVERYONE and b == EVERYONE:
        both = EVERYONE
    elif a == EVERYONE or a == b:
        both = b
    elif b == EVERYONE:
        both = a
    else:
        both = None  # no rank holds both pieces
    if c != EVERYONE:
        if both == EVERYONE or both == c:
            return Decision((c,), -1, c, a, b, c)  # the one C owner computes it
        self_serving: tuple[int, ...] = ()
    elif both == EVERYONE:
        return Decision((EVERYONE,), -1, 0, a, b, c)  # every rank computes it; rank 0's counts
    elif both is not None:
        # A replicated C: the holder of both inputs computes it and delivers it to the others.
        return Decision((both,), both, both, a, b, c)
    else:
        self_serving = ()
    candidates = sorted({x for x in (a, b, c) if x != EVERYONE})
    if compute_at_inputs and both is not None:
        candidates = [both]
    if cells.work is not None:
        candidates = [cells.box_rank(mi, ki, ni)]
    m, k, n = interval_size(cells.m[mi]), interval_size(cells.k[ki]), interval_size(cells.n[ni])
    # C owners the server delivers to (all but itself): one, or every other rank.
    others = 1 if c != EVERYONE else cells.nranks - 1
    best_cost, tied = None, []
    for p in candidates:
        cost = (0 if a in (EVERYONE, p) else m * k) + (0 if b in (EVERYONE, p) else k * n)
        cost += m * n * (others if c == EVERYONE or p != c else 0)
        if best_cost is None or cost < best_cost:
            best_cost, tied = cost, [p]
        elif cost == best_cost:
            tied.append(p)
    if c in tied:
        server = c
    else:
        server = tied[(mi + ki + ni) % len(tied)]
    return Decision(self_serving, server, server, a, b, c)


def c_owners_compute_every_cell(cells: Cells) -> bool:
    """Whether :func:`decide` gives every cell to its C owner (stationary C), for operands
    that are all partitioned and no work split: the C owner moves no more than the owner of
    the A or of the B piece would (its inputs to get against theirs and one partial to
    deliver). It looks at every cell, so it decides them a row of cells at a time, as arrays
    (K x N cells), and stops at the first cell given to another rank."""
    assert cells.work is None and not (cells.a.replicated or cells.b.replicated)
    if not (cells.m and cells.k and cells.n):
        return True  # no cell
    k, n = (np.array([interval_size(iv) for iv in ivs], np.int64) for ivs in (cells.k, cells.n))
    b = np.array([[cells.b_owner(i, j) for j in range(len(n))] for i in range(len(k))])
    kn = k[:, None] * n
    for mi, rows in enumerate(cells.m):
        a = np.array([cells.a_owner(mi, j) for j in range(len(k))])[:, None]
        c = np.array([cells.c_owner(mi, j) for j in range(len(n))])[None, :]
        mk, mn = interval_size(rows) * k[:, None], interval_size(rows) * n[None, :]

        def cost(p):
            return (a != p) * mk + (b != p) * kn + (c != p) * mn

        at_c = cost(c)
        if not np.all((at_c <= cost(a)) & (at_c <= cost(b))):
            return False
    return True


def cells_of_rank(
    cells: Cells, a: Layout, b: Layout, c: Layout, rank: int, work: Work | None = None
):
    """The cells ``rank`` can take part in: those inside its block of a partitioned operand
    or its box of ``work`` (all of them when C is replicated: every rank then owns every C
    piece).

    A rank serves, gets from, or receives a delivery of a cell only if it owns a piece of it:
    :func:`decide` picks servers among the owners of partitioned pieces, or a self-serving C
    owner. So ``rank``'s part of the plan comes from these cells alone: for the usual layouts a
    few cells per rank of the other dimension, not the whole product.
    """
    if c.is_replicated:
        return cells.every_cell()
    keys: set[tuple[int, int, int]] = set()
    starts = {
        "m": [lo for lo, _ in cells.m],
        "k": [lo for lo, _ in cells.k],
        "n": [lo for lo, _ in cells.n],
    }

    def span(dim: str, iv: Interval) -> range:
        s = starts[dim]
        return range(bisect.bisect_left(s, iv[0]), bisect.bisect_left(s, iv[1]))

    everything = {dim: range(len(s)) for dim, s in starts.items()}
    for layout, dims in ((a, ("m", "k", "n")), (b, ("k", "n", "m")), (c, ("m", "n", "k"))):
        if layout.is_replicated:
            continue
        rows, cols = layout.blocks[rank]
        if rows[0] == rows[1] or cols[0] == cols[1]:
            continue
        ranges = {
            dims[0]: span(dims[0], rows),
            dims[1]: span(dims[1], cols),
            dims[2]: everything[dims[2]],
        }
        keys.update(itertools.product(ranges["m"], ranges["k"], ranges["n"]))
    if work is not None:
        rows, inner, cols = work.box(rank)
        if rows[0] < rows[1] and inner[0] < inner[1] and cols[0] < cols[1]:
            keys.update(itertools.product(span("m", rows), span("k", inner), span("n", cols)))
    return keys


def delivered_to(d: Decision, rank: int) -> bool:
    """Whether the server of a decided cell (``d.server >= 0``) delivers its product to
    ``rank``: the C owner, or, for a replicated C, every rank that does not compute the cell
    for itself, and the server itself."""
    if d.c_owner != EVERYONE:
        return rank == d.c_owner
    return rank not in d.self_serving or rank == d.server
