"""The communication lower bound (osmm_jax._src.planning.comm_bound) and its benchmark table."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from osmm_jax._src.planning.comm_bound import moved_elements, moved_lower_bound, rank_bounds
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan


def test_no_movement_when_the_owned_pieces_suffice():
    assert moved_lower_bound(0, (4, 4, 4), (0, 0, 0)) == 0
    assert moved_lower_bound(8, (4, 4, 4), (4, 4, 4)) == 0  # one rank owns everything
    assert rank_bounds(16, 16, 16, [1.0]) == (0.0,)


def test_unlimited_matrices_give_cosma_three_v_to_the_two_thirds():
    v = 1e9
    big = 1e30
    assert moved_lower_bound(v, (big, big, big), (0, 0, 0)) == pytest.approx(3 * v ** (2 / 3))


def test_the_water_filling_optimum_is_not_beaten_by_any_feasible_point():
    rng = random.Random(7)
    for _ in range(40):
        sizes = [rng.uniform(50, 400) for _ in range(3)]
        owned = [rng.uniform(0, s / 2) for s in sizes]
        v = math.sqrt(sizes[0] * sizes[1] * sizes[2]) * rng.uniform(0.05, 0.95)
        bound = moved_lower_bound(v, sizes, owned)
        steps = 60
        best = math.inf
        for fa, fb in itertools.product(range(steps + 1), repeat=2):
            xa = owned[0] + (sizes[0] - owned[0]) * fa / steps
            xb = owned[1] + (sizes[1] - owned[1]) * fb / steps
            if xa <= 0 or xb <= 0:
                continue
            xc = max(owned[2], v * v / (xa * xb))
            if xc > sizes[2] * (1 + 1e-12):
                continue
            best = min(best, (xa - owned[0]) + (xb - owned[1]) + (xc - owned[2]))
        assert bound <= best * (1 + 1e-9)
        assert best <= bound * 1.05 + 1e-6  # the grid search comes close to it


def test_impossible_work_is_an_error():
    with pytest.raises(ValueError, match="do not fit"):
        moved_lower_bound(1e6, (10, 10, 10), (0, 0, 0))
    with pytest.raises(ValueError, match="all be zero"):
        rank_bounds(4, 4, 4, [0.0, 0.0])


def test_planner_volumes_against_the_bound():
    # A 2-D grid on a square product at P = 4 moves SUMMA's volume, 1.13x the bound; the
    # K-split of a K-large product moves exactly the bound.
    shape = (8192, 8192)
    grid = Plan(*(Layout.grid(shape, (2, 2)) for _ in range(3)))
    ratio = max(moved_elements(grid)) / max(rank_bounds(8192, 8192, 8192, [1.0] * 4))
    assert ratio == pytest.approx(1.125, abs=0.01)
    k_split = Plan(
        Layout.cols((2048, 65536), nranks=4),
        Layout.rows((65536, 2048), nranks=4),
        Layout.rows((2048, 2048), nranks=4),
    )
    ratio = max(moved_elements(k_split)) / max(rank_bounds(2048, 65536, 2048, [1.0] * 4))
    assert ratio == pytest.approx(1.0, rel=1e-6)


def test_moved_elements_counts_gets_at_the_getter_and_partials_at_the_sender():
    a = Layout.rows((4, 6), nranks=2)
    b = Layout.rows((6, 8), nranks=2)
    c = Layout.rows((4, 8), nranks=2)
    plan = Plan(a, b, c)
    moved = moved_elements(plan)
    expected = [0, 0]
    for t in plan.transfers:
        if t.origin != t.target:
            expected[t.origin] += t.elements
    assert list(moved) == expected and sum(moved) > 0


def test_the_benchmark_table():
    from benchmarks import layout_bounds

    report = layout_bounds.run(
        shapes={"K-large": (256, 8192, 256)}, ranks=(4,), mixes=layout_bounds.MIXES
    )
    rows = report["results"]
    assert [r["mix"] for r in rows] == ["equal", "1:1:2:2"]
    assert all(r["chosen"] == "k_split" for r in rows)
    assert rows[0]["chosen_ratio"] == pytest.approx(1.0, rel=1e-6)
    table = layout_bounds.markdown(report)
    assert "| K-large (256 x 8192 x 256) | 4 | equal | k_split | 1.00 |" in table


def test_one_entry_per_matrix():
    with pytest.raises(ValueError, match="one entry each"):
        moved_lower_bound(8, (4, 4, 4), (1, 1, 1, 1))
