"""osmm_jax.matmul with its operands on a GPU: every layout combination, forward and backward,
both methods, float32 and bfloat16, against numpy.

Runs only where JAX's default backend is a GPU (``make gpu-test`` sets JAX_PLATFORMS=cuda);
skipped elsewhere. Several ranks may share one GPU (each with a slice of its memory,
``XLA_PYTHON_CLIENT_MEM_FRACTION``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import KINDS, make_layout, product_and_grads

import osmm_jax as om

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs JAX's default backend to be a GPU"
)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
M, K, N = 33, 64, 17
COMBOS = list(itertools.product(KINDS, KINDS, KINDS))
METHODS = ("one_sided", "allreduce")
DTYPES = {"float32": (jnp.float32, 1e-5), "bfloat16": (jnp.bfloat16, 3e-2)}


def _close(actual, expected, tol):
    actual = np.asarray(actual, np.float64)
    scale = max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kinds", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_forward_and_grad_on_the_gpu_match_numpy(kinds, method, dtype_name):
    dtype, tol = DTYPES[dtype_name]
    a_layout, b_layout = make_layout(kinds[0], (M, K)), make_layout(kinds[1], (K, N), shift=1)
    c_layout = make_layout(kinds[2], (M, N), shift=2)
    plan = om.plan(a_layout, b_layout, c_layout)
    rng = np.random.default_rng(7)
    # Rounded to the dtype first, so numpy multiplies exactly what the GPU multiplies.
    a, b, g = (
        np.asarray(jnp.asarray(rng.standard_normal(s), dtype), np.float64)
        for s in ((M, K), (K, N), (M, N))
    )
    a_loc = jnp.asarray(a_layout.shard(a, RANK), dtype)
    b_loc = jnp.asarray(b_layout.shard(b, RANK), dtype)
    g_loc = jnp.asarray(c_layout.shard(g, RANK), dtype)
    assert a_loc.devices().pop().platform == "gpu"

    c_loc, da, db = product_and_grads(plan, method, a_loc, b_loc, g_loc)
    assert c_loc.dtype == dtype and c_loc.devices().pop().platform == "gpu"
    _close(c_loc, c_layout.shard(a @ b, RANK), tol)
    _close(da, a_layout.shard(g @ b.T, RANK), tol)
    _close(db, b_layout.shard(a.T @ g, RANK), tol)


@pytest.mark.ranks(min=2, reason="a single rank sends nothing")
def test_one_sided_sums_are_staged_through_host_memory():
    a_layout = om.Layout.cols((M, K))
    b_layout = om.Layout.rows((K, N))
    c_layout = om.Layout.rows((M, N))
    plan = om.plan(a_layout, b_layout, c_layout)
    a = np.ones((M, K), np.float32)
    b = np.ones((K, N), np.float32)
    before = om.stats()
    c_loc = jax.jit(lambda x, y: om.matmul(x, y, plan))(
        jnp.asarray(a_layout.shard(a, RANK)), jnp.asarray(b_layout.shard(b, RANK))
    )
    np.testing.assert_allclose(np.asarray(c_loc), c_layout.shard(a @ b, RANK))
    after = om.stats()
    assert after["sent_bytes"] > before["sent_bytes"]
    assert after["staged_bytes"] > before["staged_bytes"]
