"""How one global 2-D matrix is split over the ranks of a communicator.

A :class:`Layout` gives every rank one rectangular block of the global matrix
(possibly empty). Either the blocks partition the matrix (every element is owned
by exactly one rank: row, column and 2-D grid splits, uneven sizes allowed) or
every rank owns the whole matrix (replicated).

This module is pure Python: it imports neither JAX nor MPI, so plans can be
computed and tested anywhere. ``nranks=None`` is answered by a resolver the
package installs (see :func:`set_default_nranks`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from osmm_jax._src import checks

Interval = tuple[int, int]
"""A half-open index range ``(start, stop)`` into one dimension of a matrix."""

Block = tuple[Interval, Interval]
"""A rectangle of a matrix: ``(row_interval, col_interval)``."""


_default_nranks: Callable[[], int] | None = None


def set_default_nranks(resolver: Callable[[], int] | None) -> Callable[[], int] | None:
    """Install the function that gives the rank count of a layout built with ``nranks=None``;
    returns the one it replaces.

    The constructors take the rank count as an argument; only its default lives
    elsewhere. ``Layout.rows(shape)`` with no ``nranks`` is public API (a layout
    for every rank of the job), and the size of the job is a question for MPI,
    which this module must not import: so the layer that owns MPI answers it.
    ``osmm_jax/__init__.py`` installs, when the package is imported, a resolver
    that asks the default communicator (COMM_WORLD) for its size through
    ``osmm_jax._src.runtime.api.default_nranks``, importing MPI only when first called.
    Every ``import osmm_jax...`` runs the package first, so every existing call
    keeps working, and layouts with an explicit ``nranks`` (or weights, or sizes)
    never touch MPI. Without a resolver, ``nranks=None`` raises.
    """
    global _default_nranks
    previous, _default_nranks = _default_nranks, resolver
    return previous


def _check_shape(shape) -> tuple[int, int]:
    return checks.integers(shape, "shape", 2, "2-D (rows, cols)")


def _check_nranks(nranks) -> int:
    if nranks is None:
        if _default_nranks is None:
            raise ValueError("nranks is required: no default communicator is known")
        nranks = _default_nranks()
    nranks = checks.integer(nranks, "nranks")
    if nranks < 1:
        raise ValueError(f"nranks must be at least 1, got {nranks}")
    return nranks


def split_sizes(
    total: int, parts: int, weights=None, sizes=None, *, what: str = "sizes"
) -> tuple[int, ...]:
    """Split ``total`` items into ``parts`` contiguous pieces.

    With ``sizes`` the pieces are exactly those (validated: ``parts`` non-negative
    integers summing to ``total``). Otherwise they are proportional to ``weights``
    (default: equal) by the largest-remainder method, so they always sum to
    ``total`` and no piece is off its ideal share by a whole item or more. Ties go
    to the lower index, which keeps the result identical on every rank.
    """
    if sizes is not None and weights is not None:
        raise ValueError(f"give either weights or {what}, not both")
    if sizes is not None:
        sizes = tuple(sizes)
        if len(sizes) != parts:
            raise ValueError(f"{what} has {len(sizes)} entries but there are {parts} ranks")
        checked = tuple(checks.integer(s, f"{what}[{i}]") for i, s in enumerate(sizes))
        if sum(checked) != total:
            raise ValueError(
                f"{what} {list(checked)} sum to {sum(checked)}, not to the dimension {total}"
            )
        return checked
    if weights is None:
        weights = (1.0,) * parts
    weights = tuple(weights)
    if len(weights) != parts:
        raise ValueError(f"weights has {len(weights)} entries but there are {parts} ranks")
    checked_weights = checks.speeds(weights, "relative share", name="weights")
    weight_sum = math.fsum(checked_weights)
    ideal = [total * w / weight_sum for w in checked_weights]
    result = [math.floor(x) for x in ideal]
    remainder = total - sum(result)
    order = sorted(range(parts), key=lambda i: (-(ideal[i] - result[i]), i))
    for i in order[:remainder]:
        result[i] += 1
    return tuple(result)


def _intervals(sizes: Sequence[int]) -> tuple[Interval, ...]:
    bounds = []
    start = 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return tuple(bounds)


@dataclass(frozen=True)
class Layout:
    """How one global matrix of ``shape`` is split over ``nranks`` ranks.

    Immutable and hashable (usable as a static argument and a cache key). Rank
    ``r`` owns the block ``blocks[r] = ((row_start, row_stop), (col_start,
    col_stop))`` of the global matrix; an empty block is allowed. Build layouts
    with the constructors :meth:`rows`, :meth:`cols`, :meth:`grid` and
    :meth:`replicated`; :attr:`T` gives the layout of the transposed matrix.

    Attributes:
        shape: ``(rows, cols)`` of the global matrix.
        blocks: one block per rank, in rank order.
        is_replicated: every rank holds the whole matrix (its local block IS the
            global value) instead of the blocks partitioning it.
        kind: ``"rows"``, ``"cols"``, ``"grid"``, ``"replicated"``, or the
            same with ``".T"`` for a transposed layout; descriptive only.
        reason: why the layout was chosen (:func:`osmm_jax.auto_layouts` sets it
            on the three layouts it returns; :meth:`Plan.describe` repeats it when
            all three layouts of a plan carry the same one), else ``""``. Not part
            of equality or hashing: two layouts that split a matrix the same way
            are equal whatever their reasons.
    """

    shape: tuple[int, int]
    blocks: tuple[Block, ...]
    is_replicated: bool = False
    kind: str = "custom"
    reason: str = field(default="", compare=False)

    def __post_init__(self):
        shape = _check_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        blocks = tuple(_block(r, block) for r, block in enumerate(self.blocks))
        object.__setattr__(self, "blocks", blocks)
        if not blocks:
            raise ValueError("a layout needs at least one rank")
        rows, cols = shape
        for r, ((r0, r1), (c0, c1)) in enumerate(blocks):
            if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols):
                raise ValueError(
                    f"block {blocks[r]} of rank {r} lies outside the matrix of shape {shape}"
                )
        if self.is_replicated:
            if any(b != ((0, rows), (0, cols)) for b in blocks):
                raise ValueError("a replicated layout gives every rank the whole matrix")
        else:
            self._check_partition()

    def _check_partition(self) -> None:
        rows, cols = self.shape
        area = sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in self.blocks)
        if area != rows * cols:
            raise ValueError(
                f"the blocks of a layout of shape {self.shape} cover {area} elements, not {rows * cols}"
            )
        if not _any_overlap(self.blocks):
            return
        # Only a bad layout gets here: name the first overlapping pair in rank order.
        nonempty = [(r, b) for r, b in enumerate(self.blocks) if _area(b)]
        for i, (ra, a) in enumerate(nonempty):
            for rb, b in nonempty[i + 1 :]:
                if _overlap(a, b):
                    raise ValueError(f"the blocks of ranks {ra} and {rb} overlap: {a} and {b}")

    # -- constructors -------------------------------------------------------

    @classmethod
    def _made(cls, shape, blocks, is_replicated: bool, kind: str) -> Layout:
        """A layout the constructors below computed from checked sizes (or the transpose of a
        checked layout): a partition by construction, so its blocks are not checked again,
        which is most of the cost of a layout of thousands of ranks."""
        layout = object.__new__(cls)
        for name, value in (
            ("shape", shape),
            ("blocks", blocks),
            ("is_replicated", is_replicated),
            ("kind", kind),
            ("reason", ""),
        ):
            object.__setattr__(layout, name, value)
        return layout

    @classmethod
    def rows(cls, shape, weights=None, sizes=None, nranks=None) -> Layout:
        """Contiguous row blocks in rank order.

        Block heights are proportional to ``weights`` (default equal), or
        exactly ``sizes``. ``nranks=None`` means the default communicator's size
        (or ``len(weights)``/``len(sizes)`` when given).
        """
        shape = _check_shape(shape)
        nranks = _infer_nranks(nranks, weights, sizes)
        heights = split_sizes(shape[0], nranks, weights, sizes)
        blocks = tuple((iv, (0, shape[1])) for iv in _intervals(heights))
        return cls._made(shape, blocks, False, "rows")

    @classmethod
    def cols(cls, shape, weights=None, sizes=None, nranks=None) -> Layout:
        """Contiguous column blocks in rank order; as :meth:`rows` over columns."""
        shape = _check_shape(shape)
        nranks = _infer_nranks(nranks, weights, sizes)
        widths = split_sizes(shape[1], nranks, weights, sizes)
        blocks = tuple(((0, shape[0]), iv) for iv in _intervals(widths))
        return cls._made(shape, blocks, False, "cols")

    @classmethod
    def grid(
        cls, shape, grid, row_weights=None, col_weights=None, row_sizes=None, col_sizes=None
    ) -> Layout:
        """2-D blocks on a ``grid = (pr, pc)`` process grid; rank ``i*pc + j`` owns block ``(i, j)``.

        Row band heights follow ``row_weights`` (``pr`` entries) or
        ``row_sizes``; column band widths ``col_weights`` or ``col_sizes``.
        """
        shape = _check_shape(shape)
        try:
            pr, pc = grid
        except (TypeError, ValueError):
            raise TypeError(f"grid must be a pair (pr, pc), got {grid!r}") from None
        pr, pc = checks.integer(pr, "grid[0]"), checks.integer(pc, "grid[1]")
        if pr < 1 or pc < 1:
            raise ValueError(f"grid dimensions must be at least 1, got {grid!r}")
        heights = split_sizes(shape[0], pr, row_weights, row_sizes, what="row_sizes")
        widths = split_sizes(shape[1], pc, col_weights, col_sizes, what="col_sizes")
        row_ivs, col_ivs = _intervals(heights), _intervals(widths)
        blocks = tuple((row_ivs[i], col_ivs[j]) for i in range(pr) for j in range(pc))
        return cls._made(shape, blocks, False, "grid")

    @classmethod
    def replicated(cls, shape, nranks=None) -> Layout:
        """Every rank holds the whole matrix."""
        shape = _check_shape(shape)
        nranks = _check_nranks(nranks)
        full = ((0, shape[0]), (0, shape[1]))
        return cls._made(shape, (full,) * nranks, True, "replicated")

    # -- queries ------------------------------------------------------------

    @property
    def nranks(self) -> int:
        """Number of ranks the layout is made for."""
        return len(self.blocks)

    @property
    def T(self) -> Layout:
        """The layout of the transposed matrix: rank r owns the transpose of its block."""
        kind = self.kind[:-2] if self.kind.endswith(".T") else self.kind + ".T"
        if self.is_replicated:
            kind = "replicated"
        blocks = tuple((cols, rows) for rows, cols in self.blocks)
        return Layout._made((self.shape[1], self.shape[0]), blocks, self.is_replicated, kind)

    def local_shape(self, rank: int) -> tuple[int, int]:
        """Shape ``(rows, cols)`` of the block that ``rank`` holds."""
        (r0, r1), (c0, c1) = self.blocks[self._check_rank(rank)]
        return (r1 - r0, c1 - c0)

    def local_slices(self, rank: int) -> tuple[slice, slice]:
        """Row and column slices of ``rank``'s block into the global matrix."""
        (r0, r1), (c0, c1) = self.blocks[self._check_rank(rank)]
        return (slice(r0, r1), slice(c0, c1))

    def shard(self, x, rank: int):
        """``rank``'s block of the global array ``x`` (numpy or JAX, shape ``self.shape``)."""
        if tuple(x.shape) != self.shape:
            raise ValueError(f"expected a global array of shape {self.shape}, got {tuple(x.shape)}")
        rows, cols = self.local_slices(rank)
        return x[rows, cols]

    def owners(self, rows: Interval, cols: Interval) -> tuple[int, ...]:
        """Ranks whose block contains the whole rectangle ``rows x cols``."""
        return tuple(
            r
            for r, ((r0, r1), (c0, c1)) in enumerate(self.blocks)
            if r0 <= rows[0] and rows[1] <= r1 and c0 <= cols[0] and cols[1] <= c1
        )

    def _check_rank(self, rank) -> int:
        rank = checks.integer(rank, "rank")
        if rank >= self.nranks:
            raise ValueError(f"rank {rank} is out of range for a layout over {self.nranks} ranks")
        return rank

    def __repr__(self) -> str:
        return f"Layout({self.kind}, shape={self.shape}, nranks={self.nranks}, blocks={list(self.blocks)})"


def _block(rank: int, block) -> Block:
    """``block`` as ``((row_start, row_stop), (col_start, col_stop))`` of ints; TypeError or
    ValueError (through checks.integer, not int(): a bound of 4.5 must be refused, not cut
    down to 4) naming the bound otherwise."""
    try:
        (r0, r1), (c0, c1) = block
    except (TypeError, ValueError):
        pass
    else:
        # The common case, checked without a call per bound: layouts of thousands of ranks.
        if type(r0) is int and type(r1) is int and type(c0) is int and type(c1) is int:
            if r0 >= 0 and r1 >= 0 and c0 >= 0 and c1 >= 0:
                return ((r0, r1), (c0, c1))
    return tuple(
        tuple(checks.integer(x, f"blocks[{rank}][{d}][{i}]") for i, x in enumerate(iv))
        for d, iv in enumerate(block)
    )


def _infer_nranks(nranks, weights, sizes) -> int:
    if nranks is None:
        given = weights if weights is not None else sizes
        if given is not None:
            return _check_nranks(len(tuple(given)))
    return _check_nranks(nranks)


def _area(block: Block) -> int:
    (r0, r1), (c0, c1) = block
    return (r1 - r0) * (c1 - c0)


def _any_overlap(blocks: Sequence[Block]) -> bool:
    """Whether any two non-empty blocks overlap, in O(P log P) for P blocks.

    A sweep down the rows: at each row bound, the blocks ending there leave the active set and
    the blocks starting there join it. The active blocks' column ranges are kept sorted by
    start; as long as no two overlap, a joining range can only overlap its neighbours, so one
    bisection per block decides. (The pairwise test is O(P^2): seconds for thousands of ranks.)
    """
    events = []
    for (r0, r1), (c0, c1) in blocks:
        if r0 < r1 and c0 < c1:
            events.append((r1, 0, c0, c1))  # leaves (sorted before a join at the same row)
            events.append((r0, 1, c0, c1))  # joins
    events.sort()
    starts: list[int] = []
    stops: list[int] = []
    for _row, joins, c0, c1 in events:
        i = bisect.bisect_left(starts, c0)
        if not joins:
            del starts[i], stops[i]
            continue
        if (i > 0 and stops[i - 1] > c0) or (i < len(starts) and starts[i] < c1):
            return True
        starts.insert(i, c0)
        stops.insert(i, c1)
    return False


def _overlap(a: Block, b: Block) -> bool:
    (ar, ac), (br, bc) = a, b
    return ar[0] < br[1] and br[0] < ar[1] and ac[0] < bc[1] and bc[0] < ac[1]
