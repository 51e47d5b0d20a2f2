"""The pure checks and checkpoint helpers behind the tensor-parallel layers (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from osmm_jax._src.nn.tensor_parallel import (
    TensorParallelDot,
    check_batch_sizes,
    check_sizes,
    check_split,
    cut_param,
    input_error,
    join_params,
    shard_params,
    span,
    unsupported_error,
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


def test_batch_sizes_are_normalised_to_ints():
    assert check_batch_sizes([2, 0, np.int64(1)], 3) == (2, 0, 1)
    assert check_batch_sizes((0, 0), 2) == (0, 0)  # no entries at all is allowed
    assert check_batch_sizes(range(3), 3) == (0, 1, 2)
    out = check_batch_sizes(np.array([1, 2]), 2)
    assert out == (1, 2) and all(type(s) is int for s in out)


@pytest.mark.parametrize(
    "batch_sizes, error, message",
    [
        (None, TypeError, "batch_sizes must be a sequence of batch entries, one per rank"),
        (3, TypeError, "batch_sizes must be a sequence of batch entries, one per rank, got 3"),
        ("123", TypeError, "batch_sizes must be a sequence of batch entries"),
        ([1, 4], ValueError, r"batch_sizes \[1, 4\] has 2 entries but the communicator has 3"),
        ([1, 2, 3, 4], ValueError, "has 4 entries but the communicator has 3 ranks"),
        ([1, -1, 5], ValueError, r"batch_sizes\[1\] must be at least 0"),
        ([1, 2.0, 2], TypeError, r"batch_sizes\[1\] must be an integer"),
        ([1, 2, 2.5], TypeError, r"batch_sizes\[2\] must be an integer"),
        ([True, 2, 2], TypeError, r"batch_sizes\[0\] must be an integer"),
        ([1, None, 2], TypeError, r"batch_sizes\[1\] must be an integer"),
    ],
)
def test_bad_batch_sizes(batch_sizes, error, message):
    with pytest.raises(error, match=message):
        check_batch_sizes(batch_sizes, 3)


BATCH, SIZES = (2, 0, 1), (2, 0, 3)


@pytest.mark.parametrize(
    "split, shape, in_features, rank",
    [
        # Column-parallel: this rank's own entries, then the whole input's features.
        ("column", (2, 5, 4), 4, 0),
        ("column", (0, 5, 4), 4, 1),
        ("column", (1, 4), 4, 2),
        # Row-parallel: every rank's entries, then this rank's features.
        ("row", (3, 5, 2), 5, 0),
        ("row", (3, 0), 5, 1),
    ],
)
def test_inputs_of_the_right_batch_entries_pass(split, shape, in_features, rank):
    assert input_error(split, shape, in_features, SIZES, rank, BATCH) is None


@pytest.mark.parametrize(
    "split, shape, in_features, message",
    [
        (
            "column",
            (3, 5, 4),
            4,
            "the input has 3 batch entries (shape (3, 5, 4)) but this rank's batch_sizes[0] is 2 "
            "(batch_sizes [2, 0, 1])",
        ),
        (
            "row",
            (2, 5, 2),
            5,
            "the input has 2 batch entries (shape (2, 5, 2)) but every rank's (the sum of "
            "batch_sizes) is 3 (batch_sizes [2, 0, 1])",
        ),
    ],
)
def test_inputs_of_other_batch_entries_are_named(split, shape, in_features, message):
    assert input_error(split, shape, in_features, SIZES, 0, BATCH) == message


def test_input_errors_with_batch_sizes_name_the_batch_entries():
    batch, sizes = BATCH, SIZES
    assert "this rank's batch_sizes[1] is 0" in input_error("column", (2, 5, 4), 4, sizes, 1, batch)
    # The right entries, the wrong features: the features' message, as without batch_sizes.
    assert "has 5 features but the kernel has 4 rows" in input_error(
        "column", (2, 5), 4, sizes, 0, batch
    )
    assert "expected 3 local input features" in input_error("row", (3, 2), 5, sizes, 2, batch)
    # Both wrong: the batch entries are named first.
    assert "batch entries" in input_error("column", (3, 5), 4, sizes, 0, batch)
    # A batch dimension and features at least; a scalar is still a scalar.
    for split in ("column", "row"):
        message = input_error(split, (4,), 4, sizes, 0, batch)
        assert "with batch_sizes a layer needs (batch, ..., features)" in message
        assert "scalar" in input_error(split, (), 4, sizes, 0, batch)
    # Without batch_sizes the first dimension is free, as before.
    assert input_error("column", (7, 4), 4, sizes, 0) is None
    assert input_error("column", (7, 4), 4, sizes, 0, None) is None
    assert input_error("row", (2,), 5, sizes, 0) is None  # 1-D: one row


def test_batch_sizes_are_part_of_a_products_identity():
    plain = TensorParallelDot("column", [2, 1])
    sequence = TensorParallelDot("column", [2, 1], batch_sizes=[3, 0])
    assert not plain.sequence_parallel and plain.batch_sizes is None
    assert sequence.sequence_parallel and sequence.batch_sizes == (3, 0)  # a list made a tuple
    assert sequence == TensorParallelDot("column", (2, 1), batch_sizes=(3, 0))
    assert hash(sequence) == hash(TensorParallelDot("column", (2, 1), batch_sizes=(3, 0)))
    assert sequence != plain
    assert sequence != TensorParallelDot("column", [2, 1], batch_sizes=[2, 1])
    assert "batch_sizes=(3, 0)" in repr(sequence) and "batch_sizes" not in repr(plain)
    assert sequence.replace(method="allreduce").batch_sizes == (3, 0)
    assert not sequence.replace(batch_sizes=None).sequence_parallel
    # Checked when used, on every rank together, not when built.
    assert TensorParallelDot("row", [2, 1], batch_sizes=5).batch_sizes == 5


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


def test_cut_param_takes_this_ranks_columns_or_rows_and_a_row_parallel_bias_whole():
    kernel, bias = np.arange(20).reshape(5, 4), np.arange(4)
    part = slice(1, 3)
    np.testing.assert_array_equal(cut_param("kernel", kernel, part, split="column"), kernel[:, 1:3])
    np.testing.assert_array_equal(cut_param("kernel", kernel, part, split="row"), kernel[1:3, :])
    np.testing.assert_array_equal(cut_param("bias", bias, part, split="column"), bias[1:3])
    assert cut_param("bias", bias, part, split="row") is bias


def test_completed_prefix_names_what_a_sequence_parallel_product_completes():
    path = ("params", "up")
    assert TensorParallelDot("column", [2, 1]).completed_prefix(path) is None
    assert TensorParallelDot("row", [2, 1]).completed_prefix(path) is None
    column = TensorParallelDot("column", [2, 1], batch_sizes=[1, 1])
    assert column.completed_prefix(path) == path  # kernel and bias
    row = TensorParallelDot("row", [2, 1], batch_sizes=[1, 1])
    assert row.completed_prefix(path) == (*path, "kernel")  # not the bias


def test_unsupported_arguments_are_named():
    assert unsupported_error(None) is None and unsupported_error(None, None) is None
    assert "precision='highest' is not supported" in unsupported_error("highest")
    assert "out_sharding is not supported" in unsupported_error(None, "sharding")
