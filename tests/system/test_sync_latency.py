"""benchmarks/sync_latency.py end to end on 2 ranks over shared memory (the TCP configurations
need root and network namespaces; tests/system/test_multihost.py covers launching across
emulated hosts): sync_latency.c compiles with the venv's mpicc, and every case and size is
timed. The timings themselves are not checked (this machine is shared and noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (BIN / "mpiexec").exists() or not (BIN / "mpicc").exists(),
    reason="needs the venv's mpiexec and mpicc",
)

SIZES = (64, 4096, 65536, 262144, 1048576)
EXPECTED = (
    {("fence_empty", 0), ("notify_put_putflag", 64)}
    | {(c, 4) for c in ("iallreduce", "allreduce")}
    | {(c, 262144) for c in ("iallreduce", "allreduce")}
    | {
        (c, s)
        for c in ("fence_put", "fence_acc", "fence_get", "lock_put", "lock_acc", "lock_get")
        + ("notify_put", "notify_acc", "twosided", "persistent", "notify_late", "twosided_late")
        for s in SIZES
    }
)


def test_every_case_and_size_is_timed(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.sync_latency", "--configs", "shm2", "--reps", "3"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "sync_latency.json").read_text())
    (summary,) = data["configs"]
    assert summary["config"] == "shm2" and summary["status"] == 0 and len(summary["load"]) == 3
    records = data["records"]
    assert {(r["case"], r["bytes"]) for r in records} == EXPECTED
    for r in records:
        assert r["config"] == "shm2" and r["ranks"] == 2 and r["reps"] == 3, r
        assert r["ms"] > 0, r
        assert r.get("stale", 0) == 0, r  # a notified put's data landed before its flag
    text = (tmp_path / "sync_latency.md").read_text()
    assert "## shm2" in text and "| notify_put |" in text
