"""The A and B pieces a rank's multiplies need from other ranks, in the product's synchronisation.

Every rank of a plan that gets anything (``plan.has_gets``) calls :func:`fetch_pieces` (or
:func:`fetch_buffer`) at the same point; only a backward product may leave out the pieces
another product fetched, or skip a round on every rank (:mod:`.backward`). The pieces this
rank gets (:meth:`~osmm_jax._src.planning.plan.Plan.gets_by`) come back keyed ``(matrix,
rows, cols)``, each as the planner asked for it (adjacent pieces from one owner joined into
one):

- fence mode: this rank reads them (``MPI_Get`` in one fence epoch of the owners' exposed
  blocks, ``osmm_fetch``);
- notified mode: their owners push them, through the notified reduce (``osmm_reduce_*`` with
  slots and notifications, as the staged plan's all-gather does, :mod:`.gather`): each owner
  sends, into its slot at every rank that gets from it, the pieces that rank needs, one after
  another from where the getter's buffer holds that owner's pieces (the getter's "base" for
  it, which the native layer passes on to the owner the first time the product runs, so that
  neither side reads the other's part of the plan); each rank waits for exactly its owners'
  notifications. No fence, no get: over a network a fence epoch of gets costs several
  milliseconds whatever its size, a notified round a fraction of that
  (benchmarks/results/sync_latency.md). The round runs in placement (xla_ffi/protocols/
  notify.h): an owner's pieces land at the start of its slot, a slot holds the most one owner
  sends one getter (not the whole fetched buffer), and the getter copies each slot to where
  its owner's pieces start, over a "partial" of zeros (a ``-0.0`` arrives as ``0.0``); 16-bit
  pieces travel as float32 (exactly) and are cast back. An owner whose pieces are whole rows
  of its float32 or float64 blocks sends them from the blocks themselves; otherwise it packs
  them into one buffer first.

  Ahead (:func:`~osmm_jax._src.runtime.slots.fetches_ahead`, ``OSMM_FETCH_AHEAD``), a rank
  whose pieces leave from one buffer hands the round's finish to a native waiter thread
  (``osmm_reduce_start_deferred``, xla_ffi/protocols/deferred.h): the fetched buffer is an
  asynchronous result, so the GEMMs on this rank's own pieces run while it arrives, as in a
  collective matmul. The waiter holds a copy of the fetched buffer (and, with RMA, of the
  buffer the pieces leave from) until the result is collected.

  A rank hears only from the ranks it gets pieces from and sends only to those that get pieces
  from it: its notifications, slots and window bytes grow with its peers, not with the rank
  count. A rank whose program stops inside the fetch leaves the ranks that do not get from it
  free to go on into the product's reduce, or further; its next call sends every rank the
  abandonment notice, every rank fails one product for it and all start again together at
  their next one (xla_ffi/notified/notify.h, README "Failure behaviour").

The pieces come back in one flat buffer per *round* (:func:`~.slots.fetch_rounds`): one round
of every piece, except in the notified mode when the plan fetches pieces of both A and B (a
2-D grid), which runs a round for A's pieces, then one for B's. The rounds cost one more
notification but keep two things out of the product's peak: every round touches only the
slots of its own owners (the 2x2 grid's rank gets A from one owner and B from another: one
slot resident instead of two), and each matrix's pieces arrive in a buffer of their own,
which a GEMM reads whole (:func:`reads_whole`), where cutting a piece out of a shared buffer
is a copy (:mod:`.one_sided`). A round's buffer holds its pieces row-major, one after
another, by owner in ascending rank order and, from one owner, in the order of
:func:`_piece_key`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.records import rectangle_within
from osmm_jax._src.runtime import native, primitives, slots
from osmm_jax._src.runtime.slots import Sync

_REGIONS = {"A": native.REGION_A, "B": native.REGION_B}  # which region of the window a get reads


BOTH = ("A", "B")


def fetch_pieces(plan: Plan, rank: int, a, b, sync: Sync) -> dict:
    """Every A and B piece ``rank`` gets from other ranks, ``{(matrix, rows, cols): array}``
    (global intervals), in the input dtype; ``a`` and ``b`` are this rank's blocks."""
    return pieces_in(plan, rank, fetch_buffer(plan, rank, a, b, sync), sync.mode)


def fetch_buffer(
    plan: Plan, rank: int, a, b, sync: Sync, taken=None, skipped=frozenset(), part="part"
) -> tuple:
    """The fetched buffers of ``rank``, one per round (:func:`rounds`: every piece it gets of
    the round's matrices, laid out as the module docstring says), flat, in the input dtype;
    :func:`pieces_in` cuts them into the pieces.

    ``taken``: None, or the pieces (gets of ``plan``) that another product's fetch brings
    their getters, which this one leaves out on both sides (:mod:`.backward`); a set on every
    rank, maybe empty on some, since the call id says whether it is given; ``part`` names, in
    the call id, which other fetch takes them (a product may leave out different sets).
    ``skipped``: the matrices whose round runs on no rank (every rank's gets of them are
    taken)."""
    part = None if taken is None else part
    buffers = []
    for matrices in rounds(plan, sync.mode, skipped):
        where, total = _layout(plan, rank, taken, matrices)
        if sync.mode == "notify":
            buffers.append(_pushed_by_owners(plan, rank, a, b, total, sync, taken, matrices, part))
        else:
            buffers.append(_got_from_owners(plan, rank, a, b, where, total, taken, part))
    return tuple(buffers)


def pieces_in(
    plan: Plan, rank: int, fetched: tuple, mode: str, taken=None, skipped=frozenset()
) -> dict:
    """The pieces of ``rank``'s fetched buffers ``fetched`` (:func:`fetch_buffer` in
    synchronisation ``mode``, with the same ``taken`` and ``skipped``), ``{(matrix, rows,
    cols): array}``. A piece alone in its buffer is the buffer itself, reshaped (no copy)."""
    pieces = {}
    for buffer, matrices in zip(fetched, rounds(plan, mode, skipped), strict=True):
        shapes, _ = _layout(plan, rank, taken, matrices)
        for (_, matrix, rows, cols), offset in shapes.items():
            piece = buffer[offset : offset + _area(rows, cols)]
            pieces[(matrix, rows, cols)] = piece.reshape(rows[1] - rows[0], cols[1] - cols[0])
    return pieces


def lone_pieces(plan: Plan, rank: int, mode: str, taken=None, skipped=frozenset()) -> frozenset:
    """The pieces ``(matrix, rows, cols)`` that ``rank`` gets alone in their round's buffer
    (:func:`pieces_in` returns the buffer itself for them: a GEMM reads them without a copy)."""
    lone = set()
    for matrices in rounds(plan, mode, skipped):
        shapes, _ = _layout(plan, rank, taken, matrices)
        if len(shapes) == 1:
            ((_, *key),) = shapes
            lone.add(tuple(key))
    return frozenset(lone)


def rounds(plan: Plan, mode: str, skipped=frozenset()) -> tuple[tuple[str, ...], ...]:
    """The matrices of each round ``plan``'s fetch runs (:func:`~.slots.fetch_rounds`), less
    the rounds all of whose matrices are in ``skipped`` (none of their pieces moves on any
    rank: another product's fetch brought them all, :mod:`.backward`)."""
    return tuple(
        matrices
        for matrices in slots.fetch_rounds(plan, mode)
        if not all(m in skipped for m in matrices)
    )


def _piece_key(t):
    """The order of the pieces one owner sends one getter: the same on both sides."""
    return (t.matrix, t.rows, t.cols)


def moved(plan: Plan, rank: int, taken=None, matrices=BOTH) -> tuple[tuple, tuple]:
    """``(gets, served)``: the pieces of ``matrices`` that ``rank`` gets and those it serves
    in ``plan``'s fetch, less those in ``taken`` (see :func:`fetch_buffer`)."""
    mine = plan.for_rank(rank)
    if not taken and matrices == BOTH:
        return mine.gets, mine.served
    taken = taken or ()
    return (
        tuple(t for t in mine.gets if t not in taken and t.matrix in matrices),
        tuple(t for t in mine.served if t not in taken and t.matrix in matrices),
    )


def _call_id(plan: Plan, *ids, part=None):
    """The fetch's call id: one that leaves pieces out says which (another signature)."""
    return primitives.call_id(plan.fingerprint, "fetch", *ids, *(() if part is None else [part]))


def _layout(plan: Plan, rank: int, taken=None, matrices=BOTH) -> tuple[dict, int]:
    """Where each get of ``matrices`` by ``rank`` lands in its round's fetched buffer:
    ``{(owner, matrix, rows, cols): element offset}``, and the buffer's length in elements."""
    where, offset = {}, 0
    gets = moved(plan, rank, taken, matrices)[0]
    for t in sorted(gets, key=lambda t: (t.target, _piece_key(t))):
        where[(t.target, t.matrix, t.rows, t.cols)] = offset
        offset += t.elements
    return where, offset


def _area(rows, cols) -> int:
    return (rows[1] - rows[0]) * (cols[1] - cols[0])


def _got_from_owners(plan: Plan, rank: int, a, b, where: dict, total: int, taken, part):
    """Fence mode: MPI_Get of every piece from its owner's exposed block (``osmm_fetch``) to
    its place ``where`` (:func:`_layout`)."""
    itemsize = np.dtype(a.dtype).itemsize
    a_elems, b_elems = plan.expose_elements
    b_offset = native.aligned(a_elems * itemsize)
    records = []
    for t in moved(plan, rank, taken)[0]:
        layout = plan.a if t.matrix == "A" else plan.b
        at = where[(t.target, t.matrix, t.rows, t.cols)]
        records += native.transfer_record(
            _REGIONS[t.matrix], t.target, t.rows, t.cols, layout.blocks[t.target], at
        )
    expose_a, expose_b = plan.exposes(rank)
    return primitives.fetch(
        a,
        b,
        comm=plan.comm_key,
        call_id=_call_id(plan, str(a.dtype), part=part),
        window_bytes=b_offset + b_elems * itemsize,
        b_offset=b_offset,
        expose_a=expose_a,
        expose_b=expose_b,
        gets=records,
        fetched_elements=total,
    )


def _pushed_by_owners(plan: Plan, rank: int, a, b, total: int, sync: Sync, taken, matrices, part):
    """Notified mode, one round (``matrices``): this rank sends every rank that gets from it
    its pieces, and receives its own from their owners (see the module docstring)."""
    acc = dtypes.accumulation_dtype(a.dtype)
    itemsize = np.dtype(acc).itemsize
    gets, served = moved(plan, rank, taken, matrices)
    getters = sorted({t.origin for t in served})
    where, _ = _layout(plan, rank, taken, matrices)
    starts = {}  # where each owner's pieces start in this rank's buffer (laid out by owner)
    for (owner, *_), offset in where.items():
        starts.setdefault(owner, offset)
    owners = sorted(starts)
    direct = not packs_pieces(plan, rank, a.dtype == acc, taken, matrices)
    chunks, transfers = _sources(plan, rank, a, b, acc, served, getters, direct)
    bases = [starts.get(owner, 0) * itemsize for owner in owners]
    sizes = {}
    for t in gets:
        sizes[t.target] = sizes.get(t.target, 0) + t.elements
    extents = [sizes.get(owner, 0) * itemsize for owner in owners]
    notify = slots.fetch_attribute(plan, itemsize, sync, owners, getters, bases, extents)
    # The input dtype decides whether this rank packs its pieces (its signature): every rank
    # must meet a new signature at the same call, so the call id says which dtype it is.
    call_id = _call_id(plan, str(a.dtype), str(acc), sync.mode, notify[:3], *matrices, part=part)
    local = jnp.zeros((total,), acc)
    if runs_ahead(plan, rank, sync, a.dtype == acc, taken):
        # Ahead: the finish is a waiter's, and only what reads the pieces waits for it. The
        # same protocol and signature, so ranks decide alone.
        summed = primitives.reduce_deferred(
            chunks[0],
            local,
            comm=plan.comm_key,
            call_id=call_id,
            window_bytes=(1 + notify[0]) * notify[1],
            transfers=transfers[0],
            notify=notify,
        )
    else:
        summed = primitives.notified_round(
            chunks, transfers, local, comm=plan.comm_key, call_id=call_id, notify=notify
        )
    return summed.astype(a.dtype)


def _sources(plan: Plan, rank: int, a, b, acc, served, getters, direct) -> tuple[list, list]:
    """The buffers this rank sends its pieces from and each one's transfer records: every
    getter's pieces land one after another from the start of its slot, in
    :func:`_piece_key` order. ``direct`` (not :func:`packs_pieces`): the pieces are sent
    straight from the block that holds them (a chunk for A, one for B: no packed copy to
    hold); otherwise every piece is packed, cast, into one buffer."""
    blocks = {"A": a, "B": b}
    matrices = sorted({t.matrix for t in served}) if direct else ["packed"]
    records = {m: [] for m in matrices}
    pieces, packed_at = [], 0
    for getter in getters:
        mine = sorted((t for t in served if t.origin == getter), key=_piece_key)
        width = sum(t.elements for t in mine)  # from the getter's base for this rank
        at = 0
        for t in mine:
            if direct:
                source, offset = t.matrix, _row_offset(plan, rank, t)
            else:
                source, offset = "packed", packed_at
                pieces.append(_cut(plan, rank, blocks[t.matrix], t).reshape(-1))
                packed_at += t.elements
            records[source] += native.transfer_record(
                native.OP_ACCUMULATE,
                getter,
                (0, 1),
                (at, at + t.elements),
                ((0, 1), (0, width)),
                offset,
            )
            at += t.elements
    if direct:
        chunks = [blocks[m].reshape(-1) for m in matrices]
    else:
        chunks = [jnp.concatenate(pieces).astype(acc) if pieces else jnp.zeros((0,), acc)]
    return (chunks or [jnp.zeros((0,), acc)]), ([records[m] for m in matrices] or [[]])


def runs_ahead(plan: Plan, rank: int, sync: Sync, in_accumulation_dtype: bool, taken=None) -> bool:
    """Whether ``rank``'s notified fetch of ``plan`` finishes on a waiter thread while the
    GEMMs on this rank's own pieces run: :func:`~.slots.fetches_ahead` allows it, the rank
    gets pieces (less ``taken``, as for :func:`fetch_buffer`), and the pieces it serves leave
    from one buffer (packed, or one block: a rank that sends pieces of both A and B from its
    blocks fetches in place). :mod:`.one_sided` keeps the GEMMs on own pieces apart from the
    others exactly where this holds, and the memory prediction counts the waiter's copies."""
    if not slots.fetches_ahead(plan, rank, sync):
        return False
    gets, served = moved(plan, rank, taken)
    if not gets:
        return False
    one_buffer = len({t.matrix for t in served}) < 2
    return one_buffer or packs_pieces(plan, rank, in_accumulation_dtype, taken)


def packs_pieces(
    plan: Plan, rank: int, in_accumulation_dtype: bool, taken=None, matrices=BOTH
) -> bool:
    """Whether ``rank`` packs the pieces of ``matrices`` it serves in the notified fetch of
    ``plan`` into one buffer (a copy it holds while they travel) rather than sending them from
    its blocks: when
    the inputs are not in the accumulation dtype (16-bit, cast to float32), a piece is not
    whole rows of its block, or the pieces of a block leave some of its rows unsent (a device
    stages a whole block in host memory to send from it: no more than the pieces, then).
    Whether it packs is part of the fetch's signature, which the call id must determine, so
    it depends on nothing a rank chooses alone. ``taken``: as for :func:`fetch_buffer`;
    ``matrices``: one round's (:func:`~.slots.fetch_rounds`), or both."""
    served = moved(plan, rank, taken, matrices)[1]
    if not served:
        return False
    if not in_accumulation_dtype or not all(_whole_rows(plan, rank, t) for t in served):
        return True
    for matrix in {t.matrix for t in served}:
        (r0, r1), _ = _own_block(plan, rank, matrix)
        covered = r0  # the rows sent, as intervals in order, must leave no gap
        for start, stop in sorted(t.rows for t in served if t.matrix == matrix):
            if start > covered:
                return True
            covered = max(covered, stop)
        if covered < r1:
            return True
    return False


def _whole_rows(plan: Plan, rank: int, t) -> bool:
    """Whether served piece ``t`` spans every column of this rank's block (so its elements
    follow one another in the block)."""
    return tuple(t.cols) == tuple(_own_block(plan, rank, t.matrix)[1])


def _row_offset(plan: Plan, rank: int, t) -> int:
    """The element at which whole-row piece ``t`` starts in this rank's (flattened) block."""
    (r0, _), (c0, c1) = _own_block(plan, rank, t.matrix)
    return (t.rows[0] - r0) * (c1 - c0)


def _own_block(plan: Plan, rank: int, matrix: str):
    """``rank``'s block of ``matrix`` (``"A"`` or ``"B"``): global ``((r0, r1), (c0, c1))``."""
    return (plan.a if matrix == "A" else plan.b).blocks[rank]


def _cut(plan: Plan, rank: int, block, t):
    """The piece ``t.rows x t.cols`` (global) of ``rank``'s block of ``t.matrix``."""
    (r0, _), (c0, _) = _own_block(plan, rank, t.matrix)
    return block[t.rows[0] - r0 : t.rows[1] - r0, t.cols[0] - c0 : t.cols[1] - c0]


def reads_whole(plan: Plan, rank: int, m, lone: frozenset) -> bool:
    """Whether multiply ``m`` over its whole rows reads both operands without a copy: each is
    this rank's whole block of its matrix, or a fetched piece that is a whole buffer
    (``lone``, :func:`lone_pieces`)."""
    if m.a_source == rank:
        a_whole = (m.rows, m.inner) == tuple(plan.a.blocks[rank])
    else:
        a_whole = ("A", m.rows, m.inner) in lone
    if m.b_source == rank:
        return a_whole and (m.inner, m.cols) == tuple(plan.b.blocks[rank])
    return a_whole and ("B", m.inner, m.cols) in lone


def whole_cells(plan: Plan, rank: int, lone: frozenset) -> frozenset:
    """The C cells ``(rows, cols)`` of ``rank`` every one of whose multiplies reads its
    operands whole (:func:`reads_whole`): one_sided runs their GEMMs apart, without joining
    their operands, and the memory prediction counts no joined copies for them."""
    cells: dict[tuple, bool] = {}
    for m in plan.multiplies_on(rank):
        whole = reads_whole(plan, rank, m, lone)
        cells[(m.rows, m.cols)] = cells.get((m.rows, m.cols), True) and whole
    return frozenset(cell for cell, whole in cells.items() if whole)


def cut_to_multiplies(plan: Plan, rank: int, pieces: dict) -> dict:
    """``pieces`` (as fetched: the planner joins adjacent pieces from one owner into one get)
    keyed by the rectangles this rank's multiplies use: ``("A", rows, inner)`` and
    ``("B", inner, cols)``, each a slice of the fetched piece that holds it."""
    remote = {}
    for m in plan.multiplies_on(rank):
        if m.a_source != rank:
            remote[("A", m.rows, m.inner)] = _within(pieces, "A", m.rows, m.inner)
        if m.b_source != rank:
            remote[("B", m.inner, m.cols)] = _within(pieces, "B", m.inner, m.cols)
    return remote


def _within(pieces: dict, matrix: str, rows, cols):
    """The ``rows x cols`` rectangle of ``matrix`` cut from the fetched piece that holds it."""
    if (matrix, rows, cols) in pieces:
        return pieces[(matrix, rows, cols)]
    for (held, r, c), piece in pieces.items():
        if held == matrix and rectangle_within(rows, cols, r, c):
            return piece[rows[0] - r[0] : rows[1] - r[0], cols[0] - c[0] : cols[1] - c[0]]
    raise AssertionError(f"no fetched piece of {matrix} holds {rows} x {cols}")  # planner bug
