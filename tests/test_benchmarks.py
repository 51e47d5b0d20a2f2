"""The benchmark runs end to end (tiny sizes; its timings are not checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")
@pytest.mark.parametrize("case", ["k_split", "rows"])
def test_compare_methods_prints_every_peer(case):
    result = subprocess.run(
        [
            str(MPIEXEC),
            "-n",
            "2",
            sys.executable,
            "-m",
            "benchmarks.compare_methods",
            "--case",
            case,
            "--size",
            "64",
            "--repeats",
            "1",
            "--peers",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in (
        "one_sided",
        "allreduce",
        "floor",
        "reference",
        "jax_named_sharding",
        "jax_shard_map",
    ):
        assert f"| {name}" in result.stdout, result.stdout
    assert "MiB moved by one_sided RMA per rank" in result.stdout
