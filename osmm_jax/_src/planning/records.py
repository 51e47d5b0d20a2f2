"""The records a plan is made of, and the facts every rank must agree on to run one.

A plan (:class:`~osmm_jax._src.planning.plan.Plan`) is three lists of records: the GEMMs each
rank runs (:class:`LocalMultiply`), the one-sided RMA operations between ranks
(:class:`Transfer`) and the sums a rank adds into its own C block (:class:`LocalUpdate`).
Plans hold millions of them, so they are frozen dataclasses with slots. :class:`PlanFacts` is
the little each rank must know of the others' records before a product runs; every rank
contributes its own share, combined by :func:`combine_facts`. Intervals are half-open
``(start, stop)`` pairs of global indices.

Pure Python; imports neither JAX nor MPI.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from osmm_jax._src.planning.layout import Interval

FLOAT32_BYTES = 4
"""Bytes per float32 element: the default item size of every byte count of a plan."""


def interval_size(iv: Interval) -> int:
    """The number of indices in the half-open interval ``iv``."""
    return iv[1] - iv[0]


def rectangle_within(rows: Interval, cols: Interval, outer_rows: Interval, outer_cols: Interval):
    """Whether the rectangle ``rows x cols`` lies within ``outer_rows x outer_cols``."""
    inside_rows = outer_rows[0] <= rows[0] and rows[1] <= outer_rows[1]
    return inside_rows and outer_cols[0] <= cols[0] and cols[1] <= outer_cols[1]


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class LocalMultiply:
    """One GEMM on ``rank``: ``A[rows, inner] @ B[inner, cols]`` (global indices).

    ``a_source``/``b_source`` is the rank whose block holds the input piece:
    ``rank`` itself when it is local, otherwise the piece is fetched by a ``get``
    first. ``primary`` marks the one product of each cell that the all-reduce
    path counts (one-sided plans may compute a cell on several ranks when each
    of them needs it and owns its inputs).
    """

    rank: int
    rows: Interval
    inner: Interval
    cols: Interval
    a_source: int
    b_source: int
    primary: bool

    @property
    def flops(self) -> int:
        return 2 * interval_size(self.rows) * interval_size(self.inner) * interval_size(self.cols)


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class Transfer:
    """One one-sided RMA operation, issued by ``origin`` on ``target``'s window.

    ``op`` is ``"get"`` (origin reads ``matrix`` ``"A"``/``"B"`` from target's
    block), ``"accumulate"`` or ``"put"`` (origin adds / writes its partial of
    C into target's C block). ``rows``/``cols`` are the global rectangle;
    ``inner`` lists the K ranges whose products the origin sums into a C
    partial before sending it (empty for gets).
    """

    op: str
    matrix: str
    origin: int
    target: int
    rows: Interval
    cols: Interval
    inner: tuple[Interval, ...] = ()

    @property
    def elements(self) -> int:
        return interval_size(self.rows) * interval_size(self.cols)

    @property
    def sender(self) -> int:
        """The rank whose memory the data leaves (the owner, for a get)."""
        return self.target if self.op == "get" else self.origin

    @property
    def receiver(self) -> int:
        """The rank whose memory the data arrives in (the rank that gets, for a get)."""
        return self.origin if self.op == "get" else self.target

    def nbytes(self, input_itemsize: int, accum_itemsize: int) -> int:
        """Bytes moved: gets carry ``input_itemsize`` bytes per element, C partials
        (accumulate, put) ``accum_itemsize``."""
        return self.elements * (input_itemsize if self.op == "get" else accum_itemsize)


@dataclass(frozen=True, slots=True)  # no per-record dict: plans hold millions
class LocalUpdate:
    """``rank`` adds the sum of its products over ``inner`` into its own C block at ``rows x cols``."""

    rank: int
    rows: Interval
    cols: Interval
    inner: tuple[Interval, ...]


class PlanFacts(NamedTuple):
    """What every rank must agree on to run a plan, beyond its own records.

    ``has_gets``: some rank gets an A or B piece (everyone then opens the fetch window);
    ``has_deliveries``: some rank delivers a C partial (everyone opens the reduce window);
    ``expose_elements``: the largest A block and the largest B block any rank exposes to gets
    (sizes every rank's fetch window, so that B starts at the same offset everywhere);
    ``max_origins``: the most ranks that deliver into one rank's C block (sizes every rank's
    slots window in the notified reduce);
    ``fetched_elements``: the most A and B elements one rank gets, ``max_owners``: the most
    ranks one rank gets them from, and ``owner_elements``: the most one rank gets from one owner
    (size every rank's slots window in the notified fetch).
    """

    has_gets: bool
    has_deliveries: bool
    expose_elements: tuple[int, int]
    max_origins: int = 0
    fetched_elements: int = 0
    max_owners: int = 0
    owner_elements: int = 0


def combine_facts(facts: Iterable[PlanFacts]) -> PlanFacts:
    """The facts of a whole plan from every rank's own (any rank gets, any delivers, largest)."""
    facts = list(facts)
    return PlanFacts(
        any(f.has_gets for f in facts),
        any(f.has_deliveries for f in facts),
        (
            max((f.expose_elements[0] for f in facts), default=0),
            max((f.expose_elements[1] for f in facts), default=0),
        ),
        max((f.max_origins for f in facts), default=0),
        max((f.fetched_elements for f in facts), default=0),
        max((f.max_owners for f in facts), default=0),
        max((f.owner_elements for f in facts), default=0),
    )


# -- how a rank's multiplies are grouped into GEMMs (the executor and the memory model) --


def gemm_groups(requests, apart=None) -> list:
    """The GEMMs ``one_sided.products`` runs for ``requests`` (``(multiply, rows)`` pairs):
    ``(indices, union)`` each, ``union`` the merged rectangle of several requests, or None for
    a single request's own GEMM.
    ``apart``: a rank whose purely local requests (both operands its own) merge only with one
    another, so that their GEMMs need nothing fetched and run while a fetch ahead completes;
    None: merge regardless."""
    groups, gemms = {}, []
    for i, (m, _) in enumerate(requests):
        groups.setdefault((m.inner, reads_own(m, apart)), []).append(i)
    for members in groups.values():
        union = None
        if len(members) > 1:
            union = tiled_rectangle([(requests[i][1], requests[i][0].cols) for i in members])
        if union is None:
            gemms += [((i,), None) for i in members]
        else:
            gemms.append((tuple(members), union))
    return gemms


def one_gemm_over(requests, block, apart=None) -> bool:
    """Whether :func:`gemm_groups` computes all of ``requests`` as ONE GEMM whose rectangle is
    ``block`` (a rank's whole C block: ``one_sided._whole_block``, and the operands the memory
    model counts as joined for it)."""
    groups = gemm_groups(requests, apart)
    return len(groups) == 1 and groups[0][1] == tuple(block)


def reads_own(m, rank) -> bool:
    """Whether multiply ``m`` reads only ``rank``'s own blocks (False for ``rank`` None)."""
    return rank is not None and m.a_source == m.b_source == rank


def tiled_rectangle(tiles):
    """The rectangle ``(rows, cols)`` that ``tiles`` (``(rows, cols)`` intervals) cover exactly
    once, as a grid of whole rows x whole columns; None if they do not."""
    rows = sorted({r for r, _ in tiles})
    cols = sorted({c for _, c in tiles})
    if len(tiles) != len(rows) * len(cols) or len(set(tiles)) != len(tiles):
        return None
    for ranges in (rows, cols):
        if any(prev[1] != nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
            return None
    return (rows[0][0], rows[-1][1]), (cols[0][0], cols[-1][1])
