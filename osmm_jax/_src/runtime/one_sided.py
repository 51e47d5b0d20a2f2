"""The one-sided executor: this rank's block of a distributed product by MPI RMA.

:func:`forward` is called by every rank of the plan's communicator at the same
point of the program, with the same plan and its own blocks ``a`` (shape
``plan.a.local_shape(rank)``) and ``b`` (``plan.b.local_shape(rank)``) of one
supported dtype. It returns this rank's C block, shape
``plan.c.local_shape(rank)``, in the input dtype. The GEMMs are XLA dots on
static slices of the blocks; the data moves in the native custom calls of
:mod:`osmm_jax._src.runtime.primitives`:

1. The remote A and B pieces this rank's multiplies need (only if the plan gets
   any input, :mod:`osmm_jax._src.runtime.fetch`): got from windows exposing the
   owners' blocks (``osmm_fetch``), or, notified, pushed by their owners.
2. The partials other ranks own, summed per C rectangle over the inner ranges
   and delivered by ``osmm_reduce_start`` / ``_issue`` / ``_finish`` (only if
   the plan delivers any): MPI_Accumulate (or MPI_Put, for a rectangle's only
   contribution) straight into the owners' reduce windows. They are computed
   first, in chunks of about ``chunk_bytes``; with more than one chunk each one
   is handed to the background issuer as soon as its GEMMs finish, and the next
   chunk's GEMMs, then this rank's purely local ones, wait for its ticket, so
   sending overlaps computing. With one chunk (or ``chunk_bytes == 0``) the
   delivered GEMMs run first and the partials leave from the calling thread;
   this rank's own GEMMs run with them when they merge into fewer GEMMs
   (:func:`products`), else while the partials are sent. Chunking
   splits GEMMs by rows and never changes what is summed (a split GEMM may
   round differently in the last bits).
3. A staged plan (``plan.gather_stage``, a replicated C) runs steps 1-2 into an
   even split of C, then gathers the blocks this rank lacks from their owners
   (:mod:`osmm_jax._src.runtime.gather`) and returns the whole C.

Precision: products and sums are formed in the accumulation dtype (float32 for
float32, bfloat16 and float16; float64 for float64), so partials travel in it;
the result is cast to the input dtype once, at the end.

:func:`product` is shared with the all-reduce baseline (:mod:`osmm_jax._src.runtime.allreduce`),
so both executors form their GEMMs the same way.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.records import gemm_groups, one_gemm_over, reads_own
from osmm_jax._src.runtime import fetch, gather, native, primitives, slots
from osmm_jax._src.runtime.slots import FENCE, Sync, executed_plan


def forward(
    plan: Plan,
    rank: int,
    a,
    b,
    chunk_bytes: int = 0,
    sync: Sync = FENCE,
    fetched=None,
    ahead: bool = False,
    lone: frozenset = frozenset(),
):
    """This rank's C block by one-sided transfers (see the module docstring).

    ``fetched``: the remote pieces, ``{(matrix, rows, cols): array}`` holding every piece
    this rank's multiplies get, already fetched (by another product: see
    :mod:`osmm_jax._src.runtime.backward`); None to fetch them here. Only for a plan run as
    itself (not staged). ``ahead``: with ``fetched``, whether this plan's own fetch of them
    would run ahead (:func:`~.fetch.runs_ahead`): the GEMMs on own pieces are then kept apart,
    grouped as they are when this product fetches them itself (the same bits). ``lone``: with
    ``fetched``, the pieces in it that are a whole buffer (:func:`~.fetch.lone_pieces`)."""
    executed = executed_plan(plan, sync)  # a staged plan's gather stage, or its direct plan
    if executed is not plan:
        assert fetched is None, "pieces fetched for a staged plan"  # caller's bug
        if executed is not plan.gather_stage:
            return forward(executed, rank, a, b, chunk_bytes, sync)
        whole = _summed_in_place(plan, rank, a, b, chunk_bytes, sync)
        if whole is not None:
            return whole.astype(a.dtype)
        block = forward(executed, rank, a, b, chunk_bytes, sync)
        return gather.gather_blocks(plan, rank, block, sync)
    operands = _operands(plan, rank, a, b, sync, fetched, ahead, lone)
    local = jnp.zeros(plan.c.local_shape(rank), operands.acc)
    cells = _cells(plan, rank)
    own = [(cell, cell.rows) for cell in cells if cell.local and not cell.deliveries]
    ticket, buffers = None, []
    if plan.has_deliveries:
        local, buffers, ticket, own = _deliver(operands, cells, local, chunk_bytes, own, sync)
        if not buffers:  # deferred: `local` is the finished block
            return local.astype(a.dtype)
    else:
        whole = _whole_block(operands, own)
        if whole is not None:
            return whole.astype(a.dtype)
    for (cell, rows), part in zip(own, _partials(operands, own, ticket)):
        local = _add_local(operands, local, rows, cell.cols, part)
    if not plan.has_deliveries:
        return local.astype(a.dtype)
    return primitives.reduce_finish(local, buffers, comm=plan.comm_key).astype(a.dtype)


def sums_in_place(plan: Plan, rank: int, sync: Sync, itemsize: int):
    """Staged ``plan``'s GEMM request on ``rank`` when it runs in place
    (:func:`_summed_in_place`): notified and not deferred, C split by rows, and this rank's
    partial one GEMM over the whole C (a data-parallel weight gradient), every other rank
    adding to this rank's rows by accumulate (with a rank that adds nothing, an empty K block,
    the in-place sum went wrong after other products); else None.
    ``itemsize``: of the accumulation dtype."""
    stage = plan.gather_stage
    if sync.mode != "notify" or sync.defer or plan.nranks == 1 or stage.has_gets:
        return None
    if stage.c.kind != "rows" or not gather.places_rows(plan, rank, itemsize, sync):
        return None
    mine = stage.for_rank(rank)
    if len(mine.origins) < plan.nranks - 1 or {t.op for t in mine.received} != {"accumulate"}:
        return None
    cells = _cells(stage, rank)
    if any(len(c.inner) != 1 or c.cols != (0, plan.c.shape[1]) for c in cells):
        return None
    multiplies = {(m.rows, m.inner, m.cols): m for m in stage.multiplies_on(rank)}
    requests = [(multiplies[(c.rows, c.inner[0], c.cols)], c.rows) for c in cells]
    return requests if one_gemm_over(requests, tuple((0, d) for d in plan.c.shape)) else None


def _summed_in_place(plan: Plan, rank: int, a, b, chunk_bytes: int, sync: Sync):
    """Staged ``plan``'s whole C on this rank where :func:`sums_in_place`: the GEMM's buffer
    becomes the result (:func:`.gather.reduce_and_gather_in_place`), no partial is held beside
    it. None elsewhere."""
    itemsize = np.dtype(dtypes.accumulation_dtype(a.dtype)).itemsize
    requests = sums_in_place(plan, rank, sync, itemsize)
    if requests is None:
        return None
    whole_c = tuple((0, d) for d in plan.c.shape)
    whole = _merged_gemm(plan.gather_stage, rank, a, b, requests, whole_c, {})
    return gather.reduce_and_gather_in_place(plan, rank, whole, chunk_bytes, sync)


def product(plan: Plan, rank: int, a, b, m, rows, remote: dict, after=None):
    """``A[rows, m.inner] @ B[m.inner, m.cols]`` for a range ``rows`` within ``m.rows``.

    Local pieces are cut from ``a``/``b``; others come from ``remote``, keyed
    ``(matrix, rows, cols)``. The product is in the accumulation dtype.
    ``after``: a value the GEMM must wait for (a chunk's ticket), or None.
    """
    a_piece = _a_piece(plan, rank, a, m, rows, remote)
    return _dot(a_piece, _b_piece(plan, rank, b, m, remote), after)


def _a_piece(plan: Plan, rank: int, a, m, rows, remote: dict):
    """``A[rows, m.inner]``: cut from this rank's block, or from the fetched piece."""
    if m.a_source == rank:
        return _local_piece(a, plan.a, rank, rows, m.inner)
    return remote[("A", m.rows, m.inner)][rows[0] - m.rows[0] : rows[1] - m.rows[0]]


def _b_piece(plan: Plan, rank: int, b, m, remote: dict):
    """``B[m.inner, m.cols]``: cut from this rank's block, or the fetched piece."""
    if m.b_source == rank:
        return _local_piece(b, plan.b, rank, m.inner, m.cols)
    return remote[("B", m.inner, m.cols)]


def _dot(a_piece, b_piece, after=None):
    """``a_piece @ b_piece`` in the accumulation dtype, after ``after`` (or None)."""
    if after is not None:
        # A data dependency XLA cannot drop (it removes optimization barriers without a
        # trace on CPU): the ticket is never negative, so this selects a_piece unchanged.
        a_piece = jnp.where(after < 0, jnp.zeros((), a_piece.dtype), a_piece)
    acc = dtypes.accumulation_dtype(a_piece.dtype)
    if a_piece.dtype == acc:
        return jnp.dot(a_piece, b_piece, preferred_element_type=acc)
    # XLA's CPU runtime fails some 16-bit dots with a float32 result ("Unsupported element
    # type for DotThunk::Execute: BF16 x BF16 = F32", jaxlib 0.10, depending on how a small
    # dot is fused), on some ranks only, leaving the others waiting. Widening first is exact
    # and computes the same sums, in float32 as the CPU does anyway. Chosen by the platform
    # the product is compiled for (not JAX's default backend: a GPU job may compute on CPU).
    return jax.lax.platform_dependent(
        a_piece,
        b_piece,
        cpu=lambda x, y: jnp.dot(x.astype(acc), y.astype(acc), preferred_element_type=acc),
        default=lambda x, y: jnp.dot(x, y, preferred_element_type=acc),
    )


def products(plan: Plan, rank: int, a, b, requests, remote: dict, after=None, apart=False) -> list:
    """``[product(plan, rank, a, b, m, rows, remote, after) for m, rows in requests]``, with the
    GEMMs merged where that is exact and cheaper; ``apart``: never a GEMM over this rank's own
    pieces and fetched ones together (the fetch runs ahead,
    :func:`~osmm_jax._src.planning.records.gemm_groups`).

    Requests over the same inner range whose ``rows x m.cols`` rectangles tile one larger
    rectangle are computed as ONE GEMM over that rectangle, which is then sliced. One large
    GEMM runs faster than several thin ones, and cutting an operand along its strided
    dimension copies it: the weight gradient of a data-parallel layer, ``A = x.T`` split by
    C's owners, became several copies of the batch and as many thin GEMMs, 2.5x the time of
    one GEMM (6144 x 1024 x 256, float32, one core). When every piece is local, the merged
    GEMM's operands are cut from this rank's blocks; otherwise (fetched pieces) they are
    joined first: the A pieces of the rectangle's row ranges one above the other, the B
    pieces of its column ranges side by side. Joining copies A and B once, which costs less
    than the separate GEMMs: a sequence-parallel layer's own rows and the rows it fetched
    (1536 + 1536 + 3072 rows x 256 @ 256 x 257, float32, one core) take 8.6 ms as three
    GEMMs and 5.2 ms joined, against 4.7 ms for one GEMM on rows already together. Every
    element is still one dot product over the same inner range (a GEMM of another shape may
    round differently in the last bits).
    """
    results: list = [None] * len(requests)
    for members, union in gemm_groups(requests, rank if apart else None):
        if union is None:
            (i,) = members
            m, rows = requests[i]
            results[i] = product(plan, rank, a, b, m, rows, remote, after)
            continue
        (r0, _), (c0, _) = union
        block = _merged_gemm(plan, rank, a, b, [requests[i] for i in members], union, remote, after)
        for i in members:
            m, rows = requests[i]
            results[i] = block[rows[0] - r0 : rows[1] - r0, m.cols[0] - c0 : m.cols[1] - c0]
    return results


def _merged_gemm(plan: Plan, rank: int, a, b, requests, union, remote: dict, after=None):
    """The product over ``union``, the rectangle that ``requests`` (over one inner range) tile."""
    first = requests[0][0]
    if all(m.a_source == m.b_source == rank for m, _ in requests):
        whole = dataclasses.replace(first, rows=union[0], cols=union[1])
        return product(plan, rank, a, b, whole, union[0], remote, after)
    by_rows = {rows: m for m, rows in requests}
    by_cols = {m.cols: m for m, _ in requests}
    a_joined = jnp.concatenate(
        [_a_piece(plan, rank, a, by_rows[r], r, remote) for r in sorted(by_rows)]
    )
    b_joined = jnp.concatenate(
        [_b_piece(plan, rank, b, by_cols[c], remote) for c in sorted(by_cols)], axis=1
    )
    return _dot(a_joined, b_joined, after)


# -- this rank's GEMMs ---------------------------------------------------------------------


class _Operands(NamedTuple):
    """What this rank's GEMMs read: the plan, the rank, its blocks, the fetched pieces."""

    plan: Plan
    rank: int
    a: jax.Array
    b: jax.Array
    remote: dict  # the fetched pieces, {(matrix, rows, cols): array}
    multiplies: dict  # this rank's LocalMultiply by (rows, inner, cols)
    acc: np.dtype  # the accumulation dtype
    apart: int | None = None  # this rank when its fetch runs ahead (gemm_groups), else None
    lone: frozenset = frozenset()  # fetched pieces that are a whole buffer (fetch.lone_pieces)


def _operands(
    plan: Plan, rank: int, a, b, sync: Sync, fetched=None, ahead=False, lone=frozenset()
) -> _Operands:
    """This rank's operands, after getting the remote pieces (if the plan has any and
    ``fetched`` does not hold them already; ``ahead``, ``lone``: as for :func:`forward`)."""
    acc = dtypes.accumulation_dtype(a.dtype)
    remote = {}
    if plan.has_gets:
        if fetched is None:
            ahead = fetch.runs_ahead(plan, rank, sync, a.dtype == acc)
            fetched = fetch.fetch_pieces(plan, rank, a, b, sync)
            lone = fetch.lone_pieces(plan, rank, sync.mode)
        remote = fetch.cut_to_multiplies(plan, rank, fetched)
    multiplies = {(m.rows, m.inner, m.cols): m for m in plan.multiplies_on(rank)}
    apart = rank if plan.has_gets and ahead else None
    return _Operands(plan, rank, a, b, remote, multiplies, acc, apart, lone)


def _partials(operands: _Operands, pieces, after=None) -> list:
    """The partial of each ``(cell, rows)`` piece over its rows: its GEMMs over every inner
    range, summed; GEMMs merged across pieces where :func:`products` can, and a piece whose
    inner ranges none of them shares with another piece joined into one GEMM over all of
    them (:func:`_joined_over_inner`)."""
    plan, rank, a, b, remote = operands[:5]
    requests, owners = _requests(operands, pieces)
    sums = _joined_over_inner(operands, len(pieces), requests, owners, after)
    rest = [i for i, owner in enumerate(owners) if sums[owner] is None]
    later = _own_after_fetched(operands, requests, owners, rest)
    apart = operands.apart is not None
    first = [i for i in rest if i not in later]
    parts = dict(
        zip(first, products(plan, rank, a, b, [requests[i] for i in first], remote, after, apart))
    )
    if later:  # after a GEMM on fetched pieces of a piece they belong to
        waited = {owners[i] for i in later}
        ticket = _ticket_of(parts[next(i for i in first if owners[i] in waited)], after)
        later_parts = products(plan, rank, a, b, [requests[i] for i in later], remote, ticket)
        parts.update(zip(later, later_parts))
    for i in rest:  # summed in request order, whichever GEMM ran first
        index = owners[i]
        sums[index] = parts[i] if sums[index] is None else sums[index] + parts[i]
    return sums


def _own_after_fetched(operands: _Operands, requests, owners, rest) -> list:
    """The requests among ``rest`` that read only this rank's own blocks, in pieces summed from
    GEMMs on whole operands (:func:`~.fetch.reads_whole`) that also read fetched pieces; none
    when the fetch runs ahead (the own GEMMs are then meant to run while it completes). XLA
    would run them first, needing nothing fetched: a 2x2 grid's rank that multiplies its own
    two blocks and the two fetched pieces then held that partial while the GEMM on the pieces
    wrote its own, a C block more (36 MiB at 6144³ on 4 ranks). Run after it, the second
    partial takes the place of a fetched piece, dead by then."""
    if operands.apart is not None:
        return []
    rank = operands.rank
    by_piece: dict[int, list[int]] = {}
    for i in rest:
        by_piece.setdefault(owners[i], []).append(i)
    later = []
    for members in by_piece.values():
        own = [i for i in members if reads_own(requests[i][0], rank)]
        if _read_whole(operands, requests, members) and own and len(own) < len(members):
            later += own
    return later


def _read_whole(operands: _Operands, requests, members) -> bool:
    """Whether each of ``members`` spans its rows and reads whole (:func:`~.fetch.reads_whole`)."""
    return all(
        requests[i][1] == requests[i][0].rows
        and fetch.reads_whole(operands.plan, operands.rank, requests[i][0], operands.lone)
        for i in members
    )


def _ticket_of(part, after):
    """A never-negative int32 scalar that depends on ``part`` (and on ``after``, a ticket or
    None), which XLA cannot fold: GEMMs given it (:func:`_dot`) run after ``part`` is formed."""
    if part.size == 0:
        return after
    ticket = jnp.isnan(part.reshape(-1)[0]).astype(jnp.int32)
    return ticket if after is None else jnp.maximum(ticket, after.astype(jnp.int32))


def _joined_over_inner(operands: _Operands, npieces: int, requests, owners, after=None) -> list:
    """Per piece (of ``npieces``; ``owners`` gives each request's), its whole partial as ONE
    GEMM where its inner ranges follow one another and none of its GEMMs would merge with
    another piece's (:func:`products`): its A pieces set side by side, its B pieces one above
    the other. None for every other piece.

    A K-split's partial is otherwise one GEMM per inner range, summed: each cuts A along its
    strided dimension (a copy) and the sums add passes over C. The weight gradient of a
    sequence-parallel row layer, ``x.T @ dY`` with ``dY`` gathered by sequences, took 68 ms
    that way and takes 34 ms joined, the gather included (512 x 6144 x 256 per rank, 2 ranks
    on their own cores; the same GEMM with nothing to gather: 24 ms). Every element is still
    one dot product over the same inner ranges (a GEMM of another shape may round differently
    in the last bits).

    Not where every GEMM of the piece reads its operands whole (:func:`~.fetch.reads_whole`: a 2-D
    grid's C block, from this rank's blocks and pieces fetched in buffers of their own).
    Joining would copy both operands, as large as the rank's blocks and the fetched pieces
    together (144 MiB beside 108 MiB of blocks on a 2x2 grid of 6144² float32), where the
    separate GEMMs copy nothing and add one C-sized sum (benchmarks/results/memory.md).
    """
    plan, rank, a, b, remote = operands[:5]
    groups = gemm_groups(requests, operands.apart)
    merged = {i for members, union in groups if union is not None for i in members}
    by_piece: dict[int, list[int]] = {}
    for i, owner in enumerate(owners):
        by_piece.setdefault(owner, []).append(i)
    sums = [None] * npieces
    for owner, members in by_piece.items():
        if len(members) < 2 or any(i in merged for i in members):
            continue
        if len({reads_own(requests[i][0], operands.apart) for i in members}) > 1:
            continue
        if _read_whole(operands, requests, members):
            continue
        members = sorted(members, key=lambda i: requests[i][0].inner)
        inners = [requests[i][0].inner for i in members]
        if any(prev[1] != nxt[0] for prev, nxt in zip(inners, inners[1:])):
            continue
        a_joined = jnp.concatenate(
            [_a_piece(plan, rank, a, *requests[i], remote) for i in members], axis=1
        )
        b_joined = jnp.concatenate(
            [_b_piece(plan, rank, b, requests[i][0], remote) for i in members]
        )
        sums[owner] = _dot(a_joined, b_joined, after)
    return sums


def _whole_block(operands: _Operands, pieces):
    """This rank's whole C block as one GEMM, when ``pieces`` tile it over one inner range
    (e.g. its own rows and the rows it fetched, by its B block); None otherwise. Returned as
    it is, the block is neither sliced into the pieces nor added into a zero block again."""
    requests, owners = _requests(operands, pieces)
    if not requests or len(set(owners)) != len(owners):
        return None  # nothing, or a piece summed over several inner ranges
    block = tuple(operands.plan.c.blocks[operands.rank])
    if not one_gemm_over(requests, block, operands.apart):
        return None
    plan, rank, a, b, remote = operands[:5]
    return _merged_gemm(plan, rank, a, b, requests, block, remote)


def _requests(operands: _Operands, pieces) -> tuple[list, list]:
    """The GEMM requests ``(multiply, rows)`` of ``pieces``, and the piece each belongs to."""
    requests, owners = [], []
    for index, (cell, rows) in enumerate(pieces):
        for inner in cell.inner:
            requests.append((operands.multiplies[(cell.rows, inner, cell.cols)], rows))
            owners.append(index)
    return requests, owners


def _gemm_count(operands: _Operands, pieces) -> int:
    return len(gemm_groups(_requests(operands, pieces)[0], operands.apart))


def _add_local(operands: _Operands, local, rows, cols, part):
    """``local`` (this rank's C block) with ``part``, the global rectangle ``rows x cols``, added."""
    c_shape = operands.plan.c.local_shape(operands.rank)
    (cr0, _), (cc0, _) = operands.plan.c.blocks[operands.rank]
    if (rows[1] - rows[0], cols[1] - cols[0]) == c_shape:
        return local + part
    return local.at[rows[0] - cr0 : rows[1] - cr0, cols[0] - cc0 : cols[1] - cc0].add(part)


def _local_piece(x, layout, rank, rows, cols):
    """The global rectangle ``rows x cols`` of a matrix, cut from ``rank``'s local block ``x``."""
    (r0, _), (c0, _) = layout.blocks[rank]
    return x[rows[0] - r0 : rows[1] - r0, cols[0] - c0 : cols[1] - c0]


# -- cells and chunks ------------------------------------------------------------------------


class _Cell(NamedTuple):
    """One C rectangle this rank sums a partial for, and where that partial goes."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    inner: tuple  # the inner ranges summed
    deliveries: tuple  # Transfers to other ranks
    local: bool  # also added to this rank's own C block


def _cells(plan: Plan, rank: int) -> list[_Cell]:
    """The partials this rank forms: delivered ones first (in the plan's rotated order), then
    the purely local ones. A partial of a replicated C goes to several places at once."""
    order, deliveries, local = [], {}, set()
    for t in plan.deliveries_from(rank):
        key = (t.rows, t.cols, t.inner)
        if key not in deliveries:
            order.append(key)
            deliveries[key] = []
        deliveries[key].append(t)
    for u in plan.local_updates_on(rank):
        key = (u.rows, u.cols, u.inner)
        local.add(key)
        if key not in deliveries:
            order.append(key)
    return [_Cell(*key, tuple(deliveries.get(key, ())), key in local) for key in order]


def _chunks(cells: list[_Cell], itemsize: int, chunk_bytes: int) -> list[list]:
    """Group the delivered cells' rows into chunks of about ``chunk_bytes`` of partials.

    Returns a list of chunks, each a list of ``(cell, rows)`` pieces. A cell's rows are cut
    into pieces of at least ``chunk_bytes``; small cells share a chunk until it holds
    ``chunk_bytes``. ``chunk_bytes == 0``: one chunk with every delivered cell, uncut.

    A cell this rank also keeps (a replicated C summed directly: a data-parallel weight
    gradient on two ranks) is never cut: while its first rows left, the rest of the same GEMM
    would be all there is to compute, and the GEMM cut by rows cost more than the overlap
    saved (a 2-layer MLP step on 2 ranks: 302 ms cut into 4 MiB chunks, 260 ms whole).
    """
    delivered = [c for c in cells if c.deliveries]
    if chunk_bytes == 0:
        return [[(c, c.rows) for c in delivered]]
    chunks, current, current_bytes = [], [], 0
    for cell in delivered:
        row_bytes = (cell.cols[1] - cell.cols[0]) * itemsize
        whole = cell.rows[1] - cell.rows[0]
        step = max(1, whole if cell.local else -(-chunk_bytes // max(1, row_bytes)))
        for r0 in range(cell.rows[0], cell.rows[1], step):
            rows = (r0, min(r0 + step, cell.rows[1]))
            current.append((cell, rows))
            current_bytes += (rows[1] - rows[0]) * row_bytes
            if current_bytes >= chunk_bytes:
                chunks.append(current)
                current, current_bytes = [], 0
    if current or not chunks:
        chunks.append(current)
    return chunks


# -- data movement ---------------------------------------------------------------------------


def _deliver(operands: _Operands, cells: list[_Cell], local, chunk_bytes: int, own: list, sync):
    """Compute the delivered partials chunk by chunk and start sending each chunk.

    ``own``: the ``(cell, rows)`` pieces this rank keeps and sends nowhere. They are computed
    after the last chunk has been handed over, while it is sent; but with a single chunk, when
    :func:`products` can then merge their GEMMs with the delivered ones, together with it
    (a data-parallel weight gradient: one GEMM instead of one per rank, 2x faster).

    Returns ``(local, buffers, ticket, own)``: this rank's C block with the partials computed
    here that it keeps added, every chunk's buffer (for ``reduce_finish``), the ticket the
    remaining GEMMs must wait for (None when there is a single chunk), and the pieces of
    ``own`` still to compute. A deferred product (``sync.defer`` in the notified mode, one
    chunk) computes ``own`` first and returns its finished block as ``local`` and no buffers:
    its finish is :func:`primitives.reduce_deferred`'s.
    """
    plan, acc = operands.plan, operands.acc
    chunks = _chunks(cells, acc.itemsize, chunk_bytes)
    # A single chunk has nothing to overlap with but the local GEMMs, which costs more in
    # handing work to the issuer thread than it saves: send it from this thread.
    overlap = len(chunks) > 1
    transfers, sizes = _chunk_records(plan, chunks)
    ticket, buffers = None, []
    # Without overlap, the pieces this rank keeps are computed with the chunk when that
    # merges GEMMs; otherwise after the chunk has left, while it is on its way.
    merge = not overlap and _gemm_count(operands, chunks[0] + own) < (
        _gemm_count(operands, chunks[0]) + _gemm_count(operands, own)
    )
    kept = own if merge else []  # merge implies a single chunk
    notify, window_bytes = (), plan.receive_elements * acc.itemsize
    if sync.mode == "notify" and plan.nranks > 1:
        notify = slots.notify_attribute(plan, operands.rank, acc.itemsize, sync)
        window_bytes = (1 + notify[0]) * notify[1]  # the accumulator and S slots
    ids = slots.reduce_call_parts(plan, acc, chunk_bytes, sync, notify)
    if sync.defer and notify and not overlap:
        # Every piece this rank keeps is computed before the partials leave: the waiter sums
        # the whole block. Ranks decide alone (the same protocol either way), so the call id
        # does not say.
        local, buffer = _chunk_partials(operands, chunks[0], local, None, own)
        finished = primitives.reduce_deferred(
            buffer,
            local,
            comm=plan.comm_key,
            call_id=primitives.call_id(*ids),
            window_bytes=window_bytes,
            transfers=transfers[0],
            notify=notify,
        )
        return finished, [], None, []
    for index, pieces in enumerate(chunks):
        local, buffer = _chunk_partials(operands, pieces, local, ticket, kept)
        buffers.append(buffer)
        if index == 0:
            ticket = primitives.reduce_start(
                buffer,
                comm=plan.comm_key,
                call_id=primitives.call_id(*ids),
                window_bytes=window_bytes,
                local_elements=int(np.prod(plan.c.local_shape(operands.rank))),
                overlap=overlap,
                transfers=transfers,
                chunk_sizes=sizes,
                notify=notify,
            )
        else:
            ticket = primitives.reduce_issue(buffer, comm=plan.comm_key, index=index)
    return local, buffers, ticket if overlap else None, [] if merge else own


def _chunk_partials(operands: _Operands, pieces: list, local, after, kept=()):
    """One chunk's partials, flattened into one buffer (empty if none), after ``after``.

    Returns ``(local, buffer)``: pieces of cells this rank also keeps, and the ``kept``
    pieces (computed here, sent nowhere), are added to ``local``.
    """
    kept = list(kept)
    parts = _partials(operands, pieces + kept, after)
    for (cell, rows), part in zip(kept, parts[len(pieces) :]):
        local = _add_local(operands, local, rows, cell.cols, part)
    flat = []
    for (cell, rows), part in zip(pieces, parts):
        if cell.local:
            local = _add_local(operands, local, rows, cell.cols, part)
        flat.append(part.reshape(-1))
    if not flat:
        return local, jnp.zeros((0,), operands.acc)
    return local, jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def _chunk_records(plan: Plan, chunks: list[list]) -> tuple[list[list[int]], list[int]]:
    """Each chunk's transfer records (offsets within the chunk) and its size in elements."""
    transfers, sizes = [], []
    for pieces in chunks:
        records, offset = [], 0
        for cell, rows in pieces:
            for t in cell.deliveries:
                records += native.transfer_record(
                    native.OP_CODES[t.op], t.target, rows, t.cols, plan.c.blocks[t.target], offset
                )
            offset += (rows[1] - rows[0]) * (cell.cols[1] - cell.cols[0])
        transfers.append(records)
        sizes.append(offset)
    return transfers, sizes
