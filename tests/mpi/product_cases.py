"""What the collective product tests share: layouts of every kind with unequal (and empty)
blocks, global inputs that every rank builds alike, and one jitted forward-and-gradient run.

Used by test_matmul.py, test_bad_inputs.py and test_gpu.py (the same sweep on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om

SIZE = MPI.COMM_WORLD.Get_size()
M, K, N = 7, 9, 5  # divisible by no rank count > 1
KINDS = ("rows", "cols", "grid", "replicated")


def uneven_weights(n: int, shift: int = 0):
    """Unequal weights; with 3+ ranks one rank gets nothing (an empty block)."""
    base = [1.0, 2.0, 0.0, 1.5, 3.0]
    if n < 3:
        base = [1.0, 2.0]
    return [base[(i + shift) % len(base)] for i in range(n)] if n > 1 else [1.0]


def grid_shape(n: int):
    """The most square ``(rows, cols)`` grid of ``n`` ranks, rows <= cols."""
    pr = max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)
    return (pr, n // pr)


def make_layout(kind: str, shape, shift: int = 0):
    """A layout of ``kind`` over every rank of COMM_WORLD; ``shift`` rotates the weights."""
    if kind == "rows":
        return om.Layout.rows(shape, weights=uneven_weights(SIZE, shift))
    if kind == "cols":
        return om.Layout.cols(shape, weights=uneven_weights(SIZE, shift + 1))
    if kind == "grid":
        pr, pc = grid_shape(SIZE)
        return om.Layout.grid(
            shape, (pr, pc), row_weights=uneven_weights(pr, shift), col_weights=uneven_weights(pc)
        )
    return om.Layout.replicated(shape)


def global_inputs(dtype=np.float64, seed=0, m=M, k=K, n=N):
    """Global ``A (m, k)``, ``B (k, n)`` and a cotangent ``G (m, n)``, the same on every rank."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((m, k)).astype(dtype),
        rng.standard_normal((k, n)).astype(dtype),
        rng.standard_normal((m, n)).astype(dtype),
    )


def product_and_grads(plan, method, a_loc, b_loc, g_loc):
    """This rank's ``(C, dA, dB)`` for ``C = A @ B`` under ``plan``, jitted, where dA and dB are
    the gradients of ``sum(C * G)`` (so the cotangent of C is ``G``, of which ``g_loc`` is this
    rank's block)."""

    def loss(x, y):
        c = om.matmul(x, y, plan, method=method)
        return jnp.sum(c * g_loc), c

    (_, c_loc), (da, db) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        a_loc, b_loc
    )
    return c_loc, da, db


def product_grads_and_bytes(plan, a_loc, b_loc, g_loc, **options):
    """As :func:`product_and_grads` (``options`` go to ``om.matmul``), plus the RMA bytes this
    rank issued in the second, timed-like run of the jitted step (the first compiles)."""

    def loss(x, y):
        c = om.matmul(x, y, plan, **options)
        return jnp.sum(c * g_loc), c

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    jax.block_until_ready(step(a_loc, b_loc))  # compile
    before = om.stats()
    (_, c_loc), (da, db) = jax.block_until_ready(step(a_loc, b_loc))
    return c_loc, da, db, om.stats()["rma_bytes"] - before["rma_bytes"]
