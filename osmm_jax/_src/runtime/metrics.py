"""Per-rank Prometheus metrics, opt-in.

Turn them on with ``OSMM_METRICS_PORT=<base>`` (each rank serves HTTP on
``base + rank``, at ``/metrics``) and/or ``OSMM_METRICS_TEXTFILE=<path>`` (each
rank writes the text exposition format there at exit; ``{rank}`` in the path is
replaced by the rank), or call :func:`start_metrics` / :func:`write_metrics`.
They start with the first :func:`osmm_jax.plan`.

``OSMM_METRICS_ADDR`` is the address the HTTP server listens on: ``127.0.0.1``
by default (only processes on the same host can scrape it), ``0.0.0.0`` (or
``::``) for every interface so that a Prometheus server on another host can
scrape each rank, or one interface's address or host name. Anyone who can reach
that port can read the metrics; there is no authentication. A value that is
not an IPv4 or IPv6 address or a host name is a ``ValueError`` naming the
variable, raised before any server starts; an address this host cannot listen on
(another host's, a name that does not resolve, a port in use) is the ``OSError``
of starting the server, raised by every :func:`osmm_jax.plan` until it starts.

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
import ipaddress
import math
import os
import re
import threading

PORT = "OSMM_METRICS_PORT"
TEXTFILE = "OSMM_METRICS_TEXTFILE"
ADDR = "OSMM_METRICS_ADDR"

DEFAULT_ADDR = "127.0.0.1"
"""Loopback: without ``OSMM_METRICS_ADDR`` the metrics are readable from this host only."""

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

STEP_BUCKETS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
"""Upper bounds (seconds) of the step-time histogram's buckets (+Inf is implied)."""

_lock = threading.Lock()
_counts = {"matmul_calls": 0, "rebalances": 0, "fallbacks": 0, "checksum_failures": 0}
_steps = {"buckets": [0] * (len(STEP_BUCKETS) + 1), "sum": 0.0}
_share = {"ratio": math.nan}
_state = {
    "enabled": False,
    "registry": None,
    "rank": 0,
    "size": 1,
    "port": None,
    "server": None,
    "textfile": None,
}


# -- settings ---------------------------------------------------------------------------------


def check_addr(value: str, source: str = "addr") -> str:
    """``value`` stripped, if it is an IPv4 or IPv6 address or a host name (RFC 1123).

    Raises ``ValueError`` naming ``source`` (the variable or argument it came
    from) otherwise: a URL, a port (``host:9000``), brackets or spaces.
    """
    text = str(value).strip()
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if (
        0 < len(text) <= 253
        and all(_HOST_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()  # all-numeric: a mistyped IPv4 address, not a name
    ):
        return text
    raise ValueError(
        f"{source} must be an IPv4 or IPv6 address (127.0.0.1, 0.0.0.0, ::) or a host name "
        f"to serve the metrics on, got {value!r}"
    )


def metrics_addr() -> str:
    """The address the HTTP server listens on: ``OSMM_METRICS_ADDR``, or loopback when unset."""
    value = os.environ.get(ADDR, "")
    return check_addr(value, ADDR) if value.strip() else DEFAULT_ADDR


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
    *,
    port: int | None = None,
    textfile: str | None = None,
    addr: str | None = None,
    rank=None,
    world_size=None,
) -> None:
    """Enable metrics; serve them on ``addr:(port + rank)`` and/or write them to ``textfile``
    at exit.

    ``addr`` defaults to ``OSMM_METRICS_ADDR``, else ``127.0.0.1``; ``rank``/``world_size``
    default to COMM_WORLD's. Idempotent for the same settings.
    """
    addr = metrics_addr() if addr is None else check_addr(addr)
    if rank is None or world_size is None:
        from mpi4py import MPI

        rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with _lock:
        _state.update(rank=int(rank), size=int(world_size))
    registry = _registry()
    if port is not None and _state["port"] is None:
        from prometheus_client import start_http_server

        # OSError (address in use, not this host's, a name that does not resolve) leaves
        # metrics off, so the next plan raises it again rather than run without them.
        started = start_http_server(int(port) + int(rank), addr=addr, registry=registry)
        server = started[0] if isinstance(started, tuple) else None  # older versions: None
        bound = server.server_port if server is not None else int(port) + int(rank)
        _state.update(port=bound, server=server)
    with _lock:
        _state["enabled"] = True
    if textfile is not None and _state["textfile"] is None:
        _state["textfile"] = textfile
        atexit.register(write_metrics)


def start_from_environment() -> None:
    """Start metrics if ``OSMM_METRICS_PORT`` or ``OSMM_METRICS_TEXTFILE`` is set (once).

    Every setting is checked first (``OSMM_METRICS_ADDR`` too), so a bad one raises
    before any server starts.
    """
    if _state["enabled"]:
        return
    port, textfile = os.environ.get(PORT), os.environ.get(TEXTFILE)
    if not port and not textfile:
        return
    if port and not port.strip().isdigit():
        raise ValueError(f"{PORT} must be a port number, got {port!r}")
    addr = metrics_addr()
    start_metrics(port=int(port) if port else None, textfile=textfile or None, addr=addr)


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
