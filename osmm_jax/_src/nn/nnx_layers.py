"""The ``flax.nnx`` layers of :mod:`osmm_jax.flax`: data- and tensor-parallel ``Linear``.

:class:`Linear` computes its product with a :class:`DistributedDot` (batch rows split over
ranks, kernel replicated), :class:`ColumnParallelLinear` and :class:`RowParallelLinear` with a
:class:`TensorParallelDot` (kernel split over ranks). Every call also tells
:mod:`osmm_jax._src.nn.unsummed_grads` which parameters of the model its product already
sums over ranks, and :func:`summed_paths` reads the same paths from a model's graph.

Imports Flax at its top: only :mod:`osmm_jax.flax` imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from osmm_jax._src.nn import unsummed_grads
from osmm_jax._src.nn.distributed_dot import DistributedDot
from osmm_jax._src.nn.param_paths import under
from osmm_jax._src.nn.tensor_parallel import TensorParallelDot, shard_params, unsupported_error


class Linear(nnx.Linear):
    """``flax.nnx.Linear`` with the batch split over ranks; see :mod:`osmm_jax.flax`.

    Args:
        in_features, out_features: as for ``nnx.Linear``.
        row_sizes: input rows per rank (leading dimensions flattened), in rank
            order; settable later (``layer.row_sizes = new_sizes``).
        comm: the mpi4py communicator whose ranks share the batch (default
            COMM_WORLD).
        method: ``"one_sided"`` (default), ``"allreduce"`` or None (reads
            ``OSMM_USE_ALLREDUCE``).
        **kwargs: ``nnx.Linear``'s other keyword arguments (``rngs``,
            ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init``,
            ``bias_init``, ``promote_dtype``, ``preferred_element_type``, ...);
            not ``dot_general``, which is this layer's :class:`DistributedDot`.

    Call with this rank's rows, ``(..., in_features)`` holding
    ``row_sizes[rank]`` rows in all; returns ``(..., out_features)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        row_sizes: Sequence[int],
        comm=None,
        method: str | None = None,
        **kwargs,
    ):
        name = "osmm_jax.flax.Linear"
        _refuse_dot_general(name, kwargs)
        dot = DistributedDot(row_sizes, comm=comm, method=method, name=name)
        super().__init__(in_features, out_features, dot_general=dot, **kwargs)

    @property
    def row_sizes(self):
        """Input rows per rank (leading dimensions flattened), in rank order."""
        return self.dot_general.row_sizes

    @row_sizes.setter
    def row_sizes(self, value):
        self.dot_general = self.dot_general.replace(row_sizes=value)

    def __call__(self, inputs, out_sharding=None):
        """This rank's rows of ``inputs @ kernel + bias``; shape ``inputs.shape[:-1] + (out_features,)``."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        unsummed_grads.note_differentiated((kernel, bias), lambda: _unsummed(self))
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return self.dot_general.apply(
            inputs,
            kernel,
            bias,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            out_sharding=out_sharding,
        )


class _TensorParallelLinear(nnx.Linear):
    """``nnx.Linear`` whose kernel is split over ranks by :class:`TensorParallelDot`: the
    column- and row-parallel layers, which differ only in ``_split``."""

    _split = "column"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        sizes: Sequence[int],
        comm=None,
        method: str | None = None,
        batch_sizes: Sequence[int] | None = None,
        keep_fetched: bool = False,
        **kwargs,
    ):
        name = f"osmm_jax.flax.{type(self).__name__}"
        _refuse_dot_general(name, kwargs)
        dot = TensorParallelDot(
            self._split,
            sizes,
            comm=comm,
            method=method,
            name=name,
            batch_sizes=batch_sizes,
            keep_fetched=keep_fetched,
        )
        checked, rank, _ = dot.check(
            in_features, out_features, use_bias=kwargs.get("use_bias", True)
        )
        # The stock parameters from the same initialisers and key, cut to this rank's shard.
        super().__init__(in_features, out_features, **kwargs)
        shard = shard_params(
            {"kernel": self.kernel[...], "bias": None if self.bias is None else self.bias[...]},
            checked,
            rank,
            split=self._split,
        )
        self.kernel.set_value(shard["kernel"])
        if self.bias is not None:
            self.bias.set_value(shard["bias"])
        self.tensor_parallel = dot.replace(sizes=checked)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Kernel columns (column-parallel) or rows (row-parallel) per rank, in rank order."""
        return self.tensor_parallel.sizes

    def __call__(self, inputs, out_sharding=None):
        dot = self.tensor_parallel
        sizes, _, private = dot.check(
            self.in_features,
            self.out_features,
            jnp.shape(inputs),
            use_bias=self.bias is not None,
            error=unsupported_error(self.precision, out_sharding),
        )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        completed = unsummed_grads.note_tensor_parallel(dot, kernel, bias)
        if completed:
            unsummed_grads.note_differentiated(completed, lambda: _unsummed(self))
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = dot.product(inputs, kernel, sizes, private)
        if bias is not None:
            y = y + bias
        if self.preferred_element_type is not None:
            y = y.astype(self.preferred_element_type)
        return y


class ColumnParallelLinear(_TensorParallelLinear):
    """``flax.nnx.Linear`` with the kernel split by columns over ranks; see :mod:`osmm_jax.flax`.

    Args:
        in_features, out_features: the whole layer's, as for ``nnx.Linear``.
        sizes: output features (kernel columns) per rank, in rank order,
            summing to ``out_features``; uneven, possibly 0.
        comm: the mpi4py communicator whose ranks share the kernel (default
            COMM_WORLD).
        method: ``"one_sided"`` (default), ``"allreduce"`` or None (reads
            ``OSMM_USE_ALLREDUCE``).
        batch_sizes: None, or the activations' first-dimension entries per
            rank (sequence parallelism; see :class:`ColumnParallelDense` and
            :class:`RowParallelDense` for the shapes).
        keep_fetched: with ``batch_sizes``, keep what this rank gathered in the
            forward pass for the backward pass (see :class:`ColumnParallelDense`).
        **kwargs: ``nnx.Linear``'s other keyword arguments (``rngs``,
            ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init``,
            ``bias_init``, ...); not ``dot_general``.

    Rank ``r`` stores ``kernel`` ``(in_features, sizes[r])`` and ``bias``
    ``(sizes[r],)``: its columns of the stock layer's parameters from the same
    initialisers and ``rngs`` (built whole, then cut). Call with the same whole
    input ``(..., in_features)`` on every rank; returns ``(..., sizes[rank])``.
    The input's gradient is the whole gradient, the same on every rank.
    """

    _split = "column"


class RowParallelLinear(_TensorParallelLinear):
    """``flax.nnx.Linear`` with the kernel split by rows over ranks; see :mod:`osmm_jax.flax`.

    Args:
        in_features, out_features: the whole layer's, as for ``nnx.Linear``.
        sizes: input features (kernel rows) per rank, in rank order, summing
            to ``in_features``; uneven, possibly 0.
        comm, method, batch_sizes, keep_fetched, **kwargs: as for
            :class:`ColumnParallelLinear`.

    Rank ``r`` stores ``kernel`` ``(sizes[r], out_features)`` (its rows of the
    stock kernel) and the whole ``bias``, added once after the sum. Call with
    this rank's ``(..., sizes[rank])`` input features (the leading dimensions
    the same on every rank); returns the whole ``(..., out_features)``, summed
    over ranks, on every rank.
    """

    _split = "row"


def _refuse_dot_general(name: str, kwargs: dict) -> None:
    if "dot_general" in kwargs:
        raise ValueError(
            f"{name} computes its product with osmm_jax.matmul: do not pass dot_general"
        )


# -- which gradients the products sum ------------------------------------------------------


def summed_paths(model: nnx.Module) -> frozenset[tuple]:
    """``osmm_jax.flax.summed_paths`` for an nnx model, read from its graph: the paths of its
    data-parallel layers and of what its sequence-parallel layers' products complete."""
    return frozenset(
        prefix
        for path, node in nnx.iter_graph(model)
        for prefix in _summed_prefixes(tuple(path), node)
    )


def _summed_prefixes(path: tuple, node, *, tensor_parallel: bool = False) -> list[tuple]:
    """The parameter paths under ``node`` (at ``path``) whose gradients its product completes
    over ranks: a data-parallel :class:`Linear`'s, a sequence-parallel layer's kernel (and a
    column-parallel one's bias); with ``tensor_parallel``, a tensor-parallel layer's shards too
    (not summed, but not another rank's to sum either)."""
    if isinstance(node, Linear):
        return [path]
    if isinstance(node, _TensorParallelLinear):
        prefix = node.tensor_parallel.completed_prefix(path)
        if prefix is None:
            return [path] if tensor_parallel else []
        return [prefix]
    return []


def _unsummed(layer: nnx.Module):
    """For a differentiated nnx layer whose product sums gradients: the function naming the
    parameters of its model outside osmm_jax layers. The model is the largest ``nnx.Module``
    among the local variables of the calls on the stack whose graph holds ``layer`` (the
    module the training step differentiates); none found: the layer alone, nothing outside
    it."""
    for known in unsummed_grads.known_models():
        if id(layer) in known.get("node_ids", ()):
            return lambda record=known: record["unsummed"]
    root, size = layer, 1
    seen: set[int] = set()
    for frame in unsummed_grads.caller_frames():
        for value in list(frame.f_locals.values()):
            if isinstance(value, nnx.Module) and id(value) not in seen and value is not layer:
                seen.add(id(value))
                nodes = [node for _, node in nnx.iter_graph(value)]
                if len(nodes) > size and any(node is layer for node in nodes):
                    root, size = value, len(nodes)
    record = unsummed_grads.model_record(root)
    if "unsummed" not in record:
        record["node_ids"] = {id(node) for _, node in nnx.iter_graph(root)}
        covered = [
            prefix
            for path, node in nnx.iter_graph(root)
            for prefix in _summed_prefixes(tuple(path), node, tensor_parallel=True)
        ]
        record["unsummed"] = [
            "/".join(map(str, path))
            for path, node in nnx.iter_graph(root)
            if isinstance(node, nnx.Param)
            and not under(tuple(path), covered)
            and unsummed_grads.differentiated((node.get_value(),))
        ]
    return lambda: record["unsummed"]
