"""The pure checks and checkpoint helpers behind the tensor-parallel layers (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from osmm_jax._src.tensor_parallel import (
    check_sizes,
    check_split,
    input_error,
    join_params,
    shard_params,
    span,
)


def test_sizes_are_normalised_to_ints():
    assert check_sizes([3, 0, np.int64(2)], 3, 5) == (3, 0, 2)
    assert check_sizes(range(3), 3) == (0, 1, 2)  # no total: no sum check
    assert all(type(s) is int for s in check_sizes(np.array([1, 2]), 2, 3))


@pytest.mark.parametrize(
    "sizes, error, message",
    [
        (None, TypeError, "sizes is required"),
        (4, TypeError, "sequence of counts of kernel columns"),
        ([1, 4], ValueError, "has 2 entries but the communicator has 3 ranks"),
        ([1, -1, 5], ValueError, r"sizes\[1\] must be at least 0"),
        ([1, 2.0, 2], TypeError, r"sizes\[1\] must be an integer"),
        ([True, 2, 2], TypeError, r"sizes\[0\] must be an integer"),
        ([1, 1, 1], ValueError, "sum to 3 but the kernel has 5 columns"),
    ],
)
def test_bad_sizes(sizes, error, message):
    with pytest.raises(error, match=message):
        check_sizes(sizes, 3, 5)


def test_split_names_and_spans():
    assert check_split("row") == "row"
    with pytest.raises(ValueError, match="'column' or 'row'"):
        check_split("cols")
    assert [span([2, 0, 3], r) for r in range(3)] == [slice(0, 2), slice(2, 2), slice(2, 5)]


def test_input_errors_say_expected_and_got():
    assert input_error("column", (2, 3, 4), 4, (2, 0, 3), rank=1) is None
    assert "has 5 features but the kernel has 4 rows" in input_error("column", (2, 5), 4, (5,), 0)
    assert input_error("row", (2, 0), 5, (2, 0, 3), rank=1) is None
    message = input_error("row", (2, 3), 5, (2, 0, 3), rank=0)
    assert "expected 2 local input features (sizes[0] of [2, 0, 3], 5 in all) but got 3" in message
    assert "scalar" in input_error("row", (), 5, (5,), 0)


@pytest.mark.parametrize("split", ["column", "row"])
def test_shards_join_back_to_the_stock_parameters(split):
    rng = np.random.default_rng(0)
    stock = {"kernel": rng.standard_normal((5, 4)), "bias": rng.standard_normal(4)}
    sizes = [3, 0, 1] if split == "column" else [2, 3, 0]
    shards = [shard_params(stock, sizes, r, split=split) for r in range(3)]
    if split == "column":
        assert [s["kernel"].shape for s in shards] == [(5, 3), (5, 0), (5, 1)]
        assert [s["bias"].shape for s in shards] == [(3,), (0,), (1,)]
    else:
        assert [s["kernel"].shape for s in shards] == [(2, 4), (3, 4), (0, 4)]
        assert all(s["bias"] is stock["bias"] for s in shards)  # replicated
    joined = join_params(shards, split=split)
    np.testing.assert_array_equal(joined["kernel"], stock["kernel"])
    np.testing.assert_array_equal(joined["bias"], stock["bias"])
    no_bias = [shard_params({"kernel": stock["kernel"]}, sizes, r, split=split) for r in range(3)]
    assert set(join_params(no_bias, split=split)) == {"kernel"}


def test_shard_params_checks_its_arguments():
    stock = {"kernel": np.zeros((5, 4))}
    with pytest.raises(ValueError, match="sum to 3 but the kernel has 4 columns"):
        shard_params(stock, [1, 2], 0, split="column")
    with pytest.raises(ValueError, match="sum to 4 but the kernel has 5 rows"):
        shard_params(stock, [2, 2], 0, split="row")
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        shard_params(stock, [2, 2], 2, split="column")
    with pytest.raises(ValueError, match=r"expected \(in, out\)"):
        shard_params({"kernel": np.zeros(4)}, [4], 0, split="column")
    with pytest.raises(ValueError, match="none"):
        join_params([], split="row")
