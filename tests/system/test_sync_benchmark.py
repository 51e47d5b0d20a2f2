"""benchmarks/sync.py end to end on 2 ranks over shared memory: every case times the notified
mode (also with a replicated C staged), the fence mode and the all-reduce method, and says what each mode spent waiting. The
timings themselves are not checked (this machine is shared and noisy); the TCP configurations
of benchmarks/sync_report.py need root and network namespaces."""

from __future__ import annotations

import json
import sys

import pytest
from jobs import MPIEXEC, job_environment, mpiexec, run_job

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")

try:  # the MLP case trains osmm_jax.flax layers (flax >= 0.12)
    import osmm_jax.flax  # noqa: F401

    CASES = ["k_split:16", "dp_grad:16", "mlp"]
except ImportError:
    CASES = ["k_split:16", "dp_grad:16"]


def test_every_case_times_both_modes_and_the_all_reduce():
    command = [*mpiexec(2), sys.executable, "-m", "benchmarks.sync"]
    command += ["--cases", ",".join(CASES), "--repeats", "2"]
    end = run_job(command, job_environment(drop=("OSMM_",), JAX_PLATFORMS="cpu"), 300)
    assert end.status == 0, end.stdout + end.stderr
    records = [json.loads(line) for line in end.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in records] == CASES
    for r in records:
        names = {e["name"] for e in r["entries"]}
        assert {"notify", "fence", "allreduce"} <= names
        # the notified mode with a replicated C staged, where C is replicated
        assert ("notify staged" in names) == (r["case"] != "k_split:16")
        assert (r["staged_vs_allreduce"] is None) == (r["case"] == "k_split:16")
        assert all(e["seconds"] > 0 for e in r["entries"])
        assert r["counters"]["notifications"] > 0
        for rank in r["per_call_by_rank"]:
            assert rank["notify"]["fences"] == 0  # no collective fence in the notified mode
            assert rank.get("notify staged", {"fences": 0})["fences"] == 0
            assert rank["fence"]["notifications"] == 0
