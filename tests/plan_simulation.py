"""A numpy executor of plans, shared by the planning tests: what every rank computes, gets and
receives, without MPI or JAX."""

from __future__ import annotations

import numpy as np


def simulate(plan, a, b):
    """Run a plan with numpy: each rank's products, local updates and deliveries, and for a
    staged plan the gathers of the summed blocks; returns every rank's C block."""
    if plan.gather_stage is not None:
        split = plan.gather_stage.c
        summed = simulate(plan.gather_stage, a, b)
        blocks = []
        for rank in range(plan.nranks):
            full = np.full(plan.c.shape, np.nan)
            full[split.local_slices(rank)] = summed[rank]
            for t in plan.gathers_by(rank):
                full[split.local_slices(t.target)] = summed[t.target]
            blocks.append(full)
        return blocks
    products_by_rank = {}
    for m in plan.multiplies:
        products_by_rank[(m.rank, m.rows, m.inner, m.cols)] = (
            a[slice(*m.rows), slice(*m.inner)] @ b[slice(*m.inner), slice(*m.cols)]
        )
    blocks = [np.zeros(plan.c.local_shape(r)) for r in range(plan.nranks)]

    def deliver(origin, target, rows, cols, inner):
        part = sum(products_by_rank[(origin, rows, k, cols)] for k in inner)
        (r0, _), (c0, _) = plan.c.blocks[target]
        blocks[target][rows[0] - r0 : rows[1] - r0, cols[0] - c0 : cols[1] - c0] += part

    for u in plan.local_updates:
        deliver(u.rank, u.rank, u.rows, u.cols, u.inner)
    for t in plan.transfers:
        if t.op != "get":
            deliver(t.origin, t.target, t.rows, t.cols, t.inner)
    return blocks
