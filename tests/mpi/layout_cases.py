"""The layouts the collective product tests sweep: every kind, with unequal (and empty) blocks.

Shared by test_matmul.py (on the CPU) and test_gpu.py (the same sweep on a GPU).
"""

from __future__ import annotations

from mpi4py import MPI

import osmm_jax as om

SIZE = MPI.COMM_WORLD.Get_size()
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
