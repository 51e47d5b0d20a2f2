"""The all-gather of a staged plan: the whole replicated C on every rank from its blocks.

A staged plan (:attr:`~osmm_jax._src.planning.plan.Plan.gather_stage`, a replicated C summed as
"reduce-scatter, then all-gather") leaves each rank holding its block of an even row (or column)
split of C. :func:`gather_blocks` makes the whole C on every rank from those blocks, in the
synchronisation of the product:

- fence mode: every rank gets every other block from its owner (``MPI_Get`` in one fence epoch,
  ``osmm_fetch``);
- notified mode: every owner sends its block to every other rank through the notified reduce
  (``osmm_reduce_*`` with slots and notifications, no fence, no get): each rank's "partial" is
  the whole C with only its own block filled in, and its origins are the other owners. A row
  split's blocks are contiguous in C, so they are placed (xla_ffi/notified/notify.h): each
  lands at the start of a slot the size of the largest block and is copied to where it
  starts in C; a column split's are added over zeros in slots of the whole C. Either way
  every value arrives unchanged, in the same bits on every rank (a ``-0.0`` comes out as
  ``0.0``). The blocks travel in the accumulation dtype (float32 for 16-bit inputs, exactly),
  and the result is cast back.

Both move each block once to every other rank: ``(P - 1) / P`` of C in and out of each rank,
as the second half of a ring all-reduce does.

:func:`reduce_and_gather_in_place` runs both stages in one buffer where a rank's partial is one
GEMM over the whole C and the split is by rows (a data-parallel weight gradient, notified,
not deferred): its partial's rows for other ranks leave from that buffer, its own rows are
summed there (``osmm_reduce_finish``'s ``local_offset``) and the others' blocks are placed
over the rest, so XLA holds no partial beside the result: at 6144^3 on 4 ranks the gradient
holds 541 MiB where the separate partials held 649 (benchmarks/results/memory.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from osmm_jax._src import dtypes
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import native, primitives, slots
from osmm_jax._src.runtime.slots import Sync


def gather_blocks(plan: Plan, rank: int, block, sync: Sync):
    """The whole C of staged ``plan`` on this rank, from this rank's ``block`` of its even split
    (shape ``plan.gather_stage.c.local_shape(rank)``); every rank of the plan calls it."""
    if sync.mode == "notify":
        return _sent_by_owners(plan, rank, block, sync)
    return _got_from_owners(plan, rank, block)


def _got_from_owners(plan: Plan, rank: int, block):
    """Fence mode: get every other block from its owner (MPI_Get) and put them in place."""
    split = plan.gather_stage.c
    itemsize = np.dtype(block.dtype).itemsize
    largest = max(split.local_shape(r)[0] * split.local_shape(r)[1] for r in range(plan.nranks))
    window_bytes = native.aligned(largest * itemsize)
    records, where, offset = [], {}, 0
    for t in plan.gathers_by(rank):
        owner_block = split.blocks[t.target]
        records += native.transfer_record(
            native.REGION_A, t.target, t.rows, t.cols, owner_block, offset
        )
        where[t.target] = offset
        offset += t.elements
    fetched = primitives.fetch(
        block,
        jnp.zeros((0, 0), block.dtype),
        comm=plan.comm_key,
        call_id=primitives.call_id(plan.fingerprint, "gather", str(block.dtype)),
        window_bytes=window_bytes,
        b_offset=window_bytes,
        expose_a=block.size > 0,
        expose_b=False,
        gets=records,
        fetched_elements=offset,
    )
    pieces = []
    for owner in range(plan.nranks):
        shape = split.local_shape(owner)
        if owner == rank:
            pieces.append(block)
        elif shape[0] and shape[1]:
            start = where[owner]
            pieces.append(fetched[start : start + shape[0] * shape[1]].reshape(shape))
    return jnp.concatenate(pieces, axis=0 if split.kind == "rows" else 1)


def _sent_by_owners(plan: Plan, rank: int, block, sync: Sync, local=None):
    """Notified mode: this rank's block goes into a slot of every other rank's window, and the
    other owners' blocks arrive in this rank's slots (see the module docstring). ``local``:
    the whole C (accumulation dtype) with this rank's block in place and zeros elsewhere, to
    receive the others' blocks; None: made here from ``block``."""
    acc = dtypes.accumulation_dtype(block.dtype)
    spec = slots.gather_slots(plan, rank, np.dtype(acc).itemsize, sync)
    rows, cols = plan.gather_stage.c.blocks[rank]
    m, n = plan.c.shape
    placed = spec.notify[2] & 4  # records relative to this rank's block, placed by the target
    where = (rows, cols) if placed else ((0, m), (0, n))  # or to the whole replicated C
    records = []
    for target in spec.targets:
        records += native.transfer_record(native.OP_ACCUMULATE, target, rows, cols, where, 0)
    mine = block.astype(acc)
    buffer = mine.reshape(-1) if spec.targets else jnp.zeros((0,), acc)
    if local is None:
        local = jnp.zeros((m, n), acc).at[rows[0] : rows[1], cols[0] : cols[1]].set(mine)
    call_id = primitives.call_id(plan.fingerprint, "gather", str(acc), sync.mode, spec.notify[:3])
    summed = primitives.notified_round(
        [buffer], [records], local, comm=plan.comm_key, call_id=call_id, notify=spec.notify
    )
    return summed.astype(block.dtype)


def places_rows(plan: Plan, rank: int, itemsize: int, sync: Sync) -> bool:
    """Whether staged ``plan``'s notified all-gather on ``rank`` places whole row blocks (a
    row split): each arrives whole and lands over zeros in its rows, so that the result can be
    any buffer whose other rows are zeroed first (:func:`reduce_and_gather_in_place`). ``itemsize``: of the
    accumulation dtype."""
    if sync.mode != "notify" or plan.gather_stage.c.kind != "rows":
        return False
    return bool(slots.gather_slots(plan, rank, itemsize, sync).notify[2] & 4)


def reduce_and_gather_in_place(plan: Plan, rank: int, whole, chunk_bytes: int, sync: Sync):
    """The whole C of staged ``plan`` on this rank, from ``whole`` (M x N, the accumulation
    dtype), this rank's partial of the whole C, where ``one_sided.sums_in_place``: the other
    ranks' rows of it leave from it to their owners, this rank's rows are summed there (the
    same sum, bit for bit, as from a block of its own), and the other blocks are placed over
    the rest, zeroed where it lies; only the copy of this rank's rows that it sends is made."""
    stage = plan.gather_stage
    n = plan.c.shape[1]
    records = []
    for t in stage.deliveries_from(rank):  # the target's rows, where they lie in the whole C
        block = stage.c.blocks[t.target]
        offset = t.rows[0] * n
        records += native.transfer_record(
            native.OP_CODES[t.op], t.target, t.rows, t.cols, block, offset
        )
    notify = slots.notify_attribute(stage, rank, whole.dtype.itemsize, sync)
    rows, cols = stage.c.blocks[rank]
    ids = slots.reduce_call_parts(stage, whole.dtype, chunk_bytes, sync, notify)
    primitives.reduce_start(
        whole.reshape(-1),
        comm=plan.comm_key,
        call_id=primitives.call_id(*ids),
        window_bytes=(1 + notify[0]) * notify[1],
        local_elements=(rows[1] - rows[0]) * n,
        overlap=False,
        transfers=[records],
        chunk_sizes=[whole.size],
        notify=notify,
    )
    whole = primitives.reduce_finish(whole, [], comm=plan.comm_key, local_offset=rows[0] * n)
    row = jnp.arange(plan.c.shape[0])[:, None]
    zeroed = jnp.where((row >= rows[0]) & (row < rows[1]), whole, jnp.zeros((), whole.dtype))
    mine = whole[rows[0] : rows[1], cols[0] : cols[1]]
    return _sent_by_owners(plan, rank, mine, sync, zeroed)
