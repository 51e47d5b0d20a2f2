"""The shared argument checks: what each accepts, converts and rejects, and with which message."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from osmm_jax._src import checks

NOT_NUMBERS = [None, "fast", "", [1.0], {}, object(), 1j]
"""Values no check takes for a number (``float()`` fails on them)."""

BOOLS = [True, False]


def re_repr(value) -> str:
    """``repr(value)`` escaped for a regular expression."""
    return re.escape(repr(value))


# -- integer ------------------------------------------------------------------------------


@given(st.integers(), st.integers(-5, 5))
def test_integer_accepts_every_int_at_least_the_minimum(value, minimum):
    if value >= minimum:
        out = checks.integer(value, "n", minimum)
        assert out == value and type(out) is int
    else:
        with pytest.raises(ValueError, match=f"n must be at least {minimum}"):
            checks.integer(value, "n", minimum)


def test_integer_takes_numpy_integers_as_plain_ints():
    out = checks.integer(np.int64(7), "n")
    assert out == 7 and type(out) is int


@pytest.mark.parametrize("value", [2.5, 2.0, "3", None, np.float64(2.0), *BOOLS])
def test_integer_rejects_non_integers_and_bools_with_type_error(value):
    with pytest.raises(TypeError, match=rf"^count must be an integer, got {re_repr(value)}$"):
        checks.integer(value, "count")


def test_integer_messages_name_the_bound():
    with pytest.raises(ValueError, match=r"^total must be at least 0 \(non-negative\), got -1$"):
        checks.integer(-1, "total")
    with pytest.raises(ValueError, match=r"^size must be at least 1, got 0$"):
        checks.integer(0, "size", 1)


# -- real ---------------------------------------------------------------------------------


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**6), 10**6))
def test_real_takes_any_number_as_a_float(value):
    out = checks.real(value, "x")
    assert type(out) is float
    assert out == float(value) or (math.isnan(out) and math.isnan(value))


@pytest.mark.parametrize("value", [Fraction(1, 4), np.float32(0.25), "0.25"])
def test_real_takes_what_float_takes(value):
    assert checks.real(value, "x") == 0.25


@pytest.mark.parametrize("value", NOT_NUMBERS + BOOLS)
def test_real_rejects_non_numbers_and_bools_with_type_error(value):
    with pytest.raises(TypeError, match=rf"^cap must be a number, got {re_repr(value)}$"):
        checks.real(value, "cap")


# -- at_least -----------------------------------------------------------------------------


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(-10, 10))
def test_at_least_compares_finite_values_with_the_minimum(value, minimum):
    if value >= minimum:
        assert checks.at_least(value, "sigma", minimum) == value
        assert checks.at_least(value, "sigma", minimum, allow_inf=True) == value
    else:
        with pytest.raises(
            ValueError, match=f"sigma must be finite and at least {re.escape(str(minimum))}"
        ):
            checks.at_least(value, "sigma", minimum)
        with pytest.raises(
            ValueError, match=f"ratio must be at least {re.escape(str(minimum))}, got"
        ):
            checks.at_least(value, "ratio", minimum, allow_inf=True)


def test_at_least_never_takes_nan_and_takes_inf_only_when_allowed():
    with pytest.raises(ValueError, match=r"^tolerance must be finite and at least 0\.0, got nan$"):
        checks.at_least(math.nan, "tolerance", 0.0)
    with pytest.raises(ValueError, match=r"^ratio must be at least 1\.0, got nan$"):
        checks.at_least(math.nan, "ratio", 1.0, allow_inf=True)
    with pytest.raises(ValueError, match=r"^sigma must be finite and at least 0, got inf$"):
        checks.at_least(math.inf, "sigma", 0)
    assert checks.at_least(math.inf, "ratio", 1.0, allow_inf=True) == math.inf
    with pytest.raises(ValueError, match=r"^ratio must be at least 1\.0, got -inf$"):
        checks.at_least(-math.inf, "ratio", 1.0, allow_inf=True)


def test_at_least_reports_the_value_as_given():
    with pytest.raises(ValueError, match=r"^noise_threshold must be at least 0, got -1$"):
        checks.at_least(-1, "noise_threshold", 0, allow_inf=True)
    assert type(checks.at_least(3, "sigma", 0)) is float


@pytest.mark.parametrize("value", NOT_NUMBERS + BOOLS)
def test_at_least_rejects_non_numbers_with_type_error(value):
    with pytest.raises(TypeError, match="^ratio must be a number"):
        checks.at_least(value, "ratio", 1.0, allow_inf=True)


# -- positive_real ------------------------------------------------------------------------


@given(st.floats(min_value=0.0, exclude_min=True, allow_infinity=False))
def test_positive_real_takes_finite_positive_floats(value):
    assert checks.positive_real(value, "bandwidth") == value


@pytest.mark.parametrize("value", [0, 0.0, -0.0, -5e9, math.nan, math.inf, -math.inf])
def test_positive_real_rejects_zero_negative_and_non_finite(value):
    with pytest.raises(
        ValueError, match=rf"^bandwidth must be finite and > 0, got {re_repr(value)}$"
    ):
        checks.positive_real(value, "bandwidth")


@pytest.mark.parametrize("value", NOT_NUMBERS + BOOLS)
def test_positive_real_rejects_non_numbers_with_type_error(value):
    with pytest.raises(TypeError, match="^flops_per_row must be a number"):
        checks.positive_real(value, "flops_per_row")


# -- non_negative_reals -------------------------------------------------------------------

finite_non_negative = st.floats(min_value=0.0, allow_infinity=False)


@given(st.lists(finite_non_negative | st.integers(0, 10**6), max_size=8))
def test_non_negative_reals_converts_every_value(values):
    out = checks.non_negative_reals(values, "spread")
    assert out == tuple(float(v) for v in values)
    assert all(type(v) is float for v in out)


def test_non_negative_reals_takes_any_iterable():
    assert checks.non_negative_reals(np.array([1, 2]), "w") == (1.0, 2.0)
    assert checks.non_negative_reals((v for v in [0.5]), "w") == (0.5,)
    assert checks.non_negative_reals([], "w") == ()


@given(
    st.lists(finite_non_negative, max_size=5), st.floats(max_value=-1e-300, allow_infinity=False)
)
def test_non_negative_reals_names_the_first_negative_value(values, bad):
    i = len(values)
    with pytest.raises(ValueError, match=rf"^spread\[{i}\] is .*: spread must be non-negative$"):
        checks.non_negative_reals([*values, bad, -1.0], "spread")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_negative_reals_rejects_non_finite_values(bad):
    with pytest.raises(ValueError, match=rf"^spread\[1\] is {bad}: spread must be finite$"):
        checks.non_negative_reals([1.0, bad], "spread")


@pytest.mark.parametrize("values", ["12", b"12", 3, None, 1.5, np.float64(2.0), np.array(2.0)])
def test_non_negative_reals_rejects_non_sequences_with_type_error(values):
    with pytest.raises(TypeError, match="^spread must be a sequence of numbers, got"):
        checks.non_negative_reals(values, "spread")


@pytest.mark.parametrize("item", NOT_NUMBERS + BOOLS)
def test_non_negative_reals_rejects_non_number_items_with_type_error(item):
    with pytest.raises(TypeError, match=rf"^spread\[1\] must be a number, got {re_repr(item)}$"):
        checks.non_negative_reals([1.0, item], "spread")


# -- speeds -------------------------------------------------------------------------------


@given(st.lists(finite_non_negative, min_size=1, max_size=8).filter(any))
def test_speeds_takes_non_negative_values_not_all_zero(values):
    assert checks.speeds(values) == tuple(values)


def test_speeds_takes_a_generator_and_numpy_arrays():
    assert checks.speeds(s for s in (1, 0)) == (1.0, 0.0)
    assert checks.speeds(np.array([2.0, 3.0])) == (2.0, 3.0)


@pytest.mark.parametrize("empty", [[], (), np.array([]), iter([])])
def test_speeds_rejects_an_empty_sequence_naming_what_one_value_is(empty):
    with pytest.raises(ValueError, match=r"^speeds is empty: give one \(GFLOP/s\) per rank$"):
        checks.speeds(empty)
    with pytest.raises(ValueError, match=r"^weights is empty: give one \(share\) per rank$"):
        checks.speeds(empty, "share", name="weights")


@given(st.integers(1, 6))
def test_speeds_rejects_all_zero(n):
    with pytest.raises(ValueError, match=r"^speeds \[0\.0.*\] are all zero: at least one rank"):
        checks.speeds([0] * n)


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ([1, -1], ValueError, r"^speeds\[1\] is -1\.0: speeds must be non-negative$"),
        ([1, math.nan], ValueError, r"^speeds\[1\] is nan: speeds must be finite$"),
        ([math.inf], ValueError, r"^speeds\[0\] is inf: speeds must be finite$"),
        ([1, "fast"], TypeError, r"^speeds\[1\] must be a number, got 'fast'$"),
        ([1, True], TypeError, r"^speeds\[1\] must be a number, got True$"),
        ("12", TypeError, r"^speeds must be a sequence of numbers, got '12'$"),
        (5, TypeError, r"^speeds must be a sequence of numbers, got 5$"),
    ],
)
def test_speeds_rejects_bad_values(values, error, match):
    with pytest.raises(error, match=match):
        checks.speeds(values)


# -- positive_speeds ----------------------------------------------------------------------


@given(st.lists(st.floats(min_value=0.0, exclude_min=True, allow_infinity=False), max_size=8))
def test_positive_speeds_takes_exactly_nranks_positive_values(values):
    assert checks.positive_speeds(values, len(values)) == tuple(values)
    with pytest.raises(
        ValueError, match=f"^speeds has {len(values)} values but there are {len(values) + 1} ranks$"
    ):
        checks.positive_speeds(values, len(values) + 1)


@pytest.mark.parametrize("bad", [0.0, -3.0, math.inf, math.nan])
def test_positive_speeds_rejects_non_positive_and_non_finite_speeds(bad):
    match = rf"^OSMM_SPEEDS='x': rank 1's speed is {bad}; speeds must be finite and > 0$"
    with pytest.raises(ValueError, match=match):
        checks.positive_speeds([1.0, bad], 2, "OSMM_SPEEDS='x'")


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([1.0, "fast"], r"^speeds\[1\] must be a number, got 'fast'$"),
        ([False, 1.0], r"^speeds\[0\] must be a number, got False$"),
        ("12", r"^speeds must be a sequence of numbers, got '12'$"),
        (None, r"^speeds must be a sequence of numbers, got None$"),
    ],
)
def test_positive_speeds_rejects_non_numbers_with_type_error(values, match):
    with pytest.raises(TypeError, match=match):
        checks.positive_speeds(values, 2)
