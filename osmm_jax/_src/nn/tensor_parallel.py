"""The products behind the tensor-parallel layers of :mod:`osmm_jax.flax`.

A tensor-parallel dense layer splits its kernel ``(in, out)`` over the ranks,
unevenly (``sizes[r]`` entries on rank ``r``, possibly 0), and every rank
holds only its shard. Its product is one :func:`osmm_jax.matmul`:

* column-parallel (kernel split by columns, ``sum(sizes) == out``): the input
  ``(M, in)`` is replicated (every rank holds the same rows), the kernel is
  ``Layout.cols((in, out), sizes=sizes)`` and the output
  ``Layout.cols((M, out), sizes=sizes)``: rank ``r`` gets its ``sizes[r]``
  output columns. The forward product moves no data; in the backward pass the
  input's gradient, a replicated result, is summed over ranks (every rank's
  columns contribute to it) and arrives whole on every rank.
* row-parallel (kernel split by rows, ``sum(sizes) == in``): the input is
  ``Layout.cols((M, in), sizes=sizes)`` (rank ``r`` holds ``sizes[r]`` input
  features, e.g. a column-parallel layer's output), the kernel
  ``Layout.rows((in, out), sizes=sizes)`` and the output is replicated: the
  forward product sums every rank's partial onto every rank. The backward
  products are local: the cotangent of a replicated output is the same on
  every rank.

Column then row (Megatron-style) therefore costs one reduction forward (the
row layer's output) and one backward (the column layer's input gradient).

Biases are added outside the product: a column-parallel bias is split like the
output columns (its gradient is this rank's columns' own), a row-parallel bias
is replicated and added once, after the sum (its gradient, from the replicated
cotangent, is already the whole gradient on every rank).

Layout of this module: pure checks and the checkpoint helpers (numpy only, no
JAX, no MPI: testable without ``mpiexec``), then :class:`TensorParallelDot`, then
:func:`gather_params`, which joins the shards on every rank together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from osmm_jax._src import checks
from osmm_jax._src.nn.rank_counts import counts_per_rank

SPLITS = ("column", "row")

# -- pure checks and helpers ------------------------------------------------------------


def check_split(split) -> str:
    """``split`` if it is ``"column"`` or ``"row"``; ValueError otherwise."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'column' or 'row', got {split!r}")
    return split


def check_sizes(sizes, nranks: int, total: int | None = None, *, what: str = "columns"):
    """``sizes`` as a tuple of ``nranks`` non-negative ints summing to ``total``.

    ``what`` names what is split (``"columns"`` of the kernel for a
    column-parallel layer, ``"rows"`` for a row-parallel one), for messages.
    ``total=None`` skips the sum check.

    Raises:
        TypeError: ``sizes`` is missing, not a sequence, or holds a non-integer
            (a float or a bool included).
        ValueError: the wrong number of entries, a negative entry, or a sum
            other than ``total``.
    """
    out = counts_per_rank(
        sizes,
        nranks,
        "sizes",
        entries=f"counts of kernel {what}",
        give=f"the kernel {what} of every rank",
        required=f"the kernel {what} each rank holds, one entry per rank",
    )
    if total is not None and sum(out) != total:
        raise ValueError(
            f"sizes {list(out)} sum to {sum(out)} but the kernel has {total} {what}: the "
            f"sizes must split all {total} of them"
        )
    return out


def check_batch_sizes(batch_sizes, nranks: int) -> tuple[int, ...]:
    """``batch_sizes`` (entries of the activations' batch dimension per rank, for sequence
    parallelism) as a tuple of ``nranks`` non-negative ints.

    Raises:
        TypeError: not a sequence, or a non-integer entry (a float or a bool included).
        ValueError: the wrong number of entries, or a negative one.
    """
    return counts_per_rank(
        batch_sizes,
        nranks,
        "batch_sizes",
        entries="batch entries",
        give="the batch entries of every rank",
        any_iterable=False,
    )


def span(sizes: Sequence[int], rank: int) -> slice:
    """The slice of the split dimension that ``rank`` holds: ``sizes[rank]`` entries."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def input_error(
    split: str,
    shape: Sequence[int],
    in_features: int,
    sizes: Sequence[int],
    rank: int,
    batch_sizes: Sequence[int] | None = None,
) -> str | None:
    """What is wrong with ``rank``'s input of ``shape``, or None.

    Column-parallel: the whole input, ``(..., in_features)``. Row-parallel:
    this rank's ``sizes[rank]`` input features, ``(..., sizes[rank])``. At
    least one dimension either way (leading dimensions flatten to rows, the
    same on every rank). With ``batch_sizes`` (sequence parallelism) the input
    has a batch dimension first: ``batch_sizes[rank]`` entries of it for a
    column-parallel layer, all ``sum(batch_sizes)`` for a row-parallel one.
    """
    shape = tuple(shape)
    if len(shape) < 1:
        return "the input is a scalar; a dense layer needs (..., features)"
    if batch_sizes is not None:
        if len(shape) < 2:
            return (
                f"the input has shape {shape}; with batch_sizes a layer needs "
                "(batch, ..., features)"
            )
        want = batch_sizes[rank] if split == "column" else sum(batch_sizes)
        if shape[0] != want:
            whose = (
                f"this rank's batch_sizes[{rank}]"
                if split == "column"
                else "every rank's (the sum of batch_sizes)"
            )
            return (
                f"the input has {shape[0]} batch entries (shape {shape}) but {whose} is "
                f"{want} (batch_sizes {list(batch_sizes)})"
            )
    if split == "column":
        if shape[-1] != in_features:
            return (
                f"the input has {shape[-1]} features but the kernel has {in_features} rows "
                f"(input shape {shape}); a column-parallel layer takes the whole input on "
                "every rank"
            )
    elif shape[-1] != sizes[rank]:
        return (
            f"expected {sizes[rank]} local input features (sizes[{rank}] of {list(sizes)}, "
            f"{sum(sizes)} in all) but got {shape[-1]} (input shape {shape}); a row-parallel "
            "layer takes this rank's features only"
        )
    return None


def unsupported_error(precision, out_sharding=None) -> str | None:
    """What is wrong with a layer's ``precision`` / ``out_sharding`` (both must be None), or
    None: osmm_jax forms products at XLA's default precision and places each rank's block."""
    if precision is not None:
        return f"precision={precision!r} is not supported (osmm_jax.matmul takes none)"
    if out_sharding is not None:
        return "out_sharding is not supported: each rank's output block is placed by osmm_jax"
    return None


def _value(x):
    """An array-like leaf's array (an ``nnx.Variable``'s value, or the leaf itself)."""
    return x[...] if hasattr(x, "get_value") else x


def shard_params(params: Mapping, sizes: Sequence[int], rank: int, *, split: str) -> dict:
    """``rank``'s shard of a stock dense layer's parameters.

    Args:
        params: a mapping with ``"kernel"`` of shape ``(in, out)`` and
            optionally ``"bias"`` of shape ``(out,)``: one stock
            ``nn.Dense`` / ``nnx.Linear`` layer's parameters (numpy or JAX
            arrays; ``nnx.Variable`` leaves are read).
        sizes: the split dimension's entries per rank, in rank order (columns
            for ``split="column"``, rows for ``"row"``).
        rank: whose shard.
        split: ``"column"`` (kernel ``[:, cols]``, bias ``[cols]``) or
            ``"row"`` (kernel ``[rows, :]``, bias whole).

    Returns:
        A dict with the same keys holding ``rank``'s shard (what its
        column- or row-parallel layer stores).
    """
    split = check_split(split)
    kernel = _value(params["kernel"])
    if len(kernel.shape) != 2:
        raise ValueError(f"the kernel has shape {tuple(kernel.shape)}; expected (in, out)")
    total = kernel.shape[1] if split == "column" else kernel.shape[0]
    nranks = len(tuple(sizes)) if _is_sequence(sizes) else 0
    sizes = check_sizes(sizes, nranks, total, what=_what(split))
    rank = checks.integer(rank, "rank")
    if rank >= len(sizes):
        raise ValueError(f"rank {rank} is out of range for {len(sizes)} sizes")
    part = span(sizes, rank)
    out = dict(params)
    out["kernel"] = cut_param("kernel", kernel, part, split=split)
    if params.get("bias") is not None:
        out["bias"] = cut_param("bias", _value(params["bias"]), part, split=split)
    return out


def cut_param(name: str, value, part: slice, *, split: str):
    """The shard of a stock parameter that the rank holding ``part`` of the split dimension
    stores: a ``"kernel"``'s columns ``[:, part]`` (``split="column"``) or rows ``[part, :]``
    (``"row"``); a ``"bias"``'s entries ``[part]`` (column) or the whole of it (row: the
    bias is replicated, added once after the sum)."""
    if name == "kernel":
        return value[:, part] if split == "column" else value[part, :]
    return value[part] if split == "column" else value


def join_params(shards: Sequence[Mapping], *, split: str) -> dict:
    """The stock parameters ``{"kernel": (in, out), "bias": (out,)}`` from every rank's shard.

    ``shards[r]`` is rank ``r``'s (as :func:`shard_params` gives it); the
    result is numpy. The row-parallel bias is taken from rank 0 (every rank
    holds the same).
    """
    import numpy as np

    split = check_split(split)
    if not shards:
        raise ValueError("join_params needs every rank's shard, got none")
    kernels = [np.asarray(_value(s["kernel"])) for s in shards]
    out = dict(shards[0])
    out["kernel"] = np.concatenate(kernels, axis=1 if split == "column" else 0)
    if shards[0].get("bias") is not None:
        biases = [np.asarray(_value(s["bias"])) for s in shards]
        out["bias"] = np.concatenate(biases) if split == "column" else biases[0]
    return out


def _is_sequence(x) -> bool:
    return not isinstance(x, (str, bytes)) and hasattr(x, "__len__")


def _what(split: str) -> str:
    return "columns" if split == "column" else "rows"


# -- the product --------------------------------------------------------------------------


class TensorParallelDot:
    """The product of a tensor-parallel dense layer on one communicator.

    Hashable (it can live in a module's static attributes). Every rank holds
    one, with the same arguments, and calls it at the same point (SPMD).

    Args:
        split: ``"column"`` or ``"row"``.
        sizes: kernel columns (``"column"``) or rows (``"row"``) per rank, in
            rank order; uneven, possibly 0.
        comm: the mpi4py communicator whose ranks share the kernel (default
            COMM_WORLD); osmm_jax works on a private duplicate of it.
        method: ``"one_sided"``, ``"allreduce"`` or None, for
            :func:`osmm_jax.matmul`.
        name: the name errors start with.
        batch_sizes: None (every rank holds every row of the activations), or
            the entries of the activations' first (batch) dimension per rank,
            for sequence parallelism: a column-parallel product then takes
            this rank's ``batch_sizes[r]`` entries and gives every entry of its
            columns (the rows are gathered), a row-parallel one takes every
            entry of its features and gives this rank's entries of the sum
            (the partials are reduce-scattered).
        keep_fetched: for :func:`osmm_jax.matmul` (one_sided): the pieces the forward
            product fetched (a sequence-parallel column layer's gathered rows) are kept for
            the backward products instead of fetched again.
    """

    __slots__ = ("split", "sizes", "comm", "method", "name", "batch_sizes", "keep_fetched")

    def __init__(
        self,
        split,
        sizes,
        *,
        comm=None,
        method=None,
        name=None,
        batch_sizes=None,
        keep_fetched=False,
    ):
        if not isinstance(sizes, (str, bytes)) and hasattr(sizes, "__iter__"):
            sizes = tuple(sizes)  # anything else is reported, by all ranks, when it is used
        if not isinstance(batch_sizes, (str, bytes)) and hasattr(batch_sizes, "__iter__"):
            batch_sizes = tuple(batch_sizes)
        self.split = check_split(split)
        self.sizes = sizes
        self.batch_sizes = batch_sizes
        self.comm = comm
        self.method = method
        self.name = name or f"osmm_jax.flax ({split}-parallel)"
        self.keep_fetched = keep_fetched

    def replace(self, **changes) -> TensorParallelDot:
        """A copy with some of the arguments changed."""
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return TensorParallelDot(fields.pop("split"), fields.pop("sizes"), **fields)

    def _key(self):
        comm = None if self.comm is None else getattr(self.comm, "handle", id(self.comm))
        sizes, batch = repr(self.sizes), repr(self.batch_sizes)
        return (self.split, sizes, comm, self.method, self.name, batch, repr(self.keep_fetched))

    def __eq__(self, other):
        return isinstance(other, TensorParallelDot) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        batch = "" if self.batch_sizes is None else f", batch_sizes={self.batch_sizes!r}"
        return (
            f"TensorParallelDot({self.split!r}, sizes={self.sizes!r}, method={self.method!r}"
            f"{batch})"
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether the activations are split by batch entries (``batch_sizes`` given)."""
        return self.batch_sizes is not None

    def completed_prefix(self, path: tuple) -> tuple | None:
        """Where, under the layer's parameter ``path``, the gradients lie that this product
        completes over its ranks, as a data-parallel layer's are: with ``batch_sizes`` (the
        rows gathered) a column-parallel layer's kernel and bias (``path``), a row-parallel
        one's kernel (``(*path, "kernel")``; its bias, added to this rank's entries only, is
        not). None without ``batch_sizes``: each shard's gradient is this rank's own."""
        if not self.sequence_parallel:
            return None
        return path if self.split == "column" else (*path, "kernel")

    def check(
        self,
        in_features: int | None,
        out_features: int,
        inputs_shape=None,
        *,
        use_bias: bool = True,
        error=None,
    ):
        """Check the arguments on every rank together; ``(sizes, rank, private_comm)``.

        ``in_features`` is the kernel's full row count (None for a row-parallel
        layer that learns it from ``sizes``); ``inputs_shape`` this rank's
        input's shape, if there is one yet. Raises the same ``ValueError`` /
        ``TypeError`` on every rank when any rank has bad sizes, bad
        ``batch_sizes`` or a bad input, or when ranks disagree on the sizes,
        the batch sizes, the layer's shape, the input's leading dimensions
        (after the batch dimension, with ``batch_sizes``) or the method;
        nothing else moves before that.
        """
        from osmm_jax._src.runtime import communicators

        private = communicators.private_comm(self.comm)
        nranks, rank = private.Get_size(), private.Get_rank()
        sizes = batch = None
        total = out_features if self.split == "column" else in_features
        try:
            sizes = check_sizes(self.sizes, nranks, total, what=_what(self.split))
            if self.batch_sizes is not None:
                batch = check_batch_sizes(self.batch_sizes, nranks)
        except (TypeError, ValueError) as exc:
            error = error or exc
        if in_features is None and sizes is not None:
            in_features = sum(sizes)
        if error is None and inputs_shape is not None:
            error = input_error(self.split, inputs_shape, in_features, sizes, rank, batch)
        lead = None if inputs_shape is None else tuple(inputs_shape)[:-1]
        if lead is not None and self.batch_sizes is not None:
            lead = lead[1:]  # the batch dimension differs from rank to rank
        token = repr(
            (self.split, sizes, batch, in_features, out_features, use_bias, lead, self.method)
        )
        communicators.agree(
            private,
            self.name,
            token,
            error,
            must_match="the same sizes, batch sizes, layer shape, input rows and method",
        )
        return sizes, rank, private

    def product(self, inputs, kernel, sizes, private):
        """This rank's block of ``inputs @ kernel`` (no bias), after :meth:`check`.

        Column-parallel: ``inputs (..., in)`` whole, ``kernel (in, sizes[r])``;
        returns ``(..., sizes[r])``. Row-parallel: ``inputs (..., sizes[r])``,
        ``kernel (sizes[r], out)``; returns ``(..., out)``, the sum over ranks,
        the same on every rank.

        With ``batch_sizes`` (sequence parallelism): column-parallel takes
        ``inputs (batch_sizes[r], ..., in)`` and returns ``(sum(batch_sizes),
        ..., sizes[r])``; row-parallel takes ``inputs (sum(batch_sizes), ...,
        sizes[r])`` and returns this rank's ``(batch_sizes[r], ..., out)`` of
        the sum. The rows of the activations are then split by batch entry
        (``Layout.rows``) where they would otherwise be replicated.
        """
        import jax.numpy as jnp

        from osmm_jax._src.planning.layout import Layout
        from osmm_jax._src.runtime.api import plan
        from osmm_jax._src.runtime.matmul import matmul

        nranks = len(sizes)
        lead = tuple(inputs.shape[:-1])
        if self.batch_sizes is None:
            whole, total_lead = math.prod(lead), lead

            def split_rows(shape):
                return Layout.replicated(shape, nranks=nranks)

        else:
            per_entry = math.prod(lead[1:])
            row_sizes = [b * per_entry for b in self.batch_sizes]
            whole, total_lead = sum(row_sizes), (sum(self.batch_sizes), *lead[1:])

            def split_rows(shape):
                return Layout.rows(shape, sizes=row_sizes)

        x = jnp.reshape(inputs, (math.prod(lead), inputs.shape[-1]))
        if self.split == "column":
            k, n = kernel.shape[0], sum(sizes)
            a = split_rows((whole, k))
            b = Layout.cols((k, n), sizes=sizes)
            c = Layout.cols((whole, n), sizes=sizes)
            out_lead = total_lead
        else:
            k, n = sum(sizes), kernel.shape[1]
            a = Layout.cols((whole, k), sizes=sizes)
            b = Layout.rows((k, n), sizes=sizes)
            c = split_rows((whole, n))
            out_lead = lead
            if self.batch_sizes is not None:
                out_lead = (self.batch_sizes[private.Get_rank()], *lead[1:])
        p = plan(a, b, c, comm=private)
        y = matmul(x, kernel, p, method=self.method, keep_fetched=self.keep_fetched)
        return jnp.reshape(y, out_lead + (y.shape[1],))


# -- checkpoints, on every rank together ---------------------------------------------------


def gather_params(params, sizes: Sequence[int], *, split: str, comm=None) -> dict:
    """The stock parameters of a tensor-parallel layer, whole, on every rank (numpy).

    Args:
        params: this rank's shard, a mapping with ``"kernel"`` and optionally
            ``"bias"`` (a linen layer's ``params["params"]["<name>"]``, or
            ``nnx.state(layer)``), as :func:`shard_params` cuts it.
        sizes: the layer's ``sizes``.
        split: ``"column"`` or ``"row"``.
        comm: the layer's communicator (default COMM_WORLD).

    Returns ``{"kernel": (in, out), "bias": (out,)}`` (no ``"bias"`` if the
    shards have none), the same on every rank: a checkpoint for
    ``nn.Dense`` / ``nnx.Linear``. Every rank calls it; bad ``sizes`` or a
    shard of the wrong shape on any rank raise the same error on every rank
    before any shard moves.
    """
    import numpy as np

    from osmm_jax._src.runtime import communicators

    dot = TensorParallelDot(split, sizes, comm=comm, name="osmm_jax.flax.gather_params")
    private = communicators.private_comm(comm)
    local = {k: np.asarray(_value(v)) for k, v in params.items() if v is not None}
    kernel = local.get("kernel")
    in_features = out_features = error = None
    if kernel is None or kernel.ndim != 2:
        error = (
            f"expected a 2-D 'kernel' in the shard, got {None if kernel is None else kernel.shape}"
        )
    else:
        in_features, out_features, error = _shard_features(dot, kernel.shape, private)
    _, _, private = dot.check(in_features, out_features or 0, use_bias="bias" in local, error=error)
    return join_params(private.allgather(local), split=split)


def _shard_features(dot: TensorParallelDot, kernel_shape: tuple, private):
    """``(in_features, out_features, error)`` of the whole layer whose shard on this rank of
    ``private`` has ``kernel_shape``, for :meth:`TensorParallelDot.check`: the unsplit
    dimension from the shard, the split one from ``dot.sizes`` (None when they are bad, left
    for the check to report on every rank) and what is wrong with the shard, or None."""
    in_features, out_features = kernel_shape
    try:
        checked = check_sizes(dot.sizes, private.Get_size())
    except (TypeError, ValueError):
        return in_features, out_features, None
    rank, error = private.Get_rank(), None
    axis = 1 if dot.split == "column" else 0
    if kernel_shape[axis] != checked[rank]:
        error = f"the kernel shard has shape {kernel_shape}; sizes[{rank}] is {checked[rank]}"
    if dot.split == "column":
        return in_features, sum(checked), error
    return None, out_features, error
