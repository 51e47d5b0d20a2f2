"""Flax dense layers whose product runs on osmm_jax: data and tensor parallelism.

Data parallelism. :class:`Dense` replaces ``flax.linen.Dense`` and
:class:`Linear` replaces ``flax.nnx.Linear`` in a model trained with the batch
split by rows over the ranks of an MPI job (uneven, e.g. in proportion to
speed from :func:`osmm_jax.balance`) and the parameters replicated::

    import osmm_jax as om
    from osmm_jax.flax import Dense

    sizes = om.balance(batch, om.profile_speeds(), min_rows=1).sizes
    layer = Dense(64, row_sizes=sizes)           # like nn.Dense(64)
    y_local = layer.apply(params, x_local)       # x_local: this rank's rows

Each takes the stock layer's arguments plus ``row_sizes`` (the input rows each
rank holds, all leading dimensions flattened; uneven, possibly 0), ``comm``
and ``method`` (passed to :func:`osmm_jax.plan` / :func:`osmm_jax.matmul`).
The parameter tree is the stock one (``kernel`` of shape ``(in, out)``,
``bias`` of shape ``(out,)``; the linen layer is also auto-named ``Dense_<n>``),
so checkpoints interchange with the stock layers both ways, and the same
initialiser and key give the same parameters.

Gradients, when each rank's loss is its share of the global loss (e.g. its
rows' per-example losses summed and divided by the GLOBAL batch size): the
``kernel`` and ``bias`` gradients arrive already summed over ranks, the same on
every rank (do not average or all-reduce them again); the input's gradient is
this rank's rows'. Any other parameter (an embedding, a LayerNorm, a stock
layer) gets this rank's gradient alone. :func:`value_and_grad` / :func:`grad`,
in place of JAX's or nnx's, return the gradient of the global loss for every
parameter: they find the data-parallel layers while tracing and sum the rest
in one fused transfer::

    loss, grads = value_and_grad(loss_fn)(params, x_local)   # inside jax.jit

(it refuses, rather than guess, a data-parallel layer reached through
``nn.remat`` / ``scan`` / a ``jit`` inside the loss / a cast of the pytree
parameters, and a tensor-parallel layer on the communicator it sums over), or,
by hand, :func:`sync_grads` sums exactly those, given the paths of the
osmm_jax layers (:func:`summed_paths`, or the nnx model itself)::

    skip = summed_paths(model, x_local)          # once; linen: init's inputs
    grads = sync_grads(jax.grad(loss)(params, x_local), skip)

A step that differentiates data-parallel layers of a model with other
parameters and sums neither way gets one :class:`UnsummedGradientsWarning`
naming those parameters, when the jitted step is traced (eagerly: at the next
step); ``warnings.simplefilter("error", UnsummedGradientsWarning)`` makes it
refuse such a step instead.

Tensor parallelism. The kernel ``(in, out)`` is split over the ranks, unevenly
(``sizes[r]`` on rank ``r``, possibly 0), every rank stores only its shard and
every rank holds the same input rows:

* :class:`ColumnParallelDense` / :class:`ColumnParallelLinear`: kernel split by
  columns (``sum(sizes) == out``); takes the whole input ``(..., in)``, gives
  this rank's ``(..., sizes[rank])`` output features; bias split like them.
  The input's gradient is the whole gradient (summed over ranks), on every rank.
* :class:`RowParallelDense` / :class:`RowParallelLinear`: kernel split by rows
  (``sum(sizes) == in``); takes this rank's ``(..., sizes[rank])`` input
  features, gives the whole output ``(..., out)``, summed over ranks, on every
  rank; the (replicated) bias is added once, after the sum.

A column-parallel layer followed (through elementwise functions) by a
row-parallel one with the same ``sizes`` is a Megatron-style block: one
reduction forward (the row layer's output) and one backward (the column
layer's input gradient), no other communication. Every rank computes the same
loss from a replicated output; every gradient is then already complete on
every rank (a shard's for this rank's shard, a replicated parameter's, e.g. a
LayerNorm's or the row-parallel bias, the whole of it): do not sum or average
anything. The same initialiser and key give each rank its cut of the stock
parameters (built whole, then cut); :func:`shard_params` cuts a stock
``kernel``/``bias`` checkpoint for one rank and :func:`gather_params` (every
rank) or :func:`join_params` (all shards at hand) joins the shards back.

Sequence parallelism: give both layers of a pair ``batch_sizes`` (the entries
of the activations' first dimension, e.g. sequences, per rank; uneven, possibly
0). Between the pairs the activations are then split by batch entry instead of
replicated, so the work outside the pairs (embeddings, LayerNorms, residual
sums, an output layer) is split too. The column-parallel layer takes this
rank's ``(batch_sizes[rank], ..., in)`` and gives every entry of its features,
``(sum(batch_sizes), ..., sizes[rank])`` (the rows are gathered); the
row-parallel one takes ``(sum(batch_sizes), ..., sizes[rank])`` and gives this
rank's entries of the sum, ``(batch_sizes[rank], ..., out)`` (a reduce-scatter;
the bias added to them). Each rank's loss is its entries' share of the global
loss, as in data parallelism: the kernels' gradients (and a column-parallel
bias's) come complete from the products; every other gradient (the
row-parallel biases, LayerNorms, embeddings, stock layers) is this rank's
entries' alone, and :func:`value_and_grad` / :func:`sync_grads` with
:func:`summed_paths` sum exactly those. It moves the same bytes as the
reductions it replaces, in twice as many transfers.

Supported combinations, on one communicator (``comm``, default COMM_WORLD):

* data parallelism alone (:class:`Dense` / :class:`Linear`, stock layers and
  other parameters synchronised by :func:`value_and_grad` or :func:`sync_grads`);
* tensor parallelism alone (column- and row-parallel layers, any stock layer
  computed the same on every rank on replicated values between them);
* tensor with sequence parallelism (the same layers with ``batch_sizes``, the
  rest of the model on each rank's own batch entries, gradients summed by
  :func:`value_and_grad`);
* both in one model on the same ranks only where the data is laid out as each
  layer expects: a data-parallel layer's output is split by batch rows, a
  column-parallel layer needs every row on every rank, and osmm_jax does not
  convert between them;
* 2-D: tensor-parallel layers on a group's communicator (``comm=tp_comm``),
  several such groups each on its own share of the batch, each rank's loss its
  group's share of the global loss; then
  ``sync_grads(grads, comm=replica_comm)``, over the ranks that hold the same
  shards (one per group), sums every gradient (shards and replicated
  parameters alike) into the gradient of one process on the whole batch.
  Tested on 4 ranks (2 groups of 2). A data-parallel layer in such a model
  sums over its own ``comm`` (e.g. ``replica_comm``): pass its paths as
  ``skip``.

Every rank calls a layer at the same point with the same ``row_sizes`` /
``sizes`` / ``batch_sizes`` (a rank with no rows or no columns included); bad or
disagreeing arguments (wrong count, negative or non-integer entries, sizes that
do not sum to the split dimension, an input of the wrong shape) raise the same
``ValueError`` / ``TypeError`` on every rank before any data moves. Not
supported: ``precision``, ``out_sharding``, forward-mode or higher-order
derivatives. How the data-parallel layers work, when copies stay
bit-identical, and the details: docs/design.md ("The Flax layers"). Needs Flax
(``pip install 'osmm_jax[flax]'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

try:
    import flax.linen as nn
    import jax.numpy as jnp
    from flax import nnx
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "osmm_jax.flax needs Flax: pip install 'osmm_jax[flax]' (flax and optax)"
    ) from exc

from osmm_jax._src.nn import unsummed_grads
from osmm_jax._src.nn.distributed_dot import DistributedDot
from osmm_jax._src.nn.tensor_parallel import (
    TensorParallelDot,
    _value,
    check_sizes,
    join_params,
    shard_params,
    span,
)

__all__ = [
    "ColumnParallelDense",
    "ColumnParallelLinear",
    "Dense",
    "Linear",
    "RowParallelDense",
    "RowParallelLinear",
    "dot_general",
    "gather_params",
    "join_params",
    "shard_params",
    "UnsummedGradientsWarning",
    "grad",
    "summed_paths",
    "sync_grads",
    "value_and_grad",
]

UnsummedGradientsWarning = unsummed_grads.UnsummedGradientsWarning


def dot_general(row_sizes: Sequence[int], *, comm=None, method: str | None = None):
    """A ``dot_general`` for Flax's hooks whose product runs on osmm_jax.

    ``nn.Dense(features, use_bias=False, dot_general=dot_general(sizes))`` and
    ``nnx.Linear(..., use_bias=False, dot_general=dot_general(sizes))`` compute
    ``x_local @ kernel`` for this rank's ``sizes[rank]`` rows, and the kernel
    gradient comes back summed over ranks. It contracts the input's last
    dimension with a 2-D kernel's first, nothing else.

    With a bias, use :class:`Dense` / :class:`Linear` instead: the stock layers
    add the bias outside the product, so its gradient would stay this rank's own.
    """
    return DistributedDot(row_sizes, comm=comm, method=method)


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
        if self.dot_general is not None or self.dot_general_cls is not None:
            raise ValueError(
                "osmm_jax.flax.Dense computes its product with osmm_jax.matmul: leave "
                "dot_general and dot_general_cls unset"
            )
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        _linen_differentiated(self, kernel, bias, data_parallel=True)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        dot = DistributedDot(
            self.row_sizes, comm=self.comm, method=self.method, name="osmm_jax.flax.Dense"
        )
        return dot.apply(inputs, kernel, bias, precision=self.precision)


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
        if "dot_general" in kwargs:
            raise ValueError(
                "osmm_jax.flax.Linear computes its product with osmm_jax.matmul: do not pass "
                "dot_general"
            )
        dot = DistributedDot(row_sizes, comm=comm, method=method, name="osmm_jax.flax.Linear")
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
        unsummed_grads.note_differentiated((kernel, bias), lambda: _nnx_unsummed(self))
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return self.dot_general.apply(
            inputs,
            kernel,
            bias,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            out_sharding=out_sharding,
        )


# -- tensor parallelism -----------------------------------------------------------------------


def _not_supported(precision, out_sharding=None) -> str | None:
    if precision is not None:
        return f"precision={precision!r} is not supported (osmm_jax.matmul takes none)"
    if out_sharding is not None:
        return "out_sharding is not supported: each rank's output block is placed by osmm_jax"
    return None


def _no_dot_general(name: str, module) -> None:
    if module.dot_general is not None or module.dot_general_cls is not None:
        raise ValueError(
            f"{name} computes its product with osmm_jax.matmul: leave dot_general and "
            "dot_general_cls unset"
        )


class ColumnParallelDense(nn.Dense):
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

    The input's gradient is the whole gradient (summed over every rank's
    columns), the same on every rank (with ``batch_sizes``: this rank's
    entries of it).
    """

    sizes: Sequence[int] = dataclasses.field(kw_only=True)
    comm: Any = None
    method: str | None = None
    batch_sizes: Sequence[int] | None = None

    @nn.compact
    def __call__(self, inputs):
        """This rank's output columns of ``inputs @ kernel + bias``; shape ``(..., sizes[rank])``."""
        name = "osmm_jax.flax.ColumnParallelDense"
        _no_dot_general(name, self)
        dot = TensorParallelDot(
            "column",
            self.sizes,
            comm=self.comm,
            method=self.method,
            name=name,
            batch_sizes=self.batch_sizes,
        )
        in_features = jnp.shape(inputs)[-1] if jnp.ndim(inputs) else 0
        sizes, rank, private = dot.check(
            in_features,
            self.features,
            jnp.shape(inputs),
            use_bias=self.use_bias,
            error=_not_supported(self.precision),
        )
        part = span(sizes, rank)
        full = (in_features, self.features)
        kernel = self.param(
            "kernel", lambda key: self.kernel_init(key, full, self.param_dtype)[:, part]
        )
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias", lambda key: self.bias_init(key, (self.features,), self.param_dtype)[part]
            )
        _linen_tensor_parallel(self, dot, kernel, bias)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = dot.product(inputs, kernel, sizes, private)
        return y if bias is None else y + bias


class RowParallelDense(nn.Dense):
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
        comm, method: as for :class:`ColumnParallelDense`.
        batch_sizes: None, or the output's first-dimension entries per rank
            (sequence parallelism): then the input holds every entry,
            ``(sum(batch_sizes), ..., sizes[rank])``, and each rank gets its own
            entries of the sum, ``(batch_sizes[rank], ..., features)``, the bias
            added to them (its gradient is then this rank's entries' alone).

    Its output is replicated: its cotangent is taken to be the same on every
    rank (every rank computes the same loss from it). With ``batch_sizes`` it
    is split by entries instead, each rank's cotangent its own entries'.
    """

    sizes: Sequence[int] = dataclasses.field(kw_only=True)
    comm: Any = None
    method: str | None = None
    batch_sizes: Sequence[int] | None = None

    @nn.compact
    def __call__(self, inputs):
        """``inputs_all @ kernel + bias``, the same on every rank; shape ``(..., features)``
        (with ``batch_sizes``: this rank's batch entries of it)."""
        name = "osmm_jax.flax.RowParallelDense"
        _no_dot_general(name, self)
        dot = TensorParallelDot(
            "row",
            self.sizes,
            comm=self.comm,
            method=self.method,
            name=name,
            batch_sizes=self.batch_sizes,
        )
        sizes, rank, private = dot.check(
            None,
            self.features,
            jnp.shape(inputs),
            use_bias=self.use_bias,
            error=_not_supported(self.precision),
        )
        part = span(sizes, rank)
        full = (sum(sizes), self.features)
        kernel = self.param(
            "kernel", lambda key: self.kernel_init(key, full, self.param_dtype)[part, :]
        )
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        _linen_tensor_parallel(self, dot, kernel, bias)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = dot.product(inputs, kernel, sizes, private)
        return y if bias is None else y + bias


class _TensorParallelLinear(nnx.Linear):
    """``nnx.Linear`` whose kernel is split over ranks by :class:`TensorParallelDot`."""

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
        **kwargs,
    ):
        name = f"osmm_jax.flax.{type(self).__name__}"
        if "dot_general" in kwargs:
            raise ValueError(
                f"{name} computes its product with osmm_jax.matmul: do not pass dot_general"
            )
        dot = TensorParallelDot(
            self._split, sizes, comm=comm, method=method, name=name, batch_sizes=batch_sizes
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
            error=_not_supported(self.precision, out_sharding),
        )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        if dot.sequence_parallel:
            # Complete gradients (the rows were gathered): summed, as a data-parallel layer's;
            # a row-parallel bias, added to this rank's rows only, is left to be summed.
            complete = (kernel, bias) if self._split == "column" else (kernel,)
            unsummed_grads.note_sequence_parallel((kernel, bias), dot.comm)
            unsummed_grads.note_differentiated(complete, lambda: _nnx_unsummed(self))
        else:
            unsummed_grads.note_tensor_parallel((kernel, bias), dot.comm)
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
        comm, method, batch_sizes, **kwargs: as for :class:`ColumnParallelLinear`.

    Rank ``r`` stores ``kernel`` ``(sizes[r], out_features)`` (its rows of the
    stock kernel) and the whole ``bias``, added once after the sum. Call with
    this rank's ``(..., sizes[rank])`` input features (the leading dimensions
    the same on every rank); returns the whole ``(..., out_features)``, summed
    over ranks, on every rank.
    """

    _split = "row"


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

    name = "osmm_jax.flax.gather_params"
    dot = TensorParallelDot(split, sizes, comm=comm, name=name)
    private = communicators.private_comm(comm)
    rank = private.Get_rank()
    local = {k: np.asarray(_value(v)) for k, v in params.items() if v is not None}
    kernel = local.get("kernel")
    error = None
    if kernel is None or kernel.ndim != 2:
        error = (
            f"expected a 2-D 'kernel' in the shard, got {None if kernel is None else kernel.shape}"
        )
    in_features = out_features = None
    if error is None:
        in_features, out_features = kernel.shape
        try:
            checked = check_sizes(dot.sizes, private.Get_size())
        except (TypeError, ValueError):
            checked = None
        if checked is not None:
            axis = 1 if dot.split == "column" else 0
            if kernel.shape[axis] != checked[rank]:
                error = (
                    f"the kernel shard has shape {kernel.shape}; sizes[{rank}] is {checked[rank]}"
                )
            if dot.split == "column":
                out_features = sum(checked)
            else:
                in_features = None
    sizes, _, private = dot.check(
        in_features, out_features or 0, use_bias="bias" in local, error=error
    )
    return join_params(private.allgather(local), split=split)


# -- gradients outside the osmm_jax layers ------------------------------------------------------


def summed_paths(model, *args, **kwargs) -> frozenset[tuple]:
    """Where ``model``'s data-parallel layers (:class:`Dense`, :class:`Linear`) keep parameters,
    and its sequence-parallel layers (tensor-parallel ones with ``batch_sizes``) the
    parameters whose gradients their products complete (a column-parallel layer's kernel and
    bias, a row-parallel one's kernel: ``(*path, "kernel")``).

    Their gradients arrive already summed over ranks, so :func:`sync_grads`
    leaves them alone. For an ``nnx.Module`` the paths come from its graph
    (``args`` unused). For a linen module, pass the arguments of its
    ``init`` after the key (this rank's inputs): it is traced abstractly once
    (``jax.eval_shape``), on every rank together, and the paths start with
    ``"params"``. Compute them once, outside the training step.
    """
    if isinstance(model, nnx.Module):
        return frozenset(
            prefix
            for path, node in nnx.iter_graph(model)
            for prefix in _nnx_summed_prefixes(tuple(path), node)
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"summed_paths takes a flax.linen or flax.nnx module, got {type(model).__name__}"
        )
    import jax

    found = set()

    def record(next_fun, call_args, call_kwargs, context):
        module = context.module
        if module.scope is not None:
            path = ("params", *module.scope.path)
            if isinstance(module, Dense):
                found.add(path)
            elif isinstance(module, (ColumnParallelDense, RowParallelDense)):
                if module.batch_sizes is not None:
                    found.add(
                        path if isinstance(module, ColumnParallelDense) else (*path, "kernel")
                    )
        return next_fun(*call_args, **call_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    return frozenset(found)


def _key_name(key):
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _path_names(path) -> tuple:
    return tuple(_key_name(k) for k in path)


def _under(names: tuple, prefixes) -> bool:
    return any(names[: len(p)] == p for p in prefixes)


# -- noticing un-summed gradients (see osmm_jax._src.nn.unsummed_grads) -----------------------------


def _linen_tensor_parallel(module, dot, kernel, bias) -> None:
    """:func:`_linen_differentiated` for a tensor-parallel layer: with sequence parallelism its
    kernel's gradient (and a column-parallel bias's) is complete, like a data-parallel
    layer's; a row-parallel bias, added to this rank's rows only, is left to be summed."""
    if not dot.sequence_parallel:
        _linen_differentiated(module, kernel, bias, data_parallel=False)
        return
    unsummed_grads.note_sequence_parallel((kernel, bias), dot.comm)
    if dot.split == "column":
        _linen_differentiated(module, kernel, bias, data_parallel=True)
    else:
        _linen_differentiated(module, kernel, None, data_parallel=True, only="kernel")


def _linen_differentiated(
    module, kernel, bias, *, data_parallel: bool, only: str | None = None
) -> None:
    """A linen osmm_jax layer's parameters may be being differentiated: record that its path is
    covered in its model's record; a data-parallel layer also notes the differentiation, a
    tensor-parallel one reports its communicator (see :mod:`osmm_jax._src.nn.unsummed_grads`).
    ``only``: the one parameter under the layer's path that it covers (default: all)."""
    if not data_parallel:
        unsummed_grads.note_tensor_parallel((kernel, bias), module.comm)
    if module.scope is None or not unsummed_grads.differentiated((kernel, bias)):
        if data_parallel:
            unsummed_grads.note_differentiated((kernel, bias), lambda: None)
        return
    path = tuple(module.scope.path)
    root = _linen_root(module, path)
    if root is None:  # the model cannot be seen from here: nothing to judge it by
        return
    record = unsummed_grads.model_record(root)
    if "params" not in record:
        import jax

        flat = jax.tree_util.tree_flatten_with_path(_linen_params(root))[0]
        # Only parameters being differentiated can carry an un-summed gradient (a frozen one,
        # e.g. outside the trained subset of a fine-tuning, has none).
        record["params"] = [
            _path_names(path) for path, leaf in flat if unsummed_grads.differentiated((leaf,))
        ]
        record["covered"] = set()
    record["covered"].add(path if only is None else (*path, only))
    if data_parallel:
        unsummed_grads.note_differentiated(
            (kernel, bias),
            lambda: (
                lambda: [
                    "/".join(map(str, n))
                    for n in record["params"]
                    if not _under(n, record["covered"])
                ]
            ),
        )


def _linen_params(scope) -> dict:
    variables = scope.variables()
    return variables.get("params", {}) if hasattr(variables, "get") else {}


def _linen_holds(scope, path: tuple) -> bool:
    tree = _linen_params(scope)
    for name in path:
        if not hasattr(tree, "get") or name not in tree:
            return False
        tree = tree[name]
    return True


def _linen_root(module, path: tuple):
    """The root scope of the model ``module`` belongs to: its own scope's root, unless a lifted
    transformation (``nn.remat``, ``nn.scan``, ...) gave it one of its own; then the root of a
    calling module's scope on the stack that holds ``path``. None if none is found."""
    root = module.scope.root
    if not path or _linen_holds(root, path):
        return root
    for frame in _caller_frames():
        caller = frame.f_locals.get("self")
        if isinstance(caller, nn.Module) and caller.scope is not None:
            if _linen_holds(caller.scope.root, path):
                return caller.scope.root
    return None


def _caller_frames(limit: int = 64):
    """The frames of the calls on the stack, from the osmm_jax layer's caller outwards (at most
    ``limit``): where the model a layer belongs to is found while it is traced."""
    import sys

    frame = sys._getframe(3)  # 0: here, 1: the finder, 2: the layer's hook, 3: its caller
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def _nnx_summed_prefixes(path: tuple, node, *, tensor_parallel: bool = False) -> list[tuple]:
    """The parameter paths under ``node`` (at ``path``) whose gradients its product completes
    over ranks: a data-parallel :class:`Linear`'s, a sequence-parallel layer's kernel (and a
    column-parallel one's bias); with ``tensor_parallel``, a tensor-parallel layer's shards too
    (not summed, but not another rank's to sum either)."""
    if isinstance(node, Linear):
        return [path]
    if isinstance(node, _TensorParallelLinear):
        if not node.tensor_parallel.sequence_parallel:
            return [path] if tensor_parallel else []
        return [path] if node.tensor_parallel.split == "column" else [(*path, "kernel")]
    return []


def _nnx_unsummed(layer):
    """For a differentiated nnx data-parallel layer: the function naming the parameters of its
    model outside osmm_jax layers. The model is the largest ``nnx.Module`` among the local
    variables of the calls on the stack whose graph holds ``layer`` (the module the training
    step differentiates); none found: the layer alone, nothing outside it."""
    for known in unsummed_grads.known_models():
        if id(layer) in known.get("node_ids", ()):
            return lambda record=known: record["unsummed"]
    root, size = layer, 1
    seen: set[int] = set()
    for frame in _caller_frames():
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
            for prefix in _nnx_summed_prefixes(tuple(path), node, tensor_parallel=True)
        ]
        record["unsummed"] = [
            "/".join(map(str, path))
            for path, node in nnx.iter_graph(root)
            if isinstance(node, nnx.Param)
            and not _under(tuple(path), covered)
            and unsummed_grads.differentiated((node.get_value(),))
        ]
    return lambda: record["unsummed"]


# -- summing gradients over ranks -----------------------------------------------------------------


def _sum_over_ranks(leaves: list, index: Sequence[int], comm, method) -> list:
    """``leaves`` with the entries at ``index`` summed over the ranks of ``comm``: one osmm_jax
    product per dtype (a reduction onto every rank) of the concatenated leaves."""
    from osmm_jax._src.planning.layout import Layout
    from osmm_jax._src.runtime import communicators
    from osmm_jax._src.runtime.api import plan
    from osmm_jax._src.runtime.matmul import matmul

    unsummed_grads.note_synced()
    leaves = list(leaves)
    groups: dict = {}
    for i in index:
        groups.setdefault(jnp.result_type(leaves[i]), []).append(i)
    private = communicators.private_comm(comm)
    nranks = private.Get_size()
    for dtype in sorted(groups, key=str):
        members = groups[dtype]
        vector = jnp.concatenate([jnp.ravel(leaves[i]) for i in members])
        n = vector.shape[0]
        # sum_r v_r as one product: [1 .. 1] (1 x P, a column per rank) @ [v_0; ..; v_P-1].
        p = plan(
            Layout.cols((1, nranks), sizes=[1] * nranks),
            Layout.rows((nranks, n), sizes=[1] * nranks),
            Layout.replicated((1, n), nranks=nranks),
            comm=private,
        )
        total = matmul(jnp.ones((1, 1), dtype), jnp.reshape(vector, (1, n)), p, method=method)[0]
        offset = 0
        for i in members:
            size = leaves[i].size
            leaves[i] = jnp.reshape(total[offset : offset + size], jnp.shape(leaves[i]))
            offset += size
    return leaves


def sync_grads(grads, skip=frozenset(), *, comm=None, method: str | None = None):
    """``grads`` with every gradient not already summed over ranks summed over ranks.

    For data-parallel training in which each rank's loss is its share of the
    global loss: gradients that reach parameters through :class:`Dense` /
    :class:`Linear` arrive summed by their products, every other one (an
    embedding, a LayerNorm, a stock layer) is this rank's alone. This sums
    the latter, so that every rank holds the gradient of the global loss, as
    one process on the whole batch would. :func:`value_and_grad` differentiates
    and calls this in one go, finding ``skip`` itself.

    Args:
        grads: a gradient pytree (a linen ``params`` gradient, or an
            ``nnx.State`` from ``nnx.grad``), the same structure on every rank.
        skip: the parameter paths whose gradients are already summed, as
            :func:`summed_paths` gives them, or an ``nnx.Module`` (its
            :class:`Linear` layers). A leaf whose path starts with one of them
            is left as it is.
        comm: the data-parallel communicator (default COMM_WORLD).
        method: ``"one_sided"`` (default), ``"allreduce"`` or None.

    The summed leaves travel together: concatenated into one flat vector per
    dtype and summed with one osmm_jax product (a reduction onto every rank),
    inside ``jax.jit`` too. Every rank calls it with the same tree. Calling it
    tells osmm_jax that this step's gradients are summed (no
    :class:`UnsummedGradientsWarning`).
    """
    import jax

    if isinstance(skip, nnx.Module):
        skip = summed_paths(skip)
    skip = {tuple(p) for p in skip}
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    index = [i for i, (path, _) in enumerate(flat) if not _under(_path_names(path), skip)]
    leaves = _sum_over_ranks([leaf for _, leaf in flat], index, comm, method)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def value_and_grad(
    fun, argnums: int | Sequence[int] = 0, *, has_aux: bool = False, comm=None, method=None
):
    """``jax.value_and_grad`` for data-parallel training on osmm_jax: the gradients returned
    are those of the global loss, on every rank.

    Use it in place of ``jax.value_and_grad`` (linen: parameters as a pytree) or
    ``nnx.value_and_grad`` (an ``nnx.Module`` argument, differentiated with respect to its
    ``nnx.Param`` state as nnx does), with each rank's loss its share of the global loss
    (e.g. its rows' losses summed and divided by the global batch size). The gradients of
    :class:`Dense` / :class:`Linear` parameters come summed by their products; every other
    gradient of the arguments in ``argnums`` (embeddings, LayerNorms, stock layers) is then
    summed over ``comm`` in one fused transfer, as :func:`sync_grads` does. No
    :func:`summed_paths` needed: the data-parallel layers are found while ``fun`` is traced.

    Args:
        fun: the loss function; with ``has_aux``, returns ``(loss, aux)``.
        argnums: the argument(s) holding the parameters to differentiate (not the batch: an
            input's gradient is each rank's own rows'); all nnx modules or all pytrees.
        has_aux, comm, method: as for ``jax.value_and_grad`` / :func:`sync_grads`.

    Returns a function with ``fun``'s arguments returning ``(value, grads)`` (``value`` is
    this rank's loss, or ``(loss, aux)``), usable inside ``jax.jit`` / ``nnx.jit``.

    Raises ``ValueError`` while tracing, instead of summing anything twice, when it cannot
    tell which gradients a product already summed: for pytree arguments, a data-parallel
    layer must receive its parameters as they are in the argument (not through ``nn.remat``
    / ``jax.checkpoint``, ``scan``, a ``jit`` inside ``fun`` or a dtype cast: there use
    ``jax.value_and_grad`` with :func:`sync_grads` and :func:`summed_paths`); and a
    tensor-parallel layer may not share ``comm`` (its shards differ from rank to rank; in
    2-D parallelism pass the replicas' communicator), and a sequence-parallel one (with
    ``batch_sizes``) must be on ``comm`` (the gradients it completes are complete over its
    own ranks only).
    """
    many = not isinstance(argnums, int)
    nums = tuple(argnums) if many else (argnums,)

    def differentiate(*args, **kwargs):
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"osmm_jax.flax.value_and_grad: argnums {argnums!r} names argument {i} "
                    f"but the function got {len(args)} positional arguments"
                )
        modules = [isinstance(args[i], nnx.Module) for i in nums]
        if any(modules) and not all(modules):
            raise ValueError(
                "osmm_jax.flax.value_and_grad: differentiate either nnx modules or pytrees of "
                "parameters, not both in one call"
            )
        if all(modules):
            layer_comms: dict[str, list] = {"tensor_parallel": [], "sequence_parallel": []}
            with unsummed_grads.collecting(
                lambda kind, value: layer_comms[kind].append(value) if kind in layer_comms else None
            ):
                value, grads = nnx.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
                    *args, **kwargs
                )
            _check_layer_comms(layer_comms, comm)
            parts = list(grads) if many else [grads]
            for slot, i in enumerate(nums):
                parts[slot] = sync_grads(parts[slot], args[i], comm=comm, method=method)
            return value, (tuple(parts) if many else parts[0])
        return _pytree_value_and_grad(fun, nums, many, has_aux, comm, method, args, kwargs)

    return differentiate


def _check_layer_comms(layer_comms: dict, comm) -> None:
    """Refuse to sum gradients over ``comm`` when a differentiated tensor-parallel layer shares
    its ranks (their shards are different parameters, not copies), or when a
    sequence-parallel layer does not (the gradients it completes are complete over its own
    ranks only, and which others to sum them over cannot be told)."""
    if not layer_comms["tensor_parallel"] and not layer_comms["sequence_parallel"]:
        return
    from mpi4py import MPI

    from osmm_jax._src.runtime import communicators

    mine = communicators.private_comm(comm)

    def same(layer_comm) -> bool:
        relation = MPI.Comm.Compare(communicators.private_comm(layer_comm), mine)
        return relation in (MPI.IDENT, MPI.CONGRUENT)

    if not all(same(c) for c in layer_comms["sequence_parallel"]):
        raise ValueError(
            "osmm_jax.flax.value_and_grad: a sequence-parallel layer (a tensor-parallel layer "
            "with batch_sizes) is differentiated on a communicator other than the one whose "
            "gradients it sums; its gradients are complete over its own ranks only. Use "
            "sequence parallelism on the summing communicator, or jax.value_and_grad and sum "
            "each gradient over the ranks it needs by hand"
        )
    for layer_comm in layer_comms["tensor_parallel"]:
        if same(layer_comm):
            raise ValueError(
                "osmm_jax.flax.value_and_grad: a tensor-parallel layer is differentiated on "
                "the communicator whose gradients it would sum; its shards are different "
                "parameters on each rank. Tensor parallelism alone needs no summing (use "
                "jax.value_and_grad / nnx.value_and_grad); with data parallelism across "
                "tensor-parallel groups, pass comm=<the communicator of the replicas>"
            )


def _pytree_value_and_grad(fun, nums, many, has_aux, comm, method, args, kwargs):
    """:func:`value_and_grad` for pytree arguments: the data-parallel layers' parameters are
    recognised as the very tracers of the differentiated leaves they receive."""
    import jax

    summed: set[int] = set()  # positions, over the differentiated arguments' leaves
    strays: list = []
    layer_comms: dict[str, list] = {"tensor_parallel": [], "sequence_parallel": []}

    def traced(*inner_args):
        leaves = [leaf for i in nums for leaf in jax.tree_util.tree_leaves(inner_args[i])]
        position = {id(leaf): j for j, leaf in enumerate(leaves)}
        ours = next((leaf._trace for leaf in leaves if isinstance(leaf, jax.core.Tracer)), None)

        def report(kind, value):
            if kind in layer_comms:
                layer_comms[kind].append(value)
                return
            j = position.get(id(value))
            if j is not None and leaves[j] is value:
                summed.add(j)
            elif ours is not None and unsummed_grads.derived_from(value, ours):
                strays.append(value)  # ours, but not as a leaf: its gradient cannot be placed

        with unsummed_grads.collecting(report):
            return fun(*inner_args, **kwargs)

    value, grads = jax.value_and_grad(traced, argnums=nums, has_aux=has_aux)(*args)
    if strays:
        raise ValueError(
            "osmm_jax.flax.value_and_grad: an osmm_jax data-parallel layer receives its "
            "parameters through a transformation of the differentiated arguments (nn.remat / "
            "jax.checkpoint, scan, a jit inside the loss, or a dtype cast), so which gradients "
            "its product already sums cannot be told; use jax.value_and_grad with "
            "osmm_jax.flax.sync_grads(grads, summed_paths(model, ...)) there"
        )
    _check_layer_comms(layer_comms, comm)
    flat = [jax.tree_util.tree_flatten(g) for g in grads]
    leaves = [leaf for g_leaves, _ in flat for leaf in g_leaves]
    index = [j for j in range(len(leaves)) if j not in summed]
    leaves = _sum_over_ranks(leaves, index, comm, method)
    parts, offset = [], 0
    for g_leaves, treedef in flat:
        parts.append(jax.tree_util.tree_unflatten(treedef, leaves[offset : offset + len(g_leaves)]))
        offset += len(g_leaves)
    return value, (tuple(parts) if many else parts[0])


def grad(fun, argnums: int | Sequence[int] = 0, *, has_aux: bool = False, comm=None, method=None):
    """:func:`value_and_grad` without the value: returns ``grads`` (``(grads, aux)`` with
    ``has_aux``), as ``jax.grad`` does."""
    both = value_and_grad(fun, argnums, has_aux=has_aux, comm=comm, method=method)

    def differentiate(*args, **kwargs):
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return differentiate


# The nnx layers whose parameters osmm_jax handles (data- and tensor-parallel).
_OSMM_LAYERS_NNX = (Linear, _TensorParallelLinear)
