"""Metric families built from given values, without MPI or the native library."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from osmm_jax._src.runtime.metrics import STEP_BUCKETS, _python_families, _rma_families  # noqa: E402

LABELS, VALUES = ["rank", "world_size"], ["1", "4"]


def _samples(families):
    return {
        (s.name, s.labels.get("op") or s.labels.get("le")): s.value
        for f in families
        for s in f.samples
    }


def test_rma_families_from_native_counters():
    stats = {"accumulates": 3, "puts": 5, "gets": 7, "sent_bytes": 100}
    families = list(_rma_families(stats, lambda: ([0.001, 0.01], [1, 2, 3], 0.5), LABELS, VALUES))
    assert [f.name for f in families] == [
        "osmm_rma_ops",
        "osmm_sent_bytes",
        "osmm_rma_latency_seconds",
    ]
    samples = _samples(families)
    assert samples[("osmm_rma_ops_total", "put")] == 5
    assert samples[("osmm_sent_bytes_total", None)] == 100
    assert samples[("osmm_rma_latency_seconds_bucket", "0.01")] == 3  # cumulative
    assert samples[("osmm_rma_latency_seconds_bucket", "+Inf")] == 6
    assert samples[("osmm_rma_latency_seconds_sum", None)] == 0.5


def test_python_families_from_a_snapshot():
    counts = {"matmul_calls": 0, "rebalances": 2, "fallbacks": 0, "checksum_failures": 1}
    buckets = [0] * len(STEP_BUCKETS) + [4]
    families = list(_python_families(counts, buckets, 80.0, 0.25, LABELS, VALUES))
    assert [f.name for f in families] == [
        "osmm_step_seconds",
        "osmm_rank_share_ratio",
        "osmm_rebalances",
        "osmm_fallbacks",
        "osmm_checksum_failures",
    ]
    samples = _samples(families)
    assert samples[("osmm_step_seconds_bucket", "30.0")] == 0
    assert samples[("osmm_step_seconds_count", None)] == 4
    assert samples[("osmm_rank_share_ratio", None)] == 0.25
    assert samples[("osmm_rebalances_total", None)] == 2
    assert samples[("osmm_checksum_failures_total", None)] == 1
    assert all(f.samples[0].labels["rank"] == "1" for f in families)
