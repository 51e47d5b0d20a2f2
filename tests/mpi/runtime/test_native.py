"""The native handlers below osmm_jax.matmul: agreement before RMA, and its steady state.

The records here are written by hand (matmul's lowering never produces bad ones), to check
what the handlers promise: a bad record on one rank gives every rank an error before any
data moves, windows keep their all-zero invariant, and a call signature every rank has
accepted once runs without another agreement collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.runtime import communicators, native, primitives

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ROWS, COLS = 3, 4


def _reduce_to_next(key: int, target_on_rank0: int):
    """A jitted product-less reduce: every rank adds ones into the next rank's 3x4 block.

    Rank 0 addresses ``target_on_rank0`` instead of the next rank.
    """
    target = (RANK + 1) % SIZE if RANK else target_on_rank0
    record = [native.OP_ACCUMULATE, target, 0, ROWS, COLS, 0, 0, COLS]  # the whole block
    assert len(record) == native.RECORD_LENGTH

    @jax.jit
    def run(local):
        call_id = primitives.call_id("test", target_on_rank0)
        chunk = _send_ones(key, record, call_id, ROWS * COLS * 4)
        return primitives.reduce_finish(local, [chunk], comm=key)

    return run


def _send_ones(key: int, record: list, call_id: int, window_bytes: int, notify=()):
    """Start a reduce that delivers a 3x4 block of ones by ``record``; returns its chunk."""
    chunk = jnp.ones((ROWS * COLS,), jnp.float32)
    primitives.reduce_start(
        chunk,
        comm=key,
        call_id=call_id,
        window_bytes=window_bytes,
        local_elements=ROWS * COLS,
        overlap=False,
        transfers=[record],
        chunk_sizes=[ROWS * COLS],
        notify=notify,
    )
    return chunk


@pytest.fixture
def key():
    plan = om.plan(
        om.Layout.rows((ROWS * SIZE, COLS)),
        om.Layout.replicated((COLS, COLS)),
        om.Layout.rows((ROWS * SIZE, COLS)),
    )
    communicators.comm_for_key(plan.comm_key)  # the communicator exists on every rank
    return plan.comm_key


@pytest.mark.ranks(min=2, reason="a rank needs a neighbour to send to")
def test_a_bad_record_on_one_rank_fails_every_rank_before_anything_moves(key):
    local = jnp.zeros((ROWS, COLS), jnp.float32)
    before = om.stats()
    with pytest.raises(Exception, match="target outside the communicator|rank 0 rejected"):
        jax.block_until_ready(_reduce_to_next(key, target_on_rank0=SIZE + 5)(local))
    assert om.stats()["rma_ops"] == before["rma_ops"]  # nothing was sent, on any rank
    # The windows are untouched: a good call afterwards receives exactly one block of ones.
    out = jax.block_until_ready(_reduce_to_next(key, target_on_rank0=1 % SIZE)(local))
    np.testing.assert_array_equal(np.asarray(out), np.ones((ROWS, COLS)))


def test_a_signature_is_agreed_on_once_then_runs_without_the_collective(key):
    run = _reduce_to_next(key, target_on_rank0=1 % SIZE)
    local = jnp.zeros((ROWS, COLS), jnp.float32)
    jax.block_until_ready(run(local))  # this signature may be agreed already (test above)
    before = om.stats()
    for _ in range(3):
        out = jax.block_until_ready(run(local))
    after = om.stats()
    assert after["agreements"] == before["agreements"]
    assert after["calls"] == before["calls"] + 3
    np.testing.assert_array_equal(np.asarray(out), np.ones((ROWS, COLS)))
    # A new signature (another block size) is agreed on once.
    plan = om.plan(
        om.Layout.cols((5, 4 * SIZE)), om.Layout.rows((4 * SIZE, 6)), om.Layout.rows((5, 6))
    )
    f = jax.jit(lambda a, b: om.matmul(a, b, plan))
    a = jnp.ones(plan.a.local_shape(RANK), jnp.float32)
    b = jnp.ones(plan.b.local_shape(RANK), jnp.float32)
    first = om.stats()["agreements"]
    jax.block_until_ready(f(a, b))
    second = om.stats()["agreements"]
    jax.block_until_ready(f(a, b))
    assert second - first == (1 if plan.has_deliveries else 0)
    assert om.stats()["agreements"] == second


def _notified_ring(key: int, base_on_rank1: int):
    """A jitted notified reduce: every rank adds ones into the next rank's 3x4 block, through
    one 64-byte slot per rank; rank 1 tells its origin (rank 0) to write ``base_on_rank1``
    bytes into the slot (the base the notified fetch uses to lay out its pieces)."""
    target, origin = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    record = [native.OP_ACCUMULATE, target, 0, ROWS, COLS, 0, 0, COLS]
    base = base_on_rank1 if RANK == 1 else 0
    notify = (1, 64, 0, 1, origin, 1, target, 1, base)

    @jax.jit
    def run(local):
        chunk = jnp.ones((ROWS * COLS,), jnp.float32)
        call_id = primitives.call_id("ring", base_on_rank1)
        return primitives.notified_round(
            [chunk], [record], local, comm=key, call_id=call_id, notify=notify
        )

    return run


@pytest.mark.ranks(min=2, reason="a rank needs a neighbour to send to")
def test_a_base_that_would_write_past_the_targets_block_delivers_nothing(key):
    local = jnp.zeros((ROWS, COLS), jnp.float32)
    # 16 + the 48-byte block > 48: inside the 64-byte slot, but past what rank 1 sums and
    # clears, so it would be left over for the next product there.
    run = _notified_ring(key, base_on_rank1=16)
    if RANK == 0:
        with pytest.raises(Exception, match="48-byte block.*does not fit: nothing was delivered"):
            jax.block_until_ready(run(local))
    elif RANK == 1:
        with pytest.raises(Exception, match="rank 0 could not deliver"):
            jax.block_until_ready(run(local))
    else:
        np.testing.assert_array_equal(np.asarray(run(local)), np.ones((ROWS, COLS)))
    # Nothing was left in any slot: the same reduce with every base 0 gives exactly ones.
    out = jax.block_until_ready(_notified_ring(key, base_on_rank1=0)(local))
    np.testing.assert_array_equal(np.asarray(out), np.ones((ROWS, COLS)))


@pytest.mark.ranks(min=2, reason="a rank needs a neighbour to send to")
@pytest.mark.parametrize("mode", ["fence", "notify"])
def test_a_block_inside_a_larger_buffer_is_summed_where_it_lies(key, mode):
    """``local_offset``: the finish sums the block that starts there (one row down in a
    buffer of two more rows) and leaves the rows around it as they were."""
    target, origin = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    record = [native.OP_ACCUMULATE, target, 0, ROWS, COLS, 0, 0, COLS]
    notify = (1, 64, 0, 1, origin, 1, target, 1, 0) if mode == "notify" else ()

    @jax.jit
    def run(local):
        call_id = primitives.call_id("offset", mode)
        chunk = _send_ones(key, record, call_id, 64 * (2 if notify else 1), notify)
        return primitives.reduce_finish(local, [chunk], comm=key, local_offset=COLS)

    around = np.full((ROWS + 2, COLS), 7.0, np.float32)
    around[1 : ROWS + 1] = 2.0
    out = np.asarray(jax.block_until_ready(run(jnp.asarray(around))))
    expected = around.copy()
    expected[1 : ROWS + 1] += 1.0
    np.testing.assert_array_equal(out, expected)
