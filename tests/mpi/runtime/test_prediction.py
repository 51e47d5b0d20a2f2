"""osmm_jax.memory_bytes on plans of a live communicator (osmm_jax._src.runtime.prediction):
the all-reduce method's figure is the buffers XLA assigns to the program that
:func:`osmm_jax.matmul` runs, for any rank, without MPI traffic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from benchmarks.memory import layouts  # the memory benchmark's families
from osmm_jax._src.runtime import allreduce, native

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def _user_program(plan, direction: str, dtype=jnp.float32):
    """XLA's temporaries for the jitted product or gradient a user writes, on this rank."""
    a = jnp.ones(plan.a.local_shape(RANK), dtype)
    b = jnp.ones(plan.b.local_shape(RANK), dtype)
    product = lambda x, y: om.matmul(x, y, plan, method="allreduce")  # noqa: E731
    if direction == "forward":
        fn, args = jax.jit(product), (a, b)
    else:
        d_c = jnp.ones(plan.c.local_shape(RANK), dtype)
        fn, args = jax.jit(lambda x, y, d: jax.vjp(product, x, y)[1](d)), (a, b, d_c)
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("family", ["k_split", "rows", "grid"])
def test_the_allreduce_method_predicts_the_buffers_xla_assigns_to_its_program(family, direction):
    """Beside the blocks, the prediction is XLA's temporaries for the very program the user's
    jitted product (or gradient) runs, plus MPI's buffer for the largest sum; and the
    analysis moved nothing (the native counters did not change)."""
    plan = om.plan(*layouts(family, 48))
    before = native.stats()["rma_bytes"]
    peak = om.memory_bytes(plan, RANK, method="allreduce", direction=direction)
    assert native.stats()["rma_bytes"] == before
    mpi = allreduce.mpi_buffer_bytes(plan, RANK, 4, direction)
    assert peak.transient - mpi == _user_program(plan, direction)
    assert peak.windows == 0
    moves = SIZE > 1 and (family != "rows" or direction == "backward")
    if allreduce.receive_share(RANK, SIZE) > 0:
        assert (mpi > 0) == moves  # a data-parallel forward product sums nothing


@pytest.mark.parametrize("family", ["k_split", "grid"])
def test_any_rank_predicts_every_rank_s_all_reduce_peak_as_that_rank_does(family):
    """The compiled program is traced for the rank asked about, not the calling one: rank 0's
    figures for every rank are each rank's own."""
    plan = om.plan(*layouts(family, 40))
    own = om.memory_bytes(plan, RANK, method="allreduce", direction="backward")
    everyone = COMM.allgather(tuple(own))
    if RANK == 0:
        for rank in range(SIZE):
            peak = om.memory_bytes(plan, rank, method="allreduce", direction="backward")
            assert tuple(peak) == everyone[rank]
    blocks = [int(np.prod(layout.local_shape(RANK))) for layout in (plan.a, plan.b, plan.c)]
    assert own.blocks == 4 * (2 * (blocks[0] + blocks[1]) + blocks[2])


def test_16_bit_inputs_are_predicted_from_a_program_in_bfloat16():
    """Two-byte inputs with float32 sums are compiled as bfloat16 (float16 lays out the same):
    the figure is XLA's for the user's bfloat16 program, its blocks in two bytes."""
    plan = om.plan(*layouts("grid", 48))
    half = om.memory_bytes(plan, RANK, 2, 4, method="allreduce", direction="backward")
    full = om.memory_bytes(plan, RANK, 4, 4, method="allreduce", direction="backward")
    assert half.blocks * 2 == full.blocks
    mpi = allreduce.mpi_buffer_bytes(plan, RANK, 4, "backward")
    assert half.transient - mpi == _user_program(plan, "backward", jnp.bfloat16)


def test_a_sequence_parallel_product_s_buffers_are_those_xla_assigns():
    """A by rows, B and C by columns (a sequence-parallel column layer): the rank joins its
    rows of A and the fetched ones for one GEMM over its C block. The one_sided figure is
    XLA's temporaries for the user's program, on 1-4 ranks at the memory benchmark's 3072^3
    (compiled, not run): on 2 ranks the fetched rows fit the result, and XLA lends them its
    memory, as memory_bytes counts."""
    plan = om.plan(*layouts("sequence", 3072))
    a = jnp.ones(plan.a.local_shape(RANK), jnp.float32)
    b = jnp.ones(plan.b.local_shape(RANK), jnp.float32)
    program = jax.jit(lambda x, y: om.matmul(x, y, plan)).lower(a, b).compile()
    temp = program.memory_analysis().temp_size_in_bytes
    assert abs(om.memory_bytes(plan, RANK).transient - temp) <= 256  # XLA's scalars
