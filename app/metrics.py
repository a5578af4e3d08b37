"""kvgate's own Prometheus metrics: `kvgate_` prefix, base units, low-cardinality labels.

Each server gets its own registry so several kvgate apps (tests, benchmarks) can live in one
process without colliding.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.telemetry.metrics import TelemetryMetrics

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 38, 2))


class KvgateMetrics:
    """All of kvgate's metric objects, on one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvgate_decisions", "Admission decisions by outcome and reason.",
            ["decision", "reason"], registry=r,
        )
        self.queue_depth = Gauge("kvgate_queue_depth", "Requests waiting for admission.", registry=r)
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds", "Time admitted requests waited in the queue.",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.in_flight = Gauge("kvgate_in_flight_requests", "Admitted requests not yet finished.", registry=r)
        self.reserved_kv_blocks = Gauge(
            "kvgate_reserved_kv_blocks", "KV blocks reserved by in-flight requests (shared prefixes once).",
            registry=r,
        )
        self.reserved_transient = Gauge(
            "kvgate_reserved_transient_bytes",
            "Transient memory in-flight requests hold of the transient budget (profiled terms too when it comes from GPU readings).",
            registry=r,
        )
        self.predicted_transient = Histogram(
            "kvgate_predicted_transient_peak_bytes", "Predicted transient peak per request (all terms).",
            buckets=_BYTES_BUCKETS, registry=r,
        )
        self.predicted_kv_blocks = Histogram(
            "kvgate_predicted_kv_blocks", "Predicted KV blocks per request at full growth.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536), registry=r,
        )
        self.budget_kv_blocks = Gauge(
            "kvgate_budget_kv_blocks", "KV blocks kvgate may reserve (pool x overcommit).", registry=r,
        )
        self.budget_transient = Gauge(
            "kvgate_budget_transient_bytes", "Transient bytes kvgate may reserve now (after the margin).",
            registry=r,
        )
        self.tokenization = Histogram(
            "kvgate_tokenization_seconds", "Time to tokenize a request.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.added_latency = Histogram(
            "kvgate_added_latency_seconds",
            "Time kvgate spends on a request before forwarding it, queue wait excluded.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Failures talking to the backend.", ["kind"], registry=r,
        )
        self.disconnects = Counter(
            "kvgate_client_disconnects", "Clients that went away, by where they were.", ["stage"],
            registry=r,
        )
        self.releases = Counter(
            "kvgate_reservations_released", "Reservations released, by how the request ended.",
            ["outcome"], registry=r,
        )
        self.telemetry = TelemetryMetrics(r)
