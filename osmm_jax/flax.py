"""Data-parallel Flax dense layers whose product runs on osmm_jax.

:class:`Dense` replaces ``flax.linen.Dense`` and :class:`Linear` replaces
``flax.nnx.Linear`` in a model trained with the batch split by rows over the
ranks of an MPI job (uneven, e.g. in proportion to speed from
:func:`osmm_jax.balance`) and the parameters replicated::

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
this rank's rows'. Any other parameter gets this rank's gradient alone.

Every rank calls a layer at the same point with the same ``row_sizes`` (a rank
with no rows passes 0 rows); bad or disagreeing arguments raise the same
``ValueError`` / ``TypeError`` on every rank. Not supported: tensor
parallelism, ``precision``, ``out_sharding``, forward-mode or higher-order
derivatives. How the layers work, when copies stay bit-identical, and the
details: docs/design.md ("The Flax layers"). Needs Flax
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

from osmm_jax._src.distributed_dot import DistributedDot

__all__ = ["Dense", "Linear", "dot_general"]


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
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return self.dot_general.apply(
            inputs,
            kernel,
            bias,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            out_sharding=out_sharding,
        )
