"""Prometheus metrics: every rank serves the documented names over HTTP and as a textfile."""

from __future__ import annotations

import socket
import urllib.request

import jax
import jax.numpy as jnp
from mpi4py import MPI
from prometheus_client.parser import text_string_to_metric_families

import osmm_jax as om
from osmm_jax._src.runtime import metrics

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

NAMES = {
    "osmm_matmul_calls": "counter",
    "osmm_rma_ops": "counter",
    "osmm_sent_bytes": "counter",
    "osmm_rma_latency_seconds": "histogram",
    "osmm_step_seconds": "histogram",
    "osmm_rank_share_ratio": "gauge",
    "osmm_rebalances": "counter",
    "osmm_fallbacks": "counter",
    "osmm_checksum_failures": "counter",
}


def _free_base_port() -> int:
    """A base port with SIZE free ports after it, chosen by rank 0 and shared."""
    base = None
    if RANK == 0:
        for _ in range(50):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                candidate = s.getsockname()[1]
            if candidate + SIZE < 65535 and all(_free(candidate + r) for r in range(SIZE)):
                base = candidate
                break
    return MPI.COMM_WORLD.bcast(base)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_rank_serves_the_documented_metrics(tmp_path_factory):
    base = _free_base_port()
    metrics.start_metrics(port=base)
    plan = om.plan(om.Layout.cols((32, 32)), om.Layout.rows((32, 32)), om.Layout.rows((32, 32)))
    a = jnp.ones(plan.a.local_shape(RANK), jnp.float32)
    b = jnp.ones(plan.b.local_shape(RANK), jnp.float32)
    jax.block_until_ready(jax.jit(lambda x, y: om.matmul(x, y, plan))(a, b))
    metrics.observe_step(0.02)
    metrics.set_share(1.0 / SIZE)

    with urllib.request.urlopen(f"http://127.0.0.1:{base + RANK}/metrics", timeout=30) as response:
        families = _parse(response.read().decode())
    for name, kind in NAMES.items():
        assert name in families and families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["rank"] == str(RANK) and sample.labels["world_size"] == str(SIZE)
            assert set(sample.labels) <= {"rank", "world_size", "op", "le"}
    calls = {s.name: s.value for s in families["osmm_matmul_calls"].samples}
    assert calls["osmm_matmul_calls_total"] >= 1
    ops = {s.labels["op"]: s.value for s in families["osmm_rma_ops"].samples}
    assert set(ops) == {"accumulate", "put", "get"}
    if SIZE > 1:
        # A K-split delivers partials: puts or accumulates, by the mode and the transport.
        assert ops["accumulate"] + ops["put"] >= 1
        latency = {
            s.labels.get("le"): s.value
            for s in families["osmm_rma_latency_seconds"].samples
            if s.name.endswith("_bucket")
        }
        assert latency["+Inf"] >= 1
    steps = [s for s in families["osmm_step_seconds"].samples if s.name.endswith("_count")]
    assert steps[0].value >= 1

    path = str(tmp_path_factory.mktemp(f"metrics{RANK}") / "osmm_{rank}.prom")
    written = metrics.write_metrics(path)
    assert written.endswith(f"osmm_{RANK}.prom")
    with open(written) as f:
        assert set(NAMES) <= set(_parse(f.read()))
