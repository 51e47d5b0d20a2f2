"""Host-side entry points that bind the pure planner to an MPI communicator.

MPI (mpi4py), JAX and the native module are imported by the functions that use them, so that
``osmm_jax.plan(..., rank=r)`` works in a process that never starts MPI.
"""

from __future__ import annotations

import numpy as np

from osmm_jax._src import config
from osmm_jax._src.planning.auto_layout import LayoutChoice
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, RankPlan, make_plan


def plan(
    a_layout: Layout | LayoutChoice,
    b_layout: Layout | None = None,
    c_layout: Layout | None = None,
    *,
    work=None,
    comm=None,
    rank=None,
) -> Plan | RankPlan:
    """The plan of ``C = A @ B`` for the three layouts, on ``comm``; or one rank's part of it.

    Args:
        a_layout, b_layout, c_layout: layouts of A (M x K), B (K x N), C (M x N); or, alone,
            a :class:`osmm_jax.LayoutChoice` from :func:`osmm_jax.auto_layouts`, whose three
            layouts and work split are taken (``osmm_jax.plan(choice)``).
        work: an :class:`osmm_jax.Work` split of the product's multiply-adds (which rank
            computes each box, e.g. from :func:`osmm_jax.three_d_layouts`), or None: the
            owners of each cell's pieces compute it. It decides who computes every cell that
            no C owner computes for itself (one holding both its inputs), and so what moves;
            the product is the same.
        comm: an mpi4py intracommunicator whose ranks run the product (default
            COMM_WORLD). osmm_jax communicates on a private duplicate of it,
            created collectively on first use, so call this on every rank.
        rank: instead of a plan to run, return rank ``rank``'s part of the plan
            (a :class:`RankPlan`: its multiplies and the transfers it issues, serves
            and receives) for layouts of any rank count, without MPI: how to check
            the plan of a large cluster from a laptop. ``comm`` must then be None.

    Returns:
        An immutable, hashable :class:`Plan`, identical on every rank; cached,
        so calling again with equal layouts is cheap. Making it computes nothing:
        each rank builds only its own part, when it first runs the product, in
        time and memory that grow with its share of the product (for the usual
        layouts), not with the rank count; the whole schedule (``describe()``,
        ``plot()``, ``transfers``) is built only when asked for.

    Raises:
        TypeError / ValueError: not layouts, mismatched dimensions, layouts made
            for a different number of ranks than ``comm`` has, or a ``rank``
            out of range; a ``work`` split for another product or rank count.
    """
    if isinstance(a_layout, LayoutChoice):
        if b_layout is not None or c_layout is not None or work is not None:
            raise ValueError(
                "pass a LayoutChoice alone: it holds the three layouts and the work split"
            )
        choice = a_layout
        a_layout, b_layout, c_layout, work = choice.a, choice.b, choice.c, choice.work
    elif b_layout is None or c_layout is None:
        raise TypeError("plan needs three layouts (A, B, C), or one LayoutChoice")
    if rank is not None:
        if comm is not None:
            raise ValueError("pass either comm (a plan to run) or rank (one rank's part), not both")
        return make_plan(a_layout, b_layout, c_layout, work=work).for_rank(rank)
    from osmm_jax._src.runtime import communicators, metrics

    _import_what_products_trace()
    private = communicators.private_comm(comm)
    metrics.start_from_environment()
    size = private.Get_size()
    for name, layout in (("a_layout", a_layout), ("b_layout", b_layout), ("c_layout", c_layout)):
        if isinstance(layout, Layout) and layout.nranks != size:
            raise ValueError(
                f"{name} is for {layout.nranks} ranks but the communicator has {size}; "
                f"build layouts with nranks={size} (or nranks=None for COMM_WORLD)"
            )
    return make_plan(a_layout, b_layout, c_layout, communicators.comm_key(private), work)


def _import_what_products_trace() -> None:
    """Import every module a product's trace uses (the primitives, jax.extend, mpi4jax) now,
    before any program with a product is traced.

    jax 0.12 keys every jitted program's trace on the configuration values registered so far,
    and importing ``jax.extend`` (or mpi4jax, which imports it) registers two more. Imported
    for the first time inside the trace of a user's step, they would make that step trace
    again at its next call: its products' agreements run again, on the ranks whose first
    product it was, and ranks running plans in different orders would fall out of step."""
    from osmm_jax._src.runtime import matmul  # noqa: F401


def default_nranks() -> int:
    """The rank count of a layout built with ``nranks=None``: the size of COMM_WORLD.

    The package installs this as the layouts' default (see
    :func:`osmm_jax._src.planning.layout.set_default_nranks`); the first call initialises MPI.
    """
    from osmm_jax._src.runtime import communicators

    return communicators.default_comm().Get_size()


def gather(x_local, layout: Layout, *, comm=None) -> np.ndarray:
    """The whole global matrix, assembled on every rank from each rank's block (eager, host-side).

    A collective over ``comm`` (default COMM_WORLD): every rank must call it.
    Meant for tests, demos and notebooks, not for hot loops. Returns numpy.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be an osmm_jax.Layout, got {type(layout).__name__}")
    from osmm_jax._src.runtime import communicators

    private = communicators.private_comm(comm)
    rank, size = private.Get_rank(), private.Get_size()
    if layout.nranks != size:
        raise ValueError(f"layout is for {layout.nranks} ranks but the communicator has {size}")
    block = np.asarray(x_local)
    error = None
    if block.shape != layout.local_shape(rank):
        error = f"block has shape {block.shape} but the layout gives rank {rank} {layout.local_shape(rank)}"
    communicators.agree(
        private, "osmm_jax.gather", repr((layout.shape, layout.blocks, layout.is_replicated)), error
    )
    if layout.is_replicated:
        return block.copy()
    blocks = private.allgather(block)
    out = np.empty(layout.shape, dtype=block.dtype)
    for r, part in enumerate(blocks):
        rows, cols = layout.local_slices(r)
        out[rows, cols] = part
    return out


def memory_budgets(comm=None) -> tuple[float, ...]:
    """Every rank's memory budget in bytes, in rank order: the same tuple on every rank.

    A collective over ``comm`` (default COMM_WORLD): each rank states its own budget and the
    ranks exchange them (one small allgather), so ranks of unequal memory can be given their
    own: pass the result as ``memory_budget=`` to :func:`osmm_jax.balance`,
    :func:`osmm_jax.auto_layouts` or :class:`osmm_jax.Rebalancer`. A rank's own budget is
    ``OSMM_MEMORY_BUDGET`` as set in its environment (one number, or its entry of the
    per-rank form), else :func:`local_memory_budget`. ``math.inf`` means no limit.

    Raises:
        ValueError: on every rank together, when any rank's ``OSMM_MEMORY_BUDGET`` cannot be
            read or its per-rank form has the wrong number of entries.
    """
    from osmm_jax._src.runtime import communicators

    private = communicators.private_comm(comm)
    rank, size = private.Get_rank(), private.Get_size()
    own, error = None, None
    try:
        setting = config.memory_budget_setting()
        if isinstance(setting, tuple) and len(setting) != size:
            raise ValueError(
                f"{config.MEMORY_BUDGET} has {len(setting)} budgets but the communicator has "
                f"{size} ranks"
            )
        own = setting[rank] if isinstance(setting, tuple) else setting
        if own is None:
            own = local_memory_budget()
    except ValueError as exc:
        error = exc
    return tuple(communicators.agree(private, "osmm_jax.memory_budgets", "", error, share=own))


def local_memory_budget() -> float:
    """This process's default budget, bytes: on a GPU,
    :data:`~osmm_jax._src.config.DEFAULT_DEVICE_FRACTION` of its first local device's free
    memory (``bytes_limit`` less ``bytes_in_use`` of ``memory_stats()``); on a CPU (or a
    device that reports no limit), :func:`~osmm_jax._src.config.host_memory_budget`: a share
    of the host's memory or the cgroup's limit, when lower. No MPI."""
    import jax

    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats_ = device.memory_stats() or {}
        if "bytes_limit" in stats_:
            free = stats_["bytes_limit"] - stats_.get("bytes_in_use", 0)
            return config.DEFAULT_DEVICE_FRACTION * max(free, 0)
    return config.host_memory_budget()


def stats() -> dict:
    """This rank's cumulative native counters.

    Keys: ``rma_ops`` (RMA operations issued), ``rma_bytes`` (bytes they
    moved), ``sent_bytes`` (of those, pushed to other ranks by accumulate and
    put), ``accumulates``, ``puts``, ``gets``, ``fences``, ``calls`` (fetch
    and reduce epochs run), ``agreements`` (all-ranks checks the native layer
    ran: one per new compiled signature, none in a steady loop), ``windows``
    (live persistent windows) and ``window_bytes`` (their total size); in the
    notified mode ``notifications`` (stamps sent), ``notify_wait_seconds``,
    ``deferred_deliveries``, ``credit_reads``, ``credit_pushes``,
    ``slot_window_bytes``, ``accumulator_folds`` (products whose
    fixed-order sum went through the slots window's accumulator: a round of
    origins, all below this rank, followed by another; the slots alone hold
    it otherwise), ``resyncs`` (times the ranks started again
    together after a product abandoned by one of them), ``deferred_reduces``
    (weight gradients whose finish a waiter thread ran, ``OSMM_DEFER``),
    ``fetches_ahead`` (fetches a waiter thread finished while the GEMMs on
    this rank's own pieces ran, ``OSMM_FETCH_AHEAD``), ``deferred_held``
    (those the waiter holds now: 0 between programs, unless a program stopped
    between a start and its finish; :func:`release` forgets those), and
    ``messages`` and ``message_bytes`` (the message transport's sends, stamps
    included, ``OSMM_TRANSPORT``; their payload counts in ``rma_bytes`` and
    ``sent_bytes`` as RMA's would, and each message as a notification).
    """
    from osmm_jax._src.runtime import native

    return native.stats()


def release() -> int:
    """Free the memory osmm_jax keeps on this rank between products; the bytes freed.

    one_sided products keep their MPI windows from one product to the next (the slots that
    partials and fetched pieces land in, the accumulator of a reduce, the notification
    window), one set per communicator, sized by the largest product it has run: creating a
    window is collective and costs as much as a small product, and a training loop runs the
    same products every step. When a phase is over whose products will not come back (a large
    product before training, an evaluation at another size), or before something else needs
    the memory, ``release()`` frees them. The next product creates what it needs again, at its
    own size, as its first call did (one collective per window).

    Collective: call it on every rank of every communicator that ran one_sided products, at
    the same point of the program. It first waits for this rank's dispatched computations
    (``jax.effects_barrier()``); results already returned are arrays of their own and stay
    valid. A rank that does not call it leaves the others waiting in the first window's free
    (with :func:`timeout` set, the watchdog reports where). On GPUs the GPU handlers' pinned
    host staging buffers are freed too (not counted in the result). So are the results of
    deferred products that nobody collected: a program that stopped (an error) after a
    deferred product's start and before its finish could run leaves the result, and the copies
    the waiter thread made for it, with the waiter (``stats()["deferred_held"]``).

    Returns: the bytes of window memory freed on this rank (``stats()["window_bytes"]`` before
    the call; 0 when none was held).
    """
    import jax

    from osmm_jax._src.runtime import native

    jax.effects_barrier()
    return native.release_windows()
