"""kvgate's own Prometheus metrics: `kvgate_` prefix, base units, low-cardinality labels.

Each server gets its own registry so several kvgate apps (tests, benchmarks) can live in one
process without colliding. The gate's decisions and releases arrive as events (GateMetrics is one
of the gate's observers); its queue, ledger and budget are read only when /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvgate.gate.gate import Gate
from kvgate.gate.observer import Decision, Release
from kvgate.telemetry.metrics import TelemetryMetrics

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 38, 2))


class KvgateMetrics:
    """All of kvgate's metric objects, on one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvgate_decisions",
            "Admission decisions by outcome and reason.",
            ["decision", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth", "Requests waiting for admission (or for the backend, to be evaluated).", registry=r
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time admitted requests waited in the queue.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("kvgate_in_flight_requests", "Admitted requests not yet finished.", registry=r)
        self.reserved_kv_blocks = Gauge(
            "kvgate_reserved_kv_blocks",
            "KV blocks reserved by in-flight requests (shared prefixes once).",
            registry=r,
        )
        self.reserved_transient = Gauge(
            "kvgate_reserved_transient_bytes",
            "Transient memory in-flight requests hold of the transient budget (profiled terms too when it comes from GPU readings).",
            registry=r,
        )
        self.predicted_transient = Histogram(
            "kvgate_predicted_transient_peak_bytes",
            "Predicted transient peak per request (all terms).",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.predicted_kv_blocks = Histogram(
            "kvgate_predicted_kv_blocks",
            "Predicted KV blocks per request at full growth.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.budget_kv_blocks = Gauge(
            "kvgate_budget_kv_blocks",
            "KV blocks kvgate may reserve (pool x overcommit).",
            registry=r,
        )
        self.budget_transient = Gauge(
            "kvgate_budget_transient_bytes",
            "Transient bytes kvgate may reserve now (after the margin).",
            registry=r,
        )
        self.tokenization = Histogram(
            "kvgate_tokenization_seconds",
            "Time to tokenize a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.added_latency = Histogram(
            "kvgate_added_latency_seconds",
            "Time kvgate spends on a request before forwarding it, queue wait excluded.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors",
            "Failures talking to the backend.",
            ["kind"],
            registry=r,
        )
        self.disconnects = Counter(
            "kvgate_client_disconnects",
            "Clients that went away, by where they were (request_body, queued, awaiting_response, "
            "response_body); the last two are the reservations released as disconnected.",
            ["stage"],
            registry=r,
        )
        self.releases = Counter(
            "kvgate_reservations_released",
            "Reservations released, by how the request ended.",
            ["outcome"],
            registry=r,
        )
        self.telemetry = TelemetryMetrics(r)


class GateMetrics:
    """The gate's observer that counts: decisions by kind and reason, releases by outcome, queue
    waits, clients that left; and the gauges that read the gate when /metrics is scraped."""

    def __init__(self, metrics: KvgateMetrics) -> None:
        self.metrics = metrics
        # Bound label children, one per (kind, reason) and outcome: labels() is a locked lookup.
        self._decisions: dict[tuple[str, str], Counter] = {}
        self._releases: dict[str, Counter] = {}

    def decided(self, decision: Decision) -> None:
        if decision.kind == "abandon":
            self.metrics.disconnects.labels(decision.stage).inc()
            return
        key = (decision.kind, decision.reason)
        counter = self._decisions.get(key)
        if counter is None:
            counter = self._decisions[key] = self.metrics.decisions.labels(*key)
        counter.inc()
        if decision.kind == "admit":
            self.metrics.queue_wait.observe(decision.queue_wait_s)

    def released(self, release: Release) -> None:
        counter = self._releases.get(release.outcome)
        if counter is None:
            counter = self._releases[release.outcome] = self.metrics.releases.labels(release.outcome)
        counter.inc()

    def watch(self, gate: Gate) -> None:
        """The gauges of the queue, the ledger and the budget read them when /metrics is
        scraped: written on every admission and release they cost ten gauge writes a request."""
        m, ledger, budget = self.metrics, gate.ledger, gate.budget
        m.queue_depth.set_function(lambda: gate.waiting)
        m.in_flight.set_function(lambda: ledger.in_flight)
        m.reserved_kv_blocks.set_function(lambda: ledger.kv_blocks)
        m.reserved_transient.set_function(lambda: budget.transient_charge(ledger))
        m.budget_kv_blocks.set_function(_last_known(budget.kv_limit))
        m.budget_transient.set_function(_last_known(budget.transient_limit))


def _last_known(read: Callable[[], int | None]) -> Callable[[], float]:
    """`read()` when it is known, else the last value it had (0 before the first)."""
    last = 0.0

    def value() -> float:
        nonlocal last
        current = read()
        if current is not None:
            last = current
        return last

    return value
