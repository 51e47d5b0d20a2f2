"""Which pages of osmm_jax's MPI windows are in memory, and on which rank they count.

Within a node MPICH maps every rank's window memory into every process (one shared file), and
Linux counts a shared page in the resident set of each process that touched it. A rank's
write into another rank's slot therefore shows in its own VmRSS, and a slot of its own shows
only once it has read it. Across hosts or devices those pages are the target's alone, so a
per-rank memory figure counts them on the rank that owns them (:func:`window_pages`), from
the page tables (``/proc/self/pagemap``) and the page cache (``mincore``) over the regions
:func:`osmm_jax._src.runtime.native.window_regions` names. Linux only.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from osmm_jax._src.runtime import native

PAGE = os.sysconf("SC_PAGE_SIZE")


def _page_span(address: int, nbytes: int) -> tuple[int, int]:
    """The first page and the number of pages of ``nbytes`` bytes at ``address``."""
    first = address // PAGE
    return first, max(0, (address + nbytes - 1) // PAGE - first + 1)


def mapped_bytes(address: int, nbytes: int) -> int:
    """Bytes of the pages of a region that this process's page table maps (it touched them):
    bit 63 of their ``/proc/self/pagemap`` entries."""
    first, count = _page_span(address, nbytes)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entries = np.frombuffer(os.pread(fd, count * 8, first * 8), np.uint64)
    finally:
        os.close(fd)
    return int(np.count_nonzero(entries >> np.uint64(63))) * PAGE


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the pages of a region that are in memory, whoever touched them (``mincore``)."""
    first, count = _page_span(address, nbytes)
    vector = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(first * PAGE, count * PAGE, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.count_nonzero(np.frombuffer(vector, np.uint8) & 1)) * PAGE


def window_pages() -> int:
    """What to add to this rank's resident set so that osmm_jax's window pages count on the
    rank that owns them: the pages of its own windows that only other ranks touched, less
    the pages of other ranks' windows this rank touched (shared within a node)."""
    correction = 0
    for own, address, nbytes in native.window_regions():
        mapped = mapped_bytes(address, nbytes)
        correction += resident_bytes(address, nbytes) - mapped if own else -mapped
    return correction
