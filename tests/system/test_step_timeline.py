"""benchmarks/step_timeline.py: the interval arithmetic its figures rest on, and a recording of
the MLP step on 2 ranks with deferred finishes turned into a table and a picture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import MPIEXEC, mpiexec

from benchmarks import step_timeline

REPO = Path(__file__).resolve().parents[2]


def test_union_merges_touching_and_nested_intervals():
    assert step_timeline.union([(5, 7), (0, 2), (1, 3), (6, 6.5), (3, 4)]) == [(0, 4), (5, 7)]
    assert step_timeline.covered([(0, 2), (1, 3), (10, 11)]) == 4


def test_overlap_counts_each_instant_once():
    # Two GEMMs on different threads over the same part of a finish count that part once.
    comm = [(0, 10), (20, 30)]
    gemms = [(5, 15), (6, 8), (25, 40)]
    assert step_timeline.overlap(comm, gemms) == 10
    assert step_timeline.overlap(comm, []) == 0


def test_a_deferred_delivery_counts_from_its_start_to_its_completion():
    # XLA got to the asynchronous finish at 8 ms; the delivery left at 4 ms.
    spans = [
        {"kind": "GEMM", "start": 0.0, "end": 4000.0},
        {"kind": "osmm_reduce_start_deferred", "start": 4000.0, "end": 4500.0},
        {"kind": "osmm_reduce_finish_deferred", "start": 8000.0, "end": 9000.0, "issued": 4000.0},
        {"kind": "GEMM", "start": 4600.0, "end": 7000.0},
    ]
    m = step_timeline.measure(spans)
    assert m == {"step_ms": 9.0, "comm_ms": 5.0, "hidden_ms": 2.4, "gemm_ms": 6.4}


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")
def test_a_recorded_step_gives_every_rank_a_row_and_a_picture(tmp_path):
    """The MLP step, tiny, on 2 ranks with deferred finishes: each rank's traced steps show
    its deferred reduces as communication, and the report has a row per rank."""
    pytest.importorskip("osmm_jax.flax", exc_type=ImportError)
    out = tmp_path / "shm2" / "mlp"
    command = [*mpiexec(2), sys.executable, "-m", "benchmarks.step_timeline", "record"]
    command += ["--step", "mlp", "--batch", "16", "--width", "8", "--out", str(out)]
    command += ["--repeats", "1", "--traced", "2"]
    env = {**os.environ, "OSMM_DEFER": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = step_timeline.summarize(str(out))
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for rec in summary["records"]:
        assert rec["deferred_reduces"] == 4 * (step_timeline.PROFILER_WARMUP + 2)
        kinds = set(rec["kinds"].values())
        assert {"GEMM", "osmm_reduce_start_deferred", "osmm_reduce_finish_deferred"} <= kinds
        finishes = {n for n, k in rec["kinds"].items() if k == "osmm_reduce_finish_deferred"}
        assert set(rec["pairs"]) == finishes and len(finishes) == 4
        assert all(
            rec["kinds"][start] == "osmm_reduce_start_deferred" for start in rec["pairs"].values()
        )
    for row in summary["ranks"]:
        assert 0 < row["comm_ms"] <= row["step_ms"]
        assert 0 <= row["hidden_ms"] <= row["comm_ms"]
    step_timeline.report(type("Args", (), {"out": str(tmp_path)}))
    table = (tmp_path / "timeline.md").read_text()
    assert table.count("| shm2 | mlp |") == 2, table
    assert (tmp_path / "shm2_mlp.png").stat().st_size > 1000
