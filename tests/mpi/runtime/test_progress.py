"""Products under every MPI progress mode (OSMM_PROGRESS): the same results, and the progress
thread polls during the reduce epochs of ``thread`` (``auto`` polls only where ranks talk
through the network: here shared memory, so never, unless MPIR_CVAR_NOLOCAL=1).

Run under ``mpiexec -n N`` (tests/mpi/run.py); on one rank nothing is sent and nothing polls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.runtime import native

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
M = K = N = 384


@pytest.fixture
def restore_progress():
    before = native.progress_settings()
    yield
    native.set_progress(*before)


@pytest.mark.parametrize("mode", ["off", "thread", "auto"])
@pytest.mark.parametrize("chunk_bytes", [0, 64 * 1024])
def test_k_split_products_under_every_mode(mode, chunk_bytes, restore_progress):
    """A K-split product (partials of all of C accumulated onto the row owners), with overlap
    off and on (several chunks), is right on every rank whatever makes progress."""
    native.set_progress(mode, 0)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    plan = om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N)))
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, chunk_bytes=chunk_bytes))
    a_local, b_local = jnp.asarray(plan.a.shard(a, RANK)), jnp.asarray(plan.b.shard(b, RANK))
    polls = native.stats()["progress_polls"]
    # Every epoch wakes the thread, which polls at least once unless the epoch has closed by
    # the time it runs (the notified finish, which drives progress itself, can come within
    # microseconds of the start): run products until some rank's thread has polled, or 20.
    for _ in range(20):
        c_local = jax.block_until_ready(product(a_local, b_local))
        polled = native.stats()["progress_polls"] - polls
        if mode == "thread" and COMM.allreduce(polled) > 0:  # the same mode on every rank
            break
    np.testing.assert_allclose(c_local, plan.c.shard(a @ b, RANK), rtol=2e-4, atol=2e-3)
    if mode == "off" or SIZE == 1:
        assert polled == 0
    if mode == "thread" and SIZE > 1:
        assert COMM.allreduce(polled) > 0
