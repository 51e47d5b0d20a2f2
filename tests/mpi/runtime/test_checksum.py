"""Checksum verification: clean products pass, an injected corruption is caught and named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.runtime.checksum import ChecksumError, inject_fault

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# Nothing checked here changes from three ranks to four (uneven splits and a rank with nothing
# appear from 3 on); the 4-rank run is for the 2x2 grids, the notified reduce's origin rounds and
# the tensor-parallel replica groups.
pytestmark = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it")
M, K, N = 33, 40, 21


def _plans():
    weights = [1.0 + r for r in range(SIZE)]
    yield om.plan(
        om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N), weights=weights)
    )
    yield om.plan(om.Layout.rows((M, K)), om.Layout.replicated((K, N)), om.Layout.rows((M, N)))
    yield om.plan(om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.replicated((M, N)))


def _whole_inputs(dtype):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((M, K)), dtype)
    b = jnp.asarray(rng.standard_normal((K, N)), dtype)
    return a, b


def _inputs(plan, dtype):
    a, b = _whole_inputs(dtype)
    return plan.a.shard(a, RANK), plan.b.shard(b, RANK)


@pytest.mark.parametrize(
    "dtype, method",
    [
        (jnp.float32, "one_sided"),
        (jnp.float64, "one_sided"),
        (jnp.bfloat16, "one_sided"),
        (jnp.float32, "allreduce"),
    ],
)
def test_clean_products_pass_verification(dtype, method):
    a64, b64 = (np.asarray(x, np.float64) for x in _whole_inputs(dtype))
    # A sum of K products rounded in `dtype`, then up to SIZE partials added in `dtype`.
    bound = (K + SIZE) * float(jnp.finfo(dtype).eps) * (np.abs(a64) @ np.abs(b64))
    for plan in _plans():
        a, b = _inputs(plan, dtype)

        def product(x, y, p=plan):
            return om.matmul(x, y, p, method=method, verify=True)

        def product_and_gradients(x, y):
            c, pullback = jax.vjp(product, x, y)
            return c, pullback(jnp.ones_like(c))

        # Gradients are verified products too. In float32 eagerly, so each product's in-graph
        # collectives may still run while Python starts the next product's checks; the other
        # dtypes in the forward product's compiled program (an eager gradient compiles every
        # operation on its own, seconds per plan on a loaded machine, and tests nothing the
        # float32 case does not).
        if dtype == jnp.float32:
            got = jax.jit(product)(a, b)
            jax.block_until_ready(jax.grad(lambda x, y: jnp.sum(product(x, y)), (0, 1))(a, b))
        else:
            got, gradients = jax.jit(product_and_gradients)(a, b)
            jax.block_until_ready(gradients)
        error = np.abs(np.asarray(got, np.float64) - plan.c.shard(a64 @ b64, RANK))
        assert np.all(error <= plan.c.shard(bound, RANK)), float(error.max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_injected_corruption_is_caught_on_every_rank(dtype):
    plan = next(_plans())
    a, b = _inputs(plan, dtype)
    bad_rank = SIZE - 1
    # Large enough to stand out of bfloat16's rounding (its tolerance is 8e-3 of the
    # column's absolute sum); float32 and float64 catch far smaller faults.
    with inject_fault(bad_rank, 64.0):
        fn = jax.jit(lambda x, y: om.matmul(x, y, plan, verify=True))
        with pytest.raises(Exception, match=rf"C block \[\d+:\d+, 0:{N}\] on rank {bad_rank}"):
            jax.block_until_ready(fn(a, b))
    # Eagerly the error is the ChecksumError itself or carries its message.
    with inject_fault(bad_rank, 64.0):
        with pytest.raises(Exception, match="checksum verification failed") as info:
            jax.block_until_ready(om.matmul(a, b, plan, verify=True))
    assert isinstance(info.value, (ChecksumError, RuntimeError, jax.errors.JaxRuntimeError))


def test_environment_turns_verification_on(monkeypatch):
    plan = next(_plans())
    a, b = _inputs(plan, jnp.float32)
    monkeypatch.setenv("OSMM_VERIFY", "1")
    with inject_fault(0, 5.0):
        with pytest.raises(Exception, match="on rank 0"):
            jax.block_until_ready(om.matmul(a, b, plan))


@pytest.mark.parametrize("method", ["one_sided", "allreduce"])
def test_non_finite_inputs_are_not_reported_as_a_faulty_product(method):
    """A NaN in A is the user's data, not a fault: verification lets it through to exactly the
    rows of C it touches (a non-finite result from finite inputs still fails)."""
    for plan in _plans():
        rng = np.random.default_rng(1)
        a_full = rng.standard_normal((M, K))
        a_full[M // 2, K // 3] = np.nan
        b_full = rng.standard_normal((K, N))
        a = plan.a.shard(jnp.asarray(a_full, jnp.float32), RANK)
        b = plan.b.shard(jnp.asarray(b_full, jnp.float32), RANK)
        got = jax.jit(lambda x, y, p=plan: om.matmul(x, y, p, method=method, verify=True))(a, b)
        expected = plan.c.shard(jnp.asarray(a_full @ b_full, jnp.float32), RANK)
        np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(expected)))
        finite = ~np.isnan(np.asarray(expected))
        np.testing.assert_allclose(
            np.asarray(got)[finite], np.asarray(expected)[finite], 1e-4, 1e-4
        )
