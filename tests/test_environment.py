"""``python -m osmm_jax``: the environment report, and the version written in one place."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import osmm_jax
from osmm_jax._src import environment


def test_the_report_names_every_part_of_the_stack():
    run = subprocess.run(
        [sys.executable, "-m", "osmm_jax"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OSMM_TIMEOUT": "77", "FI_PROVIDER": "tcp"},
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for title, _ in environment.SECTIONS:
        assert f"== {title}\n" in out
    assert f"osmm_jax {osmm_jax.__version__}" in out
    assert "thread level: multiple" in out
    assert "libmpi.so" in out  # the file mpi4py loaded: its soname says the ABI
    assert "handlers registered for: cpu" in out
    assert "extension module: osmm_jax._src.runtime._osmm_ffi" in out
    assert "mpi4py and the extension use the same MPI library" in out
    assert "OSMM_TIMEOUT=77" in out
    assert "FI_PROVIDER=tcp" in out
    assert "unavailable" not in out
    assert "allreduce method and checksum sums: mpi4jax.allreduce" in out


def test_the_report_names_the_all_reduce_in_use(monkeypatch):
    monkeypatch.setenv("OSMM_ALLREDUCE", "native")
    assert "checksum sums: osmm_jax's own MPI_Iallreduce" in environment.report()
    monkeypatch.setenv("OSMM_ALLREDUCE", "sometimes")
    assert "checksum sums: none: OSMM_ALLREDUCE must be one of" in environment.report()


def test_a_failing_part_is_reported_in_its_place(monkeypatch):
    def broken():
        raise ImportError("no module named mpi4jax")

    monkeypatch.setattr(environment, "SECTIONS", (("mpi4jax", broken), *environment.SECTIONS[:1]))
    text = environment.report()
    assert "== mpi4jax\n  unavailable: ImportError: no module named mpi4jax" in text
    assert f"osmm_jax {osmm_jax.__version__}" in text


def test_the_version_comes_from_one_place():
    assert importlib.metadata.version("osmm_jax") == osmm_jax.__version__
