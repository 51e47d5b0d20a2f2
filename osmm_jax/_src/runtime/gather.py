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


def _sent_by_owners(plan: Plan, rank: int, block, sync: Sync):
    """Notified mode: this rank's block goes into a slot of every other rank's window, and the
    other owners' blocks arrive in this rank's slots (see the module docstring)."""
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
    local = jnp.zeros((m, n), acc).at[rows[0] : rows[1], cols[0] : cols[1]].set(mine)
    call_id = primitives.call_id(plan.fingerprint, "gather", str(acc), sync.mode, spec.notify[:3])
    summed = primitives.notified_round(
        [buffer], [records], local, comm=plan.comm_key, call_id=call_id, notify=spec.notify
    )
    return summed.astype(block.dtype)
