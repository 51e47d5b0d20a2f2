"""Bridge to the native extensions (C++, built from ``xla_ffi/``).

``osmm_jax._src.runtime._osmm_ffi`` holds the CPU handlers, the transfer-record format, the counters
and the window cache; ``osmm_jax._src.runtime._osmm_ffi_cuda``, built when CUDA is available at build
time, holds the same handlers for XLA's GPU buffers. Both sit on one native core
(``libosmm_core``: windows, agreement, RMA, the issuer thread), so windows, private
communicators and counters are shared whichever platform a call runs on.

The handlers move matrix blocks between ranks with one-sided MPI (``osmm_fetch``: MPI_Get of
remote A/B pieces; ``osmm_reduce_start``/``_issue``/``_finish``: MPI_Accumulate/MPI_Put of C
partials, chunk by chunk, into their owners' windows, from a background thread when
overlapping). This module registers them with XLA, per platform, at import: the CPU ones
always, the CUDA ones when their module loads (if it does not, the reason is logged and kept
in :data:`UNAVAILABLE`; everything on the CPU works as before).

It does not import mpi4py, except to choose between two builds: the extensions link the same
``libmpi`` that mpi4py loads (through their RPATH), and MPI initialisation stays mpi4py's job.
A binary wheel carries one build per MPI ABI (``_osmm_ffi`` for the MPICH ABI, also Intel MPI
and Cray MPICH; ``_osmm_ffi_openmpi`` for Open MPI, see CMakeLists.txt, ``OSMM_MPI_ABI``), and
the one that matches the MPI mpi4py loaded is used (:data:`ABI_SUFFIX`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import jax

from osmm_jax._src import config
from osmm_jax._src.log import get_logger


def _abi_suffix() -> str:
    """``""``, or ``"_openmpi"`` where this installation also holds a build for Open MPI's ABI
    and mpi4py loaded Open MPI."""
    if importlib.util.find_spec(f"{__package__}._osmm_ffi_openmpi") is None:
        return ""
    from mpi4py import MPI

    return "_openmpi" if MPI.Get_library_version().startswith("Open MPI") else ""


ABI_SUFFIX = _abi_suffix()
"""The suffix of the extension modules in use: ``""`` (built for the MPI at hand, or the MPICH
ABI of a wheel) or ``"_openmpi"``."""

try:
    _osmm_ffi = importlib.import_module(f"{__package__}._osmm_ffi{ABI_SUFFIX}")
except ImportError as err:  # pragma: no cover - depends on the build
    raise ImportError(
        f"osmm_jax's native extension (osmm_jax._src.runtime._osmm_ffi{ABI_SUFFIX}) is missing "
        f"or failed to load ({err}). Reinstall osmm_jax (`pip install <checkout or wheel>`, or "
        "`make install` in the repository root); `python -m osmm_jax` reports what this "
        "environment has."
    ) from err

_log = get_logger(__name__)

# -- the transfer-record format (defined once, in xla_ffi/core/records.h) --------------------------

RECORD_FIELDS: tuple[str, ...] = tuple(_osmm_ffi.RECORD_FIELDS)
"""The fields of one transfer record, in order: ``kind, target, offset, rows, cols, row0,
col0, ld`` (see xla_ffi/core/records.h)."""
RECORD_LENGTH = len(RECORD_FIELDS)
OP_ACCUMULATE: int = _osmm_ffi.OP_ACCUMULATE
"""``kind`` of a reduce record that adds into the target (MPI_Accumulate, MPI_SUM)."""
OP_PUT: int = _osmm_ffi.OP_PUT
"""``kind`` of a reduce record that writes the target (MPI_Put)."""
OP_CODES: dict[str, int] = {"accumulate": OP_ACCUMULATE, "put": OP_PUT}
"""The reduce record ``kind`` of each op a plan's Transfer names."""
REGION_A: int = _osmm_ffi.REGION_A
"""``kind`` of a fetch record that reads the A region of the target's expose window."""
REGION_B: int = _osmm_ffi.REGION_B
"""``kind`` of a fetch record that reads the B region of the target's expose window."""
WINDOW_ALIGN = 64
"""Bytes: window sizes, the B region of the expose window and every slot are multiples of it."""


def transfer_record(kind: int, target: int, rows, cols, target_block, offset: int) -> list[int]:
    """One transfer as the handlers' record (:data:`RECORD_FIELDS`): the rectangle ``rows x
    cols`` (global ``(start, stop)`` intervals) of ``target``'s block ``target_block``
    (``((r0, r1), (c0, c1))``), relative to that block (row stride ``ld``), at element
    ``offset`` of this rank's buffer."""
    (r0, _), (c0, c1) = target_block
    height, width = rows[1] - rows[0], cols[1] - cols[0]
    return [kind, target, offset, height, width, rows[0] - r0, cols[0] - c0, c1 - c0]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`WINDOW_ALIGN`."""
    return -(-nbytes // WINDOW_ALIGN) * WINDOW_ALIGN


# -- per-platform registration ------------------------------------------------------------------

# JAX lowering platform -> (extension module, XLA platform name for register_ffi_target).
_PLATFORMS = {
    "cpu": (f"_osmm_ffi{ABI_SUFFIX}", "cpu"),
    "cuda": (f"_osmm_ffi_cuda{ABI_SUFFIX}", "CUDA"),
}
XLA_PLATFORMS = {platform: xla for platform, (_, xla) in _PLATFORMS.items()}
"""The XLA platform name each lowering platform's targets are registered under."""

MODULES: dict[str, ModuleType] = {}
"""The extension module of every platform whose targets are registered, by lowering platform."""
UNAVAILABLE: dict[str, str] = {}
"""Why a platform's handlers are not available, by lowering platform."""


def _register(platform: str) -> None:
    """Import the extension of ``platform`` and register its targets with XLA (FFI api 1)."""
    module_name, xla_platform = _PLATFORMS[platform]
    module = importlib.import_module(f"osmm_jax._src.runtime.{module_name}")
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, api_version=1)
    MODULES[platform] = module


_register("cpu")
try:
    _register("cuda")
except ImportError as err:
    UNAVAILABLE["cuda"] = (
        "osmm_jax was built without its CUDA handlers (no CUDA compiler and toolkit at build "
        "time, or OSMM_ENABLE_CUDA=OFF)"
        if "_osmm_ffi_cuda" in str(err) and "No module named" in str(err)
        else f"osmm_jax's CUDA extension failed to load: {err}"
    )
    _log.debug("CUDA handlers unavailable: %s", UNAVAILABLE["cuda"])


def platforms() -> tuple[str, ...]:
    """The lowering platforms with registered handlers (``"cpu"``, and ``"cuda"`` if built)."""
    return tuple(MODULES)


# -- communicators, counters, windows -------------------------------------------------------


def comm_attribute(handle: int) -> int:
    """mpi4py's ``comm.handle`` as the signed int64 the handlers' ``comm`` attribute takes.

    mpi4py reports MPICH's 32-bit handles of duplicated communicators sign-extended to an
    unsigned 64-bit value (e.g. ``0xffffffff84000000``), which ``np.int64`` rejects. The
    handlers only read the low ``sizeof(MPI_Comm)`` bytes, so wrapping to signed is exact.
    """
    handle = int(handle) & 0xFFFF_FFFF_FFFF_FFFF
    return handle - (1 << 64) if handle >= (1 << 63) else handle


def prepare_comm(handle: int) -> None:
    """Create the native layer's private duplicate of the communicator ``handle`` now (and
    learn there whether it has ranks on other nodes, which the progress thread's ``auto`` mode
    and the choice of puts for slots read later).

    Collective over that communicator. Optional: the first ``osmm_fetch``/``osmm_reduce_start`` call
    on a communicator does it otherwise, but then from whichever thread XLA runs the call on.
    Calling it when the communicator is set up keeps every collective on it on one thread.
    """
    _osmm_ffi.prepare_comm(comm_attribute(handle))


def stats() -> dict[str, int | float]:
    """This process's native counters, since it started.

    ``rma_ops``/``rma_bytes`` (all RMA operations and their payload), ``sent_bytes``,
    ``accumulates``, ``puts``, ``gets``, ``fences``, ``calls``, ``agreements``;
    ``staged_bytes`` and ``staging_seconds`` (copies between GPU buffers and host memory by
    the CUDA handlers); and the live ``windows`` and their total ``window_bytes``. Take
    differences of two calls to measure a stretch of a program.
    """
    return dict(_osmm_ffi.stats())


def window_regions() -> list[tuple[bool, int, int]]:
    """``[(own, address, bytes)]``: where the memory of every live host window lies in this
    process. ``own``: this rank's memory; else another rank's, which MPI maps into this
    process where the window is shared within a node (MPICH's shared-memory windows). A
    write into another rank's region makes those pages part of this process's resident set
    as well as the owner's, so a per-rank memory measurement must leave them out
    (``benchmarks/pages.py``)."""
    return [
        (bool(own), int(address), int(nbytes))
        for own, address, nbytes in _osmm_ffi.window_regions()
    ]


def latency_histogram() -> tuple[list[float], list[int], float]:
    """RMA epoch latencies (opening to closing fence of each call, seconds).

    Returns (bucket upper bounds, per-bucket counts with the +Inf bucket last, sum of seconds).
    """
    bounds, counts, total = _osmm_ffi.latency_histogram()
    return list(bounds), list(counts), float(total)


def free_windows() -> None:
    """Free every cached MPI window, in creation order, and the GPU handlers' host staging.

    Collective over every communicator that owns a window: call it on all ranks, after
    ``jax.effects_barrier()`` and before MPI is finalised. Safe to call repeatedly; windows
    are created again on demand.
    """
    _osmm_ffi.free_windows()
    _free_gpu_staging()


def release_windows() -> int:
    """Free every cached MPI window, in creation order, and the GPU handlers' host staging,
    between products: they are created again on demand; and forget the results of deferred
    reduces and fetches that no finish collected (their program failed between the start and
    the finish). Returns the bytes of window memory freed on this rank.

    Collective over every communicator that owns a window: call it on all ranks, after
    ``jax.effects_barrier()``. Unlike :func:`free_windows` it leaves the private
    communicators and the watchdog's channels in place (the program goes on).
    """
    released = int(_osmm_ffi.release_windows())
    _free_gpu_staging()
    return released


def _free_gpu_staging() -> None:
    """The GPU handlers' pinned host staging buffers, if the CUDA module is loaded (created
    again on demand)."""
    if "cuda" in MODULES:
        MODULES["cuda"].free_staging()


# -- MPI progress during reduce epochs (xla_ffi/protocols/issuer.h) --------------------------------


def set_progress(mode: str, interval_us: int | None = None) -> None:
    """Who makes MPI progress while a one_sided reduce is in flight: ``"off"``, ``"thread"``
    (a native thread polls MPI during every reduce epoch) or ``"auto"`` (only during epochs
    whose communicator spans more than one node); ``interval_us``: the thread's sleep between
    polls (None: keep the current one). Takes effect from the next epoch. See
    ``config.PROGRESS``."""
    config.check_progress(mode)
    if interval_us is None:
        interval_us = progress_settings()[1]
    if isinstance(interval_us, bool) or not isinstance(interval_us, int) or interval_us < 0:
        raise ValueError(f"interval_us must be an int >= 0, got {interval_us!r}")
    _osmm_ffi.set_progress(config.PROGRESS_MODES.index(mode), interval_us)


def progress_settings() -> tuple[str, int]:
    """The progress ``(mode, interval_us)`` in force."""
    mode, interval_us = _osmm_ffi.progress_settings()
    return config.PROGRESS_MODES[mode], int(interval_us)


# From the environment at import (OSMM_PROGRESS, OSMM_PROGRESS_INTERVAL_US).
set_progress(config.progress_mode(), config.progress_interval_us())

# -- the watchdog (xla_ffi/watchdog/watchdog.h) ----------------------------------------------------


def set_watchdog(timeout_seconds: float, raise_error: bool) -> None:
    """Bound every blocking MPI step of the native layer to ``timeout_seconds`` (0: no bound);
    ``raise_error``: fail the step's call, where it can be bounded, instead of ending the job."""
    _osmm_ffi.set_watchdog(float(timeout_seconds), bool(raise_error))


def watchdog_settings() -> tuple[float, bool]:
    """The native watchdog's ``(timeout_seconds, raise_error)``."""
    timeout, raise_error = _osmm_ffi.watchdog_settings()
    return float(timeout), bool(raise_error)


def describe_ranks(handle: int, headline: str) -> str:
    """Where every rank of the communicator ``handle`` is, read through the watchdog's side
    channel (waits at most 2 s for each rank), under ``headline``."""
    return _osmm_ffi.describe_ranks(comm_attribute(handle), headline)


def report_failure(reason: str) -> str:
    """Tell every other rank, through the watchdog's side channels and without a collective,
    that this rank failed for ``reason``; ranks waiting in a blocking step then end the job (or
    raise) at once. Waits at most about a second; returns a line naming the ranks that could
    not be told, or ``""``. Once per process."""
    return _osmm_ffi.report_failure(str(reason))


def end_job_after_failure(grace_seconds: float) -> None:
    """After :func:`report_failure`, in a multi-rank job: wait ``grace_seconds`` (the others may
    end the job first), then end the job with this rank's report (``MPI_Abort``) rather than
    run a collective teardown at exit. Returns at once if there was no failure or one rank."""
    _osmm_ffi.end_job_after_failure(float(grace_seconds))


def failure_report(handle: int) -> str:
    """The report on the communicator ``handle`` headed by a failed rank's notice found in this
    rank's own window, or ``""`` when no rank has reported a failure."""
    return _osmm_ffi.failure_report(comm_attribute(handle))


def begin_host_step(handle: int) -> None:
    """Mark this rank as blocked in one of osmm_jax's Python-side collectives on ``handle``."""
    _osmm_ffi.begin_host_step(comm_attribute(handle))


def end_host_step() -> None:
    _osmm_ffi.end_host_step()


def inject_failure(op: str, count: int = 1) -> None:
    """Test hook: the next ``count`` calls of ``op`` on this process fail at their start, as if
    XLA had failed between a reduce's start and finish (``op="osmm_reduce_finish"``, the only
    one supported: ValueError otherwise)."""
    _osmm_ffi.inject_failure(op, int(count))


WATCHDOG_EXIT_CODE: int = _osmm_ffi.watchdog_exit_code()
"""The exit code of ``MPI_Abort`` when the watchdog ends the job."""


def mpi_library_version() -> str:
    """``MPI_Get_library_version()`` of the MPI the extension was linked against."""
    return _osmm_ffi.mpi_library_version()
