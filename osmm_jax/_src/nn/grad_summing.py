"""Summing gradients over ranks: :func:`sync_grads`, :func:`value_and_grad`, :func:`grad`
and :func:`summed_paths`, the public ``osmm_jax.flax`` functions.

In data-parallel training each rank's loss is its share of the global loss. The gradients of
the osmm_jax data-parallel layers' parameters (and of what a sequence-parallel layer's
product completes) arrive summed over ranks; every other gradient is this rank's alone.
:func:`sync_grads` sums exactly those, given the summed paths; :func:`value_and_grad` finds
the summed parameters while the loss is traced (the layers report them through
:func:`osmm_jax._src.nn.unsummed_grads.collecting`). Either way the leaves to sum travel
together, one osmm_jax product per dtype.

Imports Flax at its top: only :mod:`osmm_jax.flax` imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from osmm_jax._src.nn import linen_layers, nnx_layers, unsummed_grads
from osmm_jax._src.nn.param_paths import path_names, under


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
        return nnx_layers.summed_paths(model)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"summed_paths takes a flax.linen or flax.nnx module, got {type(model).__name__}"
        )
    return linen_layers.summed_paths(model, *args, **kwargs)


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
    if isinstance(skip, nnx.Module):
        skip = summed_paths(skip)
    skip = {tuple(p) for p in skip}
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    index = [i for i, (path, _) in enumerate(flat) if not under(path_names(path), skip)]
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
            return _nnx_value_and_grad(fun, argnums, nums, has_aux, comm, method, args, kwargs)
        return _pytree_value_and_grad(fun, nums, many, has_aux, comm, method, args, kwargs)

    return differentiate


def _nnx_value_and_grad(fun, argnums, nums, has_aux, comm, method, args, kwargs):
    """:func:`value_and_grad` for nnx module arguments: each module's gradients summed as
    :func:`sync_grads` sums them, but for those its osmm_jax layers' products sum."""
    layer_comms: dict[str, list] = {"tensor_parallel": [], "sequence_parallel": []}
    with unsummed_grads.collecting(
        lambda kind, value: layer_comms[kind].append(value) if kind in layer_comms else None
    ):
        value, grads = nnx.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
    _check_layer_comms(layer_comms, comm)
    many = not isinstance(argnums, int)
    parts = list(grads) if many else [grads]
    for slot, i in enumerate(nums):
        parts[slot] = sync_grads(parts[slot], args[i], comm=comm, method=method)
    return value, (tuple(parts) if many else parts[0])


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
