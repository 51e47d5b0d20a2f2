"""The ``flax.linen`` layers of :mod:`osmm_jax.flax`: data- and tensor-parallel ``Dense``.

:class:`Dense` computes its product with a :class:`DistributedDot` (batch rows split over
ranks, kernel replicated), :class:`ColumnParallelDense` and :class:`RowParallelDense` with a
:class:`TensorParallelDot` (kernel split over ranks). Every call also tells
:mod:`osmm_jax._src.nn.unsummed_grads` which parameters of the model its product already
sums over ranks, and :func:`summed_paths` finds the same paths by tracing a model's ``init``.

Imports Flax at its top: only :mod:`osmm_jax.flax` imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from osmm_jax._src.nn import unsummed_grads
from osmm_jax._src.nn.distributed_dot import DistributedDot
from osmm_jax._src.nn.param_paths import path_names, under
from osmm_jax._src.nn.tensor_parallel import TensorParallelDot, cut_param, span, unsupported_error


class Dense(nn.Dense):
    """``flax.linen.Dense`` with the batch split over ranks; see :mod:`osmm_jax.flax`.

    Attributes (beyond the stock ones):
        row_sizes: input rows per rank (leading dimensions flattened), in rank
            order; required, keyword-only. Change it with
            ``layer.clone(row_sizes=...)`` or a field of the parent module.
        comm: the mpi4py communicator whose ranks share the batch (default
            COMM_WORLD).
        method: ``"one_sided"`` (default), ``"allreduce"`` or None (reads
            ``OSMM_USE_ALLREDUCE``).

    ``dot_general``, ``dot_general_cls`` and ``precision`` must stay None.

    Call with this rank's rows, ``(..., in_features)`` holding
    ``row_sizes[rank]`` rows in all; returns ``(..., features)``.
    """

    row_sizes: Sequence[int] = dataclasses.field(kw_only=True)
    comm: Any = None
    method: str | None = None

    @nn.compact
    def __call__(self, inputs):
        """This rank's rows of ``inputs @ kernel + bias``; shape ``inputs.shape[:-1] + (features,)``."""
        name = "osmm_jax.flax.Dense"
        _refuse_dot_general(name, self)
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        _note_call(self, kernel, bias)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        dot = DistributedDot(self.row_sizes, comm=self.comm, method=self.method, name=name)
        return dot.apply(inputs, kernel, bias, precision=self.precision)


class _TensorParallelDense(nn.Dense):
    """``nn.Dense`` whose kernel is split over ranks by :class:`TensorParallelDot`: the
    column- and row-parallel layers, which differ only in ``_split``."""

    sizes: Sequence[int] = dataclasses.field(kw_only=True)
    comm: Any = None
    method: str | None = None
    batch_sizes: Sequence[int] | None = None
    keep_fetched: bool = False

    _split = "column"

    @nn.compact
    def __call__(self, inputs):
        """This rank's block of ``inputs @ kernel + bias`` (see the layer's class)."""
        _refuse_dot_general(_name(self), self)
        dot = _product(self)
        column = self._split == "column"
        # A row-parallel layer learns its input features from ``sizes``, once they are checked.
        in_features = (jnp.shape(inputs)[-1] if jnp.ndim(inputs) else 0) if column else None
        sizes, rank, private = dot.check(
            in_features,
            self.features,
            jnp.shape(inputs),
            use_bias=self.use_bias,
            error=unsupported_error(self.precision),
        )
        part = span(sizes, rank)
        full = (sum(sizes) if in_features is None else in_features, self.features)

        # The stock parameters from the same initialisers and key, cut to this rank's shard.
        def stock_shard(name, initializer, shape):
            return lambda key: cut_param(
                name, initializer(key, shape, self.param_dtype), part, split=self._split
            )

        kernel = self.param("kernel", stock_shard("kernel", self.kernel_init, full))
        bias = None
        if self.use_bias:
            bias = self.param("bias", stock_shard("bias", self.bias_init, (self.features,)))
        _note_call(self, kernel, bias, dot)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = dot.product(inputs, kernel, sizes, private)
        return y if bias is None else y + bias


class ColumnParallelDense(_TensorParallelDense):
    """``flax.linen.Dense`` with the kernel split by columns over ranks; see :mod:`osmm_jax.flax`.

    Every rank calls it with the same whole input ``(..., in_features)`` and
    gets its own ``sizes[rank]`` output features, ``(..., sizes[rank])``.
    Parameters on rank ``r``: ``kernel`` ``(in_features, sizes[r])`` (columns
    ``sum(sizes[:r])`` onwards of the stock kernel), ``bias`` ``(sizes[r],)``.

    Attributes (beyond the stock ones):
        sizes: output features (kernel columns) per rank, in rank order,
            summing to ``features``; uneven, possibly 0. Required,
            keyword-only.
        comm: the mpi4py communicator whose ranks share the kernel (default
            COMM_WORLD).
        method: ``"one_sided"`` (default), ``"allreduce"`` or None (reads
            ``OSMM_USE_ALLREDUCE``).
        batch_sizes: None, or the input's first-dimension entries per rank
            (sequence parallelism): then each rank gives its own entries,
            ``(batch_sizes[rank], ..., in_features)``, and gets every entry of
            its features, ``(sum(batch_sizes), ..., sizes[rank])``.
        keep_fetched: with ``batch_sizes``, keep the entries (and kernel columns)
            this rank gathered in the forward pass for the backward pass instead
            of gathering them again (``osmm_jax.matmul``'s ``keep_fetched``): one
            round of communication less per step, for their memory between the
            passes. Default False, as Megatron-LM's sequence parallelism.

    The input's gradient is the whole gradient (summed over every rank's
    columns), the same on every rank (with ``batch_sizes``: this rank's
    entries of it).
    """

    _split = "column"


class RowParallelDense(_TensorParallelDense):
    """``flax.linen.Dense`` with the kernel split by rows over ranks; see :mod:`osmm_jax.flax`.

    Every rank calls it with its own ``sizes[rank]`` input features,
    ``(..., sizes[rank])`` (e.g. a :class:`ColumnParallelDense` output with the
    same ``sizes``), the leading dimensions the same on every rank, and gets
    the whole output ``(..., features)``, summed over ranks, on every rank.
    Parameters on rank ``r``: ``kernel`` ``(sizes[r], features)`` (rows
    ``sum(sizes[:r])`` onwards of the stock kernel) and the whole ``bias``
    ``(features,)``, added once after the sum.

    Attributes (beyond the stock ones):
        sizes: input features (kernel rows) per rank, in rank order; their sum
            is the layer's ``in_features``. Required, keyword-only.
        comm, method, keep_fetched: as for :class:`ColumnParallelDense`.
        batch_sizes: None, or the output's first-dimension entries per rank
            (sequence parallelism): then the input holds every entry,
            ``(sum(batch_sizes), ..., sizes[rank])``, and each rank gets its own
            entries of the sum, ``(batch_sizes[rank], ..., features)``, the bias
            added to them (its gradient is then this rank's entries' alone).

    Its output is replicated: its cotangent is taken to be the same on every
    rank (every rank computes the same loss from it). With ``batch_sizes`` it
    is split by entries instead, each rank's cotangent its own entries'.
    """

    _split = "row"


def _name(module) -> str:
    return f"osmm_jax.flax.{type(module).__name__}"


def _product(module: _TensorParallelDense) -> TensorParallelDot:
    """The product of a tensor-parallel linen layer, from its attributes."""
    return TensorParallelDot(
        module._split,
        module.sizes,
        comm=module.comm,
        method=module.method,
        name=_name(module),
        batch_sizes=module.batch_sizes,
        keep_fetched=module.keep_fetched,
    )


def _refuse_dot_general(name: str, module: nn.Dense) -> None:
    if module.dot_general is not None or module.dot_general_cls is not None:
        raise ValueError(
            f"{name} computes its product with osmm_jax.matmul: leave dot_general and "
            "dot_general_cls unset"
        )


# -- which gradients the products sum ------------------------------------------------------


def summed_paths(model: nn.Module, *args, **kwargs) -> frozenset[tuple]:
    """``osmm_jax.flax.summed_paths`` for a linen model: traces its ``init`` on ``args`` /
    ``kwargs`` abstractly (``jax.eval_shape``, every rank together) and collects the paths,
    from ``"params"``, of its data-parallel layers and of what its sequence-parallel layers'
    products complete."""
    found = set()

    def record(next_fun, call_args, call_kwargs, context):
        module = context.module
        if module.scope is not None:
            path = ("params", *module.scope.path)
            if isinstance(module, Dense):
                found.add(path)
            elif isinstance(module, _TensorParallelDense):
                prefix = _product(module).completed_prefix(path)
                if prefix is not None:
                    found.add(prefix)
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    return frozenset(found)


def _note_call(module: nn.Dense, kernel, bias, dot: TensorParallelDot | None = None) -> None:
    """Every call of a linen osmm_jax layer (``dot``: a tensor-parallel layer's product, None
    for a data-parallel :class:`Dense`), its parameters perhaps being differentiated.

    The layer's path, or the part of it whose gradients the product completes, is recorded as
    covered in its model's record; a layer whose product sums gradients over ranks (a
    data-parallel or sequence-parallel one) also notes the differentiation, a tensor-parallel
    one reports its communicator (see :mod:`osmm_jax._src.nn.unsummed_grads`).
    """
    params, completes = (kernel, bias), True  # a data-parallel product sums both
    if dot is not None:
        completed = unsummed_grads.note_tensor_parallel(dot, kernel, bias)
        completes = bool(completed)
        if completes:
            params = completed
    if module.scope is None or not unsummed_grads.differentiated(params):
        if completes:
            unsummed_grads.note_differentiated(params, lambda: None)
        return
    path = tuple(module.scope.path)
    root = _root(module, path)
    if root is None:  # the model cannot be seen from here: nothing to judge it by
        return
    record = _model_record(root)
    covered = dot.completed_prefix(path) if dot is not None else None
    record["covered"].add(path if covered is None else covered)
    if completes:
        unsummed_grads.note_differentiated(params, lambda: lambda: _unsummed(record))


def _model_record(root) -> dict:
    """The record of the model whose root scope is ``root``, its differentiated parameters
    listed on first use."""
    record = unsummed_grads.model_record(root)
    if "params" not in record:
        flat = jax.tree_util.tree_flatten_with_path(_params(root))[0]
        # Only parameters being differentiated can carry an un-summed gradient (a frozen one,
        # e.g. outside the trained subset of a fine-tuning, has none).
        record["params"] = [
            path_names(p) for p, leaf in flat if unsummed_grads.differentiated((leaf,))
        ]
        record["covered"] = set()
    return record


def _unsummed(record: dict) -> list[str]:
    """The differentiated parameters of a model's record outside the paths its layers cover."""
    return ["/".join(map(str, n)) for n in record["params"] if not under(n, record["covered"])]


def _params(scope) -> dict:
    variables = scope.variables()
    return variables.get("params", {}) if hasattr(variables, "get") else {}


def _holds(scope, path: tuple) -> bool:
    tree = _params(scope)
    for name in path:
        if not hasattr(tree, "get") or name not in tree:
            return False
        tree = tree[name]
    return True


def _root(module: nn.Module, path: tuple):
    """The root scope of the model ``module`` belongs to: its own scope's root, unless a lifted
    transformation (``nn.remat``, ``nn.scan``, ...) gave it one of its own; then the root of a
    calling module's scope on the stack that holds ``path``. None if none is found. Called by
    :func:`_note_call` only (the frames on the stack are counted from there)."""
    root = module.scope.root
    if not path or _holds(root, path):
        return root
    for frame in unsummed_grads.caller_frames():
        caller = frame.f_locals.get("self")
        if isinstance(caller, nn.Module) and caller.scope is not None:
            if _holds(caller.scope.root, path):
                return caller.scope.root
    return None
