"""Metric families built from given values, and the HTTP server's address, without MPI or
the native library."""

from __future__ import annotations

import socket
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from osmm_jax._src.runtime import metrics  # noqa: E402
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


# -- the HTTP server's address ------------------------------------------------------------------


@pytest.fixture
def fresh_metrics(monkeypatch):
    """metrics with its own state (nothing started) and one stand-in family in place of the
    native counters; the server a test starts is shut down afterwards."""
    from prometheus_client.core import GaugeMetricFamily

    def families():
        family = GaugeMetricFamily("osmm_test_gauge", "A stand-in.", labels=["rank"])
        family.add_metric(["0"], 1.0)
        yield family

    state = {**metrics._state, "enabled": False, "registry": None, "port": None, "server": None}
    monkeypatch.setattr(metrics, "_state", state)
    monkeypatch.setattr(metrics, "_families", families)
    for name in (metrics.ADDR, metrics.PORT, metrics.TEXTFILE):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    if state["server"] is not None:
        state["server"].shutdown()
        state["server"].server_close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_default_address_is_loopback(fresh_metrics):
    assert metrics.metrics_addr() == "127.0.0.1" == metrics.DEFAULT_ADDR
    fresh_metrics.setenv(metrics.ADDR, "  ")  # blank: unset
    assert metrics.metrics_addr() == "127.0.0.1"
    metrics.start_metrics(port=0, rank=0, world_size=1)  # port 0 + rank 0: any free port
    assert metrics._state["server"].server_address[0] == "127.0.0.1"
    assert "osmm_test_gauge" in _scrape(metrics._state["port"])


@pytest.mark.parametrize("explicit", [True, False])
def test_set_address_is_used(fresh_metrics, explicit):
    """127.0.0.1 given to start_metrics; 0.0.0.0 (every interface) from OSMM_METRICS_ADDR."""
    if explicit:
        metrics.start_metrics(port=0, addr="127.0.0.1", rank=0, world_size=1)
        expected = "127.0.0.1"
    else:
        fresh_metrics.setenv(metrics.ADDR, " 0.0.0.0 ")
        metrics.start_metrics(port=0, rank=0, world_size=1)
        expected = "0.0.0.0"
    assert metrics._state["server"].server_address[0] == expected
    assert 'osmm_test_gauge{rank="0"} 1.0' in _scrape(metrics._state["port"])


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0.0.0.0", "0.0.0.0"),
        ("10.1.2.3", "10.1.2.3"),
        ("::", "::"),
        ("fe80:0::1", "fe80::1"),
        ("localhost", "localhost"),
        ("node-017.ib.cluster.example.", "node-017.ib.cluster.example."),
    ],
)
def test_addresses_and_host_names_are_accepted(value, expected):
    assert metrics.check_addr(value, metrics.ADDR) == expected


@pytest.mark.parametrize(
    "value",
    ["0.0.0.0:9100", "http://node1", "[::1]", "node 1", "-node1", "10.0.0.256", "a" * 64, "é"],
)
def test_bad_address_raises_before_anything_starts(fresh_metrics, value):
    fresh_metrics.setenv(metrics.PORT, "0")
    fresh_metrics.setenv(metrics.ADDR, value)
    with pytest.raises(ValueError, match=r"OSMM_METRICS_ADDR must be an IPv4 or IPv6 address"):
        metrics.start_from_environment()
    assert not metrics.enabled() and metrics._state["server"] is None
    with pytest.raises(ValueError, match=r"^addr must be"):
        metrics.start_metrics(port=0, addr=value, rank=0, world_size=1)
    assert not metrics.enabled() and metrics._state["server"] is None


def test_a_port_in_use_raises_and_leaves_metrics_off(fresh_metrics):
    """The bind's OSError reaches the caller, and metrics stay off, so the next try raises too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for _ in range(2):
            with pytest.raises(OSError):
                metrics.start_metrics(port=port, addr="127.0.0.1", rank=0, world_size=1)
            assert not metrics.enabled() and metrics._state["server"] is None
