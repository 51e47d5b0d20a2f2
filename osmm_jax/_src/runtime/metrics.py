"""Per-rank Prometheus metrics, opt-in.

Turn them on with ``OSMM_METRICS_PORT=<base>`` (each rank serves HTTP on
``base + rank``, at ``/metrics``) and/or ``OSMM_METRICS_TEXTFILE=<path>`` (each
rank writes the text exposition format there at exit; ``{rank}`` in the path is
replaced by the rank), or call :func:`start_metrics` / :func:`write_metrics`.
They start with the first :func:`osmm_jax.plan`.

Every metric carries the labels ``rank`` and ``world_size`` (and ``op`` for RMA
operations):

=================================  =========  ==============================================
name                               type       meaning
=================================  =========  ==============================================
``osmm_matmul_calls_total``        counter    products executed (counted only while enabled)
``osmm_rma_ops_total{op}``         counter    RMA operations issued: accumulate, put, get
``osmm_sent_bytes_total``          counter    bytes this rank pushed by accumulate and put
``osmm_rma_latency_seconds``       histogram  one-sided epochs, opening to closing fence
``osmm_step_seconds``              histogram  step times fed to MethodSelector / Rebalancer
``osmm_rank_share_ratio``          gauge      this rank's share of the split rows (NaN: unknown)
``osmm_rebalances_total``          counter    rebalancing decisions
``osmm_fallbacks_total``           counter    switches from one_sided to allreduce
``osmm_checksum_failures_total``   counter    products whose checksum verification failed
=================================  =========  ==============================================

Native counters are lock-free atomics read only when a scrape or write happens;
Python-side counters are plain integers behind a lock. Nothing on the
product's path waits for a scrape or for I/O.
"""

from __future__ import annotations

import atexit
import math
import os
import threading

PORT = "OSMM_METRICS_PORT"
TEXTFILE = "OSMM_METRICS_TEXTFILE"

STEP_BUCKETS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
"""Upper bounds (seconds) of the step-time histogram's buckets (+Inf is implied)."""

_lock = threading.Lock()
_counts = {"matmul_calls": 0, "rebalances": 0, "fallbacks": 0, "checksum_failures": 0}
_steps = {"buckets": [0] * (len(STEP_BUCKETS) + 1), "sum": 0.0}
_share = {"ratio": math.nan}
_state = {"enabled": False, "registry": None, "rank": 0, "size": 1, "port": None, "textfile": None}


# -- recording (cheap, never blocks on I/O) ------------------------------------------------


def increment(name: str, amount: int = 1) -> None:
    """Add to one of the Python-side counters (``rebalances``, ``fallbacks``, ...)."""
    with _lock:
        _counts[name] += amount


def observe_step(seconds: float) -> None:
    """Record one step time in the step histogram."""
    index = next((i for i, bound in enumerate(STEP_BUCKETS) if seconds <= bound), len(STEP_BUCKETS))
    with _lock:
        _steps["buckets"][index] += 1
        _steps["sum"] += float(seconds)


def set_share(ratio: float) -> None:
    """Set this rank's share of the rows it splits with the others (0..1)."""
    with _lock:
        _share["ratio"] = float(ratio)


def enabled() -> bool:
    """Whether metrics are being collected (decides, at trace time, whether products count)."""
    return _state["enabled"]


def count_product() -> None:
    """Host callback run once per executed product while metrics are enabled."""
    increment("matmul_calls")


# -- exposition -------------------------------------------------------------------------------


_EVENT_COUNTERS = (
    ("osmm_rebalances", "Rebalancing decisions.", "rebalances"),
    ("osmm_fallbacks", "Switches from one_sided to allreduce.", "fallbacks"),
    ("osmm_checksum_failures", "Products that failed checksum verification.", "checksum_failures"),
)
"""The Python-side event counters after the step histogram and share: (name, help, key in ``_counts``)."""


def _families():
    """Every metric family of this rank, in exposition order, read when the scrape asks.

    The native RMA counters are read first, then the Python-side ones in one
    snapshot under the lock; the RMA latency histogram is read when reached.
    """
    from osmm_jax._src.runtime import native

    labels = ["rank", "world_size"]
    values = [str(_state["rank"]), str(_state["size"])]
    stats = native.stats()
    counts, step_buckets, step_sum, share = _snapshot()
    doc = "Products executed while metrics were enabled."
    yield _counter("osmm_matmul_calls", doc, counts["matmul_calls"], labels, values)
    yield from _rma_families(stats, native.latency_histogram, labels, values)
    yield from _python_families(counts, step_buckets, step_sum, share, labels, values)


def _snapshot():
    """The Python-side state, copied under the lock: one scrape sees one consistent state.

    Returns ``(counters by name, step-histogram count per bucket, sum of step
    seconds, this rank's share of the rows as a ratio)``.
    """
    with _lock:
        return dict(_counts), list(_steps["buckets"]), _steps["sum"], _share["ratio"]


def _counter(name, doc, value, labels, values):
    """A counter family ``name`` (``_total`` is added on exposition) with one sample."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


def _rma_families(stats, latency_histogram, labels, values):
    """The native RMA families: operations by ``op``, bytes sent, epoch latency (seconds).

    ``stats`` is ``native.stats()``; ``latency_histogram()`` returns ``(bucket
    upper bounds in seconds, count per bucket, sum of seconds)``.
    """
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    ops = CounterMetricFamily(
        "osmm_rma_ops", "RMA operations issued by this rank.", labels=[*labels, "op"]
    )
    for op, key in (("accumulate", "accumulates"), ("put", "puts"), ("get", "gets")):
        ops.add_metric([*values, op], stats[key])
    yield ops
    yield _counter(
        "osmm_sent_bytes",
        "Bytes this rank pushed by MPI_Accumulate and MPI_Put.",
        stats["sent_bytes"],
        labels,
        values,
    )
    bounds, counts, seconds = latency_histogram()
    doc = "One-sided RMA epochs, opening to closing fence."
    yield _histogram(
        HistogramMetricFamily,
        "osmm_rma_latency_seconds",
        doc,
        labels,
        values,
        bounds,
        counts,
        seconds,
    )


def _python_families(counts, step_buckets, step_sum, share, labels, values):
    """The Python-side families, from a :func:`_snapshot`.

    Step times (seconds), this rank's share of the rows (a ratio), then the
    counters of rebalances, fallbacks and checksum failures.
    """
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    doc = "Step times observed by MethodSelector and Rebalancer."
    yield _histogram(
        HistogramMetricFamily,
        "osmm_step_seconds",
        doc,
        labels,
        values,
        STEP_BUCKETS,
        step_buckets,
        step_sum,
    )
    gauge = GaugeMetricFamily(
        "osmm_rank_share_ratio", "This rank's share of the split rows.", labels=labels
    )
    gauge.add_metric(values, share)
    yield gauge
    for name, doc, key in _EVENT_COUNTERS:
        yield _counter(name, doc, counts[key], labels, values)


def _histogram(family_type, name, doc, labels, values, bounds, counts, total):
    cumulative, running = [], 0
    for bound, count in zip([*map(float, bounds), math.inf], counts):
        running += count
        cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), running))
    family = family_type(name, doc, labels=labels)
    family.add_metric(values, cumulative, total)
    return family


class _Collector:
    def collect(self):
        yield from _families()


def _registry():
    from prometheus_client import CollectorRegistry

    if _state["registry"] is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())
        _state["registry"] = registry
    return _state["registry"]


def start_metrics(
    *, port: int | None = None, textfile: str | None = None, rank=None, world_size=None
) -> None:
    """Enable metrics; serve them on ``port + rank`` and/or write them to ``textfile`` at exit.

    ``rank``/``world_size`` default to COMM_WORLD's. Idempotent for the same settings.
    """
    if rank is None or world_size is None:
        from mpi4py import MPI

        rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with _lock:
        _state.update(enabled=True, rank=int(rank), size=int(world_size))
    registry = _registry()
    if port is not None and _state["port"] is None:
        from prometheus_client import start_http_server

        start_http_server(int(port) + int(rank), addr="127.0.0.1", registry=registry)
        _state["port"] = int(port) + int(rank)
    if textfile is not None and _state["textfile"] is None:
        _state["textfile"] = textfile
        atexit.register(write_metrics)


def start_from_environment() -> None:
    """Start metrics if ``OSMM_METRICS_PORT`` or ``OSMM_METRICS_TEXTFILE`` is set (once)."""
    if _state["enabled"]:
        return
    port, textfile = os.environ.get(PORT), os.environ.get(TEXTFILE)
    if not port and not textfile:
        return
    if port and not port.strip().isdigit():
        raise ValueError(f"{PORT} must be a port number, got {port!r}")
    start_metrics(port=int(port) if port else None, textfile=textfile or None)


def write_metrics(path: str | None = None) -> str:
    """Write this rank's metrics in the text format to ``path`` (default: the configured
    textfile); ``{rank}`` in the path becomes the rank. Returns the path written."""
    from prometheus_client import write_to_textfile

    path = path or _state["textfile"]
    if path is None:
        raise ValueError(f"no path given and {TEXTFILE} is not set")
    path = path.replace("{rank}", str(_state["rank"]))
    write_to_textfile(path, _registry())
    return path
