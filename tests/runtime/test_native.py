"""Which build of the native extension osmm_jax loads (native._abi_suffix): a wheel carries one
per MPI ABI, a source build one for the MPI it was built against."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("jax")
from mpi4py import MPI  # noqa: E402

from osmm_jax._src.runtime import native  # noqa: E402


def test_a_source_build_loads_its_one_extension():
    assert native.ABI_SUFFIX == ""
    assert native.MODULES["cpu"].__name__ == "osmm_jax._src.runtime._osmm_ffi"


@pytest.mark.parametrize(
    "library, suffix",
    [
        ("Open MPI v5.0.11, package: Open MPI Distribution", "_openmpi"),
        ("MPICH Version:      5.0.2", ""),
        ("Intel(R) MPI Library 2021.19 for Linux* OS", ""),  # the MPICH ABI
    ],
)
def test_a_wheel_with_both_builds_loads_the_one_of_the_mpi_mpi4py_loaded(
    monkeypatch, library, suffix
):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name.endswith("._osmm_ffi_openmpi"):
            return object()  # as if the wheel's Open MPI build were installed
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(MPI, "Get_library_version", lambda: library)
    assert native._abi_suffix() == suffix


def test_without_a_second_build_the_mpi_is_not_asked(monkeypatch):
    def unexpected():
        raise AssertionError("mpi4py asked for its library although there is one build only")

    monkeypatch.setattr(MPI, "Get_library_version", unexpected)
    assert native._abi_suffix() == ""
