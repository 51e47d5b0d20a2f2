"""Who computes which part of a product: a 3-D split of its multiply-adds over the ranks.

By default the planner lets the owners of a cell's pieces compute it (:func:`decide
<osmm_jax._src.planning.cells.decide>`): a 1-D or 2-D algorithm, in which a rank touches a whole row
band of A or column band of B. On many ranks that moves more than necessary: a rank that
computes ``V`` multiply-adds touches at least ``3 V^(2/3)`` elements, which only a 3-D split
of the ``M x K x N`` multiply-adds reaches (Agarwal et al. 1995; the "3-D" and "2.5-D"
algorithms; COSMA). A :class:`Work` is that split: the box of multiply-adds each rank
computes, whatever it owns, except where a C owner holds both inputs of a cell (it then
computes that cell for itself: nothing needs to move) or C is replicated (the holder of both
inputs computes it for everyone). With :func:`three_d_layouts` each rank owns a slice of the
A, B and C blocks its box touches, gets the rest of its box's inputs and delivers its partial
sum of C to the ranks that own the other slices.

Pure Python; imports neither JAX nor MPI.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from osmm_jax._src import checks
from osmm_jax._src.planning.layout import Interval, Layout, _intervals, split_sizes


@dataclass(frozen=True)
class Work:
    """A split of the multiply-adds of ``C[M x N] = A[M x K] @ B[K x N]`` into one box per rank.

    The boxes lie on a ``pm x pk x pn`` grid: box ``(i, ki, j)`` is rows ``m[i]`` of A and C,
    inner indices ``k[ki]`` and columns ``n[j]`` of B and C, and rank
    ``ranks[(i * pk + ki) * pn + j]`` computes it (the cells of it that the module docstring's
    exceptions leave); every rank has exactly one box (possibly empty). Immutable and
    hashable; build it with :meth:`grid`.

    Attributes:
        dims: ``(M, K, N)``.
        m, k, n: the intervals of each dimension, in order, covering it.
        ranks: the rank of each box, a permutation of ``range(nranks)``.
    """

    dims: tuple[int, int, int]
    m: tuple[Interval, ...]
    k: tuple[Interval, ...]
    n: tuple[Interval, ...]
    ranks: tuple[int, ...]

    def __post_init__(self):
        dims = checks.integers(self.dims, "dims", 3, "a triple (M, K, N)")
        object.__setattr__(self, "dims", dims)
        for name, ivs, extent in zip("mkn", (self.m, self.k, self.n), dims):
            ivs = tuple(
                checks.integers(iv, f"{name}[{x}]", 2, "a pair (start, stop)")
                for x, iv in enumerate(ivs)
            )
            object.__setattr__(self, name, ivs)
            if not ivs or ivs[0][0] != 0 or ivs[-1][1] != extent:
                raise ValueError(f"the intervals of {name} must cover 0..{extent}, got {ivs}")
            if any(lo > hi for lo, hi in ivs) or any(a[1] != b[0] for a, b in zip(ivs, ivs[1:])):
                raise ValueError(f"the intervals of {name} must be consecutive, got {ivs}")
        ranks = tuple(checks.integer(r, "ranks[i]") for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        boxes = len(self.m) * len(self.k) * len(self.n)
        if len(ranks) != boxes or sorted(ranks) != list(range(boxes)):
            raise ValueError(
                f"ranks must give each of the {boxes} boxes its own rank (a permutation of "
                f"0..{boxes - 1}), got {list(ranks)}"
            )

    @classmethod
    def grid(cls, dims, grid, m_weights=None, k_weights=None, n_weights=None, ranks=None) -> Work:
        """Boxes on a ``grid = (pm, pk, pn)``: each dimension split in proportion to its
        weights (default equal); rank ``(i * pk + ki) * pn + j`` computes box ``(i, ki, j)``
        unless ``ranks`` says otherwise."""
        M, K, N = checks.integers(dims, "dims", 3, "a triple (M, K, N)")
        pm, pk, pn = checks.integers(grid, "grid", 3, "a triple (pm, pk, pn)", 1)
        m = _intervals(split_sizes(M, pm, m_weights, what="m_weights"))
        k = _intervals(split_sizes(K, pk, k_weights, what="k_weights"))
        n = _intervals(split_sizes(N, pn, n_weights, what="n_weights"))
        return cls((M, K, N), m, k, n, tuple(range(pm * pk * pn)) if ranks is None else ranks)

    @property
    def nranks(self) -> int:
        return len(self.ranks)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(pm, pk, pn)``, the boxes along each dimension."""
        return (len(self.m), len(self.k), len(self.n))

    def index(self, rank: int) -> tuple[int, int, int]:
        """``(i, ki, j)``, the position of ``rank``'s box."""
        rank = checks.integer(rank, "rank")
        if rank >= self.nranks:
            raise ValueError(f"rank {rank} is out of range for a split over {self.nranks} ranks")
        return _coords(self.positions[rank], self.shape)

    def box(self, rank: int) -> tuple[Interval, Interval, Interval]:
        """``(rows, inner, cols)`` of the multiply-adds ``rank`` computes."""
        i, ki, j = self.index(rank)
        return (self.m[i], self.k[ki], self.n[j])

    def rank_at(self, row: int, inner: int, col: int) -> int:
        """The rank whose box holds the multiply-add ``(row, inner, col)``."""
        for value, extent, name in zip((row, inner, col), self.dims, ("row", "inner", "col")):
            if not 0 <= value < extent:
                raise ValueError(f"{name} {value} is outside 0..{extent - 1}")
        _, pk, pn = self.shape
        i = bisect.bisect_right(self._starts[0], row) - 1
        ki = bisect.bisect_right(self._starts[1], inner) - 1
        j = bisect.bisect_right(self._starts[2], col) - 1
        return self.ranks[(i * pk + ki) * pn + j]

    def permuted(self, axes: tuple[int, int, int]) -> Work:
        """The same boxes for a product whose dimensions are this one's in the order ``axes``:
        ``(0, 2, 1)`` for ``dA = dC @ B.T`` (M x N x K), ``(1, 0, 2)`` for ``dB = A.T @ dC``
        (K x M x N)."""
        if sorted(axes) != [0, 1, 2]:
            raise ValueError(f"axes must be a permutation of (0, 1, 2), got {axes!r}")
        intervals = (self.m, self.k, self.n)
        shape = tuple(self.shape[a] for a in axes)
        ranks = [0] * self.nranks
        for flat, rank in enumerate(self.ranks):
            coords = _coords(flat, self.shape)
            i, ki, j = (coords[a] for a in axes)
            ranks[(i * shape[1] + ki) * shape[2] + j] = rank
        return Work(tuple(self.dims[a] for a in axes), *(intervals[a] for a in axes), tuple(ranks))

    @functools.cached_property
    def positions(self) -> tuple[int, ...]:
        """The flat index ``(i * pk + ki) * pn + j`` of each rank's box, by rank."""
        positions = [0] * self.nranks
        for flat, rank in enumerate(self.ranks):
            positions[rank] = flat
        return tuple(positions)

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[int], list[int]]:
        return tuple([lo for lo, _ in ivs] for ivs in (self.m, self.k, self.n))

    def __repr__(self) -> str:
        pm, pk, pn = self.shape
        boxes = f"{pm}x{pk}x{pn} boxes of {self.dims[0]}x{self.dims[1]}x{self.dims[2]}"
        if self.ranks != tuple(range(self.nranks)):
            boxes += f", ranks {list(self.ranks)}"
        return f"Work({boxes})"


def three_d_layouts(dims, grid, speeds=None) -> tuple[Layout, Layout, Layout, Work]:
    """Layouts of A, B and C and the :class:`Work` of the 3-D algorithm on ``grid = (pm, pk,
    pn)`` ranks (``pm * pk * pn`` of them), shares in proportion to ``speeds``.

    Rank ``r = (i * pk + ki) * pn + j`` computes box ``(i, ki, j)``: ``A[M_i, K_ki] @ B[K_ki,
    N_j]``, a partial sum of ``C[M_i, N_j]``. It owns a row slice of each block its box
    touches: of ``A[M_i, K_ki]`` (shared by the ``pn`` ranks ``(i, ki, *)``), of ``B[K_ki,
    N_j]`` (the ``pm`` ranks ``(*, ki, j)``) and of ``C[M_i, N_j]`` (the ``pk`` ranks ``(i,
    *, j)``), so it gets the rest of its box's inputs and delivers its partial sum to the
    owners of the other slices of its C block: per rank about ``MK/(pm pk) + KN/(pk pn) +
    MN/(pm pn)`` elements, the surface of its box, where a 2-D grid moves a whole row band of
    A and column band of B. ``pk = 1`` is a 2-D split (nothing summed), ``pm = pn = 1`` a split
    over K.

    Each dimension is split in proportion to the speeds summed over the other two (the exact
    speed shares when the speeds are a product of one factor per dimension, e.g. ``1:1:2:2``
    repeated with ``pn`` a multiple of 4); slices in proportion to their owners' speeds. A rank
    of speed 0 still gets a box unless its whole row, layer or column of the grid has speed 0
    (a box is a product of shares): :func:`osmm_jax.auto_layouts` prices such a split as never
    finishing, and does not pick it.

    Memory: a rank owns only its slices, but while it multiplies it also holds the rest of its
    box's inputs and its whole partial of C (about ``pn``, ``pm`` and ``pk`` times its A, B
    and C slices), which :func:`osmm_jax.auto_layouts`' memory budget does not count.
    """
    M, K, N = checks.integers(dims, "dims", 3, "a triple (M, K, N)")
    pm, pk, pn = checks.integers(grid, "grid", 3, "a triple (pm, pk, pn)", 1)
    p = pm * pk * pn
    speeds = checks.speeds((1.0,) * p if speeds is None else speeds)
    if len(speeds) != p:
        raise ValueError(f"{len(speeds)} speeds for a {pm}x{pk}x{pn} grid of {p} ranks")

    def rank(i, ki, j):
        return (i * pk + ki) * pn + j

    sums = ([0.0] * pm, [0.0] * pk, [0.0] * pn)
    for r, s in enumerate(speeds):
        i, ki, j = _coords(r, (pm, pk, pn))
        sums[0][i] += s
        sums[1][ki] += s
        sums[2][j] += s
    work = Work.grid((M, K, N), (pm, pk, pn), *sums)
    a_blocks, b_blocks, c_blocks = [None] * p, [None] * p, [None] * p

    def slices(rows: Interval, owners):
        weights = [speeds[r] for r in owners]
        if not any(weights):
            weights = [1.0] * len(owners)
        return _intervals(split_sizes(rows[1] - rows[0], len(owners), weights, what="weights"))

    for i in range(pm):
        for ki in range(pk):
            owners = [rank(i, ki, j) for j in range(pn)]
            for r, (lo, hi) in zip(owners, slices(work.m[i], owners)):
                a_blocks[r] = ((work.m[i][0] + lo, work.m[i][0] + hi), work.k[ki])
    for ki in range(pk):
        for j in range(pn):
            owners = [rank(i, ki, j) for i in range(pm)]
            for r, (lo, hi) in zip(owners, slices(work.k[ki], owners)):
                b_blocks[r] = ((work.k[ki][0] + lo, work.k[ki][0] + hi), work.n[j])
    for i in range(pm):
        for j in range(pn):
            owners = [rank(i, ki, j) for ki in range(pk)]
            for r, (lo, hi) in zip(owners, slices(work.m[i], owners)):
                c_blocks[r] = ((work.m[i][0] + lo, work.m[i][0] + hi), work.n[j])
    kind = f"3-D {pm}x{pk}x{pn}"
    a = Layout._made((M, K), tuple(a_blocks), False, kind)
    b = Layout._made((K, N), tuple(b_blocks), False, kind)
    c = Layout._made((M, N), tuple(c_blocks), False, kind)
    return a, b, c, work


def owner_boxes(c: Layout, inner: int) -> Work | None:
    """The split in which every rank computes its own block of C over the whole inner
    dimension (``inner`` = K), when C's blocks tile a grid of at least 2 x 2 tiles, one rank
    per tile; else None. A 2-D grid product computes so by default (stationary C, as SUMMA);
    given to its backward products (:func:`~osmm_jax._src.planning.plan.backward_plans`),
    each rank computes the gradients of the multiply-adds it computed."""
    rows = sorted({block[0] for block in c.blocks})
    cols = sorted({block[1] for block in c.blocks})
    tiles = {(block[0], block[1]): rank for rank, block in enumerate(c.blocks)}
    if min(len(rows), len(cols)) < 2 or not len(tiles) == c.nranks == len(rows) * len(cols):
        return None
    if any((r, col) not in tiles for r in rows for col in cols):
        return None
    ranks = tuple(tiles[(r, col)] for r in rows for col in cols)
    try:
        return Work((c.shape[0], inner, c.shape[1]), tuple(rows), ((0, inner),), tuple(cols), ranks)
    except ValueError:  # tiles that do not cover C edge to edge
        return None


def _coords(flat: int, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """``(i, ki, j)`` of the box at ``flat = (i * pk + ki) * pn + j`` on a ``shape`` grid."""
    _, pk, pn = shape
    return (flat // (pk * pn), flat // pn % pk, flat % pn)
