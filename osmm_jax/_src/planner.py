"""The planner: which rank multiplies which sub-blocks, and where results go.

Given the layouts of A (M x K), B (K x N) and C (M x N), the planner cuts each
dimension at every block boundary of the two layouts that share it (M at A's
and C's row boundaries, K at A's column and B's row boundaries, N at B's and
C's column boundaries). Every resulting cell ``(m, k, n)`` is one sub-product
``A[m, k] @ B[k, n]`` that contributes to ``C[m, n]``; inside a cell each
operand piece has a fixed set of owners (one rank, or all ranks when
replicated). This is the index arithmetic ("slicing") of Brock & Golin,
arXiv 2510.08874.

For each cell and each rank that must end up with ``C[m, n]``:

* a C owner that also owns both input pieces computes the cell for itself;
* the other C owners are served by ONE rank that delivers the cell by
  one-sided RMA: one of the self-serving owners if there are any (so no cell is
  computed twice just to save a send), otherwise the candidate (an owner of A,
  B or C) that moves the fewest elements (inputs it lacks, fetched by ``get``,
  plus results it must send); ties go to the least loaded rank, then the
  lowest rank.

Partials a rank delivers to the same C rectangle of the same target are summed
locally first, so each (origin, target, C cell) pair costs one transfer: a
``put`` when it is the only contribution that rectangle receives, else an
``accumulate``.

Pure Python, deterministic and identical on every rank; imports neither JAX
nor MPI.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import defaultdict
from dataclasses import dataclass

from osmm_jax._src.layout import Interval, Layout

FLOAT32_BYTES = 4


def _size(iv: Interval) -> int:
    return iv[1] - iv[0]


def _fmt(iv: Interval) -> str:
    return f"{iv[0]}:{iv[1]}"


@dataclass(frozen=True)
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
        return 2 * _size(self.rows) * _size(self.inner) * _size(self.cols)


@dataclass(frozen=True)
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
        return _size(self.rows) * _size(self.cols)

    @property
    def sender(self) -> int:
        """The rank whose memory the data leaves (the owner, for a get)."""
        return self.target if self.op == "get" else self.origin


@dataclass(frozen=True)
class LocalUpdate:
    """``rank`` adds the sum of its products over ``inner`` into its own C block at ``rows x cols``."""

    rank: int
    rows: Interval
    cols: Interval
    inner: tuple[Interval, ...]


class Plan:
    """The complete schedule of one distributed product C = A @ B.

    Immutable, hashable and identical on every rank; equality and hashing use
    the three layouts and the communicator key only (everything else derives
    from them). Build it with :func:`osmm_jax.plan`.

    Attributes:
        a, b, c: the layouts of A (M x K), B (K x N) and C (M x N).
        comm_key: identifies the communicator the plan runs on (0 = none).
        multiplies: every :class:`LocalMultiply`, ordered by rank.
        transfers: every :class:`Transfer` (gets, then C deliveries), ordered by
            origin; each origin's deliveries start at the next rank and wrap
            around, so ranks do not all target the same owner at once.
        local_updates: every :class:`LocalUpdate`.
        gather_stage: for a replicated C that is cheaper to sum as "reduce-scatter,
            then all-gather": the plan of the same product into an even row (or
            column) split of C, whose multiplies, deliveries and local updates
            this plan runs; None otherwise.
        compute_at_inputs: whether cells are computed where both inputs are
            (set on gather stages).
        gathers: the C blocks each rank then gets from their owners in
            ``gather_stage`` (``Transfer("get", "C", ...)``, also listed in
            ``transfers``); empty unless staged.
    """

    def __init__(
        self, a: Layout, b: Layout, c: Layout, comm_key: int = 0, *, compute_at_inputs=False
    ):
        _check_layouts(a, b, c)
        self.a, self.b, self.c = a, b, c
        self.comm_key = int(comm_key)
        self.compute_at_inputs = bool(compute_at_inputs)
        multiplies, transfers, local_updates = _schedule(a, b, c, self.compute_at_inputs)
        gather_stage, gathers = None, ()
        stage = _gather_stage(a, b, c, self.comm_key)
        if stage is not None:
            # Reduce-scatter, then all-gather: C is summed into an even split first (the
            # stage's own schedule), and every rank then gets the blocks it lacks.
            staged_gathers = _gathers(stage.c)
            staged = _elements_sent(stage.transfers + staged_gathers, a.nranks)
            direct_flops = _flops(multiplies, a.nranks)
            if max(staged) < max(_elements_sent(transfers, a.nranks)) and all(
                s <= d for s, d in zip(stage.flops, direct_flops)
            ):
                gather_stage, gathers = stage, staged_gathers
                multiplies, local_updates = stage.multiplies, stage.local_updates
                transfers = stage.transfers + staged_gathers
        self.multiplies, self.transfers, self.local_updates = multiplies, transfers, local_updates
        self.gather_stage: Plan | None = gather_stage
        self.gathers: tuple[Transfer, ...] = gathers

    # -- identity -----------------------------------------------------------

    def _key(self):
        return (self.a, self.b, self.c, self.comm_key, self.compute_at_inputs)

    def __eq__(self, other):
        return isinstance(other, Plan) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __setattr__(self, name, value):
        if name in self.__dict__:
            raise AttributeError(f"Plan is immutable: cannot set {name!r}")
        super().__setattr__(name, value)

    def __repr__(self):
        M, K, N = self.dims
        return f"Plan(C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {self.nranks} ranks, {self.a.kind}/{self.b.kind}/{self.c.kind})"

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the layouts, equal on two ranks iff they built the same plan."""
        text = repr(
            (
                self.a.shape,
                self.a.blocks,
                self.a.is_replicated,
                self.b.shape,
                self.b.blocks,
                self.b.is_replicated,
                self.c.shape,
                self.c.blocks,
                self.c.is_replicated,
                self.compute_at_inputs,
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- sizes --------------------------------------------------------------

    @property
    def nranks(self) -> int:
        return self.a.nranks

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(M, K, N)``."""
        return (self.a.shape[0], self.a.shape[1], self.b.shape[1])

    @functools.cached_property
    def flops(self) -> tuple[int, ...]:
        """Floating-point operations (2 per multiply-add) each rank performs."""
        flops = [0] * self.nranks
        for m in self.multiplies:
            flops[m.rank] += m.flops
        return tuple(flops)

    @functools.cached_property
    def comm_elements(self) -> tuple[int, ...]:
        """Matrix elements leaving each rank's memory (C partials it sends, A/B pieces others get from it)."""
        sent = [0] * self.nranks
        for t in self.transfers:
            sent[t.sender] += t.elements
        return tuple(sent)

    @property
    def comm_bytes(self) -> tuple[int, ...]:
        """Bytes each rank sends for a float32 product (see :meth:`bytes_sent` for other dtypes)."""
        return self.bytes_sent(FLOAT32_BYTES, FLOAT32_BYTES)

    def bytes_sent(self, input_itemsize: int, accum_itemsize: int) -> tuple[int, ...]:
        """Bytes each rank sends when inputs have ``input_itemsize`` bytes per element
        and C partials travel with ``accum_itemsize`` (the accumulation type:
        4 for float32/bfloat16/float16, 8 for float64)."""
        sent = [0] * self.nranks
        for t in self.transfers:
            sent[t.sender] += t.elements * (input_itemsize if t.op == "get" else accum_itemsize)
        return tuple(sent)

    def plot(self, **kwargs):
        """A matplotlib Figure of the A, B and C tilings and the bytes each rank sends to each
        other rank; see :func:`osmm_jax.plot_plan` (needs matplotlib: the ``plot`` extra)."""
        from osmm_jax._src.plot import plot_plan  # lazily: plot imports this module

        return plot_plan(self, **kwargs)

    def backward(self) -> tuple[Plan, Plan]:
        """The plans of the backward products ``(dA = dC @ B.T, dB = A.T @ dC)``."""
        return backward_plans(self)

    def bytes_issued(self, input_itemsize: int, accum_itemsize: int) -> tuple[int, ...]:
        """Bytes moved by the RMA operations each rank issues (gets counted at the rank that
        gets); what ``osmm_jax.stats()['rma_bytes']`` measures per product."""
        issued = [0] * self.nranks
        for t in self.transfers:
            issued[t.origin] += t.elements * (input_itemsize if t.op == "get" else accum_itemsize)
        return tuple(issued)

    # -- per-rank views used by the executors -------------------------------

    def multiplies_on(self, rank: int) -> tuple[LocalMultiply, ...]:
        return tuple(m for m in self.multiplies if m.rank == rank)

    def gets_by(self, rank: int) -> tuple[Transfer, ...]:
        """The A and B pieces ``rank`` gets before it multiplies."""
        return tuple(
            t for t in self.transfers if t.op == "get" and t.matrix != "C" and t.origin == rank
        )

    def deliveries_from(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.op != "get" and t.origin == rank)

    def local_updates_on(self, rank: int) -> tuple[LocalUpdate, ...]:
        return tuple(u for u in self.local_updates if u.rank == rank)

    @functools.cached_property
    def has_gets(self) -> bool:
        """Whether any rank gets A or B pieces (the gathers of a staged plan do not count)."""
        return any(t.op == "get" and t.matrix != "C" for t in self.transfers)

    @functools.cached_property
    def has_deliveries(self) -> bool:
        return any(t.op != "get" for t in self.transfers)

    def exposes(self, rank: int) -> tuple[bool, bool]:
        """Whether other ranks get pieces of ``rank``'s A block, and of its B block."""
        gets = [t for t in self.transfers if t.op == "get" and t.target == rank]
        return (any(t.matrix == "A" for t in gets), any(t.matrix == "B" for t in gets))

    def gathers_by(self, rank: int) -> tuple[Transfer, ...]:
        """The C blocks ``rank`` gets after the reduction of a staged plan (see ``gather_stage``)."""
        return tuple(t for t in self.gathers if t.origin == rank)

    @functools.cached_property
    def expose_elements(self) -> tuple[int, int]:
        """Largest A block and largest B block any rank exposes (sizes every rank's window to fit)."""
        a_max = b_max = 0
        for r in range(self.nranks):
            ea, eb = self.exposes(r)
            if ea:
                a_max = max(a_max, _area(self.a, r))
            if eb:
                b_max = max(b_max, _area(self.b, r))
        return (a_max, b_max)

    @functools.cached_property
    def receive_elements(self) -> int:
        """Largest C block of any rank (sizes every rank's reduce window; 0 if nothing is delivered).

        Every rank's window must hold its own C block, receiver or not: the
        native reduce adds the window to the local partial.
        """
        if not self.has_deliveries:
            return 0
        return max(_area(self.c, r) for r in range(self.nranks))

    # -- reporting ----------------------------------------------------------

    def describe(self, max_lines: int = 40) -> str:
        """A readable summary: layouts, who multiplies what, who sends how much to whom."""
        M, K, N = self.dims
        lines = [
            f"C[{M}x{N}] = A[{M}x{K}] @ B[{K}x{N}] over {self.nranks} ranks",
            f"  A: {self.a.kind}   B: {self.b.kind}   C: {self.c.kind}",
            f"  total {sum(self.flops) / 1e9:.3f} GFLOP, {sum(self.comm_bytes) / 2**20:.2f} MiB sent (float32)",
        ]
        reason = _CHOICE_REASONS.get((self.a, self.b, self.c))
        if reason:
            lines.append(f"  {reason}")
        pair_bytes: dict[tuple[int, int, str], int] = defaultdict(int)
        for t in self.transfers:
            pair_bytes[(t.sender, t.target if t.op != "get" else t.origin, t.op)] += (
                t.elements * FLOAT32_BYTES
            )
        for r in range(self.nranks):
            sends = ", ".join(
                f"{op} -> {dst}: {nbytes / 2**20:.2f} MiB"
                for (src, dst, op), nbytes in sorted(pair_bytes.items())
                if src == r
            )
            lines.append(
                f"  rank {r}: {len(self.multiplies_on(r))} multiplies, {self.flops[r] / 1e9:.3f} GFLOP, "
                f"sends {self.comm_bytes[r] / 2**20:.2f} MiB" + (f" ({sends})" if sends else "")
            )
        detail = ["  multiplies:"] + [
            f"    rank {m.rank}: A[{_fmt(m.rows)}, {_fmt(m.inner)}]{_src(m.a_source, m.rank)} @ "
            f"B[{_fmt(m.inner)}, {_fmt(m.cols)}]{_src(m.b_source, m.rank)} -> C[{_fmt(m.rows)}, {_fmt(m.cols)}]"
            for m in self.multiplies
        ]
        if self.transfers:
            detail += ["  transfers:"] + [
                f"    rank {t.origin} {t.op} {t.matrix}[{_fmt(t.rows)}, {_fmt(t.cols)}] "
                f"{'from' if t.op == 'get' else 'into'} rank {t.target} ({t.elements} elements)"
                for t in self.transfers
            ]
        if len(detail) > max_lines:
            detail = detail[:max_lines] + [f"  ... {len(detail) - max_lines} more lines"]
        return "\n".join(lines + detail)


def _src(source: int, rank: int) -> str:
    return "" if source == rank else f"(from {source})"


def _area(layout: Layout, rank: int) -> int:
    rows, cols = layout.local_shape(rank)
    return rows * cols


def _flops(multiplies, nranks: int) -> list[int]:
    flops = [0] * nranks
    for m in multiplies:
        flops[m.rank] += m.flops
    return flops


def _elements_sent(transfers, nranks: int) -> list[int]:
    sent = [0] * nranks
    for t in transfers:
        sent[t.sender] += t.elements
    return sent


def _gather_stage(a: Layout, b: Layout, c: Layout, comm_key: int) -> Plan | None:
    """For a replicated C, the plan of the same product into an even split of C, or None.

    Summing a replicated C directly makes every contributing rank send its whole partial to
    every other rank: (P - 1) copies of C per rank. Reducing into an even split first and then
    getting the other blocks moves about 2 (P - 1) / P copies, like a ring all-reduce, and
    leaves every rank with bit-identical values. The stage keeps the products where the
    inputs are (``compute_at_inputs``), so the split of work the layouts chose (e.g. batch
    rows in proportion to speed) stays; the caller keeps the stage only if it moves less and
    gives no rank more work.
    """
    if not c.is_replicated or c.nranks < 3:
        return None
    M, N = c.shape
    if M >= N:
        split = Layout.rows(c.shape, nranks=c.nranks)
    else:
        split = Layout.cols(c.shape, nranks=c.nranks)
    return Plan(a, b, split, comm_key, compute_at_inputs=True)


def _gathers(split: Layout) -> tuple[Transfer, ...]:
    """Every rank gets every other rank's block of ``split`` (rotated by origin, as deliveries)."""
    n = split.nranks
    gathers = []
    for origin in range(n):
        for step in range(1, n):
            owner = (origin + step) % n
            rows, cols = split.blocks[owner]
            if rows[1] > rows[0] and cols[1] > cols[0]:
                gathers.append(Transfer("get", "C", origin, owner, rows, cols))
    return tuple(gathers)


def _check_layouts(a: Layout, b: Layout, c: Layout) -> None:
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


def _cuts(extent: int, *bounds_lists) -> tuple[Interval, ...]:
    points = {0, extent}
    for bounds in bounds_lists:
        for lo, hi in bounds:
            points.update((lo, hi))
    points = sorted(points)
    return tuple((lo, hi) for lo, hi in zip(points, points[1:]) if hi > lo)


def _owner_table(layout: Layout, row_cells, col_cells) -> list[list[tuple[int, ...]]]:
    return [[layout.owners(r, c) for c in col_cells] for r in row_cells]


def _schedule(a: Layout, b: Layout, c: Layout, compute_at_inputs: bool = False):
    """Multiplies, transfers and local updates of C = A @ B for the layouts.

    ``compute_at_inputs``: a cell's product is computed by a rank that holds both of its
    inputs whenever there is one (partials move, inputs do not), whatever the bytes.
    """
    M, K = a.shape
    N = b.shape[1]
    m_cells = _cuts(M, [blk[0] for blk in a.blocks], [blk[0] for blk in c.blocks])
    k_cells = _cuts(K, [blk[1] for blk in a.blocks], [blk[0] for blk in b.blocks])
    n_cells = _cuts(N, [blk[1] for blk in b.blocks], [blk[1] for blk in c.blocks])
    a_owners = _owner_table(a, m_cells, k_cells)
    b_owners = _owner_table(b, k_cells, n_cells)
    c_owners = _owner_table(c, m_cells, n_cells)

    load = [0] * a.nranks
    products: dict[tuple[int, int, int, int], bool] = {}  # (rank, mi, ki, ni) -> primary
    # (origin, target, mi, ni) -> [ki]
    deliveries: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)

    # Pass 1: every C owner that holds both inputs computes the cell for itself. Counting all
    # of this load first lets pass 2 break cost ties by the work ranks really end up with.
    unserved = []
    for mi, ni in itertools.product(range(len(m_cells)), range(len(n_cells))):
        owners_c = c_owners[mi][ni]
        for ki, k in enumerate(k_cells):
            owners_a, owners_b = a_owners[mi][ki], b_owners[ki][ni]
            self_serving = [r for r in owners_c if r in owners_a and r in owners_b]
            for r in self_serving:
                products[(r, mi, ki, ni)] = False
                deliveries[(r, r, mi, ni)].append(ki)
                load[r] += 2 * _size(m_cells[mi]) * _size(k) * _size(n_cells[ni])
            remaining = [r for r in owners_c if r not in self_serving]
            if remaining:
                unserved.append((mi, ki, ni, self_serving, remaining))
            else:
                products[(min(self_serving), mi, ki, ni)] = True

    # Pass 2: one server per cell for the C owners that lack an input: the candidate that moves
    # the fewest elements, ties going to the least-loaded rank. Cells with a single cheapest
    # candidate are placed first, so that ties are broken knowing the work nobody can avoid
    # (on a 2x2 grid this balances flops 2:2:2:2 instead of 1:3:2:2 at the same bytes).
    def moved(entry, p):
        mi, ki, ni, _, remaining = entry
        m, k, n = m_cells[mi], k_cells[ki], n_cells[ni]
        fetch = (0 if p in a_owners[mi][ki] else _size(m) * _size(k)) + (
            0 if p in b_owners[ki][ni] else _size(k) * _size(n)
        )
        return fetch + _size(m) * _size(n) * sum(1 for r in remaining if r != p)

    def candidates(entry):
        mi, ki, ni, self_serving, _ = entry
        # A cell already computed by a self-serving owner is sent from there: fetching its
        # inputs elsewhere would compute it twice.
        if self_serving:
            return self_serving
        if compute_at_inputs:
            holders = set(a_owners[mi][ki]) & set(b_owners[ki][ni])
            if holders:
                return holders
        return set(a_owners[mi][ki]) | set(b_owners[ki][ni]) | set(c_owners[mi][ni])

    def tied(entry):
        costs = [moved(entry, p) for p in candidates(entry)]
        return costs.count(min(costs)) > 1

    for entry in sorted(unserved, key=tied):  # stable: unique cheapest first, then ties
        mi, ki, ni, _, remaining = entry
        m, k, n = m_cells[mi], k_cells[ki], n_cells[ni]
        server = min(candidates(entry), key=lambda p: (moved(entry, p), load[p], p))
        if (server, mi, ki, ni) not in products:
            load[server] += 2 * _size(m) * _size(k) * _size(n)
        products[(server, mi, ki, ni)] = True
        for r in remaining:
            deliveries[(server, r, mi, ni)].append(ki)

    multiplies = []
    gets = {}
    for (rank, mi, ki, ni), primary in sorted(products.items()):
        m, k, n = m_cells[mi], k_cells[ki], n_cells[ni]
        a_src = rank if rank in a_owners[mi][ki] else a_owners[mi][ki][0]
        b_src = rank if rank in b_owners[ki][ni] else b_owners[ki][ni][0]
        if a_src != rank:
            gets[(rank, "A", m, k)] = Transfer("get", "A", rank, a_src, m, k)
        if b_src != rank:
            gets[(rank, "B", k, n)] = Transfer("get", "B", rank, b_src, k, n)
        multiplies.append(LocalMultiply(rank, m, k, n, a_src, b_src, primary))

    senders_per_cell: dict[tuple[int, int, int], int] = defaultdict(int)
    for _origin, target, mi, ni in deliveries:
        senders_per_cell[(target, mi, ni)] += 1

    nranks = a.nranks
    c_transfers, local_updates = [], []
    for (origin, target, mi, ni), kis in deliveries.items():
        inner = tuple(k_cells[ki] for ki in sorted(kis))
        if origin == target:
            local_updates.append(LocalUpdate(origin, m_cells[mi], n_cells[ni], inner))
        else:
            op = "put" if senders_per_cell[(target, mi, ni)] == 1 else "accumulate"
            c_transfers.append(Transfer(op, "C", origin, target, m_cells[mi], n_cells[ni], inner))

    def rotated(t: Transfer):
        return (t.origin, (t.target - t.origin) % nranks, t.rows, t.cols)

    get_list = sorted(gets.values(), key=rotated)
    c_transfers.sort(key=rotated)
    local_updates.sort(key=lambda u: (u.rank, u.rows, u.cols))
    return tuple(multiplies), tuple(get_list) + tuple(c_transfers), tuple(local_updates)


_CHOICE_REASONS: dict[tuple[Layout, Layout, Layout], str] = {}


def record_choice(a: Layout, b: Layout, c: Layout, reason: str) -> None:
    """Remember why these layouts were chosen; :meth:`Plan.describe` of their plans says so."""
    _CHOICE_REASONS[(a, b, c)] = reason


@functools.lru_cache(maxsize=256)
def make_plan(a: Layout, b: Layout, c: Layout, comm_key: int = 0) -> Plan:
    """The (cached) plan of ``C = A @ B`` for the given layouts."""
    return Plan(a, b, c, comm_key)


@functools.lru_cache(maxsize=256)
def backward_plans(plan: Plan) -> tuple[Plan, Plan]:
    """Plans of the two backward products of ``plan``.

    ``dA = dC @ B.T`` (layouts C, B.T -> A) and ``dB = A.T @ dC`` (layouts A.T,
    C -> B): both are ordinary distributed products with transposed layouts.
    """
    d_a = make_plan(plan.c, plan.b.T, plan.a, plan.comm_key)
    d_b = make_plan(plan.a.T, plan.c, plan.b, plan.comm_key)
    return d_a, d_b
