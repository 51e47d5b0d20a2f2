"""Each rank's GEMM rate (GFLOP/s): measured, read from a cache, or declared.

Work is split in proportion to these speeds (see :mod:`osmm_jax._src.planning.balance`).
:func:`profile_speeds` times a jitted square ``jnp.dot`` on every rank at the same
time (ranks that share a core must be measured while they compete for it, as
they will when they multiply), takes each rank's median and exchanges the
results, so every rank returns the same array.

Measuring costs about a second, so results can be cached in a JSON file, one
entry per rank keyed by the rank and job size and by what determines the rate:
host, device kind, the CPUs the rank may run on, how many ranks of the job share
those CPUs, matrix size and dtype. Whether to measure is decided collectively: if
any rank lacks its entry, every rank measures, so no rank waits in a collective
the others skipped.

Speeds can also be declared (``speeds=[...]`` or ``OSMM_SPEEDS=300,300,125``),
which skips measuring altogether.

Importing this module loads neither JAX nor MPI: :func:`declared_speeds` is pure;
:func:`profile_speeds` imports them when called.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from osmm_jax._src import checks, config, dtypes
from osmm_jax._src.log import get_logger
from osmm_jax._src.planning.balance import NOISE_THRESHOLD

log = get_logger("speeds")  # not __name__, which is "__main__" under python -m

SOURCES = ("measured", "cache", "declared")
"""Where a :class:`SpeedProfile` came from."""

CACHE_VERSION = 1


@dataclass(frozen=True, eq=False)
class SpeedProfile:
    """The GEMM rate of every rank of a communicator, identical on every rank.

    Attributes:
        gflops: float64 array, shape ``(nranks,)``: rank ``r``'s rate in GFLOP/s
            (median over the timed repeats).
        spread: float64 array, shape ``(nranks,)``: the coefficient of variation
            (standard deviation / mean) of rank ``r``'s timed repeats; 0 for
            declared speeds. Pass it to ``balance(..., spread=...)``, which falls
            back to an even split when the timings were too noisy to trust.
        source: ``"measured"``, ``"cache"`` or ``"declared"``.

    Both arrays are read-only. Compared by identity (arrays have no single truth value).
    """

    gflops: np.ndarray
    spread: np.ndarray
    source: str

    def __post_init__(self) -> None:
        for name in ("gflops", "spread"):
            value = np.array(getattr(self, name), dtype=np.float64)
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        if self.gflops.shape != self.spread.shape or self.gflops.ndim != 1:
            raise ValueError(
                f"gflops and spread must be 1-D of one length, got {self.gflops.shape} and {self.spread.shape}"
            )
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    def describe(self) -> str:
        """One line per rank: rate and spread, e.g. ``rank 2: 85.3 GFLOP/s (CV 0.02)``."""
        lines = [f"GEMM rates ({self.source}):"]
        for r, (g, s) in enumerate(zip(self.gflops, self.spread)):
            lines.append(f"  rank {r}: {g:8.1f} GFLOP/s (CV {s:.2f})")
        return "\n".join(lines)


# -- declared speeds ---------------------------------------------------------------------


def declared_speeds(nranks: int) -> np.ndarray | None:
    """The speeds declared by ``OSMM_SPEEDS`` (GFLOP/s per rank), or None when it is unset.

    Args:
        nranks: how many ranks the speeds are for.

    Raises:
        ValueError: the variable does not hold ``nranks`` comma-separated finite
            numbers greater than zero.
    """
    text = config.declared_speeds_text()
    if text is None:
        return None
    what = f"{config.SPEEDS}={text!r}"
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"{what}: expected comma-separated GFLOP/s per rank, e.g. '300,300,125'"
        ) from None
    return np.array(checks.positive_speeds(values, nranks, what), dtype=np.float64)


# -- measuring ------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(getattr(dtype, "__name__", dtype))
    if name not in dtypes.NAMES:
        raise ValueError(f"dtype must be one of {dtypes.NAMES}, got {dtype!r}")
    return name


def _time_gemm(comm, size: int, repeats: int, dtype: str) -> tuple[float, float]:
    """This rank's (GFLOP/s from the median time, CV of the times) of a ``size``³ ``dtype`` dot.

    Collective: the ranks start the timed runs together, so ranks sharing a core
    are measured while they compete for it.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype=dtype)
    dot = jax.jit(jnp.dot)
    dot(x, x).block_until_ready()  # compile and warm up
    comm.Barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dot(x, x).block_until_ready()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    cv = statistics.pstdev(times) / statistics.fmean(times)
    return 2.0 * size**3 / median / 1e9, cv


# -- cache ------------------------------------------------------------------------------


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/osmm_jax/speeds.json`` (``~/.cache/osmm_jax/speeds.json`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "osmm_jax" / "speeds.json"


def _cache_path(cache) -> Path | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        return default_cache_path()
    if isinstance(cache, (str, os.PathLike)):
        return Path(cache).expanduser()
    raise TypeError(f"cache must be None, True or a path, got {cache!r}")


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def _cpu_ranges(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``; None -> ``"any"``."""
    if cpus is None:
        return "any"
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _cache_key(comm, size: int, dtype: str) -> str:
    """This rank's cache key (collective: ranks compare hosts and CPU sets).

    E.g. ``"rank 2/3|node7|cpu|cpus 1|shared by 1|1024|float32"``. A rank's rate
    depends on how many ranks of the job compete for its CPUs, not only on which
    CPUs those are, so the key counts them. The rank and job size are part of the
    key, so each rank reads back exactly what it measured.
    """
    import jax

    host, cpus = socket.gethostname(), _affinity()
    everyone = comm.allgather((host, cpus))
    sharing = sum(1 for h, c in everyone if h == host and (cpus is None or c is None or cpus & c))
    kind = jax.devices()[0].device_kind
    rank, nranks = comm.Get_rank(), comm.Get_size()
    return "|".join(
        (
            f"rank {rank}/{nranks}",
            host,
            kind,
            f"cpus {_cpu_ranges(cpus)}",
            f"shared by {sharing}",
            str(size),
            dtype,
        )
    )


def _read_cache(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable speed cache %s: %s", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _cached_entry(path: Path, key: str) -> tuple[float, float] | None:
    entry = _read_cache(path).get(key)
    try:
        gflops, spread = float(entry["gflops"]), float(entry["spread"])
    except (TypeError, KeyError, ValueError):
        return None
    if not (math.isfinite(gflops) and gflops > 0 and math.isfinite(spread) and spread >= 0):
        return None
    return gflops, spread


def _write_cache(path: Path, key: str, gflops: float, spread: float) -> None:
    """Add this rank's entry: read-modify-write under an exclusive lock, replaced atomically.

    Several ranks (of this job or another) may write the same file at once.
    Failing to write is logged, never raised: the cache is an optimisation.
    """
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = _read_cache(path)
            entries[key] = {
                "gflops": gflops,
                "spread": spread,
                "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(
                    {"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True
                )
            os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the speed cache %s: %s", path, e)


# -- public function ----------------------------------------------------------------


def _info(rank: int, msg: str, *args) -> None:
    """A progress line: INFO on rank 0, DEBUG on the others (so one terminal shows it once)."""
    log.log(logging.INFO if rank == 0 else logging.DEBUG, msg, *args)


def profile_speeds(
    comm=None,
    *,
    size: int = 1024,
    repeats: int = 7,
    dtype="float32",
    cache=None,
    progress: bool = True,
    speeds=None,
    return_profile: bool = False,
):
    """Every rank's GEMM rate in GFLOP/s, the same array on every rank.

    A collective over ``comm``: every rank must call it, with the same arguments.
    Each rank times a jitted ``size`` x ``size`` ``jnp.dot`` (one warm-up, then
    ``repeats`` timed runs, all ranks at once) and reports ``2 * size**3 /
    median_time``. Ranks that share CPUs are measured while competing for them.

    Args:
        comm: an mpi4py intracommunicator (default COMM_WORLD); a private
            duplicate is used for the exchange.
        size: the matrix dimension (rows = cols) to time; large enough that one
            product takes tens of milliseconds gives stable numbers.
        repeats: timed runs per rank; the median is used.
        dtype: ``"float32"`` (default), ``"float64"``, ``"bfloat16"`` or ``"float16"``.
        cache: None (default: always measure), True (``~/.cache/osmm_jax/speeds.json``)
            or a JSON file path. Ranks read their own entries; if any rank has
            none, every rank measures and stores its entry.
        progress: log one line per phase (INFO on rank 0, DEBUG elsewhere; see
            :func:`osmm_jax.enable_logging`).
        speeds: declared GFLOP/s per rank; skips measuring (source ``"declared"``).
            Without it, ``OSMM_SPEEDS`` is read, and if set used the same way.
        return_profile: return a :class:`SpeedProfile` (rates, spread, source)
            instead of the bare array.

    Returns:
        float64 array of shape ``(comm size,)`` in GFLOP/s, or a :class:`SpeedProfile`.

    Raises:
        TypeError / ValueError: bad arguments, declared speeds of the wrong count
            or not finite and positive, or ranks passing different arguments;
            raised on every rank alike.
    """
    from osmm_jax._src.runtime import communicators

    private = communicators.private_comm(comm)
    rank, nranks = private.Get_rank(), private.Get_size()
    args = _checked_arguments(size, repeats, dtype, cache, speeds, nranks)
    communicators.agree(
        private,
        "osmm_jax.profile_speeds",
        _agreed_choice(args),
        args.error,
        must_match="the same declared speeds, size, repeats, dtype and cache on/off",
    )
    if args.declared is not None:
        if progress:
            _info(rank, "GEMM rates %s: %s GFLOP/s", args.origin, _fmt(args.declared))
        return _result(SpeedProfile(args.declared, np.zeros(nranks), "declared"), return_profile)
    key = None
    if args.path is not None:
        key, profile = _cached_profile(private, args.path, args.size, args.dtype, progress)
        if profile is not None:
            return _result(profile, return_profile)
    return _result(_measured_profile(private, args, key, progress), return_profile)


class _Arguments(NamedTuple):
    """:func:`profile_speeds`'s arguments as checked on this rank, and the first problem found.

    ``declared`` holds the declared GFLOP/s per rank (None: measure), ``origin``
    says where they were declared, ``path`` is the cache file (None: no cache).
    After an ``error`` the fields not yet checked hold the values as given.
    """

    size: int
    repeats: int
    dtype: str
    path: Path | None
    declared: np.ndarray | None
    origin: str
    error: Exception | None


def _checked_arguments(size, repeats, dtype, cache, speeds, nranks: int) -> _Arguments:
    """Check :func:`profile_speeds`'s arguments locally, catching the error instead of raising.

    The error is raised later by the agreement, on every rank alike, so that a
    bad argument on one rank does not leave the others waiting in a collective.
    Without ``speeds``, ``OSMM_SPEEDS`` is read.
    """
    declared, origin, path, error = None, "", None, None
    try:
        size = checks.integer(size, "size", 1)
        repeats = checks.integer(repeats, "repeats", 1)
        dtype = _dtype_name(dtype)
        path = _cache_path(cache)
        if speeds is not None:
            declared = np.array(checks.positive_speeds(speeds, nranks), dtype=np.float64)
            origin = "declared"
        else:
            declared, origin = declared_speeds(nranks), f"declared by {config.SPEEDS}"
    except (TypeError, ValueError) as e:
        error = e
    return _Arguments(size, repeats, dtype, path, declared, origin, error)


def _agreed_choice(args: _Arguments) -> str:
    """What every rank must have chosen alike: declared speeds, size, repeats, dtype, cache on/off."""
    declared = None if args.declared is None else args.declared.tolist()
    return repr((declared, args.size, args.repeats, args.dtype, args.path is not None))


def _cached_profile(comm, path: Path, size: int, dtype: str, progress: bool):
    """``(this rank's cache key, the cached SpeedProfile or None)``; collective over ``comm``.

    The profile comes from the cache only when every rank finds its entry;
    otherwise every rank measures (and None is returned).
    """
    rank = comm.Get_rank()
    key = _cache_key(comm, size, dtype)
    found = comm.allgather(_cached_entry(path, key))
    if all(entry is not None for entry in found):
        profile = SpeedProfile([g for g, _ in found], [s for _, s in found], "cache")
        if progress:
            _info(rank, "GEMM rates from the cache %s: %s GFLOP/s", path, _fmt(profile.gflops))
        return key, profile
    missing = [r for r, entry in enumerate(found) if entry is None]
    if progress:
        _info(rank, "speed cache %s has no entry for ranks %s: measuring", path, missing)
    return key, None


def _measured_profile(comm, args: _Arguments, key: str | None, progress: bool) -> SpeedProfile:
    """Time the GEMM on every rank of ``comm`` at once and exchange the rates (collective).

    Each rank stores its entry under ``key`` when there is a cache; on return the
    file holds every rank's entry.
    """
    rank = comm.Get_rank()
    if progress:
        _info(rank, "profiling GEMM rate: %d^3 %s, %d repeats", args.size, args.dtype, args.repeats)
    gflops, spread = _time_gemm(comm, args.size, args.repeats, args.dtype)
    measured = comm.allgather((gflops, spread))
    profile = SpeedProfile([g for g, _ in measured], [s for _, s in measured], "measured")
    if args.path is not None:
        _write_cache(args.path, key, gflops, spread)
        comm.Barrier()  # on return, the file holds every rank's entry
    noisy = _noisy_ranks(profile.spread)
    if noisy and rank == 0:
        log.warning(
            "GEMM timings vary (%s > %s): balance() will split evenly; a larger size or "
            "more repeats may help",
            noisy,
            NOISE_THRESHOLD,
        )
    if progress:
        _info(
            rank,
            "GEMM rates measured: %s GFLOP/s (CV %s)",
            _fmt(profile.gflops),
            ", ".join(f"{s:.2f}" for s in profile.spread),
        )
    return profile


def _noisy_ranks(spread) -> str:
    """The ranks too noisy for ``balance()`` to trust, in words; empty when none.

    ``spread`` holds each rank's coefficient of variation of its timings
    (unitless); above :data:`NOISE_THRESHOLD` a rank is listed, e.g.
    ``"rank 1 CV 0.35"``.
    """
    return ", ".join(f"rank {r} CV {s:.2f}" for r, s in enumerate(spread) if s > NOISE_THRESHOLD)


def _fmt(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _result(profile: SpeedProfile, return_profile: bool):
    return profile if return_profile else profile.gflops.copy()


def main(argv=None) -> int:
    """``mpiexec -n N python -m osmm_jax._src.tuning.speeds``: print every rank's GEMM rate."""
    import argparse

    parser = argparse.ArgumentParser(description="Measure and print every rank's GEMM rate.")
    parser.add_argument("--size", type=int, default=1024, help="matrix dimension (default 1024)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs (default 7)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), float64, ...")
    parser.add_argument("--cache", default=None, help="a JSON cache file (default: none)")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from osmm_jax._src.log import enable_logging

    enable_logging("INFO")
    profile = profile_speeds(
        size=args.size,
        repeats=args.repeats,
        dtype=args.dtype,
        cache=args.cache,
        return_profile=True,
    )
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(profile.describe(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
