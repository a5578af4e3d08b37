"""An endpoint picker that scores and admits as llm-d's EPP does, for the fleet benchmark.

Read from llm-d/llm-d-router at commit ebab687927f5 (v0.10.0-rc.1-62, 2026-08-22); every rule
names its file there:

- Scraping: each endpoint's /metrics every 50 ms (pkg/epp/server/options.go,
  MinRefreshMetricsInterval, the default refresh interval), 1 s timeout; the gauges of the Model
  Server Protocol for vLLM, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
  (docs/plugin-metric-protocol.md). A failed scrape leaves the last values, which grow stale.
- Pool membership: an InferencePool holds the Ready pods its selector matches, so an endpoint is
  in the pool while its readiness probe answers 200 (vLLM's /health, or kvgate's /readyz), probed
  every second with one failure taking it out: faster than the manifests' probes (5 s x 2), which
  favours the arms without kvgate when an engine dies.
- Scoring: the default scheduling profile of the chart (config/charts/routerlib/templates/
  _config.yaml): queue-scorer weight 2 (pkg/epp/framework/plugins/scheduling/scorer/queuedepth/
  queue.go: (max - waiting) / (max - min), 1.0 when all are equal) and kv-cache-utilization-scorer
  weight 2 (scorer/kvcacheutilization/kvcache_utilization.go: 1 - usage); max-score picker with a
  random tie break (picker/maxscore/picker.go). The profile's prefix-cache-scorer is left out: the
  benchmark's traffic shares no prefixes.
- Without flow control: LegacyAdmissionController (pkg/epp/requestcontrol/admission.go) drops only
  sheddable requests (priority < 0) when saturated; these requests have priority 0: all go.
- With flow control: FlowControlAdmissionController (same file) queues in the EPP; the dispatch
  cycle (pkg/epp/flowcontrol/controller/internal/processor.go) dispatches while the pool's
  saturation is below the usage limit (1.0, the static policy's default, plugins/flowcontrol/
  usagelimits/usagelimitpolicy.go). Saturation is the utilization detector's
  (plugins/flowcontrol/saturationdetector/utilization/detector.go, config.go defaults: queue 5,
  KV 0.8, staleness 200 ms, headroom 0): the mean over endpoints of max(waiting / 5, kv / 0.8), a
  stale endpoint counting 1.0; the detector, enabled by default with flow control (its README),
  also filters out endpoints at or over those limits (all of them back if none is left). A request
  queued past the TTL (60 s, flowcontrol/controller/config.go defaultRequestTTL) is answered 429
  with `x-llm-d-request-dropped-reason: rejected-ttl-expired` (admission.go,
  translateFlowControlOutcome).

Times: the simulated engines run `speedup` times faster than the wall clock, so every interval
above is divided by it: the router sees an engine as often, in simulated time, as the EPP would.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx

# The EPP's defaults (files in the module docstring), in seconds of the engines' time.
SCRAPE_INTERVAL_S = 0.05
SCRAPE_TIMEOUT_S = 1.0
STALENESS_S = 0.2
QUEUE_THRESHOLD = 5
KV_THRESHOLD = 0.8
USAGE_LIMIT = 1.0
REQUEST_TTL_S = 60.0
READINESS_PERIOD_S = 1.0  # Kubernetes' shortest probe period
QUEUE_SCORER_WEIGHT = 2.0
KV_SCORER_WEIGHT = 2.0

TTL_EXPIRED = "rejected-ttl-expired"
NO_ENDPOINTS = "rejected-no-endpoints"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf|-Inf)$", re.M)


def gauges(page: str) -> dict[str, float]:
    """Every sample's value by metric name; a family with several series (vLLM labels each engine
    of a data-parallel server) adds up, which is what the EPP's totals mean."""
    out: dict[str, float] = {}
    for m in _SAMPLE.finditer(page):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class Endpoint:
    """One pool member as the router sees it: where requests go and what its last scrape said."""

    url: str
    waiting: float = 0.0
    kv_usage: float = 0.0
    updated_at: float | None = None  # monotonic wall time of the last good scrape
    in_pool: bool = False  # its readiness probe's last answer was 200
    scrapes: int = 0
    failed_scrapes: int = 0


Scrape = Callable[[httpx.AsyncClient, Endpoint], Awaitable[tuple[float, float]]]
Probe = Callable[[httpx.AsyncClient, Endpoint], Awaitable[bool]]


async def scrape_vllm_gauges(client: httpx.AsyncClient, endpoint: Endpoint) -> tuple[float, float]:
    """(waiting, KV usage) from the endpoint's own /metrics, as the EPP reads them."""
    r = await client.get(endpoint.url + "/metrics")
    r.raise_for_status()
    values = gauges(r.text)
    return values["vllm:num_requests_waiting"], values["vllm:kv_cache_usage_perc"]


def readiness(path: str) -> Probe:
    """A readiness probe on `path`: ready while it answers 200."""

    async def probe(client: httpx.AsyncClient, endpoint: Endpoint) -> bool:
        return (await client.get(endpoint.url + path)).status_code == 200

    return probe


class Router:
    """Picks an endpoint per request, and with flow control holds requests while the pool is saturated."""

    def __init__(
        self,
        urls: list[str],
        speedup: float,
        *,
        flow_control: bool,
        seed: int = 0,
        ready: Probe,
        scrape: Scrape = scrape_vllm_gauges,
    ) -> None:
        self.endpoints = [Endpoint(u) for u in urls]
        self.speedup = speedup
        self.flow_control = flow_control
        self.rng = random.Random(seed)
        self._scrape = scrape
        self._ready = ready
        self._queue: deque[tuple[float, asyncio.Future[Endpoint | None]]] = deque()
        self._wake = asyncio.Event()
        self._pool_full = asyncio.Event()
        self._stopped = False
        self.dispatched_by_endpoint = [0] * len(urls)
        self.max_queue = 0

    def wall(self, sim_s: float) -> float:
        return sim_s / self.speedup

    # ----- scraping -----------------------------------------------------------------------------
    async def scrape_forever(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        while not self._stopped:
            endpoint.scrapes += 1
            try:
                endpoint.waiting, endpoint.kv_usage = await self._scrape(client, endpoint)
                endpoint.updated_at = time.monotonic()
                self._note_pool()
            except (httpx.HTTPError, KeyError):
                endpoint.failed_scrapes += 1
            self._wake.set()
            await asyncio.sleep(self.wall(SCRAPE_INTERVAL_S))

    async def probe_forever(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        while not self._stopped:
            try:
                endpoint.in_pool = await self._ready(client, endpoint)
            except httpx.HTTPError:
                endpoint.in_pool = False
            self._note_pool()
            self._wake.set()
            await asyncio.sleep(self.wall(READINESS_PERIOD_S))

    def _note_pool(self) -> None:
        if all(e.in_pool and e.updated_at is not None for e in self.endpoints):
            self._pool_full.set()

    async def pool_full(self, timeout_s: float = 60.0) -> None:
        """Returns once every endpoint is ready and scraped (traffic starts on a full pool)."""
        try:
            await asyncio.wait_for(self._pool_full.wait(), timeout_s)
        except TimeoutError:
            raise RuntimeError(f"the pool is not ready after {timeout_s} s: {self.endpoints}") from None

    def fresh(self, endpoint: Endpoint) -> bool:
        return endpoint.updated_at is not None and time.monotonic() - endpoint.updated_at <= self.wall(STALENESS_S)

    # ----- the detector, the scorers, the picker ------------------------------------------------
    def pool(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.in_pool]

    def saturation(self, candidates: list[Endpoint]) -> float:
        if not candidates:
            return 1.0
        total = 0.0
        for e in candidates:
            total += max(e.waiting / QUEUE_THRESHOLD, e.kv_usage / KV_THRESHOLD) if self.fresh(e) else 1.0
        return total / len(candidates)

    def detector_filter(self, candidates: list[Endpoint]) -> list[Endpoint]:
        kept = [e for e in candidates if self.fresh(e) and e.waiting < QUEUE_THRESHOLD and e.kv_usage < KV_THRESHOLD]
        return kept or candidates

    def pick(self, candidates: list[Endpoint]) -> Endpoint:
        low = min(e.waiting for e in candidates)
        high = max(e.waiting for e in candidates)

        def score(e: Endpoint) -> float:
            queue = 1.0 if high == low else (high - e.waiting) / (high - low)
            return QUEUE_SCORER_WEIGHT * queue + KV_SCORER_WEIGHT * (1.0 - e.kv_usage)

        shuffled = list(candidates)
        self.rng.shuffle(shuffled)
        return max(shuffled, key=score)

    def _schedule(self) -> Endpoint | None:
        candidates = self.pool()
        if not candidates:
            return None
        if self.flow_control:
            candidates = self.detector_filter(candidates)
        chosen = self.pick(candidates)
        self.dispatched_by_endpoint[self.endpoints.index(chosen)] += 1
        return chosen

    # ----- admission ----------------------------------------------------------------------------
    async def admit(self) -> Endpoint | str:
        """The endpoint to send to, or the dropped reason the client gets with its 429 or 503."""
        if not self.flow_control:
            return self._schedule() or NO_ENDPOINTS
        ticket: asyncio.Future[Endpoint | None] = asyncio.get_running_loop().create_future()
        self._queue.append((time.monotonic(), ticket))
        self.max_queue = max(self.max_queue, len(self._queue))
        self._wake.set()
        chosen = await ticket
        return chosen if chosen is not None else TTL_EXPIRED

    async def dispatch_forever(self) -> None:
        """The flow controller's dispatch cycle: FIFO, while the pool is below its usage limit;
        it runs again whenever a scrape or an arrival may have changed the answer."""
        while not self._stopped:
            await self._wake.wait()
            self._wake.clear()
            ttl = self.wall(REQUEST_TTL_S)
            now = time.monotonic()
            while self._queue and now - self._queue[0][0] > ttl:
                self._queue.popleft()[1].set_result(None)
            while self._queue and self.saturation(self.pool()) < USAGE_LIMIT:
                chosen = self._schedule()
                if chosen is None:
                    break
                self._queue.popleft()[1].set_result(chosen)

    async def expire_forever(self) -> None:
        """Wakes the dispatch cycle every simulated second so expired requests leave on time."""
        while not self._stopped:
            await asyncio.sleep(self.wall(1.0))
            self._wake.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Router]:
        """Scrapes (and with flow control dispatches) until the block ends. Timeouts are the HTTP
        client's, not asyncio.wait_for: on Python 3.11 a wait_for that completes as it is
        cancelled swallows the cancellation, and a scrape loop went on forever."""
        timeout = httpx.Timeout(self.wall(SCRAPE_TIMEOUT_S))
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
            tasks = [asyncio.create_task(self.scrape_forever(client, e)) for e in self.endpoints]
            tasks += [asyncio.create_task(self.probe_forever(client, e)) for e in self.endpoints]
            if self.flow_control:
                tasks += [asyncio.create_task(self.dispatch_forever()), asyncio.create_task(self.expire_forever())]
            try:
                yield self
            finally:
                self._stopped = True
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
