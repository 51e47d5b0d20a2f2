"""Every environment variable osmm_jax reads, with its default, in one place."""

from __future__ import annotations

import os

import numpy as np

USE_ALLREDUCE = "OSMM_USE_ALLREDUCE"
"""``1``/``true``/``yes``/``on``: the default ``method`` of :func:`osmm_jax.matmul` is ``"allreduce"``
instead of ``"one_sided"``; ``0``/``false``/``no``/``off``: it stays ``"one_sided"``; any other
value is a ValueError. Default: unset (one_sided)."""

VERIFY = "OSMM_VERIFY"
"""``1``/``true``/``yes``/``on``: :func:`osmm_jax.matmul` verifies every product by checksum
(as with ``verify=True``); ``0``/``false``/``no``/``off``: it does not; any other value is a
ValueError. Default: unset (no verification)."""

METHODS = ("one_sided", "allreduce")

MEMORY_BUDGET = "OSMM_MEMORY_BUDGET"
"""Bytes one rank may hold for a product (its blocks and the product's buffers), for
:func:`osmm_jax.auto_layouts` (which leaves out layouts that need more) and
:func:`osmm_jax.memory_budgets`: a number of bytes with an optional binary unit (``"8GiB"``,
``"512 MiB"``, ``"1.5e9"``), the same for every rank; or one such number per rank, comma
separated in rank order (``"4GiB,16GiB,16GiB"``); ``0``, ``none`` or ``inf`` for no limit.
Default: unset, which is the rank's own memory (:func:`osmm_jax.memory_budgets`: a share of the
device's free memory on a GPU, of the host's or the cgroup's limit on a CPU)."""

DEFAULT_MEMORY_FRACTION = 0.25
"""The share of the host's physical memory (or of the process's cgroup limit, when lower) one
rank may use for a product by default on a CPU: conservative for a few ranks per host."""

DEFAULT_DEVICE_FRACTION = 0.8
"""The share of a GPU's free memory (``bytes_limit`` less ``bytes_in_use`` of the device's
``memory_stats()``) one rank may use for a product by default: the rest stays for the model,
the optimizer state and XLA's temporaries."""

_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, source: str) -> float:
    """``"8GiB"``, ``"512 MiB"`` or ``"1.5e9"`` in bytes; ``0``/``none``/``inf``: ``math.inf``."""
    word = text.strip().lower()
    if word in ("0", "none", "inf", "unlimited"):
        return float("inf")
    number = word.rstrip("kmgtib ")
    unit = word[len(number) :].strip()
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"{source} must be a number of bytes with an optional unit (B, KiB, MiB, GiB, TiB), "
            f"or 0/none/inf for no limit; got {text!r}"
        ) from None
    if value == 0:
        return float("inf")
    if not value > 0 or value != value:
        raise ValueError(f"{source} must be positive (or 0 for no limit), got {text!r}")
    return value


def memory_budget_setting() -> float | tuple[float, ...] | None:
    """``OSMM_MEMORY_BUDGET`` parsed: one budget for every rank (bytes, ``math.inf`` for none),
    a tuple of one per rank (the comma-separated form), or None when it is unset or blank."""
    text = os.environ.get(MEMORY_BUDGET, "")
    if not text.strip():
        return None
    if "," in text:
        return tuple(parse_bytes(part, f"{MEMORY_BUDGET} entry") for part in text.split(","))
    return parse_bytes(text, MEMORY_BUDGET)


def host_memory_budget() -> float:
    """:data:`DEFAULT_MEMORY_FRACTION` of this host's physical memory, or of the process's
    cgroup memory limit when that is lower (a container, a batch job's allocation); bytes."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return float("inf")
    return DEFAULT_MEMORY_FRACTION * min(physical, cgroup_memory_limit())


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_memory_limit() -> float:
    """The memory limit of this process's cgroup (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``) in bytes; ``math.inf`` when there is none or it cannot be read."""
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 reports "no limit" as a huge number
            return float(int(text))
    return float("inf")


def memory_budget() -> float:
    """Bytes per rank (blocks and a product's buffers) :func:`osmm_jax.auto_layouts` allows when
    given none and ``OSMM_MEMORY_BUDGET`` holds one number or is unset (then
    :func:`host_memory_budget`). The per-rank form is read by :func:`memory_budget_setting`."""
    setting = memory_budget_setting()
    if isinstance(setting, tuple):
        raise ValueError(
            f"{MEMORY_BUDGET} holds one budget per rank; this entry point takes one budget "
            "(pass memory_budget= explicitly)"
        )
    return host_memory_budget() if setting is None else setting


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    """A yes/no variable: unset or blank is no. Anything but the words above is an error,
    not a silent no: ``OSMM_VERIFY=ture`` must not turn verification off unnoticed."""
    text = os.environ.get(name, "")
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(
        f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE[1:])} "
        f"(or unset), got {text!r}"
    )


def default_method() -> str:
    """The method used when a caller passes ``method=None``."""
    return "allreduce" if _flag(USE_ALLREDUCE) else "one_sided"


def resolve_method(method: str | None) -> str:
    if method is None:
        return default_method()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    return method


def resolve_verify(verify: bool | None) -> bool:
    """Whether to verify a product: the argument if given, else ``OSMM_VERIFY``."""
    if verify is None:
        return _flag(VERIFY)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True, False or None, got {verify!r}")
    return verify


SPEEDS = "OSMM_SPEEDS"
"""Comma-separated GEMM rates in GFLOP/s, one per rank in rank order (e.g. ``300,300,125,125``):
:func:`osmm_jax.profile_speeds` returns these instead of measuring. Default: unset (measure)."""


def declared_speeds_text() -> str | None:
    """The raw value of ``OSMM_SPEEDS``, or None when it is unset or blank (parsed by ``speeds.py``)."""
    return os.environ.get(SPEEDS, "").strip() or None


CHUNK_BYTES = "OSMM_CHUNK_BYTES"
"""Default ``chunk_bytes`` of :func:`osmm_jax.matmul`: how many bytes of partial results the
one_sided method computes before it starts sending them, so that sending overlaps computing.
``0`` turns overlap off. Default: 4194304 (4 MiB)."""

DEFAULT_CHUNK_BYTES = 4 << 20


def resolve_chunk_bytes(chunk_bytes: int | None) -> int:
    """The chunk size to use: the argument if given, else ``OSMM_CHUNK_BYTES``, else 4 MiB."""
    source = "chunk_bytes"
    if chunk_bytes is None:
        text = os.environ.get(CHUNK_BYTES, "").strip()
        if not text:
            return DEFAULT_CHUNK_BYTES
        source = CHUNK_BYTES
        try:
            chunk_bytes = int(text)
        except ValueError:
            raise ValueError(
                f"{CHUNK_BYTES} must be an integer number of bytes, got {text!r}"
            ) from None
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)):
        raise TypeError(f"{source} must be an int (bytes) or None, got {chunk_bytes!r}")
    if chunk_bytes < 0:
        raise ValueError(f"{source} must be >= 0 (0 turns overlap off), got {chunk_bytes}")
    return int(chunk_bytes)


SYNC = "OSMM_SYNC"
"""Default ``sync`` of :func:`osmm_jax.matmul`: how the one_sided method synchronises the
partials it delivers. ``notify``: each partial goes into a slot of its owner's window reserved
for its origin, and the owner waits for exactly the notifications the plan says it will get,
then sums in ascending rank order (no collective per product; bit-identical results run to
run). ``fence``: every product is bracketed by collective ``MPI_Win_fence`` epochs and partials
are accumulated in arrival order. Any other value is a ValueError. Default: ``notify`` (over
TCP between 3-4 hosts 1.6-4.9x faster than fences; within one node a tie on 2 ranks and
1.0-2.3x faster for a training step on 3, benchmarks/results/sync.md), except ``fence`` under an
MPI whose accumulates wait for the target (Open MPI, where fences measured 1.02-2.5x faster over
TCP: benchmarks/results/sync_openmpi.md, ``communicators.accumulates_wait_for_target``) and
whenever ``OSMM_CUDA_AWARE=1`` puts the GPU handlers' windows in device memory, which the
notified mode does not use."""

SYNC_MODES = ("notify", "fence")

CUDA_AWARE = "OSMM_CUDA_AWARE"
"""``1``: the CUDA handlers use CUDA-aware MPI, windows in device memory (read by the native
layer; see BUILD.md, "GPUs"). Anything else: host-staged through pinned memory."""


def resolve_sync(sync: str | None, waiting_accumulates: bool = False) -> str:
    """The synchronisation to use: the argument if given, else ``OSMM_SYNC``, else notify but
    under an MPI whose accumulates wait for the target's progress (``waiting_accumulates``)
    and under ``OSMM_CUDA_AWARE=1`` (see ``SYNC``)."""
    source = "sync"
    if sync is None:
        aware = os.environ.get(CUDA_AWARE) == "1"
        default = "fence" if aware or waiting_accumulates else "notify"
        sync = os.environ.get(SYNC, "").strip().lower() or default
        source = SYNC
    if sync not in SYNC_MODES:
        raise ValueError(f"{source} must be one of {SYNC_MODES}, got {sync!r}")
    return sync


DEFER = "OSMM_DEFER"
"""Whether the weight gradient of a product (``dB`` of ``A @ B``, what a layer's ``x @ W``
gives its optimizer) has its finish deferred: its partials leave where they are computed, a
native waiter thread waits for the other ranks' partials and sums them, and only what reads it
(the update) waits, so that a layer's gradient travels while the rest of the backward pass
computes. ``1``: always; ``0``: never; unset (default): where the plan's communicator spans
several nodes, where it was measured to pay (benchmarks/results/overlap.md: a 4-layer MLP step
over TCP between 3 emulated hosts 1.1-1.4x faster; in shared memory with ranks sharing cores
up to 10% slower, the hand-offs to the waiter costing more than the wait they hide). Applies in
the notified mode on the CPU where the partials leave in one chunk; every other product
finishes in place. The sums are the same, bit for bit. Set it alike on every rank (a deferred
product's slots window differs; a mismatch is an error on every rank)."""


def defer_finishes() -> bool | None:
    """``OSMM_DEFER`` (see there): True or False when set, None (decide by the communicator)
    when unset or blank."""
    if not os.environ.get(DEFER, "").strip():
        return None
    return _flag(DEFER)


FETCH_AHEAD = "OSMM_FETCH_AHEAD"
"""Whether a product's notified fetch (the A and B pieces its multiplies get from other ranks:
a sequence-parallel layer's gathered rows, a row-parallel layer's gathered output gradient)
runs ahead of its GEMMs, as a collective matmul does: the owners' pieces leave at once, a
native waiter thread receives them, and the GEMMs on this rank's own pieces run meanwhile;
only the GEMMs that read fetched pieces wait for them. ``1``: always; ``0``: never (one GEMM
over the own and fetched pieces joined, after the fetch); unset (default): where a rank gets
at most ``runtime.slots.FETCH_AHEAD_MAX_ELEMENTS`` elements (a fetch ahead holds a copy of
them until they are read; measured in benchmarks/results/overlap.md, section 9). Applies in the
notified mode on the CPU where a rank serves its pieces from one buffer; elsewhere the fetch
finishes in place. Each C element is the same dot product either way (a GEMM of another shape
may round differently in the last bits). Set it alike on every rank (a mismatch is an error on
every rank)."""


def fetch_ahead() -> bool | None:
    """``OSMM_FETCH_AHEAD`` (see there): True or False when set, None (decide by the size of
    what a rank gets) when unset or blank."""
    if not os.environ.get(FETCH_AHEAD, "").strip():
        return None
    return _flag(FETCH_AHEAD)


TRANSPORT = "OSMM_TRANSPORT"
"""How the notified mode moves a product's partials and pieces: ``rma`` (one-sided puts or
accumulates into the target's slot, a flush, then a stamp by ``MPI_Accumulate``), ``messages``
(the partials and their stamp as one two-sided message into a receive the target posted,
xla_ffi/notified/messages.h) or ``auto`` (default): messages where the plan's communicator
spans several nodes, RMA within one. Measured (benchmarks/results/overlap.md, section 6): over
TCP, where MPICH and Open MPI emulate RMA with messages, a message is 1.3-4.7x faster than the
notified RMA round; in shared memory RMA is 1.7-3.9x faster from 64 KiB up. On a network with
RDMA, where RMA may win, compare with ``python -m benchmarks.sync_latency`` and set ``rma``.
The sums are the same, bit for bit. Set it alike on every rank (a mismatch is an error on
every rank)."""

TRANSPORTS = ("auto", "rma", "messages")


def transport() -> str:
    """``OSMM_TRANSPORT`` (see there), ``auto`` when unset or blank; anything else is a
    ValueError."""
    value = os.environ.get(TRANSPORT, "").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT} must be one of {TRANSPORTS}, got {value!r}")
    return value


ALLREDUCE = "OSMM_ALLREDUCE"
"""Which all-reduce sums inside a compiled program (the allreduce method, checksum
verification): ``mpi4jax`` (mpi4jax.allreduce, the baseline osmm_jax is measured against),
``native`` (osmm_jax's own MPI_Iallreduce custom call, CPU only, bounded by the watchdog in raise
mode) or ``auto`` (default: mpi4jax when it is installed, else native)."""

ALLREDUCE_IMPLEMENTATIONS = ("auto", "mpi4jax", "native")


def allreduce_implementation(have_mpi4jax: bool) -> str:
    """``mpi4jax`` or ``native``, from ``OSMM_ALLREDUCE`` (see there); a ValueError for an
    unknown value, or for ``mpi4jax`` when it is not installed."""
    choice = os.environ.get(ALLREDUCE, "").strip().lower() or "auto"
    if choice not in ALLREDUCE_IMPLEMENTATIONS:
        raise ValueError(f"{ALLREDUCE} must be one of {ALLREDUCE_IMPLEMENTATIONS}, got {choice!r}")
    if choice == "auto":
        return "mpi4jax" if have_mpi4jax else "native"
    if choice == "mpi4jax" and not have_mpi4jax:
        raise ValueError(
            f"{ALLREDUCE}=mpi4jax, but mpi4jax is not installed: `pip install osmm_jax[mpi4jax]` "
            "(its build needs your MPI's mpicc on PATH), or unset it to use osmm_jax's own"
        )
    return choice


SLOT_BUDGET = "OSMM_SLOT_BUDGET"
"""Bytes of slots one rank's window may hold in the notified mode (``OSMM_SYNC=notify``): a
number of bytes with an optional binary unit, as for ``OSMM_MEMORY_BUDGET`` (``0``, ``none`` or
``inf``: as many slots as a rank has origins). A rank that more origins deliver to than fit
sums them in rounds, in the same fixed order, through the slots it has (at least one). Must be
the same on every rank. Default: 512 MiB."""

DEFAULT_SLOT_BUDGET = float(512 << 20)


def slot_budget() -> float:
    """``OSMM_SLOT_BUDGET`` in bytes (``math.inf``: no limit), or the default when unset."""
    text = os.environ.get(SLOT_BUDGET, "").strip()
    if not text:
        return DEFAULT_SLOT_BUDGET
    return parse_bytes(text, SLOT_BUDGET)


TIMEOUT = "OSMM_TIMEOUT"
"""Seconds that one blocking MPI step of osmm_jax (an agreement, a fence, creating or freeing a
window, matmul's own checks across ranks) may take before the watchdog acts (README, "Failure
behaviour"): a positive number; ``0`` or ``off`` turns the watchdog off. Any other value is a
ValueError naming the variable. Default: 300."""

DEFAULT_TIMEOUT = 300.0

ON_TIMEOUT = "OSMM_ON_TIMEOUT"
"""What the watchdog does when a step exceeds ``OSMM_TIMEOUT``: ``abort`` (default) prints a
report naming every rank's position and ends the job (MPI_Abort); ``raise`` raises an error
instead where the step allows it (for notebooks; the communicator is unusable afterwards).
Any other value is a ValueError."""

ON_TIMEOUT_CHOICES = ("abort", "raise")


def check_timeout(seconds, source: str = "timeout") -> float:
    """``seconds`` as a float, 0.0 meaning no limit; a clear error for anything else."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)):
        raise TypeError(f"{source} must be a number of seconds (0: no limit), got {seconds!r}")
    seconds = float(seconds)
    if not np.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{source} must be a finite number of seconds >= 0, got {seconds!r}")
    return seconds


def check_on_timeout(value, source: str = "on_timeout") -> str:
    if value not in ON_TIMEOUT_CHOICES:
        raise ValueError(f"{source} must be one of {ON_TIMEOUT_CHOICES}, got {value!r}")
    return value


def timeout_seconds() -> float:
    """``OSMM_TIMEOUT`` in seconds (0.0: no limit), or the default when unset or blank."""
    text = os.environ.get(TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    if text.lower() == "off":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT} must be a number of seconds (0 or off: no limit), got {text!r}"
        ) from None
    return check_timeout(value, TIMEOUT)


def on_timeout() -> str:
    """``OSMM_ON_TIMEOUT``: ``"abort"`` (default when unset or blank) or ``"raise"``."""
    text = os.environ.get(ON_TIMEOUT, "").strip().lower() or "abort"
    return check_on_timeout(text, ON_TIMEOUT)


REPORT_FAILURES = "OSMM_REPORT_FAILURES"
"""Whether an uncaught Python exception on a rank tells the other ranks at once (``1``,
default), so that those waiting for it in a product end the job with its reason instead of
waiting out ``OSMM_TIMEOUT``; ``0`` leaves ``sys.excepthook`` alone."""


def report_failures() -> bool:
    """``OSMM_REPORT_FAILURES``: True unless set to a no (``0``, ``false``, ``no``, ``off``)."""
    if not os.environ.get(REPORT_FAILURES, "").strip():
        return True
    return _flag(REPORT_FAILURES)


PROGRESS = "OSMM_PROGRESS"
"""Who makes MPI progress while a one_sided reduce is in flight. Over a network (MPICH's OFI or
UCX netmod on TCP) MPI_Accumulate is completed by the target rank inside MPI calls, and a rank
computing its GEMMs makes none, so without help the partials it receives wait for its closing
fence. ``thread``: a native thread polls MPI (MPI_Iprobe) during every reduce epoch; ``auto``:
only during epochs whose communicator has ranks on other nodes (or ``MPIR_CVAR_NOLOCAL=1``),
where over shared memory the origin does all the work and polling would only cost CPU;
``off``: never (the closing fence moves what is left). Any other value is a ValueError.
Default: ``off``: where the ranks' GEMMs fill the cores, the thread's polling and the
overlapped transfers cost the GEMMs more than they save (BUILD.md, "MPI progress over a
network", has the measurements)."""

PROGRESS_MODES = ("off", "thread", "auto")
"""The values of ``OSMM_PROGRESS``, in the order of their native codes (0, 1, 2)."""

DEFAULT_PROGRESS = "off"

PROGRESS_INTERVAL_US = "OSMM_PROGRESS_INTERVAL_US"
"""Microseconds the progress thread sleeps between two polls: a whole number >= 0 (``0``: poll
continuously, yielding the CPU in between). Any other value is a ValueError. Default: 0."""

DEFAULT_PROGRESS_INTERVAL_US = 0


def check_progress(mode, source: str = "progress") -> str:
    if mode not in PROGRESS_MODES:
        raise ValueError(f"{source} must be one of {PROGRESS_MODES}, got {mode!r}")
    return mode


def progress_mode() -> str:
    """``OSMM_PROGRESS``: ``"off"`` (default when unset or blank), ``"thread"`` or ``"auto"``."""
    text = os.environ.get(PROGRESS, "").strip().lower() or DEFAULT_PROGRESS
    return check_progress(text, PROGRESS)


def progress_interval_us() -> int:
    """``OSMM_PROGRESS_INTERVAL_US``, or the default when unset or blank."""
    text = os.environ.get(PROGRESS_INTERVAL_US, "").strip()
    if not text:
        return DEFAULT_PROGRESS_INTERVAL_US
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{PROGRESS_INTERVAL_US} must be a whole number of microseconds >= 0, got {text!r}"
        )
    return value
