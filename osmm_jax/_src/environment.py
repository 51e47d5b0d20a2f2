"""The environment report of ``python -m osmm_jax``: what a bug report or a failed install needs.

Each section is gathered on its own and never raises: a section that fails (a missing package,
a native module that does not load, no MPI) says why in its place, since that is usually what
the reader is looking for. Run it where the problem is (on a cluster's compute node, inside the
job's environment); it initialises MPI through mpi4py as a one-rank job when run alone.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable

# The environment variables that say which transport an MPI uses (shown when set).
TRANSPORT_VARIABLES = (
    "MPIR_CVAR_CH4_NETMOD",
    "MPIR_CVAR_NOLOCAL",
    "MPIR_CVAR_ENABLE_GPU",
    "FI_PROVIDER",
    "FI_TCP_IFACE",
    "UCX_TLS",
    "UCX_NET_DEVICES",
    "I_MPI_FABRICS",
    "I_MPI_OFI_PROVIDER",
    "CUDA_VISIBLE_DEVICES",
    "JAX_PLATFORMS",
)
TRANSPORT_PREFIXES = ("OMPI_MCA_",)


def _osmm_jax() -> list[str]:
    # The package's own module would import every layer; its metadata and location suffice.
    import importlib.metadata

    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [f"osmm_jax {importlib.metadata.version('osmm_jax')} ({package})"]


def _python() -> list[str]:
    return [f"Python {platform.python_version()} ({sys.executable}), {platform.platform()}"]


def _jax() -> list[str]:
    import jax
    import jaxlib

    from osmm_jax._src.compat import TESTED_JAX

    lines = [
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__} "
        f"(osmm_jax is tested with {TESTED_JAX[0]} to {TESTED_JAX[1]})"
    ]
    lines.append(f"default backend: {jax.default_backend()}")
    lines += [f"device {d.id}: {d.platform} {d.device_kind}" for d in jax.devices()]
    return lines


def _mpi() -> list[str]:
    import mpi4py
    from mpi4py import MPI

    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    return [
        f"mpi4py {mpi4py.__version__}, MPI standard {'.'.join(map(str, MPI.Get_version()))}",
        f"MPI library: {library}",
        f"MPI library file: {_loaded_libmpi() or 'unknown'}",
        f"thread level: {levels.get(MPI.Query_thread(), MPI.Query_thread())} (osmm_jax needs multiple)",
        f"COMM_WORLD: {MPI.COMM_WORLD.Get_size()} rank(s)",
    ]


def _loaded_libmpi() -> str | None:
    """The path of the libmpi this process has loaded (its soname says the ABI: .so.12 is
    MPICH's, shared by Intel MPI and Cray MPICH; .so.40 is Open MPI's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi.so" in line}
    except OSError:
        return None
    return ", ".join(sorted(paths)) or None


def _all_reduce() -> list[str]:
    from osmm_jax._src import compat, config

    try:
        import mpi4jax
    except ImportError:
        lines = ["mpi4jax: not installed (`pip install osmm_jax[mpi4jax]` for the baseline)"]
    else:
        lines = [f"mpi4jax {mpi4jax.__version__}"]
    try:
        used = config.allreduce_implementation(compat.HAVE_MPI4JAX)
    except ValueError as err:
        used = f"none: {err}"
    lines.append(
        "allreduce method and checksum sums: "
        + {"mpi4jax": "mpi4jax.allreduce", "native": "osmm_jax's own MPI_Iallreduce"}.get(
            used, used
        )
    )
    return lines


def _native() -> list[str]:
    from osmm_jax._src.runtime import communicators, native  # noqa: F401 - its import checks the MPI

    lines = [f"handlers registered for: {', '.join(native.platforms())}"]
    lines.append(f"extension module: {native.MODULES['cpu'].__name__}")
    lines += [f"not available for {p}: {why}" for p, why in native.UNAVAILABLE.items()]
    # Open MPI's version string ends in a NUL.
    ours = native.mpi_library_version().strip("\x00 \n").splitlines()[0]
    lines.append(f"extension's MPI: {ours}")
    # communicators checks this at import: a mismatch makes this section unavailable, saying so.
    lines.append("mpi4py and the extension use the same MPI library")
    if "cuda" in native.MODULES:
        support = native.MODULES["cuda"].mpi_cuda_support()
        lines.append(
            "MPIX_Query_cuda_support: "
            + {1: "1 (CUDA-aware)", 0: "0 (host staging only)"}.get(support, "not provided")
        )
    return lines


def _settings() -> list[str]:
    names = sorted(n for n in os.environ if n.startswith("OSMM_"))
    return [f"{n}={os.environ[n]}" for n in names] or ["no OSMM_* variable set (all defaults)"]


def _transport() -> list[str]:
    names = [n for n in TRANSPORT_VARIABLES if n in os.environ]
    names += sorted(n for n in os.environ if n.startswith(TRANSPORT_PREFIXES))
    return [f"{n}={os.environ[n]}" for n in names] or ["none set (each MPI's defaults)"]


SECTIONS: tuple[tuple[str, Callable[[], list[str]]], ...] = (
    ("osmm_jax", _osmm_jax),
    ("Python", _python),
    ("JAX", _jax),
    ("MPI", _mpi),
    ("all-reduce", _all_reduce),
    ("native handlers", _native),
    ("osmm_jax settings", _settings),
    ("transport hints", _transport),
)


def report() -> str:
    """The whole report as text, one ``== section`` heading per part."""
    out = []
    for title, gather in SECTIONS:
        out.append(f"== {title}")
        try:
            lines = gather()
        except Exception as err:  # noqa: BLE001 - the report says what failed, never raises
            lines = [f"unavailable: {type(err).__name__}: {err}"]
        out += [f"  {line}" for line in lines]
    return "\n".join(out)
