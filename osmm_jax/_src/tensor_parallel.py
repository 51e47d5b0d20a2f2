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
JAX, no MPI: testable without ``mpiexec``), then :class:`TensorParallelDot`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from osmm_jax._src import checks

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
    if sizes is None:
        raise TypeError(f"sizes is required: the kernel {what} each rank holds, one entry per rank")
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        try:
            sizes = tuple(sizes)
        except TypeError:
            raise TypeError(
                f"sizes must be a sequence of counts of kernel {what}, one per rank, got {sizes!r}"
            ) from None
    if len(sizes) != nranks:
        raise ValueError(
            f"sizes {list(sizes)} has {len(sizes)} entries but the communicator has {nranks} "
            f"ranks: give the kernel {what} of every rank"
        )
    out = tuple(checks.integer(s, f"sizes[{i}]") for i, s in enumerate(sizes))
    if total is not None and sum(out) != total:
        raise ValueError(
            f"sizes {list(out)} sum to {sum(out)} but the kernel has {total} {what}: the "
            f"sizes must split all {total} of them"
        )
    return out


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
) -> str | None:
    """What is wrong with ``rank``'s input of ``shape``, or None.

    Column-parallel: the whole input, ``(..., in_features)``. Row-parallel:
    this rank's ``sizes[rank]`` input features, ``(..., sizes[rank])``. At
    least one dimension either way (leading dimensions flatten to rows, the
    same on every rank).
    """
    shape = tuple(shape)
    if len(shape) < 1:
        return "the input is a scalar; a dense layer needs (..., features)"
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
    out["kernel"] = kernel[:, part] if split == "column" else kernel[part, :]
    if params.get("bias") is not None:
        bias = _value(params["bias"])
        out["bias"] = bias[part] if split == "column" else bias
    return out


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
    """

    __slots__ = ("split", "sizes", "comm", "method", "name")

    def __init__(self, split, sizes, *, comm=None, method=None, name=None):
        if not isinstance(sizes, (str, bytes)) and hasattr(sizes, "__iter__"):
            sizes = tuple(sizes)  # anything else is reported, by all ranks, when it is used
        self.split = check_split(split)
        self.sizes = sizes
        self.comm = comm
        self.method = method
        self.name = name or f"osmm_jax.flax ({split}-parallel)"

    def replace(self, **changes) -> TensorParallelDot:
        """A copy with some of the arguments changed."""
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return TensorParallelDot(fields.pop("split"), fields.pop("sizes"), **fields)

    def _key(self):
        comm = None if self.comm is None else getattr(self.comm, "handle", id(self.comm))
        return (self.split, repr(self.sizes), comm, self.method, self.name)

    def __eq__(self, other):
        return isinstance(other, TensorParallelDot) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"TensorParallelDot({self.split!r}, sizes={self.sizes!r}, method={self.method!r})"

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
        ``TypeError`` on every rank when any rank has bad sizes or a bad input,
        or when ranks disagree on the sizes, the layer's shape, the input's
        leading dimensions or the method; nothing else moves before that.
        """
        from osmm_jax._src import communicators

        private = communicators.private_comm(self.comm)
        nranks, rank = private.Get_size(), private.Get_rank()
        sizes = None
        total = out_features if self.split == "column" else in_features
        try:
            sizes = check_sizes(self.sizes, nranks, total, what=_what(self.split))
        except (TypeError, ValueError) as exc:
            error = error or exc
        if in_features is None and sizes is not None:
            in_features = sum(sizes)
        if error is None and inputs_shape is not None:
            error = input_error(self.split, inputs_shape, in_features, sizes, rank)
        lead = None if inputs_shape is None else tuple(inputs_shape)[:-1]
        token = repr((self.split, sizes, in_features, out_features, use_bias, lead, self.method))
        communicators.agree(
            private,
            self.name,
            token,
            error,
            must_match="the same sizes, layer shape, input rows and method",
        )
        return sizes, rank, private

    def product(self, inputs, kernel, sizes, private):
        """This rank's block of ``inputs @ kernel`` (no bias), after :meth:`check`.

        Column-parallel: ``inputs (..., in)`` whole, ``kernel (in, sizes[r])``;
        returns ``(..., sizes[r])``. Row-parallel: ``inputs (..., sizes[r])``,
        ``kernel (sizes[r], out)``; returns ``(..., out)``, the sum over ranks,
        the same on every rank.
        """
        import jax.numpy as jnp

        from osmm_jax._src.api import plan
        from osmm_jax._src.layout import Layout
        from osmm_jax._src.matmul import matmul

        nranks = len(sizes)
        lead = tuple(inputs.shape[:-1])
        rows = math.prod(lead)
        x = jnp.reshape(inputs, (rows, inputs.shape[-1]))
        if self.split == "column":
            k, n = kernel.shape[0], sum(sizes)
            a = Layout.replicated((rows, k), nranks=nranks)
            b = Layout.cols((k, n), sizes=sizes)
            c = Layout.cols((rows, n), sizes=sizes)
        else:
            k, n = sum(sizes), kernel.shape[1]
            a = Layout.cols((rows, k), sizes=sizes)
            b = Layout.rows((k, n), sizes=sizes)
            c = Layout.replicated((rows, n), nranks=nranks)
        y = matmul(x, kernel, plan(a, b, c, comm=private), method=self.method)
        return jnp.reshape(y, lead + (y.shape[1],))
