"""Fixtures shared by the planning tests."""

from __future__ import annotations

import pytest

from osmm_jax._src.planning.layout import Layout


@pytest.fixture
def example_layouts() -> tuple[Layout, Layout, Layout]:
    """The worked example of the cell and schedule tests: 2 ranks, A (4x6) split by rows 1:3,
    B (6x5) by rows 2:4, C (4x5) by columns 3:2.

    M is cut at A's rows, K at B's rows, N at C's columns: cell (mi, ki, ni) has its A piece
    on rank mi, its B piece on rank ki and its C piece on rank ni.
    """
    return (
        Layout.rows((4, 6), sizes=[1, 3]),
        Layout.rows((6, 5), sizes=[2, 4]),
        Layout.cols((4, 5), sizes=[3, 2]),
    )
