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
reductions it replaces, in twice as many transfers. ``keep_fetched=True`` on
the column-parallel layer keeps the entries it gathered in the forward pass for
its backward pass instead of gathering them again (fewer transfers, the same
bits, the gathered entries held between the passes; off by default).

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

# Flax first: without it, or with one too old for the layers, this import fails here saying
# how to install it (the layers behind these names import Flax at their top).
from osmm_jax._src.nn import flax_requirement  # noqa: F401, I001 - before the layers
from osmm_jax._src.nn.distributed_dot import dot_general
from osmm_jax._src.nn.grad_summing import grad, summed_paths, sync_grads, value_and_grad
from osmm_jax._src.nn.linen_layers import ColumnParallelDense, Dense, RowParallelDense
from osmm_jax._src.nn.nnx_layers import ColumnParallelLinear, Linear, RowParallelLinear
from osmm_jax._src.nn.tensor_parallel import gather_params, join_params, shard_params
from osmm_jax._src.nn.unsummed_grads import UnsummedGradientsWarning

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
