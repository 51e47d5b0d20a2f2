"""The per-rank counts check shared by row_sizes, sizes and batch_sizes (no MPI, no JAX)."""

from __future__ import annotations

import numpy as np
import pytest

from osmm_jax._src.nn.rank_counts import counts_per_rank


def _check(values, *, required=None, any_iterable=True):
    return counts_per_rank(
        values,
        3,
        "counts",
        entries="apples",
        give="one apple count per rank",
        required=required,
        any_iterable=any_iterable,
    )


def test_counts_are_normalised_to_ints():
    assert _check([3, 0, np.int64(2)]) == (3, 0, 2)
    assert _check(np.array([1, 2, 3])) == (1, 2, 3)
    assert all(type(c) is int for c in _check(np.array([1, 2, 3])))
    assert _check(c for c in (0, 1, 2)) == (0, 1, 2)  # any iterable


@pytest.mark.parametrize(
    "values, error, message",
    [
        (4, TypeError, "counts must be a sequence of apples, one per rank, got 4"),
        (None, TypeError, "counts must be a sequence of apples, one per rank, got None"),
        ([1, 2], ValueError, r"counts \[1, 2\] has 2 entries but the communicator has 3 ranks: "),
        ([1, 2], ValueError, "give one apple count per rank"),
        ([1, -1, 2], ValueError, r"counts\[1\] must be at least 0"),
        ([1, 2.0, 2], TypeError, r"counts\[1\] must be an integer"),
        ([True, 1, 1], TypeError, r"counts\[0\] must be an integer"),
    ],
)
def test_bad_counts_name_the_argument(values, error, message):
    with pytest.raises(error, match=message):
        _check(values)


def test_a_required_argument_says_what_it_needs():
    with pytest.raises(TypeError, match="counts is required: the apples each rank holds"):
        _check(None, required="the apples each rank holds")


def test_only_sized_values_unless_any_iterable():
    assert _check((0, 1, 2), any_iterable=False) == (0, 1, 2)
    assert _check(np.array([0, 1, 2]), any_iterable=False) == (0, 1, 2)
    for values in ("012", (c for c in (0, 1, 2))):
        with pytest.raises(TypeError, match="counts must be a sequence of apples"):
            _check(values, any_iterable=False)
    # Taken as an iterable, a string's characters are not integers.
    with pytest.raises(TypeError, match=r"counts\[0\] must be an integer"):
        _check("012")
