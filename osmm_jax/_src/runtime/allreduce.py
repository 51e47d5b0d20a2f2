"""The all-reduce executor: the baseline (and the fallback) for a plan.

:func:`forward` is called by every rank of the plan's communicator at the same
point of the program, with the same plan and its own blocks ``a`` (shape
``plan.a.local_shape(rank)``) and ``b`` (``plan.b.local_shape(rank)``) of one
supported dtype. It returns this rank's C block, shape
``plan.c.local_shape(rank)``, in the input dtype; the copies of a replicated C
are bit-identical on every rank.

* A plan that needs no communication at all (every rank holds all it needs for
  its own block, e.g. a data-parallel forward product) is computed locally, as
  a data-parallel code would, by the one-sided executor (which then moves
  nothing).
* Otherwise, if any rank lacks input pieces, A and B are first assembled whole
  on every rank the baseline way: each rank places its block into a zero
  full-size matrix in the accumulation dtype (M x K, K x N), an all-reduce
  sums them, and the sum is cast back to the input dtype (replicated inputs
  pass through). Each rank then adds the products of its primary multiplies
  (each cell of the product once over all ranks) into a zero full-size C
  (M x N, accumulation dtype), one all-reduce sums it, and each rank
  slices its block.

The all-reduce is ``mpi4jax.allreduce`` when mpi4jax is installed (the baseline osmm_jax is
measured against), else osmm_jax's own ``MPI_Iallreduce`` custom call
(:func:`osmm_jax._src.runtime.primitives.allreduce_sum`, ``OSMM_ALLREDUCE``).

Precision: products and sums are formed in the accumulation dtype (float32 for
float32, bfloat16 and float16; float64 for float64), so the all-reduced C is in
it; the result is cast to the input dtype once, at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from osmm_jax._src import dtypes
from osmm_jax._src.planning.memory import allreduce_sums
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.runtime import one_sided, primitives


def forward(plan: Plan, rank: int, a, b):
    """This rank's C block by all-reduce (see the module docstring)."""
    if not (plan.has_gets or plan.has_deliveries):
        # Every rank holds all it needs for its own block (e.g. a data-parallel forward
        # product): a data-parallel code would not communicate here, so neither does the
        # baseline.
        return one_sided.forward(plan, rank, a, b)
    acc = dtypes.accumulation_dtype(a.dtype)
    multiplies = [m for m in plan.multiplies_on(rank) if m.primary]
    remote = {}
    if plan.has_gets:
        # Inputs a rank lacks are assembled the baseline way too: zero-padded blocks, summed.
        a_full = _assemble(a, plan.a, rank, plan.comm_key)
        b_full = _assemble(b, plan.b, rank, plan.comm_key)
        for m in multiplies:
            remote[("A", m.rows, m.inner)] = a_full[m.rows[0] : m.rows[1], m.inner[0] : m.inner[1]]
            remote[("B", m.inner, m.cols)] = b_full[m.inner[0] : m.inner[1], m.cols[0] : m.cols[1]]
    M, _, N = plan.dims
    total = jnp.zeros((M, N), acc)
    for (rows, _, cols), product in _products(plan, rank, a, b, multiplies, remote).items():
        total = total.at[rows[0] : rows[1], cols[0] : cols[1]].add(product)
    total = primitives.allreduce_sum(total, comm=plan.comm_key)
    row_slice, col_slice = plan.c.local_slices(rank)
    return total[row_slice, col_slice].astype(a.dtype)


def _products(plan: Plan, rank: int, a, b, multiplies, remote: dict) -> dict:
    """The GEMMs of ``multiplies``: ``{(rows, inner, cols): A[rows, inner] @ B[inner, cols]}``.

    Local pieces are cut from ``a``/``b``; others come from ``remote``, keyed
    ``(matrix, rows, cols)``. Products are in the accumulation dtype, formed as the one-sided
    executor forms them (:func:`osmm_jax._src.runtime.one_sided.products`).
    """
    requests = [(m, m.rows) for m in multiplies]
    return {
        (m.rows, m.inner, m.cols): part
        for (m, _), part in zip(requests, one_sided.products(plan, rank, a, b, requests, remote))
    }


def _assemble(x, layout, rank, comm_key):
    """The whole matrix on every rank, summed from zero-padded blocks (replicated layouts pass through)."""
    if layout.is_replicated:
        return x
    rows, cols = layout.local_slices(rank)
    padded = jnp.zeros(layout.shape, dtypes.accumulation_dtype(x.dtype)).at[rows, cols].set(x)
    summed = primitives.allreduce_sum(padded, comm=comm_key)
    return summed.astype(x.dtype)


def compiled_temporaries(plan: Plan, rank: int, dtype, direction: str) -> int:
    """Bytes of the buffers XLA assigns beside the blocks when this method runs ``plan`` on
    ``rank``: the temporaries of its compiled program (``memory_analysis()``), for the product
    (``direction="forward"``) or its gradient with respect to A and B (``"backward"``: the
    product and both backward products, as the jitted gradient runs them), inputs of ``dtype``.
    Compiled, never run: no MPI traffic. The blocks themselves are the program's arguments and
    results, not counted here."""
    shapes = [plan.a.local_shape(rank), plan.b.local_shape(rank)]
    if direction == "forward":
        program = lambda a, b: forward(plan, rank, a, b)  # noqa: E731
    else:
        plan_da, plan_db = backward_plans(plan)
        shapes.append(plan.c.local_shape(rank))

        def program(a, b, d_c):
            forward(plan, rank, a, b)  # its custom calls run although C is not returned
            return forward(plan_da, rank, d_c, b.T), forward(plan_db, rank, a.T, d_c)

    arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]
    analysis = jax.jit(program).lower(*arguments).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)


def mpi_buffer_bytes(plan: Plan, rank: int, accum_itemsize: int, direction: str) -> int:
    """Bytes the MPI library holds on ``rank`` while this method's largest all-reduce runs:
    the part of the message it receives into a buffer of its own (:func:`receive_share`); 0
    when the plans move nothing."""
    plans = (plan,) if direction == "forward" else (plan, *backward_plans(plan))
    largest = max((n for p in plans for n in allreduce_sums(p)), default=0)
    return int(largest * accum_itemsize * receive_share(rank, plan.nranks))


def receive_share(rank: int, nranks: int) -> float:
    """The part of a large sum's message that MPICH's all-reduce (a reduce-scatter by
    recursive halving, then an all-gather) receives into a buffer of its own on ``rank``: half,
    on a power-of-two number of ranks. Otherwise, with ``rem`` ranks beyond the largest power
    of two, the first ``2 * rem`` pair up first: the even one of each pair sends its whole
    message to the odd one, which receives it whole, and takes no further part. Measured on
    this machine (benchmarks/results/memory.md): 72 MiB for a 144 MiB sum on every one of 4
    ranks; 0, 36 and 18 MiB for a 36 MiB sum on ranks 0, 1 and 2 of 3."""
    below = 1 << (nranks.bit_length() - 1)
    paired = 2 * (nranks - below)
    if rank < paired:
        return float(rank % 2)
    return 0.5


def dtype_of(input_itemsize: int, accum_itemsize: int):
    """The input dtype whose elements are ``input_itemsize`` bytes and whose accumulation dtype's
    are ``accum_itemsize`` (bfloat16 standing for both 16-bit types: they lay out the same);
    None where no supported dtype does, or float64 while JAX runs without 64-bit types."""
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float64):
        if np.dtype(dtype).itemsize != input_itemsize:
            continue
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            return None
        if np.dtype(dtypes.accumulation_dtype(dtype)).itemsize == accum_itemsize:
            return dtype
    return None
