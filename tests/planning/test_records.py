"""The rectangle helpers of the planner's records (osmm_jax._src.planning.records)."""

from __future__ import annotations

from osmm_jax._src.planning import records


def test_tiles_that_do_not_cover_a_rectangle_are_not_merged():
    assert records.tiled_rectangle([((0, 2), (0, 3)), ((2, 4), (0, 3))]) == ((0, 4), (0, 3))
    assert records.tiled_rectangle([((0, 2), (0, 3)), ((0, 2), (3, 5))]) == ((0, 2), (0, 5))
    grid = [((r, r + 2), (c, c + 3)) for r in (0, 2) for c in (0, 3)]
    assert records.tiled_rectangle(grid) == ((0, 4), (0, 6))
    assert records.tiled_rectangle([((0, 2), (0, 3)), ((3, 4), (0, 3))]) is None  # a gap
    assert records.tiled_rectangle(grid[:3]) is None  # a corner missing
    assert records.tiled_rectangle([((0, 2), (0, 3))] * 2) is None  # twice the same tile
