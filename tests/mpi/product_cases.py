"""What the collective product tests share: layouts of every kind with unequal (and empty)
blocks, global inputs that every rank builds alike, jitted forward-and-gradient runs checked
against numpy, and this process's resident memory.

Used by test_matmul.py, test_bad_inputs.py, test_gpu.py (the same sweep on a GPU),
planning/test_work.py, test_random_products.py, test_soak.py and tests/multihost/program.py.
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
M, K, N = 7, 9, 5  # divisible by no rank count > 1
KINDS = ("rows", "cols", "grid", "replicated")
METHODS = ("one_sided", "allreduce")
# Kinds of (A, B, C) that put every kind in every place of A and B and every kind but cols in
# C: a data-parallel product, a K-split, a product into a grid, a 2-D grid product and a
# replicated result.
SAMPLE_KINDS = [
    ("rows", "replicated", "rows"),
    ("cols", "rows", "rows"),
    ("rows", "cols", "grid"),
    ("grid", "grid", "grid"),
    ("replicated", "cols", "replicated"),
]

# OSMM_TEST_ALL_COMBOS=1: every combination on every rank count (see layout_combos).
ALL_COMBOS = os.environ.get("OSMM_TEST_ALL_COMBOS", "0") == "1"


def layout_combos():
    """Every (A, B, C) triple of KINDS, as pytest parameters named "rows-cols-grid".

    The MPI suite runs on 1 to 4 ranks, and the two oversubscribed runs split the triples
    between them: on 3 ranks a "grid" is a 1x3 grid, the same partition as columns (with
    other weights), so the triples with a grid run on 4 ranks (a real 2x2 grid) and not on 3;
    the triples without one run on 3 ranks (uneven blocks, an empty one, several origins per
    target) and not on 4, which would only take those paths again. 1 and 2 ranks run all.
    ``OSMM_TEST_ALL_COMBOS=1`` runs every triple everywhere.
    """
    runs_on = {
        True: (1, 2, 4, "on 3 ranks a grid is 1x3, columns again (4 ranks run a 2x2 grid)"),
        False: (1, 2, 3, "without a 2-D grid 4 ranks repeat 3 ranks' paths"),
    }
    params = []
    for kinds in itertools.product(KINDS, KINDS, KINDS):
        *sizes, why = runs_on["grid" in kinds]
        reason = f"{why}; OSMM_TEST_ALL_COMBOS=1 runs it"
        marks = () if ALL_COMBOS else (pytest.mark.ranks(*sizes, reason=reason),)
        params.append(pytest.param(kinds, marks=marks, id="-".join(kinds)))
    return params


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


def make_layouts(kinds, shifts=(0, 0, 0), m=M, k=K, n=N):
    """Layouts of ``A (m, k)``, ``B (k, n)`` and ``C (m, n)`` of ``kinds`` (three of KINDS);
    ``shifts`` rotate each one's weights (see make_layout)."""
    (a_kind, b_kind, c_kind), (a_shift, b_shift, c_shift) = kinds, shifts
    return (
        make_layout(a_kind, (m, k), a_shift),
        make_layout(b_kind, (k, n), b_shift),
        make_layout(c_kind, (m, n), c_shift),
    )


def global_inputs(dtype=np.float64, seed=0, m=M, k=K, n=N):
    """Global ``A (m, k)``, ``B (k, n)`` and a cotangent ``G (m, n)``, the same on every rank."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((m, k)).astype(dtype),
        rng.standard_normal((k, n)).astype(dtype),
        rng.standard_normal((m, n)).astype(dtype),
    )


def product_and_grads_step(product):
    """``step(x, y, g) -> (C, dA, dB)`` for ``C = product(x, y)``, where dA and dB are the
    gradients of ``sum(C * G)`` (so ``g``, this rank's block of G, is the cotangent of C)."""

    def loss(x, y, g):
        c = product(x, y)
        return jnp.sum(c * g), c

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    def step(x, y, g):
        (_, c), (da, db) = value_and_grad(x, y, g)
        return c, da, db

    return step


def product_and_grads(plan, method, a_loc, b_loc, g_loc):
    """This rank's ``(C, dA, dB)`` for ``C = A @ B`` under ``plan``, jitted, where dA and dB are
    the gradients of ``sum(C * G)`` (so the cotangent of C is ``G``, of which ``g_loc`` is this
    rank's block)."""
    step = product_and_grads_step(lambda x, y: om.matmul(x, y, plan, method=method))
    return jax.jit(step)(a_loc, b_loc, g_loc)


def product_grads_and_bytes(plan, a_loc, b_loc, g_loc, **options):
    """As :func:`product_and_grads` (``options`` go to ``om.matmul``), plus the RMA bytes this
    rank issued in the second, timed-like run of the jitted step (the first compiles)."""
    step = jax.jit(product_and_grads_step(lambda x, y: om.matmul(x, y, plan, **options)))
    jax.block_until_ready(step(a_loc, b_loc, g_loc))  # compile
    before = om.stats()
    c_loc, da, db = jax.block_until_ready(step(a_loc, b_loc, g_loc))
    return c_loc, da, db, om.stats()["rma_bytes"] - before["rma_bytes"]


def default_sync():
    """The ``runtime.slots.Sync`` products run with when no ``sync`` is given
    (``OSMM_SYNC``, else notified but under an MPI whose accumulates wait for the target)."""
    from osmm_jax._src import config
    from osmm_jax._src.runtime import communicators, slots

    waiting = communicators.accumulates_wait_for_target()
    return slots.Sync(config.resolve_sync(None, waiting), config.slot_budget())


def local_blocks(plan, inputs):
    """This rank's blocks of the global ``inputs`` (A, B, G) under the layouts of ``plan``'s
    A, B and C."""
    a, b, g = inputs
    return plan.a.shard(a, RANK), plan.b.shard(b, RANK), plan.c.shard(g, RANK)


def assert_product_and_grads_match(plan, inputs, results):
    """Assert that this rank's ``results`` (its blocks of C, dA and dB) equal, to 1e-12, its
    blocks of numpy's ``A @ B``, ``G @ B.T`` and ``A.T @ G`` (the gradients of
    ``sum(C * G)``), given the global ``inputs`` (A, B, G) and the ``plan`` of the product."""
    (a, b, g), (c_loc, da, db) = inputs, results
    np.testing.assert_allclose(c_loc, plan.c.shard(a @ b, RANK), rtol=1e-12, atol=1e-12)
    # The cotangent of C is g (the same global value on every rank that holds a copy).
    np.testing.assert_allclose(da, plan.a.shard(g @ b.T, RANK), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, plan.b.shard(a.T @ g, RANK), rtol=1e-12, atol=1e-12)


def rss_mib() -> float:
    """This process's resident set size in MiB (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
