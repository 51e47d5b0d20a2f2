"""Which MPI a build of osmm_jax uses: the machine's own, or the MPICH wheel from PyPI.

A scikit-build-core dynamic-metadata provider (pyproject.toml, ``[[tool.dynamic-metadata]]``),
run by ``pip install`` / ``python -m build`` before and during the build:

* With an MPI on the machine (``MPI_CXX_COMPILER`` or ``MPICXX`` set, else ``mpicxx`` or
  ``mpicc`` on ``PATH``: a ``module load openmpi``, a system package, a cluster's MPI), the
  extension is built against it (CMakeLists.txt finds the same wrapper) and the package's
  dependencies are the base ones: no second MPI is installed next to it.
* With none, the build asks for the ``mpich`` wheel (``get_requires_for_dynamic_metadata``:
  pip installs it into the isolated build environment, whose ``bin`` is then on ``PATH``), the
  extension is built against that wheel's MPI, and ``mpich`` becomes a run-time dependency so
  the installed package runs with the very library it was built against.

The two calls see different machines (before and after the wheel is in the build environment);
a compiler that belongs to the ``mpich`` distribution counts as "none", so both decide the same.
``OSMM_BUILD_MPI=mpich`` forces the wheel, ``OSMM_BUILD_MPI=system`` forbids it (the build then
fails, saying how to provide an MPI, when there is none).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MPI_WHEEL = "mpich"
CHOICE = "OSMM_BUILD_MPI"


def _wheel_files() -> set[Path]:
    """The files of the installed ``mpich`` distribution (empty if none is installed)."""
    try:
        dist = importlib.metadata.distribution(MPI_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {Path(dist.locate_file(f)).resolve() for f in dist.files or ()}


def system_mpi_compiler() -> str | None:
    """The MPI compiler wrapper of the machine's own MPI, or None (only the wheel's, or none).

    Raises SystemExit with a one-line message for a compiler variable that names no file."""
    for variable in ("MPI_CXX_COMPILER", "MPICXX"):
        value = os.environ.get(variable, "").strip()
        if value:
            path = shutil.which(value)
            if path is None:
                raise SystemExit(
                    f"osmm_jax: {variable}={value!r} is not an executable MPI compiler wrapper: "
                    "point it at your MPI's mpicxx, or unset it"
                )
            return path
    wheel = _wheel_files()
    for name in ("mpicxx", "mpicc"):
        path = shutil.which(name)
        if path is not None and Path(path).resolve() not in wheel:
            return path
    return None


def uses_mpi_wheel() -> bool:
    """Whether this build is made against (and the package then needs) the ``mpich`` wheel."""
    choice = os.environ.get(CHOICE, "").strip().lower() or "auto"
    if choice not in ("auto", "mpich", "system"):
        raise SystemExit(f"osmm_jax: {CHOICE} must be auto, mpich or system, got {choice!r}")
    if choice == "auto":
        return system_mpi_compiler() is None
    if choice == "system" and system_mpi_compiler() is None:
        raise SystemExit(
            f"osmm_jax: {CHOICE}=system, but no MPI was found: put your MPI's mpicxx on PATH "
            "(e.g. `module load openmpi`) or set MPI_CXX_COMPILER, or unset it to use the "
            "MPICH wheel"
        )
    return choice == "mpich"


def get_requires_for_dynamic_metadata(settings: Mapping[str, Any]) -> list[str]:
    """Build requirements: the MPI wheel when the build uses it."""
    return [MPI_WHEEL] if uses_mpi_wheel() else []


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    """``dependencies``: the ``base`` list of the settings, plus the MPI wheel when used."""
    base = list(settings.get("base", []))
    return {"dependencies": base + ([MPI_WHEEL] if uses_mpi_wheel() else [])}


def dynamic_wheel(settings: Mapping[str, Any]) -> dict[str, bool]:
    """The dependencies depend on the machine a wheel is built on, not only on the sources."""
    return {"dependencies": True}
