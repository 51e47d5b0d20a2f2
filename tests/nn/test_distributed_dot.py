"""The pure argument checks behind osmm_jax.flax (no MPI, no JAX)."""

from __future__ import annotations

import numpy as np
import pytest

from osmm_jax._src.nn.distributed_dot import check_row_sizes, input_error, local_rows


def test_row_sizes_are_normalised_to_ints():
    assert check_row_sizes([3, 0, np.int64(2)], 3) == (3, 0, 2)
    assert check_row_sizes(range(2), 2) == (0, 1)
    assert all(type(s) is int for s in check_row_sizes(np.array([1, 2]), 2))


@pytest.mark.parametrize(
    "row_sizes, error, message",
    [
        (None, TypeError, "row_sizes is required"),
        (4, TypeError, "sequence of row counts"),
        ([1, 2], ValueError, "has 2 entries but the communicator has 3 ranks"),
        ([1, -1, 2], ValueError, r"row_sizes\[1\] must be at least 0"),
        ([1, 2.0, 2], TypeError, r"row_sizes\[1\] must be an integer"),
        ([True, 1, 1], TypeError, r"row_sizes\[0\] must be an integer"),
    ],
)
def test_bad_row_sizes(row_sizes, error, message):
    with pytest.raises(error, match=message):
        check_row_sizes(row_sizes, 3)


def test_leading_dimensions_flatten_to_rows():
    assert local_rows((4, 5)) == 4
    assert local_rows((2, 3, 5)) == 6
    assert local_rows((0, 3, 5)) == 0


def test_input_errors_say_expected_and_got():
    assert input_error((2, 3, 5), (5, 4), (6, 1), rank=0) is None
    assert input_error((0, 5), (5, 4), (6, 0), rank=1) is None
    message = input_error((2, 3, 5), (5, 4), (6, 1), rank=1)
    assert (
        "expected 1 local input rows (row_sizes[1] of [6, 1], 7 rows in all) but got 6" in message
    )
    assert "at least 2 dimensions" in input_error((5,), (5, 4), (1,), rank=0)
    assert "has 5 features but the kernel has shape (6, 4)" in input_error((1, 5), (6, 4), (1,), 0)
