"""``osmm_jax.matmul``: a distributed product as a differentiable JAX operation.

Section order: public function, input checks, executors (one_sided,
allreduce), differentiation.

Every rank calls :func:`matmul` with the same plan and its own local blocks
(SPMD). The executors turn the rank's share of the plan into static slices and
XLA dots (the GEMMs run in XLA, which is much faster than hand-written loops and
fuses the slicing), plus the native data movement:

* ``one_sided``: ``osmm_fetch`` (MPI_Get of remote input pieces, only if the
  plan needs any), local dots, and the reduce (MPI_Accumulate / MPI_Put of
  partials straight into their owners' windows, only if the plan delivers any).
  The partials other ranks need are computed first, in chunks, and each chunk
  leaves (from a background thread) as soon as it is ready, while the next
  chunk and then this rank's own part are computed: communication overlaps
  computation. Chunking splits GEMMs by rows, never changes what is summed
  (a split GEMM may round differently in the last bits).
* ``allreduce``: the baseline. Each rank places its products into a zero
  full-size C, ``mpi4jax.allreduce`` sums it, and each rank slices its block.
  A plan that needs no communication at all is computed locally, as a
  data-parallel code would.

Under ``jax.vmap`` a batch of products runs one after another (see
:func:`_batchable_forward`).

Accumulation precision: products and sums are formed in float32 for float32,
bfloat16 and float16 inputs, and in float64 for float64; the result is cast
back to the input dtype once, at the end. 16-bit partials therefore travel as
float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from osmm_jax._src import checksum, communicators, config, dtypes, metrics, primitives
from osmm_jax._src.planner import Plan, backward_plans

_ALIGN = 64  # bytes; the B region of the expose window starts on this boundary

_OPS = {"accumulate": 0, "put": 1}
_MATRICES = {"A": 0, "B": 1}


# -- public function ------------------------------------------------------------------


class _Options(NamedTuple):
    """Static choices of one product, shared by its backward products."""

    method: str
    verify: bool
    chunk_bytes: int  # one_sided: overlap sends with GEMMs in chunks of this size; 0 = off


def matmul(
    a_local,
    b_local,
    plan: Plan,
    *,
    method: str | None = None,
    verify: bool | None = None,
    chunk_bytes: int | None = None,
):
    """This rank's block of ``C = A @ B`` in ``plan``'s C layout.

    Args:
        a_local: this rank's block of A, shape ``plan.a.local_shape(rank)``.
        b_local: this rank's block of B, shape ``plan.b.local_shape(rank)``,
            same dtype as ``a_local`` (float32, float64, bfloat16 or float16).
        plan: from :func:`osmm_jax.plan`; the same on every rank.
        method: ``"one_sided"`` (default) or ``"allreduce"`` (the mpi4jax
            baseline); ``None`` reads ``OSMM_USE_ALLREDUCE``.
        verify: check the result by checksum (see :mod:`osmm_jax._src.checksum`;
            a few percent of the product's cost) and raise ChecksumError, naming
            the C block and the ranks involved, if it drifts; the backward
            products are checked too. ``None`` reads ``OSMM_VERIFY``.
        chunk_bytes: ``one_sided`` only: overlap communication with computation.
            The partials other ranks receive are computed in chunks of about
            this many bytes, and each chunk is sent by a background thread as
            soon as its GEMMs finish, while the next chunk (and finally this
            rank's own part) is computed. ``0`` turns overlap off: every GEMM
            first, then all sends. ``None`` reads ``OSMM_CHUNK_BYTES``
            (default 4 MiB). The sums are the same either way; a GEMM split by
            rows may round differently in the last bits.

    Returns:
        A JAX array of shape ``plan.c.local_shape(rank)`` and the input dtype.

    Works eagerly, under ``jax.jit``, inside loops, under ``jax.grad`` /
    ``jax.vjp`` (the backward products are distributed products with transposed
    layouts) and under ``jax.vmap`` (a batch of distributed products, run one
    after another). Every rank must call it at the same point of the program.
    Before any MPI traffic, all ranks check together that they hold the same
    plan and method and valid blocks; otherwise every rank raises ValueError.
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"plan must be an osmm_jax Plan (from osmm_jax.plan), got {type(plan).__name__}"
        )
    options = _Options(
        config.resolve_method(method),
        config.resolve_verify(verify),
        config.resolve_chunk_bytes(chunk_bytes),
    )
    comm = communicators.comm_for_key(plan.comm_key)
    rank = comm.Get_rank()
    a_local, b_local, error = _check_inputs(a_local, b_local, plan, rank)
    communicators.agree(comm, "osmm_jax.matmul", f"plan {plan.fingerprint} {options}", error)
    return _matmul(plan, options, a_local, b_local)


# -- input checks -----------------------------------------------------------------------


def _as_array(x, name):
    if isinstance(x, jax.Array) or hasattr(x, "aval"):
        return x, None
    try:
        return jnp.asarray(x), None
    except (TypeError, ValueError) as exc:
        return None, f"{name} is not an array ({type(x).__name__}: {exc})"


def _check_inputs(a_local, b_local, plan: Plan, rank: int):
    """Validate this rank's blocks; returns (a, b, error message or None)."""
    given = (getattr(a_local, "dtype", None), getattr(b_local, "dtype", None))
    a_local, err_a = _as_array(a_local, "a_local")
    b_local, err_b = _as_array(b_local, "b_local")
    if err_a or err_b:
        return a_local, b_local, err_a or err_b
    # Compare the dtypes as given: JAX would silently turn a float64 numpy array into
    # float32 when x64 is off, hiding the mismatch.
    dtype_a, dtype_b = (
        np.dtype(d) if d is not None else x.dtype for d, x in zip(given, (a_local, b_local))
    )
    if dtype_a != dtype_b:
        return a_local, b_local, f"a_local is {dtype_a} but b_local is {dtype_b}; they must match"
    if not dtypes.is_supported(a_local.dtype):
        names = ", ".join(dtypes.NAMES)
        return a_local, b_local, f"dtype {a_local.dtype} is not supported (use one of {names})"
    for name, x, layout in (("a_local", a_local, plan.a), ("b_local", b_local, plan.b)):
        expected = layout.local_shape(rank)
        if tuple(x.shape) != expected:
            return (
                a_local,
                b_local,
                (
                    f"{name} has shape {tuple(x.shape)} but the {layout.kind} layout of "
                    f"{'A' if name == 'a_local' else 'B'} {layout.shape} gives rank {rank} a block of {expected}"
                ),
            )
    return a_local, b_local, None


# -- executors ----------------------------------------------------------------------------


def _forward(plan: Plan, options: _Options, a, b):
    return _batchable_forward(plan, options)(a, b)


@functools.lru_cache(maxsize=512)
def _batchable_forward(plan: Plan, options: _Options):
    """The forward product of ``plan``, with a vmap rule that loops over the batch.

    Every rank must issue the same MPI operations in the same order. Under a
    plain vmap, whether an intermediate is batched can differ between ranks (a
    rank with an empty block has nothing batched to send), so each rank would
    issue a different number of collectives. Looping over the batch instead
    runs ``axis_size`` complete products, identically on every rank.
    """
    rank = communicators.comm_for_key(plan.comm_key).Get_rank()
    comm = communicators.in_graph_comm(plan.comm_key)
    if options.method == "allreduce":
        execute = _allreduce_forward
    else:
        execute = functools.partial(_one_sided_forward, chunk_bytes=options.chunk_bytes)

    @jax.custom_batching.custom_vmap
    def forward(a, b):
        c = execute(plan, rank, a, b)
        fault = checksum.injected_fault(rank)
        if fault is not None and c.size:
            c = c.at[0, 0].add(jnp.asarray(fault, c.dtype))
        if options.verify:
            checksum.check(plan, rank, comm, a, b, c, dtypes.accumulation_dtype(a.dtype))
        if metrics.enabled():
            jax.debug.callback(metrics.count_product)
        return c

    @forward.def_vmap
    def _loop_over_batch(axis_size, in_batched, a, b):
        a_batched, b_batched = in_batched
        outs = [
            forward(a[i] if a_batched else a, b[i] if b_batched else b) for i in range(axis_size)
        ]
        return jnp.stack(outs), True

    return forward


def _local_piece(x, layout, rank, rows, cols):
    """The global rectangle ``rows x cols`` of a matrix, cut from ``rank``'s local block ``x``."""
    (r0, _), (c0, _) = layout.blocks[rank]
    return x[rows[0] - r0 : rows[1] - r0, cols[0] - c0 : cols[1] - c0]


def _record(kind: int, t, target_block, offset: int) -> list[int]:
    """The 8 ints the native handlers take for one transfer: ``[kind, target, offset, rows,
    cols, row0, col0, ld]``, the rectangle relative to the target's block (row stride ``ld``)."""
    (r0, _), (c0, c1) = target_block
    rows, cols = t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]
    return [kind, t.target, offset, rows, cols, t.rows[0] - r0, t.cols[0] - c0, c1 - c0]


def _fetch_remote_pieces(plan: Plan, rank: int, a, b) -> dict:
    """Get every remote A/B piece this rank's multiplies need; ``{(matrix, rows, cols): array}``."""
    itemsize = np.dtype(a.dtype).itemsize
    a_elems, b_elems = plan.expose_elements
    b_offset = -(-a_elems * itemsize // _ALIGN) * _ALIGN
    records, shapes, offset = [], {}, 0
    for t in plan.gets_by(rank):
        layout = plan.a if t.matrix == "A" else plan.b
        rows, cols = t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]
        records += _record(_MATRICES[t.matrix], t, layout.blocks[t.target], offset)
        shapes[(t.matrix, t.rows, t.cols)] = (offset, rows, cols)
        offset += rows * cols
    expose_a, expose_b = plan.exposes(rank)
    fetched = primitives.fetch(
        a,
        b,
        comm=plan.comm_key,
        call_id=primitives.call_id(plan.fingerprint, "fetch", str(a.dtype)),
        window_bytes=b_offset + b_elems * itemsize,
        b_offset=b_offset,
        expose_a=expose_a,
        expose_b=expose_b,
        gets=records,
        fetched_elements=offset,
    )
    return {key: fetched[off : off + r * c].reshape(r, c) for key, (off, r, c) in shapes.items()}


def _products(plan: Plan, rank: int, a, b, multiplies, remote: dict) -> dict:
    """The GEMMs of ``multiplies``: ``{(rows, inner, cols): A[rows, inner] @ B[inner, cols]}``.

    Local pieces are cut from ``a``/``b``; others come from ``remote``, keyed
    ``(matrix, rows, cols)``. Products are in the accumulation dtype.
    """
    return {
        (m.rows, m.inner, m.cols): _product(plan, rank, a, b, m, m.rows, remote) for m in multiplies
    }


def _product(plan: Plan, rank: int, a, b, m, rows, remote: dict, after=None):
    """``A[rows, m.inner] @ B[m.inner, m.cols]`` for a range ``rows`` within ``m.rows``.

    ``after``: a value the GEMM must wait for (a chunk's ticket), or None.
    """
    if m.a_source == rank:
        a_piece = _local_piece(a, plan.a, rank, rows, m.inner)
    else:
        a_piece = remote[("A", m.rows, m.inner)][rows[0] - m.rows[0] : rows[1] - m.rows[0]]
    if m.b_source == rank:
        b_piece = _local_piece(b, plan.b, rank, m.inner, m.cols)
    else:
        b_piece = remote[("B", m.inner, m.cols)]
    if after is not None:
        _, a_piece = jax.lax.optimization_barrier((after, a_piece))
    return jnp.dot(a_piece, b_piece, preferred_element_type=dtypes.accumulation_dtype(a.dtype))


class _Cell(NamedTuple):
    """One C rectangle this rank sums a partial for, and where that partial goes."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    inner: tuple  # the inner ranges summed
    deliveries: tuple  # Transfers to other ranks
    local: bool  # also added to this rank's own C block


def _cells(plan: Plan, rank: int) -> list[_Cell]:
    """The partials this rank forms: delivered ones first (in the plan's rotated order), then
    the purely local ones. A partial of a replicated C goes to several places at once."""
    order, deliveries, local = [], {}, set()
    for t in plan.deliveries_from(rank):
        key = (t.rows, t.cols, t.inner)
        if key not in deliveries:
            order.append(key)
            deliveries[key] = []
        deliveries[key].append(t)
    for u in plan.local_updates_on(rank):
        key = (u.rows, u.cols, u.inner)
        local.add(key)
        if key not in deliveries:
            order.append(key)
    return [_Cell(*key, tuple(deliveries.get(key, ())), key in local) for key in order]


def _chunks(cells: list[_Cell], itemsize: int, chunk_bytes: int) -> list[list]:
    """Group the delivered cells' rows into chunks of about ``chunk_bytes`` of partials.

    Returns a list of chunks, each a list of ``(cell, rows)`` pieces. A cell's rows are cut
    into pieces of at least ``chunk_bytes``; small cells share a chunk until it holds
    ``chunk_bytes``. ``chunk_bytes == 0``: one chunk with every delivered cell, uncut.
    """
    delivered = [c for c in cells if c.deliveries]
    if chunk_bytes == 0:
        return [[(c, c.rows) for c in delivered]]
    chunks, current, current_bytes = [], [], 0
    for cell in delivered:
        row_bytes = (cell.cols[1] - cell.cols[0]) * itemsize
        step = max(1, -(-chunk_bytes // max(1, row_bytes)))
        for r0 in range(cell.rows[0], cell.rows[1], step):
            rows = (r0, min(r0 + step, cell.rows[1]))
            current.append((cell, rows))
            current_bytes += (rows[1] - rows[0]) * row_bytes
            if current_bytes >= chunk_bytes:
                chunks.append(current)
                current, current_bytes = [], 0
    if current or not chunks:
        chunks.append(current)
    return chunks


def _one_sided_forward(plan: Plan, rank: int, a, b, chunk_bytes: int = 0):
    """This rank's C block by one-sided transfers.

    With ``chunk_bytes > 0`` the delivered partials are computed chunk by chunk and, when
    there is more than one chunk, each is handed to the background issuer as soon as its GEMMs
    are done (the next chunk's GEMMs, then the purely local ones, wait for its ticket), so
    sending overlaps computing. Otherwise every GEMM runs first and all partials go out at
    the end, from the calling thread.
    """
    if plan.gather_stage is not None:
        block = _one_sided_forward(plan.gather_stage, rank, a, b, chunk_bytes)
        return _gather_blocks(plan, rank, block)
    acc = dtypes.accumulation_dtype(a.dtype)
    remote = _fetch_remote_pieces(plan, rank, a, b) if plan.has_gets else {}
    multiplies = {(m.rows, m.inner, m.cols): m for m in plan.multiplies_on(rank)}
    c_shape = plan.c.local_shape(rank)
    (cr0, _), (cc0, _) = plan.c.blocks[rank]
    local = jnp.zeros(c_shape, acc)

    def add_local(local, rows, cols, part):
        if (rows[1] - rows[0], cols[1] - cols[0]) == c_shape:
            return local + part
        return local.at[rows[0] - cr0 : rows[1] - cr0, cols[0] - cc0 : cols[1] - cc0].add(part)

    def partial(cell, rows, after=None):
        return functools.reduce(
            jnp.add,
            [
                _product(
                    plan, rank, a, b, multiplies[(cell.rows, k, cell.cols)], rows, remote, after
                )
                for k in cell.inner
            ],
        )

    cells = _cells(plan, rank)
    ticket, buffers = None, []
    if plan.has_deliveries:
        chunks = _chunks(cells, acc.itemsize, chunk_bytes)
        # A single chunk has nothing to overlap with but the local GEMMs, which costs more in
        # handing work to the issuer thread than it saves: send it from this thread.
        overlap = len(chunks) > 1
        transfers, sizes = _chunk_records(plan, chunks)
        for index, pieces in enumerate(chunks):
            flat = []
            for cell, rows in pieces:
                part = partial(cell, rows, ticket)
                if cell.local:
                    local = add_local(local, rows, cell.cols, part)
                flat.append(part.reshape(-1))
            buffer = jnp.concatenate(flat) if len(flat) > 1 else flat[0] if flat else None
            buffers.append(jnp.zeros((0,), acc) if buffer is None else buffer)
            if index == 0:
                ticket = primitives.reduce_start(
                    buffers[0],
                    comm=plan.comm_key,
                    call_id=primitives.call_id(plan.fingerprint, "reduce", str(acc), chunk_bytes),
                    window_bytes=plan.receive_elements * acc.itemsize,
                    local_elements=int(np.prod(c_shape)),
                    overlap=overlap,
                    transfers=transfers,
                    chunk_sizes=sizes,
                )
            else:
                ticket = primitives.reduce_issue(buffers[-1], comm=plan.comm_key, index=index)
        if not overlap:
            ticket = None  # the GEMMs need not wait for the sends
    for cell in cells:
        if cell.local and not cell.deliveries:
            local = add_local(local, cell.rows, cell.cols, partial(cell, cell.rows, ticket))
    if not plan.has_deliveries:
        return local.astype(a.dtype)
    return primitives.reduce_finish(local, buffers, comm=plan.comm_key).astype(a.dtype)


def _gather_blocks(plan: Plan, rank: int, block):
    """The whole (replicated) C of a staged plan from this rank's ``block`` of its even split:
    get every other block from its owner (MPI_Get) and put them in place."""
    split = plan.gather_stage.c
    itemsize = np.dtype(block.dtype).itemsize
    largest = max(split.local_shape(r)[0] * split.local_shape(r)[1] for r in range(plan.nranks))
    window_bytes = -(-largest * itemsize // _ALIGN) * _ALIGN
    records, where, offset = [], {}, 0
    for t in plan.gathers_by(rank):
        records += _record(_MATRICES["A"], t, split.blocks[t.target], offset)
        where[t.target] = offset
        offset += t.elements
    fetched = primitives.fetch(
        block,
        jnp.zeros((0, 0), block.dtype),
        comm=plan.comm_key,
        call_id=primitives.call_id(plan.fingerprint, "gather", str(block.dtype)),
        window_bytes=window_bytes,
        b_offset=window_bytes,
        expose_a=block.size > 0,
        expose_b=False,
        gets=records,
        fetched_elements=offset,
    )
    pieces = []
    for owner in range(plan.nranks):
        shape = split.local_shape(owner)
        if owner == rank:
            pieces.append(block)
        elif shape[0] and shape[1]:
            start = where[owner]
            pieces.append(fetched[start : start + shape[0] * shape[1]].reshape(shape))
    return jnp.concatenate(pieces, axis=0 if split.kind == "rows" else 1)


def _chunk_records(plan: Plan, chunks: list[list]) -> tuple[list[list[int]], list[int]]:
    """Each chunk's transfer records (offsets within the chunk) and its size in elements."""
    transfers, sizes = [], []
    for pieces in chunks:
        records, offset = [], 0
        for cell, rows in pieces:
            for t in cell.deliveries:
                records += _record(
                    _OPS[t.op], dataclasses.replace(t, rows=rows), plan.c.blocks[t.target], offset
                )
            offset += (rows[1] - rows[0]) * (cell.cols[1] - cell.cols[0])
        transfers.append(records)
        sizes.append(offset)
    return transfers, sizes


def _allreduce_forward(plan: Plan, rank: int, a, b):
    if not (plan.has_gets or plan.has_deliveries):
        # Every rank holds all it needs for its own block (e.g. a data-parallel forward
        # product): a data-parallel code would not communicate here, so neither does the
        # baseline.
        return _one_sided_forward(plan, rank, a, b)
    import mpi4jax
    from mpi4py import MPI

    comm = communicators.in_graph_comm(plan.comm_key)
    acc = dtypes.accumulation_dtype(a.dtype)
    multiplies = [m for m in plan.multiplies_on(rank) if m.primary]
    remote = {}
    if plan.has_gets:
        # Inputs a rank lacks are assembled the baseline way too: zero-padded blocks, summed.
        a_full = _allreduce_assemble(a, plan.a, rank, comm)
        b_full = _allreduce_assemble(b, plan.b, rank, comm)
        for m in multiplies:
            remote[("A", m.rows, m.inner)] = a_full[m.rows[0] : m.rows[1], m.inner[0] : m.inner[1]]
            remote[("B", m.inner, m.cols)] = b_full[m.inner[0] : m.inner[1], m.cols[0] : m.cols[1]]
    M, _, N = plan.dims
    total = jnp.zeros((M, N), acc)
    for (rows, _, cols), product in _products(plan, rank, a, b, multiplies, remote).items():
        total = total.at[rows[0] : rows[1], cols[0] : cols[1]].add(product)
    total = mpi4jax.allreduce(total, op=MPI.SUM, comm=comm)
    row_slice, col_slice = plan.c.local_slices(rank)
    return total[row_slice, col_slice].astype(a.dtype)


def _allreduce_assemble(x, layout, rank, comm):
    """The whole matrix on every rank, summed from zero-padded blocks (replicated layouts pass through)."""
    import mpi4jax
    from mpi4py import MPI

    if layout.is_replicated:
        return x
    rows, cols = layout.local_slices(rank)
    padded = jnp.zeros(layout.shape, dtypes.accumulation_dtype(x.dtype)).at[rows, cols].set(x)
    return mpi4jax.allreduce(padded, op=MPI.SUM, comm=comm).astype(x.dtype)


# -- differentiation ------------------------------------------------------------------------


@jax.custom_jvp
def _first_order_only(x):
    """Identity that refuses forward-mode differentiation.

    A custom_vjp's forward pass is only differentiated when a derivative of a
    derivative is taken. The native primitives have no derivative rules, and
    mpi4jax's all-reduce transposes to the identity, which would make a
    second derivative of the baseline silently wrong: refuse clearly instead.
    """
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(
        "osmm_jax.matmul supports first-order reverse-mode differentiation (jax.grad, jax.vjp, "
        "jax.value_and_grad); forward-mode (jax.jvp) and higher-order derivatives are not supported"
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(plan: Plan, options: _Options, a, b):
    return _forward(plan, options, a, b)


def _matmul_fwd(plan: Plan, options: _Options, a, b):
    return _forward(plan, options, _first_order_only(a), _first_order_only(b)), (a, b)


def _matmul_bwd(plan: Plan, options: _Options, residuals, d_c):
    """dA = dC @ B.T and dB = A.T @ dC, each a distributed product with transposed layouts."""
    a, b = residuals
    plan_da, plan_db = backward_plans(plan)
    d_c = d_c.astype(a.dtype)
    d_a = _matmul(plan_da, options, d_c, b.T)
    d_b = _matmul(plan_db, options, a.T, d_c)
    return d_a, d_b


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
