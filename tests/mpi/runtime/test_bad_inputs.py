"""osmm_jax.matmul on awkward inputs: NaN/Inf operands, empty matrices, wrong shapes under jit.

Run under ``mpiexec -n N`` for N = 1..4 (see conftest.py). Every rank builds the
same global matrices, so each checks its own block against numpy, and every
rank must raise the same error for bad input (never hang).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import K, M, N, global_inputs, product_and_grads, uneven_weights

import osmm_jax as om

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
METHODS = ("one_sided", "allreduce")


def _layouts(split: str, m: int, k: int, n: int):
    """(A, B, C) layouts over every rank: ``"rows"`` splits A and C by rows with B
    replicated; ``"k"`` splits the inner dimension (A by columns, B by rows) and C by rows."""
    if split == "rows":
        return (
            om.Layout.rows((m, k), weights=uneven_weights(SIZE)),
            om.Layout.replicated((k, n)),
            om.Layout.rows((m, n), weights=uneven_weights(SIZE, 1)),
        )
    return (
        om.Layout.cols((m, k), weights=uneven_weights(SIZE)),
        om.Layout.rows((k, n), weights=uneven_weights(SIZE, 1)),
        om.Layout.rows((m, n), weights=uneven_weights(SIZE, 2)),
    )


# -- NaN and Inf --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("split", ["rows", "k"])
@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_element_of_a_spoils_exactly_its_row_of_c(method, split, bad):
    """A[i, j] non-finite: C[i, :] is non-finite (every C[i, n] sums A[i, j] * B[j, n]
    with B[j, n] != 0); every other element of C is finite and correct. Backward: dB[j, :]
    (= A[:, j].T @ dC) is non-finite, and dA = dC @ B.T stays finite and correct."""
    a_layout, b_layout, c_layout = _layouts(split, M, K, N)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, g = global_inputs()
    i, j = 3, 4
    a[i, j] = bad
    a_loc, b_loc, g_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK), c_layout.shard(g, RANK)

    c_loc, da, db = product_and_grads(plan, method, a_loc, b_loc, g_loc)
    clean = a.copy()
    clean[i, j] = 0.0
    want_c, bad_c = clean @ b, np.zeros((M, N), bool)
    bad_c[i, :] = True
    want_db, bad_db = clean.T @ g, np.zeros((K, N), bool)
    bad_db[j, :] = True
    for got, want, spoiled, layout in (
        (c_loc, want_c, bad_c, c_layout),
        (db, want_db, bad_db, b_layout),
    ):
        got, spoiled = np.asarray(got), layout.shard(spoiled, RANK)
        assert not np.isfinite(got[spoiled]).any()
        assert np.isfinite(got[~spoiled]).all()
        np.testing.assert_allclose(got[~spoiled], layout.shard(want, RANK)[~spoiled], rtol=1e-12)
    np.testing.assert_allclose(da, a_layout.shard(g @ b.T, RANK), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", ["rows", "k"])
@pytest.mark.parametrize("method", METHODS)
def test_a_nan_in_b_spoils_exactly_its_column_of_c(method, split):
    a_layout, b_layout, c_layout = _layouts(split, M, K, N)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs(seed=1)
    j, n = 2, 3
    b[j, n] = np.nan
    c_loc = np.asarray(
        om.matmul(a_layout.shard(a, RANK), b_layout.shard(b, RANK), plan, method=method)
    )
    clean = b.copy()
    clean[j, n] = 0.0
    spoiled = np.zeros((M, N), bool)
    spoiled[:, n] = True
    spoiled = c_layout.shard(spoiled, RANK)
    assert np.isnan(c_loc[spoiled]).all()
    assert np.isfinite(c_loc[~spoiled]).all()
    want = c_layout.shard(a @ clean, RANK)
    np.testing.assert_allclose(c_loc[~spoiled], want[~spoiled], rtol=1e-12)


# -- empty matrices -----------------------------------------------------------------------

EMPTY_DIMS = [(0, K, N), (M, 0, N), (M, K, 0), (0, 0, 0)]


@pytest.mark.parametrize("dims", EMPTY_DIMS, ids=["m0", "k0", "n0", "all0"])
@pytest.mark.parametrize("split", ["rows", "k"])
@pytest.mark.parametrize("method", METHODS)
def test_empty_matrices_give_numpys_answer(method, split, dims):
    """M, K or N = 0: C has the right shape (zeros when K = 0, as numpy gives), and so do
    the gradients; eager (verified, one chunk per row) and under jit."""
    m, k, n = dims
    a_layout, b_layout, c_layout = _layouts(split, m, k, n)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, g = global_inputs(m=m, k=k, n=n, seed=2)
    a_loc, b_loc, g_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK), c_layout.shard(g, RANK)

    c_eager = om.matmul(a_loc, b_loc, plan, method=method, verify=True, chunk_bytes=8)
    np.testing.assert_array_equal(c_eager, c_layout.shard(a @ b, RANK))

    c_loc, da, db = product_and_grads(plan, method, a_loc, b_loc, g_loc)
    assert c_loc.shape == c_layout.local_shape(RANK)
    np.testing.assert_allclose(c_loc, c_layout.shard(a @ b, RANK), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(da, a_layout.shard(g @ b.T, RANK), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, b_layout.shard(a.T @ g, RANK), rtol=1e-12, atol=1e-12)


# -- wrong shapes under jit ---------------------------------------------------------------


@pytest.mark.parametrize("operand", ["a_local", "b_local"])
@pytest.mark.parametrize("method", METHODS)
def test_a_traced_operand_of_the_wrong_shape_fails_at_trace_time_on_every_rank(method, operand):
    """Under jit the operands are tracers: the shape check still runs when tracing, and every
    rank raises the same ValueError naming the operand and the block it should have."""
    a_layout, b_layout, c_layout = _layouts("rows", M, K, N)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs()
    a_loc, b_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK)
    expected = (a_layout if operand == "a_local" else b_layout).local_shape(0)
    if operand == "a_local":
        a_loc = np.zeros((a_loc.shape[0], a_loc.shape[1] + 1))  # one column too many
    elif RANK == 0:
        b_loc = b_loc[:-1]  # only rank 0 is wrong: the others must raise too

    step = jax.jit(lambda x, y: om.matmul(x, y, plan, method=method))
    with pytest.raises(
        ValueError, match=rf"rank 0: {operand} has shape .*{re.escape(str(expected))}"
    ):
        step(a_loc, b_loc)


# -- bad options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("OSMM_USE_ALLREDUCE", "maybe"),
        ("OSMM_VERIFY", "ture"),
        ("OSMM_CHUNK_BYTES", "4MiB"),
        ("OSMM_TIMEOUT", "5min"),
        ("OSMM_TIMEOUT", "-1"),
        ("OSMM_TIMEOUT", "nan"),
        ("OSMM_ON_TIMEOUT", "retry"),
        ("OSMM_ALLREDUCE", "nccl"),
    ],
)
def test_a_garbage_variable_on_one_rank_is_an_error_on_every_rank(monkeypatch, name, text):
    """Only rank 0 has the bad value; the others must raise the same error, not wait for it."""
    if RANK == 0:
        monkeypatch.setenv(name, text)
    else:
        monkeypatch.delenv(name, raising=False)
    a_layout, b_layout, c_layout = _layouts("rows", M, K, N)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs()
    with pytest.raises(ValueError, match=rf"rank 0: {name}.*{text}"):
        om.matmul(a_layout.shard(a, RANK), b_layout.shard(b, RANK), plan)
