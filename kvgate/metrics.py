"""kvgate's Prometheus page: its own `kvgate_` families, and the vLLM gauges a router reads.

Each server gets its own registry so several kvgate apps (tests, benchmarks) can live in one
process without colliding. The gate's decisions and releases arrive as events (GateMetrics is one
of the gate's observers); its queue, ledger and budget are read only when /metrics is scraped.

A router (llm-d's endpoint picker) and an autoscaler scrape the pool's target port, kvgate's, for
vLLM's gauges: PoolGauges gives them one series each, vLLM's figures from the last scrape with
kvgate's queue and reservations added (docs/metrics.md says what each means), and MetricsPage
serves them beside kvgate's families, which it renders at most once per --metrics-cache-seconds
(a router scrapes every 50 ms; kvgate's families are most of a scrape's cost: bench/results/poll-cost).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvgate.gate.gate import Gate
from kvgate.gate.observer import Decision, Release
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.telemetry.vllm import BackendSnapshot

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 38, 2))


class LoopCounter(Collector):
    """A labelled counter kept in a plain dict, for what is counted on every request.

    Why not prometheus_client's Counter: each of its increments takes a lock (values.py
    MutexValue.inc), a few microseconds a request over kvgate's per-request counts. These are
    counted and read (when /metrics is scraped) on the event loop's thread alone, so they need
    none; the page is the one the Counter writes (`_total` and `_created` per label set)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._counts: dict[tuple[str, ...], list[float]] = {}  # label values -> [count, created]
        registry.register(self)

    def inc(self, *labels: str) -> None:
        entry = self._counts.get(labels)
        if entry is None:
            self._counts[labels] = [1.0, time.time()]
        else:
            entry[0] += 1

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, (count, created) in self._counts.items():
            family.add_metric(labels, count, created=created)
        yield family


class LoopHistogram(Collector):
    """A histogram without labels kept in plain numbers, for what is observed on every request:
    prometheus_client's Histogram takes two locks an observation (its sum's and its bucket's).
    Observed and read on the event loop's thread alone, as LoopCounter; the same page as the
    Histogram's (cumulative `_bucket`s, `_count`, `_sum`, `_created`)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = (*map(float, buckets), math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        """Count `value` in the first bucket whose upper bound is at least it (Prometheus' `le`)."""
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        family.add_metric([], buckets, self._sum)
        family.samples.append(Sample(self.name + "_created", {}, self._created))
        yield family


class KvgateMetrics:
    """All of kvgate's metric objects, on one registry. What changes on every request is a
    LoopCounter or LoopHistogram; the rest prometheus_client's own metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = LoopCounter(
            "kvgate_decisions",
            "Admission decisions by outcome and reason.",
            ["decision", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth", "Requests waiting for admission (or for the backend, to be evaluated).", registry=r
        )
        self.queue_wait = LoopHistogram(
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
        self.predicted_transient = LoopHistogram(
            "kvgate_predicted_transient_peak_bytes",
            "Predicted transient peak per request (all terms).",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.predicted_kv_blocks = LoopHistogram(
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
            "Transient bytes kvgate may reserve now (after the co-tenants' reserve and the margin).",
            registry=r,
        )
        self.tokenization = LoopHistogram(
            "kvgate_tokenization_seconds",
            "Time to tokenize a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.added_latency = LoopHistogram(
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
        self.releases = LoopCounter(
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

    def decided(self, decision: Decision) -> None:
        if decision.kind == "abandon":
            self.metrics.disconnects.labels(decision.stage).inc()
            return
        self.metrics.decisions.inc(decision.kind, decision.reason)
        if decision.kind == "admit":
            self.metrics.queue_wait.observe(decision.queue_wait_s)

    def released(self, release: Release) -> None:
        self.metrics.releases.inc(release.outcome)

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


class PoolGauges(Collector):
    """vLLM's gauges as a router and an autoscaler should see them behind kvgate, read when
    scraped: one series each, labelled with the served model's name (vLLM 0.32.0
    vllm/v1/metrics/loggers.py PrometheusStatLogger labels them model_name and engine, one series
    per data-parallel engine; llm-d's endpoint picker reads only the first series of a family
    with no timestamps, so a pod's total must be one series, and it has no `engine`).

    - vllm:num_requests_waiting: vLLM's waiting (all engines, last scrape) + kvgate's queue.
    - vllm:num_requests_running: vLLM's running (all engines, last scrape); 0 while it is down.
    - vllm:kv_cache_usage_perc: the larger of vLLM's usage and kvgate's reserved blocks over the
      pool, at most 1; 1 while kvgate would refuse or hold new work (not ready, backend down or
      hung, queue full).
    - vllm:cache_config_info: engine 0's series, as vLLM wrote it.
    - vllm:lora_requests_info: the newest series (only when vLLM serves it, with --enable-lora).
    """

    def __init__(
        self,
        gate: Gate,
        ready: Callable[[], bool],
        snapshot: Callable[[], BackendSnapshot | None],
        model_name: Callable[[], str | None],
    ) -> None:
        self.gate = gate
        self.ready = ready
        self.snapshot = snapshot
        self.model_name = model_name

    def saturated(self) -> bool:
        """kvgate would not take new work now: it refuses it (queue full) or holds it (not ready,
        backend down or hung)."""
        queue = self.gate.queue
        return not self.ready() or self.gate.budget.hold is not None or 0 < queue.max_size <= len(queue)

    def kv_usage(self, snapshot: BackendSnapshot | None) -> float:
        if self.saturated():
            return 1.0
        vllm_usage = snapshot.kv_usage if snapshot is not None and snapshot.kv_usage is not None else 0.0
        pool = self.gate.budget.kv_blocks
        reserved = self.gate.ledger.kv_blocks / pool if pool else 0.0
        return min(1.0, max(vllm_usage, reserved))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snapshot = self.snapshot()
        name = self.model_name() or (snapshot.model_name if snapshot else None) or ""
        up = snapshot is not None and self.gate.budget.backend.up
        vllm_waiting = (snapshot.waiting or 0.0) if up and snapshot else 0.0
        vllm_running = (snapshot.running or 0.0) if up and snapshot else 0.0
        for family, help_text, value in (
            (
                "vllm:num_requests_waiting",
                "Requests waiting: vLLM's (all engines, kvgate's last scrape) plus kvgate's admission queue.",
                vllm_waiting + self.gate.waiting,
            ),
            (
                "vllm:num_requests_running",
                "Requests in vLLM's execution batches (all engines, kvgate's last scrape; 0 while it is down).",
                vllm_running,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage, 1 means 100 percent: the larger of vLLM's and kvgate's reservations over "
                "the pool; 1 while kvgate would refuse or hold new work.",
                self.kv_usage(snapshot),
            ),
        ):
            gauge = GaugeMetricFamily(family, help_text, labels=["model_name"])
            gauge.add_metric([name], value)
            yield gauge
        if snapshot is not None and snapshot.cache_config_labels is not None:
            labels = snapshot.cache_config_labels
            info = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
            )
            info.add_metric(list(labels.values()), 1.0)
            yield info
        if snapshot is not None and snapshot.lora_series is not None:
            set_at, labels = snapshot.lora_series
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=list(labels))
            lora.add_metric(list(labels.values()), set_at)
            yield lora


class MetricsPage:
    """The /metrics page: the router's gauges rendered on every scrape (fresh and cheap), kvgate's
    own families rendered at most once per `cache_s` (0: every scrape)."""

    def __init__(
        self, pool: PoolGauges, own: CollectorRegistry, cache_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool = CollectorRegistry(auto_describe=False)
        self.pool.register(pool)
        self.own = own
        self.cache_s = cache_s
        self.clock = clock
        self._own_page = b""
        self._rendered_at = -float("inf")

    def own_families(self) -> bytes:
        """kvgate's `kvgate_` families, from the cache while it is younger than cache_s."""
        now = self.clock()
        if now - self._rendered_at >= self.cache_s:
            self._own_page, self._rendered_at = generate_latest(self.own), now
        return self._own_page

    def render(self) -> bytes:
        return generate_latest(self.pool) + self.own_families()
