"""MPI on the host side: private communicators, preflight agreement, shutdown.

osmm_jax never communicates on a communicator the user owns: every product runs
on a private duplicate (of COMM_WORLD by default), so its traffic cannot match
the user's own messages. Native code receives that duplicate's handle as an
integer, which is also the plan's ``comm_key``.

Before the first MPI operation of every product, all ranks exchange a small
record (plan fingerprint, method, and any input error found locally): if one
rank passed a bad block or ranks built different plans, EVERY rank raises the
same clear error instead of some of them waiting forever in a collective.
"""

from __future__ import annotations

import atexit
import functools
import threading

from mpi4py import MPI

from osmm_jax._src.runtime import native

_lock = threading.Lock()
_private: dict[int, tuple] = {}  # handle of the user's comm -> (that comm, private duplicate)
_by_key: dict[int, MPI.Intracomm] = {}  # handle of a private duplicate -> itself
_spans_nodes: dict[int, bool] = {}  # private communicator key -> spans several nodes
_in_graph: dict[int, MPI.Intracomm] = {}  # handle of a private duplicate -> its in-graph twin


def check_thread_level() -> None:
    """Raise if MPI was initialised without MPI_THREAD_MULTIPLE.

    XLA may run a custom call on a worker thread while Python keeps issuing MPI
    calls on the main thread, so full thread support is required.
    """
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {
            MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
            MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
            MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        }
        raise RuntimeError(
            f"osmm_jax needs MPI initialised with MPI_THREAD_MULTIPLE, but it provides "
            f"{names.get(provided, provided)}. Do not set mpi4py.rc.thread_level (its default, "
            f"'multiple', is what osmm_jax needs), or initialise MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE)."
        )


def private_comm(comm=None) -> MPI.Intracomm:
    """The private duplicate osmm_jax uses for ``comm`` (default COMM_WORLD); created once, collectively."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    handle = comm_key(comm)
    with _lock:
        if handle in _by_key:  # already one of ours
            return _by_key[handle]
        cached = _private.get(handle)
        # MPI reuses the handles of freed communicators: a cached duplicate belongs to
        # `comm` only while the communicator it was made from is still alive.
        if cached is not None and cached[0] != MPI.COMM_NULL and comm_key(cached[0]) == handle:
            return cached[1]
        if comm == MPI.COMM_WORLD:
            _hint_if_single_notebook_rank()
        dup = comm.Dup()
        # The native layer's own duplicate, made here on the calling thread, so no
        # collective on `dup` ever runs from an XLA worker thread.
        native.prepare_comm(dup.handle)
        _private[handle] = (comm, dup)
        _by_key[comm_key(dup)] = dup
        _in_graph[comm_key(dup)] = dup.Dup()
        node = dup.Split_type(MPI.COMM_TYPE_SHARED)
        _spans_nodes[comm_key(dup)] = node.Get_size() < dup.Get_size()
        node.Free()
        return dup


def spans_nodes(key: int) -> bool:
    """Whether the ranks of the private communicator ``key`` are on more than one node
    (``MPI_COMM_TYPE_SHARED``, found when it was made: the same answer on every rank)."""
    comm_for_key(key)  # a clear error for an unknown communicator
    return _spans_nodes[key]


SINGLE_RANK_HINT = (
    "osmm_jax: this Python process is a single MPI rank (not started by mpiexec), so products "
    "run locally with no communication. For more ranks from a notebook, start MPI engines with "
    "ipyparallel: cluster = ipyparallel.Cluster(engines='mpi', n=3); "
    "rc = cluster.start_and_connect_sync(), then run osmm_jax in %%px cells "
    "(see notebooks/01_quickstart.ipynb)."
)


def _hint_if_single_notebook_rank() -> None:
    """Say once, in an interactive kernel that is a world of one rank, how to get more ranks."""
    import sys

    if MPI.COMM_WORLD.Get_size() == 1 and "ipykernel" in sys.modules:
        print(SINGLE_RANK_HINT, file=sys.stderr)


def default_comm() -> MPI.Intracomm:
    """The private duplicate of COMM_WORLD."""
    return private_comm(None)


def comm_key(comm: MPI.Intracomm) -> int:
    """The integer that identifies a communicator in plans and native calls (signed int64)."""
    return native.comm_attribute(comm.handle)


def is_known(key: int) -> bool:
    """Whether ``key`` names a communicator osmm_jax.plan() made in this process."""
    return key in _by_key


def comm_for_key(key: int) -> MPI.Intracomm:
    """The private communicator a plan's ``comm_key`` names."""
    try:
        return _by_key[key]
    except KeyError:
        raise ValueError(
            "this plan was not made by osmm_jax.plan() in this process (unknown communicator); "
            "build plans with osmm_jax.plan(a_layout, b_layout, c_layout, comm=...)"
        ) from None


@functools.cache
def accumulates_wait_for_target() -> bool:
    """Whether this process's MPI may hold an ``MPI_Accumulate`` call until the target rank
    makes MPI progress: Open MPI, whose osc/rdma, over a network without RDMA atomics (its TCP
    BTL), takes a lock at the target for every accumulate. MPICH and Intel MPI return from an
    accumulate at once. Under such an MPI the notified reduce pulls its credits (slots.Sync: a
    target that pushed them would be held, its own part done, until the origins called MPI
    again, maybe never if they wait in another library's collective meanwhile), and the fence
    mode is the default, measured faster there (benchmarks/results/sync_openmpi.md)."""
    return MPI.Get_library_version().startswith("Open MPI")


def in_graph_comm(key: int) -> MPI.Intracomm:
    """The communicator for mpi4jax collectives inside compiled products on plan ``key``.

    Separate from the private communicator itself, which the host-side checks
    use from the Python thread: a compiled product may still be running its
    collectives on an XLA thread while Python starts the next product's checks,
    and two threads must never interleave collectives on one communicator.
    """
    comm_for_key(key)  # a clear error for unknown keys
    return _in_graph[key]


def agree(
    comm: MPI.Intracomm, what: str, token: str, local_error, *, must_match: str = "", share=None
) -> list:
    """Collectively check that every rank is about to do the same thing, with valid inputs.

    Each rank contributes ``token`` (e.g. a plan fingerprint and method) and the
    error it found in its own inputs: None, a message, or an exception. Raises
    the same error on every rank if any rank found one (a TypeError when every
    failing rank had a TypeError, else a ValueError) or if the tokens differ,
    naming the ranks. ``must_match`` says what has to agree, for the message.

    ``share`` is any small picklable value that travels in the same exchange;
    returns every rank's ``share``, in rank order (so that callers need no
    collective of their own for what the ranks must combine).
    """
    if isinstance(local_error, BaseException):
        mine = (type(local_error).__name__, str(local_error))
    else:
        mine = None if local_error is None else ("ValueError", str(local_error))
    records = comm.allgather((token, mine, share))
    errors = [(r, err) for r, (_, err, _) in enumerate(records) if err is not None]
    if errors:
        cls = TypeError if all(kind == "TypeError" for _, (kind, _) in errors) else ValueError
        detail = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in errors)
        raise cls(f"{what}: invalid input on {len(errors)} of {len(records)} ranks: {detail}")
    groups: dict[str, list[int]] = {}
    for r, (tok, _, _) in enumerate(records):
        groups.setdefault(tok, []).append(r)
    if len(groups) > 1:
        detail = "; ".join(f"ranks {ranks} have {tok}" for tok, ranks in groups.items())
        needed = must_match or "the same layouts, plan and method"
        raise ValueError(f"{what}: ranks disagree (every rank must call with {needed}): {detail}")
    return [shared for _, _, shared in records]


def _shutdown() -> None:
    """Free persistent windows collectively, before MPI_Finalize.

    Registered with atexit after mpi4py is imported, so it runs before
    mpi4py's own finalisation. Pending custom calls finish first.
    """
    try:
        import jax

        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - interpreter teardown; nothing left to run
        pass
    native.free_windows()


def check_mpi_abi() -> None:
    """Raise if the native extension and mpi4py loaded different MPI libraries."""
    ours, theirs = native.mpi_library_version().strip(), MPI.Get_library_version().strip()
    if ours.splitlines()[0] != theirs.splitlines()[0]:
        raise ImportError(
            "osmm_jax's native extension and mpi4py use different MPI libraries:\n"
            f"  osmm_jax: {ours.splitlines()[0]}\n  mpi4py:   {theirs.splitlines()[0]}\n"
            "Rebuild osmm_jax against the MPI that mpi4py loads (see BUILD.md; `python -m osmm_jax`\n"
            "shows which library each side loaded)."
        )


check_thread_level()
check_mpi_abi()
# Registered after mpi4py's own exit hook, so it runs first (atexit is LIFO).
atexit.register(_shutdown)
