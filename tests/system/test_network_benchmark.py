"""benchmarks/network.py's report, from a made-up record (the jobs themselves need root and
network namespaces: tests/system/test_multihost.py covers launching across emulated hosts)."""

from __future__ import annotations

import pytest

network = pytest.importorskip("benchmarks.network")


def _record(progress: str) -> dict:
    names = {
        "one_sided": 0.100,
        "one_sided, progress off": 0.125,
        "one_sided, progress thread": 0.100,
        "allreduce": 0.130,
        "jax_named_sharding": 0.120,
        "floor (local GEMMs only)": 0.090,
    }
    return {
        "case": "k_split",
        "label": f"k_split tcp {progress}",
        "title": "k_split: C[8x8] = A[8x8] @ B[8x8]",
        "path": "tcp",
        "progress": progress,
        "entries": [{"name": n, "seconds": s, "gflops": 1.0} for n, s in names.items()],
        "notes": ["a note"],
    }


def test_ratios_are_speed_ups_over_the_peers():
    rows = {name: (a, n) for name, a, n in network.ratios(_record("default"))}
    assert rows["one_sided"] == pytest.approx((1.3, 1.2))
    assert rows["one_sided, progress off"] == pytest.approx((1.04, 0.96))
    assert "allreduce" not in rows


def test_report_writes_markdown_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    network.report([_record("default"), _record("mpich-async")], tmp_path, 60.0)
    text = (tmp_path / "network.md").read_text()
    assert "| k_split | tcp | one_sided, progress default | 1.30 | 1.20 | 100.0 |" in text
    assert "MPIR_CVAR_ASYNC_PROGRESS=1" in text
    assert (tmp_path / "network.png").stat().st_size > 0
