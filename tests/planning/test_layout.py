"""Layouts, without MPI or JAX: constructors, validation, blocks, transposes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layouts, weights

from osmm_jax._src.planning import layout as layout_module
from osmm_jax._src.planning.layout import Layout, split_sizes


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 8).flatmap(lambda p: weights(p)))
def test_split_sizes_is_proportional_and_exact(total, ws):
    sizes = split_sizes(total, len(ws), ws)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    for s, w in zip(sizes, ws):
        assert abs(s - total * w / math.fsum(ws)) < 1
        if w == 0:
            assert s == 0


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5)
    .flatmap(lambda p: st.tuples(st.just(p), st.integers(0, 9), st.integers(0, 9)))
    .flatmap(lambda t: st.tuples(st.just(t), layouts((t[1], t[2]), t[0])))
)
def test_blocks_partition_or_replicate_the_matrix(args):
    (nranks, rows, cols), layout = args
    x = np.arange(rows * cols).reshape(rows, cols)
    seen = np.zeros_like(x)
    for r in range(nranks):
        block = layout.shard(x, r)
        assert block.shape == layout.local_shape(r)
        row_slice, col_slice = layout.local_slices(r)
        np.testing.assert_array_equal(block, x[row_slice, col_slice])
        seen[row_slice, col_slice] += 1
    assert (seen == (nranks if layout.is_replicated else 1)).all()
    assert layout.T.T == layout
    for r in range(nranks):
        assert layout.T.local_shape(r) == layout.local_shape(r)[::-1]


def test_constructors():
    rows = Layout.rows((10, 3), weights=[1, 0, 4])
    assert rows.blocks == (((0, 2), (0, 3)), ((2, 2), (0, 3)), ((2, 10), (0, 3)))
    assert rows.local_shape(1) == (0, 3)
    cols = Layout.cols((3, 7), sizes=[0, 7])
    assert cols.local_shape(0) == (3, 0) and cols.local_shape(1) == (3, 7)
    grid = Layout.grid((4, 6), (2, 3))
    assert grid.nranks == 6
    assert grid.local_slices(4) == (
        slice(2, 4),
        slice(2, 4),
    )  # rank i*pc + j owns block (i, j) = (1, 1)
    rep = Layout.replicated((3, 3), nranks=4)
    assert rep.is_replicated and all(rep.local_shape(r) == (3, 3) for r in range(4))
    assert hash(rows) == hash(Layout.rows((10, 3), weights=[1, 0, 4]))
    assert Layout.rows((9, 2), nranks=3) == Layout.rows((9, 2), sizes=[3, 3, 3])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Layout.rows((4, 4), weights=[1, -1]), "non-negative"),
        (lambda: Layout.rows((4, 4), weights=[1, float("nan")]), "finite"),
        (lambda: Layout.rows((4, 4), weights=[0, 0]), "all zero"),
        (lambda: Layout.rows((4, 4), sizes=[1, 2]), "sum to 3, not to the dimension 4"),
        (lambda: Layout.rows((4, 4), sizes=[5, -1]), "non-negative"),
        (lambda: Layout.rows((4, 4), weights=[1, 1], nranks=3), "2 entries but there are 3 ranks"),
        (lambda: Layout.cols((4, 4), weights=[1], sizes=[4]), "either weights or sizes"),
        (lambda: Layout.grid((4, 4), (2, 2), row_weights=[1]), "1 entries but there are 2 ranks"),
        (lambda: Layout.grid((4, 4), (0, 2)), "at least 1"),
        (lambda: Layout.rows((4, 4, 4), nranks=2), "2-D"),
        (lambda: Layout.rows((4, -1), nranks=2), "non-negative"),
        (lambda: Layout.replicated((4, 4), nranks=0), "at least 1"),
        (lambda: Layout((4, 4), (((0, 4), (0, 3)), ((0, 4), (2, 4)))), "cover 20 elements"),
        (lambda: Layout((4, 4), (((0, 2), (0, 4)), ((1, 3), (0, 2)), ((3, 4), (0, 4)))), "overlap"),
    ],
)
def test_bad_layouts_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_types_raise_type_errors():
    with pytest.raises(TypeError):
        Layout.rows((4.5, 4), nranks=2)
    with pytest.raises(TypeError):
        Layout.rows((4, 4), weights=["a", 1])
    with pytest.raises(ValueError, match="out of range"):
        Layout.rows((4, 4), nranks=2).local_shape(2)
    with pytest.raises(ValueError, match="global array of shape"):
        Layout.rows((4, 4), nranks=2).shard(np.zeros((3, 4)), 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Layout.rows((10, 4), sizes=[5.0, 5.0]), r"sizes\[0\] must be an integer, got 5.0"),
        (lambda: Layout.rows((10, 4), sizes=[4.5, 5.5]), r"sizes\[0\] must be an integer, got 4.5"),
        (lambda: Layout.cols((4, 10), sizes=[5, np.float64(5)]), r"sizes\[1\] must be an integer"),
        (lambda: Layout.rows((10, 4), sizes=[True, 9]), r"sizes\[0\] must be an integer"),
        (lambda: Layout.grid((4, 4), (2, 1), row_sizes=[2.0, 2]), r"row_sizes\[0\]"),
        (lambda: Layout.grid((4, 4), (1, 2), col_sizes=[2, 2.0]), r"col_sizes\[1\]"),
        (
            lambda: Layout((10, 4), (((0, 4.5), (0, 4)), ((4.5, 10), (0, 4)))),
            r"blocks\[0\]\[0\]\[1\] must be an integer, got 4.5",
        ),
    ],
)
def test_sizes_and_bounds_must_be_integers_not_floats(make, message):
    """A float size is refused, integral or not: 4.5 rows cannot be split, and accepting 5.0
    would hide a size computed in floating point, whose next value may not be integral."""
    with pytest.raises(TypeError, match=message):
        make()


def test_numpy_integer_sizes_are_integers():
    assert Layout.rows((10, 4), sizes=[np.int64(4), np.int32(6)]) == Layout.rows(
        (10, 4), sizes=[4, 6]
    )


def test_nranks_none_asks_the_installed_resolver():
    previous = layout_module.set_default_nranks(lambda: 5)
    try:
        assert previous is not None  # the package installs one when imported
        assert Layout.rows((10, 2)).nranks == 5
        assert Layout.cols((2, 10)).nranks == 5
        assert Layout.replicated((3, 3)).nranks == 5
        assert Layout.rows((10, 2), weights=[1, 2]).nranks == 2  # weights give the count
        layout_module.set_default_nranks(None)
        with pytest.raises(ValueError, match="nranks is required"):
            Layout.rows((10, 2))
        assert Layout.rows((10, 2), nranks=3).nranks == 3
    finally:
        layout_module.set_default_nranks(previous)


def test_reason_is_carried_but_not_compared():
    plain = Layout.rows((6, 2), nranks=3)
    chosen = dataclasses.replace(plain, reason="picked")
    assert chosen.reason == "picked" and plain.reason == ""
    assert chosen == plain and hash(chosen) == hash(plain)
    assert chosen.T.reason == ""  # the transpose was not chosen


_intervals = st.integers(0, 6).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, 6)))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(_intervals, _intervals), min_size=1, max_size=9))
def test_overlap_sweep_agrees_with_the_pairwise_test(blocks):
    nonempty = [b for b in blocks if layout_module._area(b)]
    pairwise = any(
        layout_module._overlap(a, b) for i, a in enumerate(nonempty) for b in nonempty[i + 1 :]
    )
    assert layout_module._any_overlap(blocks) == pairwise


def test_overlap_is_named_by_the_first_pair_in_rank_order():
    # The right area, but rank 2 repeats row 1 of rank 0 and row 2 is nobody's.
    blocks = (((0, 2), (0, 4)), ((3, 4), (0, 4)), ((1, 2), (0, 4)), ((0, 0), (0, 0)))
    with pytest.raises(ValueError, match=r"ranks 0 and 2 overlap"):
        Layout((4, 4), blocks)


def test_thousands_of_ranks_validate_quickly():
    # Pairwise validation took seconds here; the sweep takes milliseconds.
    import time

    start = time.perf_counter()
    Layout.rows((100_000, 8), nranks=20_000)
    Layout.grid((4096, 4096), (128, 128))
    assert time.perf_counter() - start < 5
