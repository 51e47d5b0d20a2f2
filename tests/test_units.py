"""Byte counts written for people: the largest binary unit that keeps the number at least 1."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from osmm_jax._src.units import format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1023.4, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (2**20 - 1, "1.02e+03 KiB"),
        (3 * 2**20, "3 MiB"),
        (5 * 2**30, "5 GiB"),
        (2**40, "1.02e+03 GiB"),
        (-1536, "-1.5 KiB"),
        (-12, "-12 B"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@given(st.integers(0, 2**50))
def test_format_bytes_picks_the_largest_unit_not_above_the_count(n):
    number, unit = format_bytes(n).split()
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert n >= size or unit == "B"
    assert unit == "GiB" or n < size * 2**10
    assert float(number) == pytest.approx(n / size, rel=5e-3, abs=0.5)
    assert format_bytes(-n) == (format_bytes(n) if n == 0 else "-" + format_bytes(n))


def test_plot_and_auto_layout_share_it():
    from osmm_jax._src.planning import auto_layout, plot

    assert plot.format_bytes is format_bytes
    assert auto_layout.units.format_bytes is format_bytes
