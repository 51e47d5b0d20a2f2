"""Per-rank totals of the plans of :func:`osmm_jax.auto_layouts`' candidate strategies, from
arrays instead of cell by cell.

:func:`osmm_jax.auto_layouts` prices each candidate by every rank's flops and the bytes it
sends and receives, exactly as the planner would plan it
(:class:`osmm_jax._src.planning.plan_totals.PlanTotals`). Cell by cell that is P^2 decisions for the
one-dimensional splits over K (a K-split over 1024 ranks
has a million cells) and P (pr + pc) for a pr x pc grid. Their layouts have a structure that
makes the same decisions (:func:`osmm_jax._src.planning.cells.decide`) countable in bulk:

* ``rows, B split`` (A, B, C by rows; A and C split alike), ``cols, A split`` (its transpose)
  and ``k_split`` (A by columns, B by rows, split alike over K; C by rows): every cell pairs
  the rank that owns its C piece with one other rank, and which of the two serves it is a
  threshold on the other's share of K. Sorting the shares once answers every pair:
  O(P log P).
* ``3-D PMxPKxPN`` (a :class:`~osmm_jax._src.planning.work.Work` split whose every rank owns pieces
  of A, B and C inside the blocks its box touches, as
  :func:`~osmm_jax._src.planning.work.three_d_layouts` makes them): the rank of the box computes
  every cell of it, so each rank gets the rest of its box's inputs and delivers the rest of
  its partial C block: a few array sums over ranks, O(P).
* ``grid PRxPC`` (A, B and C on one grid, A's and C's rows split alike, B's and C's columns
  alike): for each of the pr + pc - 1 pieces of K, the decisions of all pr x pc cells are
  array operations, and each fetched piece and sent partial is counted once per rank that
  needs it, as the planner makes them, at the rank it leaves and at the rank it reaches.

:func:`family_totals` recognises these layouts and returns ``None`` for any other, which the
caller then plans cell by cell. The results equal the cell-by-cell totals exactly (a property
test compares them on random speeds and shapes).
"""

from __future__ import annotations

import numpy as np

from osmm_jax._src.planning.cells import cuts
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.totals import Totals
from osmm_jax._src.planning.work import Work

_NEVER = np.iinfo(np.int64).max  # a threshold every share is under


def family_totals(a: Layout, b: Layout, c: Layout, work: Work | None = None) -> Totals | None:
    """The :class:`~osmm_jax._src.planning.totals.Totals` of ``Plan(a, b, c, work=work)`` for the
    candidate families above, or None when the layouts are not one of them."""
    if a.is_replicated or b.is_replicated or c.is_replicated or a.nranks < 2:
        return None
    if work is not None:
        return _nested_in_boxes(a, b, c, work)
    (M, K), N = a.shape, b.shape[1]
    bands = [_bands(layout) for layout in (a, b, c)]
    if None in bands:
        return None
    (a_rows, a_cols), (b_rows, b_cols), (c_rows, c_cols) = bands
    whole_m, whole_k, whole_n = [(0, M)], [(0, K)], [(0, N)]
    p = a.nranks
    if a_cols == whole_k and b_cols == whole_n and c_cols == whole_n:
        if a_rows == c_rows and len(c_rows) == p and len(b_rows) == p:
            # rows, B split: C owner i holds A[i, :] and gets B[j, :], or rank j serves.
            return _owner_and_other(_sizes(c_rows), _sizes(b_rows), N)
    if a_rows == whole_m and b_rows == whole_k and c_rows == whole_m:
        if b_cols == c_cols and len(c_cols) == p and len(a_cols) == p:
            # cols, A split: the transpose.
            return _owner_and_other(_sizes(c_cols), _sizes(a_cols), M)
    if a_rows == whole_m and b_cols == whole_n and c_cols == whole_n:
        if a_cols == b_rows and len(a_cols) == p and len(c_rows) == p:
            return _k_split(_sizes(c_rows), _sizes(b_rows), N)
    pr, pc = len(c_rows), len(c_cols)
    if a_rows == c_rows and b_cols == c_cols and len(a_cols) == pc and len(b_rows) == pr:
        return _grid(a_rows, a_cols, b_rows, b_cols, K)
    return None


def _nested_in_boxes(a: Layout, b: Layout, c: Layout, work: Work) -> Totals | None:
    """The totals of a :class:`Work` split whose every rank ``r`` with box ``(i, ki, j)`` owns
    A inside ``M_i x K_ki``, B inside ``K_ki x N_j`` and C inside ``M_i x N_j``; else None.

    Then every piece of a cell in box ``(i, ki, j)`` belongs to a rank ``(i, ki, *)``, ``(*, ki,
    j)`` or ``(i, *, j)``, so only the box's own rank can own all three, and
    :func:`~osmm_jax._src.planning.cells.decide` gives every cell to its box's rank. A rank with a
    non-empty box gets the parts of ``A[M_i, K_ki]`` and ``B[K_ki, N_j]`` it does not own and
    delivers the parts of ``C[M_i, N_j]`` it does not own; its own pieces are got by the other
    ranks with non-empty boxes beside it, and its C block is delivered into by them."""
    p = a.nranks
    position = np.array(work.positions, dtype=np.int64)
    pm, pk, pn = work.shape
    i, ki, j = position // (pk * pn), position // pn % pk, position % pn
    m, k, n = (np.array(ivs, dtype=np.int64).reshape(-1, 2) for ivs in (work.m, work.k, work.n))
    spans = {"m": m[i], "k": k[ki], "n": n[j]}
    areas = []
    for layout, (row_dim, col_dim) in ((a, "mk"), (b, "kn"), (c, "mn")):
        blocks = np.array(layout.blocks, dtype=np.int64).reshape(p, 2, 2)
        rows, cols = blocks[:, 0], blocks[:, 1]
        area = (rows[:, 1] - rows[:, 0]) * (cols[:, 1] - cols[:, 0])
        inside = (
            (rows[:, 0] >= spans[row_dim][:, 0])
            & (rows[:, 1] <= spans[row_dim][:, 1])
            & (cols[:, 0] >= spans[col_dim][:, 0])
            & (cols[:, 1] <= spans[col_dim][:, 1])
        )
        if not np.all(inside | (area == 0)):
            return None
        areas.append(area)
    area_a, area_b, area_c = areas
    size_m, size_k, size_n = (x[:, 1] - x[:, 0] for x in (m, k, n))
    mk, kn, mn = size_m[i] * size_k[ki], size_k[ki] * size_n[j], size_m[i] * size_n[j]
    busy = mk * size_n[j] > 0
    # Ranks beside r with a non-empty box: along N for A, along M for B, along K for C.
    other_n = np.count_nonzero(size_n) - (size_n[j] > 0)
    other_m = np.count_nonzero(size_m) - (size_m[i] > 0)
    other_k = np.count_nonzero(size_k) - (size_k[ki] > 0)
    flops = np.where(busy, 2 * mk * size_n[j], 0)
    received_inputs = np.where(busy, mk - area_a + kn - area_b, 0)
    inputs = area_a * other_n + area_b * other_m
    partials = np.where(busy, mn - area_c, 0)
    received_partials = area_c * other_k
    return Totals(
        *(
            tuple(int(x) for x in v)
            for v in (flops, inputs, partials, received_inputs, received_partials)
        )
    )


def _bands(layout: Layout):
    """``(row intervals, column intervals)`` when rank ``i * pc + j`` owns row band ``i`` times
    column band ``j`` (rows: pc = 1, columns: pr = 1); else None."""
    blocks = layout.blocks
    p = len(blocks)
    if layout.kind == "rows":
        pc = 1
    elif layout.kind == "cols":
        pc = p
    else:
        pc = len({blk[1] for blk in blocks})
    if pc < 1 or p % pc:
        return None
    rows = [blocks[i * pc][0] for i in range(p // pc)]
    cols = [blocks[j][1] for j in range(pc)]
    for r, (row, col) in enumerate(blocks):
        if row != rows[r // pc] or col != cols[r % pc]:
            return None
    return rows, cols


def _sizes(intervals) -> np.ndarray:
    return np.array([hi - lo for lo, hi in intervals], dtype=np.int64)


def _threshold_sums(x: np.ndarray, y: np.ndarray, threshold: np.ndarray):
    """For every pair of distinct ranks (owner ``i``, other ``j``) with ``x[i] > 0`` and
    ``y[j] > 0``, whether ``y[j] <= threshold[i]`` (the owner serves the pair).

    Returns ``(y_served, owners_served, x_served, x_all, y_all, pairs_served, pairs_all)``:
    per owner ``i``, the sum of ``y[j]`` over the pairs it serves; per other ``j``, how many
    owners serve its pair and the sum of their ``x[i]``; per rank the sums of ``x`` and of
    ``y`` over all its pairs; and per owner ``i``, how many pairs it serves and how many it
    is in.
    """
    x_ok, y_ok = x > 0, y > 0
    xs, ys = np.where(x_ok, x, 0), np.where(y_ok, y, 0)
    # Per owner: the sum of the others' y at or under its threshold.
    order = np.sort(y[y_ok])
    prefix = np.concatenate(([0], np.cumsum(order)))
    under = np.searchsorted(order, threshold, side="right")
    y_served = np.where(x_ok, prefix[under], 0)
    pairs_served = np.where(x_ok, under, 0)
    # Per other: the owners whose threshold is at or over its y.
    t_order = np.argsort(threshold[x_ok], kind="stable")
    t_sorted = threshold[x_ok][t_order]
    x_suffix = np.concatenate((np.cumsum(x[x_ok][t_order][::-1])[::-1], [0]))
    first = np.searchsorted(t_sorted, y, side="left")
    owners_served = np.where(y_ok, len(t_sorted) - first, 0)
    x_served = np.where(y_ok, x_suffix[first], 0)
    # A rank is never paired with itself.
    diagonal = x_ok & y_ok & (y <= threshold)
    y_served = y_served - np.where(diagonal, y, 0)
    pairs_served = pairs_served - diagonal
    owners_served = owners_served - diagonal
    x_served = x_served - np.where(diagonal, x, 0)
    x_all = np.where(y_ok, xs.sum() - xs, 0)
    y_all = np.where(x_ok, ys.sum() - ys, 0)
    pairs_all = np.where(x_ok, int(y_ok.sum()) - y_ok, 0)
    return y_served, owners_served, x_served, x_all, y_all, pairs_served, pairs_all


def _owner_and_other(x, y, z):
    """``rows, B split``: rank ``i`` owns C rows ``x[i]`` and the A rows beside them, rank
    ``j`` B rows ``y[j]`` (a share of K), every row ``z`` wide. Cell ``(i, j)`` costs the
    owner ``y z`` (it gets B[j]), rank ``j`` ``x y + x z`` (it gets A[i, j] and sends a
    partial); the owner serves ties. ``cols, A split`` is the same with rows and columns
    exchanged."""
    threshold = np.where(z <= x, _NEVER, (x * z) // np.maximum(z - x, 1))
    return _pairs(x, y, z, threshold, owner_gets_both=False)


def _k_split(x, y, z):
    """``k_split``: rank ``i`` owns C rows ``x[i]``, rank ``j`` A columns and B rows ``y[j]``
    (its share of K); C is ``z`` wide. Cell ``(i, j)`` costs the owner ``x y + y z`` (it gets
    both pieces), rank ``j`` ``x z`` (it sends a partial); the owner serves ties."""
    threshold = (x * z) // np.maximum(x + z, 1)
    return _pairs(x, y, z, threshold, owner_gets_both=True)


def _pairs(x, y, z, threshold, *, owner_gets_both: bool) -> Totals:
    """The totals of the pairs (owner ``i``, other ``j``) where the owner serves iff
    ``y[j] <= threshold[i]``; each cell is ``2 x y z`` flops, a pair the other serves sends one
    ``x z`` partial. The owner, serving, gets ``y z`` (B[j]) from ``j``, plus ``x y`` (A[i, j])
    when ``owner_gets_both``; otherwise ``j``, serving, gets ``x y`` (A[i, j]) from the owner."""
    sums = _threshold_sums(x, y, threshold)
    y_served, owners_served, x_served, x_all, y_all, pairs_served, pairs_all = sums
    x_other = x_all - x_served  # per j: the owners' x of the pairs j serves
    flops = 2 * z * (x * y_served + y * x_other + x * y)
    if owner_gets_both:
        inputs = y * (x_served + z * owners_served)
        received_inputs = (x + z) * y_served
    else:
        inputs = y * z * owners_served + x * (y_all - y_served)
        received_inputs = z * y_served + y * x_other
    # The owner receives one x z partial from every other of a pair it does not serve.
    received_partials = x * z * (pairs_all - pairs_served)
    return _totals(flops, inputs, z * x_other, received_inputs, received_partials)


_CHUNK_CELLS = 1 << 18  # cells decided at once by :func:`_grid`: arrays of a few MiB


def _grid(a_rows, a_cols, b_rows, b_cols, K) -> Totals:
    """A, B and C on one pr x pc grid (see the module docstring), many K pieces at once.

    Cell ``(i, t, j)`` (row band ``i``, K piece ``t``, column band ``j``) has its A piece on
    rank ``(i, col_band[t])``, its B piece on ``(row_band[t], j)`` and its C piece on
    ``(i, j)``. The A owner fetches nothing for it; a server lacking the A piece gets it once
    (servers of one A piece differ from cell to cell along ``j``), likewise along ``i`` for B;
    an A owner serving several K pieces of one column band sends one partial per C cell.
    """
    k_cuts = cuts(K, a_cols, b_rows)
    k = _sizes(k_cuts)
    starts = [lo for lo, _ in k_cuts]
    col_band, row_band = _band_of(a_cols, starts), _band_of(b_rows, starts)
    tally = _GridTally(_sizes(a_rows), _sizes(b_cols))
    step = max(1, _CHUNK_CELLS // max(1, len(a_rows) * len(b_cols)))
    for t0 in range(0, len(k_cuts), step):
        t = np.arange(t0, min(t0 + step, len(k_cuts)))
        tally.add(t, k[t], col_band[t], row_band[t])
    return tally.totals()


class _GridTally:
    """The totals of a pr x pc grid, summed over chunks of K pieces (:meth:`add`).

    Rank ``i * pc + j`` owns row band ``i`` (``m[i]`` rows) of A and C and column band ``j``
    (``n[j]`` columns) of B and C. The cells of ``T`` K pieces are arrays of shape
    ``(T, pr, pc)``; the per-rank sums are flat arrays indexed by rank.
    """

    def __init__(self, m: np.ndarray, n: np.ndarray):
        pr, pc = len(m), len(n)
        self.m, self.n, self.pc = m, n, pc
        self.rows, self.cols = np.arange(pr), np.arange(pc)
        self.i, self.j = self.rows[None, :, None], self.cols[None, None, :]
        self.mm, self.nn = m[None, :, None], n[None, None, :]
        self.area = m[:, None] * n[None, :]
        self.exists = (self.mm > 0) & (self.nn > 0)
        self.all_exist = bool(self.exists.all())
        # The planner's cut indices (empty bands make no cut), for the turns of tied cells.
        rotation = (np.cumsum(m > 0) - 1)[None, :, None] + (np.cumsum(n > 0) - 1)[None, None, :]
        self.rotation_even = rotation % 2 == 0
        # Off the special row and column: whether the A owner is cheaper than the B owner.
        self.a_cheaper, self.a_b_tie = self.nn < self.mm, self.nn == self.mm
        self.any_tie = bool(self.a_b_tie.any())
        self.flops, self.inputs, self.partials = (np.zeros(pr * pc, np.int64) for _ in range(3))
        self.received_inputs = np.zeros(pr * pc, dtype=np.int64)
        self.received_partials = np.zeros(pr * pc, dtype=np.int64)
        # Per kind of server ("A", "B"): the last band's partial mask, continued by the next chunk.
        self.carried: dict[str, tuple | None] = {"A": None, "B": None}

    def servers(self, t, kt, cbt, rbt):
        """Who serves the cells of the K pieces ``t`` (sizes ``kt``, in A's column bands ``cbt``
        and B's row bands ``rbt``): ``(has_a, has_b, by_c, by_a, by_b)``, whether the C owner
        holds the A piece, the B piece, and whether the C, the A or the B owner serves."""
        i, j, mm, nn = self.i, self.j, self.mm, self.nn
        kk = kt[:, None, None]
        cb, rb = cbt[:, None, None], rbt[:, None, None]
        has_a = j == cb  # the C owner holds the A piece (one column per K piece)
        has_b = i == rb  # ... the B piece (one row)
        # Three different owners: the C owner moves m k + k n, the A owner k n + m n, the B
        # owner m k + m n; the C owner serves when k <= m and k <= n, else the cheaper of the
        # other two (n < m: the A owner), tied ones taking turns: the lower rank on even
        # positions.
        by_c = (kk <= mm) & (kk <= nn)
        by_a = self.a_cheaper
        if self.any_tie:
            a_lower = (i < rb) | ((i == rb) & (cb < j))
            even = self.rotation_even ^ (t[:, None, None] % 2 == 1)
            by_a = by_a | (self.a_b_tie & (even == a_lower))
        by_a = ~by_c & by_a
        # The special column (the C owner holds A): the C owner (k n) or the B owner
        # (m k + m n); the special row (it holds B): the C owner (m k) or the A owner
        # (k n + m n); their crossing: the C owner holds both.
        tt, rows, cols = np.arange(len(t)), self.rows, self.cols
        m_col, n_col = self.m[None, :], self.n[cbt][:, None]  # (T, pr) along the special column
        col_c = kt[:, None] * n_col <= m_col * kt[:, None] + m_col * n_col
        by_c[tt[:, None], rows[None, :], cbt[:, None]] = col_c
        by_a[tt[:, None], rows[None, :], cbt[:, None]] = False
        m_row, n_row = self.m[rbt][:, None], self.n[None, :]  # (T, pc) along the special row
        row_c = m_row * kt[:, None] <= kt[:, None] * n_row + m_row * n_row
        by_c[tt[:, None], rbt[:, None], cols[None, :]] = row_c
        by_a[tt[:, None], rbt[:, None], cols[None, :]] = ~row_c
        by_c[tt, rbt, cbt] = True
        by_a[tt, rbt, cbt] = False
        return has_a, has_b, by_c, by_a, ~by_c & ~by_a

    def add(self, t, kt, cbt, rbt) -> None:
        """Count the flops, gets and partials of the cells of the K pieces ``t`` (arguments as
        :meth:`servers`); a partial is counted when its band's run of K pieces ends."""
        has_a, has_b, by_c, by_a, by_b = self.servers(t, kt, cbt, rbt)
        mine = has_a & has_b
        if self.all_exist:
            live, served_c, served_a, served_b = ~mine, by_c, by_a, by_b
        else:
            e = self.exists
            live, served_c, served_a, served_b = e & ~mine, e & by_c, e & by_a, e & by_b
        m, n, pc = self.m, self.n, self.pc
        mk = self.mm[:, :, 0] * kt[:, None]  # (T, pr)
        kn = kt[:, None] * self.nn[:, 0, :]  # (T, pc)
        # Flops: 2 m k n per cell, to its server.
        self.flops += 2 * self.area.ravel() * (kt @ served_c.reshape(len(t), -1))
        a_index = (self.rows[None, :] * pc + cbt[:, None]).ravel()
        b_index = (rbt[:, None] * pc + self.cols[None, :]).ravel()
        np.add.at(self.flops, a_index, (2 * mk * (served_a @ n)).ravel())
        np.add.at(self.flops, b_index, (2 * kn * (m @ served_b)).ravel())
        gets_a = live & ((by_c & ~has_a) | by_b)
        gets_b = live & ((by_c & ~has_b) | by_a)
        np.add.at(self.inputs, a_index, (mk * gets_a.sum(axis=2)).ravel())
        np.add.at(self.inputs, b_index, (kn * gets_b.sum(axis=1)).ravel())
        # The same gets at the servers: the C owner gets what it lacks, the B owner the A
        # piece, the A owner the B piece.
        c_gets_a = (live & by_c & ~has_a).astype(np.int64)
        c_gets_b = (live & by_c & ~has_b).astype(np.int64)
        self.received_inputs += (
            np.einsum("ti,tij->ij", mk, c_gets_a) + np.einsum("tj,tij->ij", kn, c_gets_b)
        ).ravel()
        b_gets_a = (live & by_b).astype(np.int64)
        a_gets_b = (live & by_a).astype(np.int64)
        np.add.at(self.received_inputs, b_index, np.einsum("ti,tij->tj", mk, b_gets_a).ravel())
        np.add.at(self.received_inputs, a_index, np.einsum("tj,tij->ti", kn, a_gets_b).ravel())
        self.runs("A", cbt, live & by_a)
        self.runs("B", rbt, live & by_b)

    def runs(self, kind: str, bands: np.ndarray, masks: np.ndarray) -> None:
        """Count one partial per (server, C cell) over each band's K pieces: ``masks[t]`` says
        which cells the band's owner serves at piece ``t``; a band's run may span chunks."""
        starts = np.flatnonzero(np.diff(bands, prepend=-1))
        if len(starts) == len(bands):
            merged = masks  # one K piece per band here: nothing to merge
        else:
            merged = np.logical_or.reduceat(masks, starts, axis=0)
        run_bands = bands[starts]
        pending = self.carried[kind]
        if pending is not None and pending[0] == run_bands[0]:
            merged[0] |= pending[1]
        elif pending is not None:
            self.flush(kind, np.array([pending[0]]), pending[1][None])
        self.carried[kind] = (run_bands[-1], merged[-1].copy())
        if len(run_bands) > 1:
            self.flush(kind, run_bands[:-1], merged[:-1])

    def flush(self, kind: str, bands: np.ndarray, masks: np.ndarray) -> None:
        """Add the partials of complete runs: ``masks[r]`` the C cells band ``bands[r]``'s
        owners send to (each C owner receives one partial per run)."""
        m, n, pc = self.m, self.n, self.pc
        self.received_partials += (self.area * masks.sum(axis=0)).ravel()
        if kind == "A":  # owner (i, band) sends m_i n_j to (i, j)
            senders = self.rows[None, :] * pc + bands[:, None]
            values = (masks @ n) * m[None, :]
        else:  # owner (band, j) sends m_i n_j to (i, j)
            senders = bands[:, None] * pc + self.cols[None, :]
            values = (m @ masks) * n[None, :]
        np.add.at(self.partials, senders.ravel(), values.ravel())

    def totals(self) -> Totals:
        """The totals of the K pieces added, once the runs still open are counted."""
        for kind, pending in self.carried.items():
            if pending is not None:
                self.flush(kind, np.array([pending[0]]), pending[1][None])
                self.carried[kind] = None
        columns = (self.flops, self.inputs, self.partials)
        return _totals(*columns, self.received_inputs, self.received_partials)


def _band_of(intervals, points) -> np.ndarray:
    """For each point, the index of the non-empty interval holding it."""
    nonempty = [index for index, (lo, hi) in enumerate(intervals) if hi > lo]
    starts = np.array([intervals[index][0] for index in nonempty], dtype=np.int64)
    where = np.searchsorted(starts, np.asarray(points, dtype=np.int64), side="right") - 1
    return np.array(nonempty, dtype=np.int64)[where]


def _totals(*columns) -> Totals:
    return Totals(*(tuple(int(v) for v in column) for column in columns))
