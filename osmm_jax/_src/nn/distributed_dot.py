"""The product behind :mod:`osmm_jax.flax`: a ``dot_general`` that runs on osmm_jax.

A data-parallel dense layer holds the batch split by rows over the ranks
(``row_sizes[r]`` rows on rank ``r``, uneven and possibly 0) and the kernel
replicated. Its product is one :func:`osmm_jax.matmul` with

* A = ``Layout.rows((sum(row_sizes), K), sizes=row_sizes)``: the input, leading
  dimensions flattened to rows;
* B = ``Layout.replicated((K, N))``: the kernel;
* C = ``Layout.rows((sum(row_sizes), N), sizes=row_sizes)``: the output.

The forward product needs no communication. Its backward products are
dA = dC·Bᵀ (local) and dB = Aᵀ·dC, a reduction over every rank's rows that
osmm_jax delivers onto every rank by one-sided transfers: the kernel
gradient comes back summed over ranks, which is what data-parallel training
needs, without an all-reduce.

The bias is folded into the same product: ``[x, 1] @ [[kernel], [bias]]``. The
bias gradient is then the last row of dB and arrives summed over ranks in the
same accumulation, with no extra collective (a bias added outside the product,
as Flax's stock layers do, would only get each rank's own rows' gradient).

Layout of this module: pure argument checks (no JAX, no MPI: testable without
``mpiexec``), then :class:`DistributedDot`, the hook itself, and
:func:`dot_general`, the public way to build one (``osmm_jax.flax.dot_general``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from osmm_jax._src.nn.rank_counts import counts_per_rank

# -- pure checks ---------------------------------------------------------------------


def check_row_sizes(row_sizes, nranks: int) -> tuple[int, ...]:
    """``row_sizes`` as a tuple of ``nranks`` non-negative ints.

    Raises:
        TypeError: ``row_sizes`` is missing, not a sequence, or holds a
            non-integer.
        ValueError: the wrong number of entries, or a negative entry.
    """
    return counts_per_rank(
        row_sizes,
        nranks,
        "row_sizes",
        entries="row counts",
        give="one row count per rank",
        required="the number of input rows (leading dimensions flattened) each rank holds, "
        "one entry per rank",
    )


def local_rows(shape: Sequence[int]) -> int:
    """Rows of an input of ``shape`` once its leading dimensions are flattened."""
    return math.prod(shape[:-1])


def input_error(
    shape: Sequence[int], kernel_shape: Sequence[int], row_sizes: Sequence[int], rank: int
) -> str | None:
    """What is wrong with ``rank``'s input of ``shape`` for a kernel of ``kernel_shape``, or None.

    The input must have at least two dimensions, its last one must match the
    kernel's first, and its leading dimensions, flattened, must give exactly
    ``row_sizes[rank]`` rows.
    """
    shape, kernel_shape = tuple(shape), tuple(kernel_shape)
    if len(shape) < 2:
        return (
            f"the input has shape {shape}; a data-parallel dense layer needs at least 2 "
            "dimensions (rows..., features)"
        )
    if len(kernel_shape) != 2 or kernel_shape[0] != shape[-1]:
        return f"the input has {shape[-1]} features but the kernel has shape {kernel_shape}"
    rows = local_rows(shape)
    if rows != row_sizes[rank]:
        return (
            f"expected {row_sizes[rank]} local input rows (row_sizes[{rank}] of "
            f"{list(row_sizes)}, {sum(row_sizes)} rows in all) but got {rows} "
            f"(input shape {shape}, leading dimensions flattened)"
        )
    return None


def _contraction_error(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str | None:
    expected = (((lhs_ndim - 1,), (0,)), ((), ()))
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        given = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    except (TypeError, ValueError):
        given = dimension_numbers
    if rhs_ndim != 2 or given != expected:
        return (
            f"osmm_jax's dot_general contracts the input's last dimension with a 2-D kernel's "
            f"first (dimension_numbers {expected}); got {dimension_numbers} with a "
            f"{rhs_ndim}-D kernel"
        )
    return None


# -- the dot_general hook ---------------------------------------------------------------


class DistributedDot:
    """A ``jax.lax.dot_general`` stand-in: input rows split over ranks, kernel replicated.

    Every rank calls it (SPMD) with its own input block and the same kernel.
    It fits Flax's ``dot_general`` hooks (``nn.Dense(dot_general=...)``,
    ``nnx.Linear(dot_general=...)``) and is hashable, so it can live in a
    module's static attributes.

    Args:
        row_sizes: input rows per rank (all leading dimensions flattened), in
            rank order; uneven, possibly 0.
        comm: the mpi4py communicator whose ranks share the batch (default
            COMM_WORLD); osmm_jax works on a private duplicate of it.
        method: ``"one_sided"``, ``"allreduce"`` or None, for
            :func:`osmm_jax.matmul`.
        name: the name errors start with.

    Arguments are checked when the product runs, by all ranks together, so a
    mistake on one rank raises the same error on every rank instead of leaving
    the others waiting.
    """

    __slots__ = ("row_sizes", "comm", "method", "name")

    def __init__(self, row_sizes, *, comm=None, method=None, name="osmm_jax.flax.dot_general"):
        if not isinstance(row_sizes, (str, bytes)):
            try:
                row_sizes = tuple(row_sizes)
            except TypeError:
                pass  # reported, by all ranks together, when the product runs
        self.row_sizes = row_sizes
        self.comm = comm
        self.method = method
        self.name = name

    def replace(self, **changes) -> DistributedDot:
        """A copy with some of ``row_sizes``, ``comm``, ``method``, ``name`` changed."""
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return DistributedDot(fields.pop("row_sizes"), **fields)

    def _key(self):
        # mpi4py communicators are not hashable: identify them by their handle.
        comm = None if self.comm is None else getattr(self.comm, "handle", id(self.comm))
        return (repr(self.row_sizes), comm, self.method, self.name)

    def __eq__(self, other):
        return isinstance(other, DistributedDot) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"DistributedDot(row_sizes={self.row_sizes!r}, method={self.method!r})"

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        """``lax.dot_general(lhs, rhs, dimension_numbers)`` for ``lhs (..., K) @ rhs (K, N)``.

        ``lhs`` is this rank's ``row_sizes[rank]`` rows; returns this rank's
        rows of the product, shape ``lhs.shape[:-1] + (N,)``.
        """
        error = _contraction_error(len(lhs.shape), len(rhs.shape), dimension_numbers)
        return self.apply(
            lhs,
            rhs,
            None,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            error=error,
        )

    def apply(
        self,
        inputs,
        kernel,
        bias=None,
        *,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
        error=None,
    ):
        """``inputs @ kernel + bias`` for this rank's rows, with the bias folded into the product.

        Args:
            inputs: this rank's rows, shape ``(..., K)`` with the leading
                dimensions holding ``row_sizes[rank]`` rows in all.
            kernel: ``(K, N)``, the same on every rank.
            bias: ``(N,)``, the same on every rank, or None.
            precision, out_sharding: must be None (osmm_jax forms products at
                XLA's default precision, accumulating in float32 or float64,
                and places them itself).
            preferred_element_type: the dtype of the result, if given.
            error: a problem the caller already found on this rank (reported
                collectively with the others).

        Returns:
            Shape ``inputs.shape[:-1] + (N,)``, in the inputs' dtype (or
            ``preferred_element_type``).

        Raises, on every rank at once, ``ValueError`` / ``TypeError`` when any
        rank has bad ``row_sizes``, an input whose flattened rows are not its
        ``row_sizes`` entry, a kernel or bias of the wrong shape, or when ranks
        disagree on ``row_sizes``, the kernel's shape or the method.
        """
        import jax.numpy as jnp

        from osmm_jax._src.runtime import communicators

        private = communicators.private_comm(self.comm)
        sizes, error = _check_apply(
            self.row_sizes,
            private.Get_size(),
            private.Get_rank(),
            inputs.shape,
            kernel.shape,
            None if bias is None else bias.shape,
            precision,
            out_sharding,
            error,
        )
        token = repr((sizes, tuple(kernel.shape), bias is not None, self.method))
        communicators.agree(
            private,
            self.name,
            token,
            error,
            must_match="the same row_sizes, kernel shape, bias and method",
        )

        rows, features = local_rows(inputs.shape), inputs.shape[-1]
        x = jnp.reshape(inputs, (rows, features))
        if bias is not None:  # [x, 1] @ [[kernel], [bias]]
            x = jnp.concatenate([x, jnp.ones((rows, 1), x.dtype)], axis=1)
            kernel = jnp.concatenate([kernel, jnp.reshape(bias, (1, -1)).astype(kernel.dtype)])
        y = _product(x, kernel, sizes, private, self.method)
        y = jnp.reshape(y, tuple(inputs.shape[:-1]) + (y.shape[1],))
        if preferred_element_type is not None:
            y = y.astype(preferred_element_type)
        return y


def dot_general(row_sizes: Sequence[int], *, comm=None, method: str | None = None):
    """A ``dot_general`` for Flax's hooks whose product runs on osmm_jax.

    ``nn.Dense(features, use_bias=False, dot_general=dot_general(sizes))`` and
    ``nnx.Linear(..., use_bias=False, dot_general=dot_general(sizes))`` compute
    ``x_local @ kernel`` for this rank's ``sizes[rank]`` rows, and the kernel
    gradient comes back summed over ranks. It contracts the input's last
    dimension with a 2-D kernel's first, nothing else.

    With a bias, use :class:`osmm_jax.flax.Dense` / :class:`osmm_jax.flax.Linear`
    instead: the stock layers add the bias outside the product, so its gradient
    would stay this rank's own.
    """
    return DistributedDot(row_sizes, comm=comm, method=method)


def _check_apply(
    row_sizes, nranks, rank, inputs_shape, kernel_shape, bias_shape, precision, out_sharding, error
):
    """``(sizes, error)`` for :meth:`DistributedDot.apply` on ``rank``: the checked row sizes
    (None if they are bad) and the first problem found (``error`` if the caller found one)."""
    sizes = None
    try:
        sizes = check_row_sizes(row_sizes, nranks)
    except (TypeError, ValueError) as exc:
        error = error or exc
    if error is None:
        error = input_error(inputs_shape, kernel_shape, sizes, rank)
    if error is None and bias_shape is not None and tuple(bias_shape) != (kernel_shape[1],):
        error = f"the bias has shape {tuple(bias_shape)}; expected ({kernel_shape[1]},)"
    if error is None and precision is not None:
        error = f"precision={precision!r} is not supported (osmm_jax.matmul takes none)"
    if error is None and out_sharding is not None:
        error = "out_sharding is not supported: each rank's output block is its own rows"
    return sizes, error


def _product(x, kernel, sizes: tuple[int, ...], private, method):
    """``x (rows, K) @ kernel (K, N)`` with rows split as ``sizes`` over ``private``."""
    from osmm_jax._src.planning.layout import Layout
    from osmm_jax._src.runtime.api import plan
    from osmm_jax._src.runtime.matmul import matmul

    total, nranks = sum(sizes), len(sizes)
    k, n = kernel.shape
    p = plan(
        Layout.rows((total, k), sizes=sizes),
        Layout.replicated((k, n), nranks=nranks),
        Layout.rows((total, n), sizes=sizes),
        comm=private,
    )
    return matmul(x, kernel, p, method=method)
