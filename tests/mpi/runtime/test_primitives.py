"""The all-reduce inside compiled programs (primitives.allreduce_sum): osmm_jax's own
``osmm_allreduce`` (``OSMM_ALLREDUCE=native``, what an install without mpi4jax uses) sums like
mpi4jax's, orders with the one-sided calls on one token chain, and carries the allreduce method
and checksum verification."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.runtime import native, primitives
from osmm_jax._src.runtime.checksum import inject_fault

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
M, K, N = 30, 26, 22

# Sums over 2 and 3 ranks cover the handler; one rank sums nothing, four only cost time.
pytestmark = pytest.mark.ranks(2, 3, reason="a sum over several ranks")


@pytest.fixture
def native_allreduce(monkeypatch):
    monkeypatch.setenv("OSMM_ALLREDUCE", "native")


def _k_split():
    return om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N)))


def _data_parallel_grad():
    """A data-parallel weight gradient: a replicated C summed over the ranks."""
    return om.plan(om.Layout.cols((K, M)), om.Layout.rows((M, N)), om.Layout.replicated((K, N)))


def _inputs(plan, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(plan.a.shape)
    b = rng.standard_normal(plan.b.shape)
    return a, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_the_native_sum_adds_every_ranks_array(native_allreduce, dtype):
    plan = _k_split()
    x = (np.arange(35).reshape(5, 7) * (RANK + 1)).astype(dtype)
    before = native.stats()["rma_ops"]
    got = jax.jit(lambda v: primitives.allreduce_sum(v, comm=plan.comm_key))(x)
    expected = x // (RANK + 1) * sum(range(1, SIZE + 1))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert native.stats()["rma_ops"] == before  # a collective, no RMA
    # The input is the caller's: untouched.
    np.testing.assert_array_equal(x, (np.arange(35).reshape(5, 7) * (RANK + 1)).astype(dtype))


def test_the_native_sum_orders_with_one_sided_products_in_one_program(native_allreduce):
    """Products and sums interleaved in one jitted program, some sums of product results:
    one token chain keeps every rank's collectives in the same order."""
    plan = _k_split()
    a, b = _inputs(plan)
    a_local, b_local = plan.a.shard(a, RANK), plan.b.shard(b, RANK)

    def program(x, y):
        total = jnp.zeros((), jnp.float64)
        for _ in range(3):
            c = om.matmul(x, y, plan)
            total = total + primitives.allreduce_sum(jnp.sum(c), comm=plan.comm_key)
        return c, total

    c, total = jax.jit(program)(a_local, b_local)
    np.testing.assert_allclose(np.asarray(c), plan.c.shard(a @ b, RANK), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(total), 3 * np.sum(a @ b), rtol=1e-10)


@pytest.mark.parametrize("make_plan", [_k_split, _data_parallel_grad])
def test_the_allreduce_method_gives_the_same_products_and_gradients_with_either_sum(
    monkeypatch, make_plan
):
    pytest.importorskip("mpi4jax", reason="compares with mpi4jax, an optional dependency")
    plan = make_plan()
    a, b = _inputs(plan, seed=1)
    a_local, b_local = plan.a.shard(a, RANK), plan.b.shard(b, RANK)
    results = {}
    for choice in ("mpi4jax", "native"):
        monkeypatch.setenv("OSMM_ALLREDUCE", choice)

        def loss(x, y):
            return jnp.sum(jnp.sin(om.matmul(x, y, plan, method="allreduce")))

        # A fresh function per choice: the choice is read when the program is traced.
        value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        results[choice] = jax.tree.map(np.asarray, value_and_grads(a_local, b_local))
    (v0, (ga0, gb0)), (v1, (ga1, gb1)) = results["mpi4jax"], results["native"]
    np.testing.assert_allclose(v1, v0, rtol=1e-12)
    np.testing.assert_allclose(ga1, ga0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gb1, gb0, rtol=1e-12, atol=1e-12)
    c = om.matmul(a_local, b_local, plan, method="allreduce")
    np.testing.assert_allclose(np.asarray(c), plan.c.shard(a @ b, RANK), rtol=1e-12, atol=1e-12)


def test_checksum_verification_runs_on_the_native_sum(native_allreduce):
    plan = _k_split()
    a, b = _inputs(plan, seed=2)
    a_local = jnp.asarray(plan.a.shard(a, RANK), jnp.float32)
    b_local = jnp.asarray(plan.b.shard(b, RANK), jnp.float32)
    jax.block_until_ready(
        jax.jit(lambda x, y: om.matmul(x, y, plan, verify=True))(a_local, b_local)
    )
    bad_rank = SIZE - 1
    with inject_fault(bad_rank, 8.0):
        fn = jax.jit(lambda x, y: om.matmul(x, y, plan, verify=True))
        with pytest.raises(Exception, match=rf"on rank {bad_rank}"):
            jax.block_until_ready(fn(a_local, b_local))
