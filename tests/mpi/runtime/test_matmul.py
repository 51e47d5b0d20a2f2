"""osmm_jax.matmul on every layout combination, both methods, eager / jit / grad, all dtypes.

Run under ``mpiexec -n N`` for N = 1..4 (see conftest.py). Every rank builds the
same global matrices from a fixed seed, so each can check its own block
against numpy.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import (
    METHODS,
    SAMPLE_KINDS,
    K,
    M,
    N,
    assert_product_and_grads_match,
    global_inputs,
    layout_combos,
    local_blocks,
    make_layout,
    make_layouts,
    product_and_grads,
    product_grads_and_bytes,
    uneven_weights,
)

import osmm_jax as om
from osmm_jax._src.runtime import matmul as matmul_module

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
COMBOS = layout_combos()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kinds", COMBOS)
def test_jit_forward_and_grad_match_numpy(kinds, method):
    """Exact products and gradients; one_sided also moves exactly the bytes the plan predicts,
    forward and backward (dB's product fetching C's cotangent only where dA's fetch lacks
    pieces of it; at these sizes the default ``chunk_bytes`` makes one chunk, sent
    from the calling thread)."""
    plan = om.plan(*make_layouts(kinds, shifts=(0, 1, 2)))
    inputs = global_inputs()
    blocks = local_blocks(plan, inputs)
    if method == "allreduce":
        results = product_and_grads(plan, method, *blocks)
    else:
        *results, sent = product_grads_and_bytes(plan, *blocks, method=method)
        backward = om.rma_bytes(plan, 8, 8, direction="backward")
        assert sent == om.rma_bytes(plan, 8, 8)[RANK] + backward[RANK]
    assert_product_and_grads_match(plan, inputs, results)


@pytest.mark.parametrize("kinds", COMBOS)
def test_chunk_per_row_overlap_gives_the_same_products_and_bytes(kinds):
    """chunk_bytes=8 sends every row of every partial as its own chunk, from the issuer
    thread, while the next rows are computed: the exact products, and exactly the bytes the
    plan predicts, forward and backward."""
    plan = om.plan(*make_layouts(kinds, shifts=(0, 1, 2)))
    inputs = global_inputs(seed=5)
    *results, sent = product_grads_and_bytes(plan, *local_blocks(plan, inputs), chunk_bytes=8)
    assert_product_and_grads_match(plan, inputs, results)
    backward = om.rma_bytes(plan, 8, 8, direction="backward")
    assert sent == om.rma_bytes(plan, 8, 8)[RANK] + backward[RANK]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kinds", SAMPLE_KINDS, ids=["-".join(c) for c in SAMPLE_KINDS])
def test_eager_forward_and_grad(kinds, method):
    plan = om.plan(*make_layouts(kinds))
    inputs = global_inputs(seed=1)
    a_loc, b_loc, g_loc = local_blocks(plan, inputs)
    c_loc = om.matmul(a_loc, b_loc, plan, method=method)
    _, vjp = jax.vjp(lambda x, y: om.matmul(x, y, plan, method=method), a_loc, b_loc)
    assert_product_and_grads_match(plan, inputs, (c_loc, *vjp(jnp.asarray(g_loc))))


DTYPE_COMBOS = [("rows", "replicated", "rows"), ("cols", "rows", "rows"), ("rows", "cols", "grid")]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float16, 5e-3)]
)
@pytest.mark.parametrize("kinds", DTYPE_COMBOS, ids=["-".join(c) for c in DTYPE_COMBOS])
def test_low_precision_dtypes(kinds, dtype, rtol, method):
    m, k, n = 33, 64, 17
    a_layout, b_layout, c_layout = make_layouts(kinds, m=m, k=k, n=n)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs(np.float64, seed=2, m=m, k=k, n=n)
    a_lo, b_lo = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    # Reference: the same rounded inputs, multiplied exactly, rounded once.
    exact = np.asarray(a_lo, np.float64) @ np.asarray(b_lo, np.float64)
    c_loc = jax.jit(lambda x, y: om.matmul(x, y, plan, method=method))(
        a_layout.shard(a_lo, RANK), b_layout.shard(b_lo, RANK)
    )
    assert c_loc.dtype == dtype
    expected = c_layout.shard(exact, RANK)
    scale = np.abs(exact).max()
    np.testing.assert_allclose(np.asarray(c_loc, np.float64), expected, rtol=0, atol=rtol * scale)


def test_row_split_weights_gradient_arrives_summed_on_every_rank():
    """Data parallel: A (batch) split by rows, B (weights) replicated, dB global everywhere."""
    a_layout = om.Layout.rows((M, K), weights=uneven_weights(SIZE))
    b_layout = om.Layout.replicated((K, N))
    c_layout = om.Layout.rows((M, N), weights=uneven_weights(SIZE))
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs(seed=3)
    before = om.stats()
    db = jax.jit(jax.grad(lambda y: jnp.sum(om.matmul(a_layout.shard(a, RANK), y, plan) ** 2)))(b)
    np.testing.assert_allclose(db, a.T @ (2 * (a @ b)), rtol=1e-12)
    after = om.stats()
    delivered = sum(after[k] - before[k] for k in ("accumulates", "puts"))
    plan_db = plan.backward()[1]
    # Every rank with rows sends its partial of dB to every other rank; nobody recomputes it.
    senders = [r for r in range(SIZE) if a_layout.local_shape(r)[0] > 0]
    expected = SIZE - 1 if RANK in senders else 0
    assert delivered == expected == len(plan_db.deliveries_from(RANK)), (
        "dB must arrive by one-sided deliveries"
    )
    assert sum(plan_db.flops) == 2 * M * K * N


@pytest.mark.parametrize("method", METHODS)
def test_gradient_for_one_input_runs_only_its_backward_product(method):
    """Only the backward products of differentiated inputs are traced: here the batch's dA is
    local, but where such a product communicates XLA could not drop it (MPI side effects)."""
    a_layout = om.Layout.rows((M, K), weights=uneven_weights(SIZE))
    b_layout = om.Layout.replicated((K, N))
    plan = om.plan(a_layout, b_layout, om.Layout.rows((M, N), weights=uneven_weights(SIZE)))
    a, b, _ = global_inputs(seed=5)
    x = a_layout.shard(a, RANK)
    loss = lambda x, w: jnp.sum(om.matmul(x, w, plan, method=method) ** 2)  # noqa: E731
    plan_da, plan_db = plan.backward()
    for argnums, expected in ((0, [plan, plan_da]), (1, [plan, plan_db]), ((0, 1), None)):
        traced = []
        real_forward = matmul_module._forward

        def counting_forward(p, *args, traced=traced, real_forward=real_forward):
            traced.append(p)
            return real_forward(p, *args)

        with mock.patch.object(matmul_module, "_forward", counting_forward):
            jax.make_jaxpr(jax.grad(loss, argnums=argnums))(x, b)
        assert traced == (expected or [plan, plan_da, plan_db])
    before = om.stats()["rma_ops"]
    dx = jax.jit(jax.grad(loss, argnums=0))(x, b)
    np.testing.assert_allclose(dx, a_layout.shard(2 * (a @ b) @ b.T, RANK), rtol=1e-12)
    # dA of rows x replicated is local: no rank sends anything when only dA is asked for.
    assert om.stats()["rma_ops"] == before
    db = jax.jit(jax.grad(loss, argnums=1))(x, b)
    np.testing.assert_allclose(db, a.T @ (2 * (a @ b)), rtol=1e-12)


def test_k_split_moves_fewer_bytes_than_the_allreduce_baseline():
    n = 64
    a_layout, b_layout, c_layout = (
        om.Layout.cols((n, n)),
        om.Layout.rows((n, n)),
        om.Layout.rows((n, n)),
    )
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs(np.float32, seed=4, m=n, k=n, n=n)
    f = jax.jit(lambda x, y: om.matmul(x, y, plan))
    f(a_layout.shard(a, RANK), b_layout.shard(b, RANK)).block_until_ready()  # compile, warm windows
    before = om.stats()
    c_loc = f(a_layout.shard(a, RANK), b_layout.shard(b, RANK)).block_until_ready()
    after = om.stats()
    np.testing.assert_allclose(c_loc, c_layout.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    sent = after["rma_bytes"] - before["rma_bytes"]
    assert sent == plan.bytes_sent()[RANK]
    if SIZE == 1:
        assert sent == 0
        return
    assert after["rma_ops"] > before["rma_ops"]
    # A bandwidth-optimal all-reduce of the float32 C sends 2 (P-1)/P of it per rank.
    allreduce_bytes = 2 * (SIZE - 1) / SIZE * n * n * 4
    assert sent < allreduce_bytes
    assert sent == (n * n - c_layout.local_shape(RANK)[0] * n) * 4


def test_twice_in_one_jit_inside_loops_and_with_mpi4jax():
    # Ordering against a user's own mpi4jax calls: only where mpi4jax (an extra) is installed.
    mpi4jax = pytest.importorskip("mpi4jax", reason="mpi4jax, an optional dependency")

    a_layout, b_layout, c_layout = make_layouts(("cols", "rows", "rows"))
    sq_layout = make_layout("rows", (M, N), shift=1)
    plan = om.plan(a_layout, b_layout, c_layout)
    plan2 = om.plan(c_layout, om.Layout.replicated((N, N)), sq_layout)
    a, b, _ = global_inputs(seed=5)
    w = np.random.default_rng(6).standard_normal((N, N)) / N

    @jax.jit
    def f(x, y):
        def body(i, acc):
            c = om.matmul(x, y, plan) * (i + 1)
            total = mpi4jax.allreduce(jnp.sum(c), op=MPI.SUM, comm=MPI.COMM_WORLD)
            return acc + om.matmul(c, jnp.asarray(w), plan2) + total

        return jax.lax.fori_loop(0, 3, body, jnp.zeros(sq_layout.local_shape(RANK)))

    got = f(a_layout.shard(a, RANK), b_layout.shard(b, RANK))
    c = a @ b
    expected = sum((i + 1) * (c @ w) + (i + 1) * c.sum() for i in range(3))
    np.testing.assert_allclose(got, sq_layout.shard(expected, RANK), rtol=1e-10)

    def scanned(x, y):
        def step(carry, scale):
            return carry + om.matmul(x * scale, y, plan), None

        return jax.lax.scan(step, jnp.zeros(c_layout.local_shape(RANK)), jnp.arange(1.0, 4.0))[0]

    got = jax.jit(scanned)(a_layout.shard(a, RANK), b_layout.shard(b, RANK))
    np.testing.assert_allclose(got, c_layout.shard(6 * c, RANK), rtol=1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_is_a_batch_of_distributed_products(method):
    a_layout, b_layout, c_layout = make_layouts(("cols", "rows", "grid"))
    plan = om.plan(a_layout, b_layout, c_layout)
    batch = [global_inputs(seed=10 + i) for i in range(3)]
    a_b = jnp.stack([a_layout.shard(a, RANK) for a, _, _ in batch])
    b_b = jnp.stack([b_layout.shard(b, RANK) for _, b, _ in batch])
    for fn in (
        jax.vmap(lambda x, y: om.matmul(x, y, plan, method=method)),
        jax.jit(jax.vmap(lambda x, y: om.matmul(x, y, plan, method=method))),
    ):
        got = fn(a_b, b_b)
        for i, (a, b, _) in enumerate(batch):
            np.testing.assert_allclose(got[i], c_layout.shard(a @ b, RANK), rtol=1e-12)
    # Per-example gradients: vmap of grad.
    g_b = jnp.stack([c_layout.shard(g, RANK) for _, _, g in batch])
    per_example = jax.jit(
        jax.vmap(
            jax.grad(
                lambda x, y, g: jnp.sum(om.matmul(x, y, plan, method=method) * g), argnums=(0, 1)
            )
        )
    )
    da, db = per_example(a_b, b_b, g_b)
    for i, (a, b, g) in enumerate(batch):
        np.testing.assert_allclose(da[i], a_layout.shard(g @ b.T, RANK), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(db[i], b_layout.shard(a.T @ g, RANK), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_higher_order_and_forward_mode_raise_clear_errors(method):
    a_layout, b_layout, c_layout = make_layouts(("rows", "cols", "rows"))
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, _ = global_inputs(seed=7)
    a_loc, b_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK)

    def inner(x):
        gb = jax.grad(lambda y: jnp.sum(om.matmul(x, y, plan, method=method)))(b_loc)
        return jnp.sum(gb)

    with pytest.raises(NotImplementedError, match="first-order reverse-mode"):
        jax.jit(jax.grad(inner))(a_loc)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: om.matmul(x, b_loc, plan, method=method), (a_loc,), (a_loc,))
