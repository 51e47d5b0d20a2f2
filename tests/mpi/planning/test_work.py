"""osmm_jax.matmul with a Work split (who computes which multiply-adds): the 3-D layouts and a
work split over ordinary layouts, forward and backward, both methods, against numpy.

Run under ``mpiexec -n N`` for N = 1..4 (see conftest.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import (
    METHODS,
    K,
    M,
    N,
    assert_product_and_grads_match,
    global_inputs,
    local_blocks,
    make_layouts,
    product_and_grads,
    product_grads_and_bytes,
)

import osmm_jax as om

jax.config.update("jax_enable_x64", True)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def grids(p: int):
    """Every ``(pm, pk, pn)`` grid of ``p`` ranks."""
    return [
        (pm, pk, p // (pm * pk))
        for pm in range(1, p + 1)
        for pk in range(1, p + 1)
        if p % (pm * pk) == 0
    ]


GRIDS = grids(SIZE)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("grid", GRIDS, ids=["x".join(map(str, g)) for g in GRIDS])
@pytest.mark.parametrize("speeds", ["equal", "uneven"])
def test_three_d_layouts_forward_and_grad_match_numpy(grid, speeds, method):
    weights = None if speeds == "equal" else [1.0 + (r % 3) for r in range(SIZE)]
    a_layout, b_layout, c_layout, work = om.three_d_layouts((M, K, N), grid, weights)
    plan = om.plan(a_layout, b_layout, c_layout, work=work)
    inputs = global_inputs(seed=11)
    results = product_and_grads(plan, method, *local_blocks(plan, inputs))
    assert_product_and_grads_match(plan, inputs, results)


@pytest.mark.parametrize("kinds", [("rows", "cols", "grid"), ("cols", "rows", "rows")])
def test_a_work_split_over_ordinary_layouts_moves_what_its_plan_says(kinds):
    # The boxes decide who computes every cell no C owner holding both inputs computes for
    # itself: here every rank computes a slice of K for every C element, so most of its inputs
    # and all but its own rows of C move.
    work = om.Work.grid((M, K, N), (1, SIZE, 1), k_weights=[2.0, 1.0, 1.0, 3.0][:SIZE])
    plan = om.plan(*make_layouts(kinds, shifts=(0, 1, 2)), work=work)
    inputs = global_inputs(seed=12)
    *results, sent = product_grads_and_bytes(plan, *local_blocks(plan, inputs))
    assert_product_and_grads_match(plan, inputs, results)
    backward = om.rma_bytes(plan, 8, 8, direction="backward")
    assert sent == om.rma_bytes(plan, 8, 8)[RANK] + backward[RANK]


def test_ranks_with_different_work_splits_all_raise_the_same_error():
    a_layout, b_layout, c_layout, work = om.three_d_layouts((M, K, N), (1, SIZE, 1))
    if RANK == 0 and SIZE > 1:
        work = om.Work.grid((M, K, N), (1, SIZE, 1), k_weights=[5.0] + [1.0] * (SIZE - 1))
    plan = om.plan(a_layout, b_layout, c_layout, work=work)
    a, b, _ = global_inputs(seed=13)
    a_loc, b_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK)
    if SIZE == 1:
        np.testing.assert_allclose(om.matmul(a_loc, b_loc, plan), a @ b, rtol=1e-12)
        return
    with pytest.raises(ValueError, match="plan"):
        om.matmul(a_loc, b_loc, plan)


def test_the_choice_of_auto_layouts_plans_with_its_work_split():
    choice = om.auto_layouts(64, 64, 64, [1.0] * SIZE, memory_budget=float("inf"))
    plan = om.plan(choice)
    assert plan.work == choice.work
    a, b, _ = global_inputs(seed=14, m=64, k=64, n=64)
    c_loc = om.matmul(choice.a.shard(a, RANK), choice.b.shard(b, RANK), plan)
    np.testing.assert_allclose(c_loc, choice.c.shard(a @ b, RANK), rtol=1e-12, atol=1e-12)
