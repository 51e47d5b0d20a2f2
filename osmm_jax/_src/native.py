"""Bridge to the native extension ``osmm_jax._src._osmm_ffi`` (C++, built from ``xla_ffi/``).

The extension holds the XLA FFI handlers that move matrix blocks between ranks with one-sided
MPI (``osmm_fetch``: MPI_Get of remote A/B pieces; ``osmm_reduce_start``/``_issue``/``_finish``:
MPI_Accumulate/MPI_Put of C partials, chunk by chunk, into their owners' windows, from a
background thread when overlapping), a cache of persistent MPI windows, and counters. This
module registers the handlers with XLA for the CPU platform (once, on first use) and exposes
the counters and the window cache to the rest of the package.

It deliberately does not import mpi4py: the extension links the same ``libmpi`` that mpi4py
loads (through its RPATH), and MPI initialisation stays mpi4py's job.
"""

from __future__ import annotations

import threading

import jax

try:
    from osmm_jax._src import _osmm_ffi
except ImportError as err:  # pragma: no cover - depends on the build
    raise ImportError(
        "osmm_jax's native extension (osmm_jax._src._osmm_ffi) is missing or failed to load "
        f"({err}). Build it with `make install` in the repository root (or `pip install "
        "--no-build-isolation -e .` in an environment with jax, nanobind, scikit-build-core, "
        "mpi4py and an MPI)."
    ) from err

_lock = threading.Lock()
_registered = False


def ensure_registered() -> None:
    """Register the FFI targets with XLA (CPU, FFI api_version 1); a no-op after the first call."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        for name, capsule in _osmm_ffi.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
        _registered = True


def comm_attribute(handle: int) -> int:
    """mpi4py's ``comm.handle`` as the signed int64 the handlers' ``comm`` attribute takes.

    mpi4py reports MPICH's 32-bit handles of duplicated communicators sign-extended to an
    unsigned 64-bit value (e.g. ``0xffffffff84000000``), which ``np.int64`` rejects. The
    handlers only read the low ``sizeof(MPI_Comm)`` bytes, so wrapping to signed is exact.
    """
    handle = int(handle) & 0xFFFF_FFFF_FFFF_FFFF
    return handle - (1 << 64) if handle >= (1 << 63) else handle


def prepare_comm(handle: int) -> None:
    """Create the native layer's private duplicate of the communicator ``handle`` now.

    Collective over that communicator. Optional: the first ``osmm_fetch``/``osmm_reduce_start`` call
    on a communicator does it otherwise, but then from whichever thread XLA runs the call on.
    Calling it when the communicator is set up keeps every collective on it on one thread.
    """
    _osmm_ffi.prepare_comm(comm_attribute(handle))


def stats() -> dict[str, int]:
    """This process's native counters.

    ``rma_ops``/``rma_bytes`` (all RMA operations and their payload), ``sent_bytes``,
    ``accumulates``, ``puts``, ``gets``, ``fences``, ``calls``, ``agreements`` (since the last
    :func:`reset_stats`), and the live ``windows`` and their total ``window_bytes``.
    """
    return dict(_osmm_ffi.stats())


def latency_histogram() -> tuple[list[float], list[int], float]:
    """RMA epoch latencies (opening to closing fence of each call, seconds).

    Returns (bucket upper bounds, per-bucket counts with the +Inf bucket last, sum of seconds).
    """
    bounds, counts, total = _osmm_ffi.latency_histogram()
    return list(bounds), list(counts), float(total)


def reset_stats() -> None:
    """Zero the event counters; the live window figures are unaffected."""
    _osmm_ffi.reset_stats()


def free_windows() -> None:
    """Free every cached MPI window, in creation order.

    Collective over every communicator that owns a window: call it on all ranks, after
    ``jax.effects_barrier()`` and before MPI is finalised. Safe to call repeatedly; windows
    are created again on demand.
    """
    _osmm_ffi.free_windows()


def mpi_library_version() -> str:
    """``MPI_Get_library_version()`` of the MPI the extension was linked against."""
    return _osmm_ffi.mpi_library_version()


def mpi_comm_handle_size() -> int:
    """``sizeof(MPI_Comm)`` in the extension's MPI (4 for MPICH, 8 for Open MPI)."""
    return _osmm_ffi.mpi_comm_handle_size()


ensure_registered()
