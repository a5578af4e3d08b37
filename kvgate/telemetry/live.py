"""The loop that keeps the budget true: scrape vLLM, read the GPU, reconcile, survive restarts.

Every `--scrape-interval` it reads vLLM's /metrics and the GPU probe, then sets the budget:

- live: readings fresh; KV limit = pool x calibrated overcommit, transient limit = live headroom
  x (1 - calibrated margin).
- conservative: the last good scrape (or GPU reading) is older than `--max-staleness`. kvgate does
  not stop (the backend may be fine and only /metrics slow) but spends only
  `--stale-budget-fraction` of both limits with overcommit off, so it is never blind at full speed.
- down: /metrics and /health both fail to connect or answer 5xx (or the proxy found a
  connection refused), or /metrics answers while /health answers 5xx (an engine dead behind an
  API server still up: asked after a request got a 5xx, see _engine_dead). New arrivals wait in the queue (up to their deadline); in-flight requests
  fail as their connections do and release their reservations. When /metrics answers again
  kvgate re-reads the backend's configuration before admitting anything.
- hung: the scrape of /metrics timed out (`--max-staleness`) and /health did not answer within
  HEALTH_TIMEOUT_S either: the backend accepts connections and answers nothing (SIGSTOP, a
  wedged server). New arrivals wait in the queue as when it is down, instead of piling onto it
  for the upstream timeout; they are admitted once a scrape answers again.
The status is the budget's shared view of the backend (kvgate.gate.backend_state), which /readyz
reports.

A restart is a new process start time, a counter that went backwards or a changed set of engines.
A restart that follows steps kvgate admitted (requests running when it went down) is taken as an
OOM, the transient margin backed off and the log says why, unless the backend vanished without a
word: see _on_restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from kvgate.gate.backend_state import Status
from kvgate.gate.budget import KV_BUSY, TRANSIENT_BUSY, Budget
from kvgate.gate.view import GateView
from kvgate.settings import Settings
from kvgate.telemetry.calibration import (
    Calibration,
    CalibrationConfig,
    blocks_in_use,
    growth_tolerance,
    region_held,
    region_segments,
)
from kvgate.telemetry.cotenants import CotenantSteps
from kvgate.telemetry.first_tokens import FirstTokenAccount, FirstTokenCount
from kvgate.telemetry.gpu import GpuProbe, GpuReading
from kvgate.telemetry.headroom import HeadroomTracker
from kvgate.telemetry.in_flight import InFlightRequests
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.telemetry.vllm import COUNTERS, BackendSnapshot, LoraActivity, fetch_snapshot
from kvgate.units import MiB

log = logging.getLogger("kvgate.telemetry")
HEALTH_TIMEOUT_S = 1.0  # /health is vLLM's cheapest route: a server that misses this is not answering


class LiveBudget:
    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        gate: GateView,
        in_flight: InFlightRequests,
        budget: Budget,
        metrics: TelemetryMetrics,
        probe: GpuProbe,
        resync: Callable[[], Awaitable[None]],
        block_size: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
        lora_seen: Callable[[LoraActivity], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.gate = gate
        self.in_flight = in_flight
        self.budget = budget
        self.metrics = metrics
        self.probe = probe
        self.resync = resync
        self.block_size = block_size
        self.lora_seen = lora_seen  # the adapters vLLM runs: the served names follow them
        self.clock = clock
        self.calibration = Calibration(
            CalibrationConfig(
                margin=settings.transient_safety_margin,
                max_margin=settings.max_transient_safety_margin,
                max_overcommit=settings.max_kv_overcommit,
            )
        )
        self.backend = budget.backend  # the shared view: this loop keeps it true, /readyz reads it
        self.mode = "live"
        self.problem: str | None = None
        self.static_headroom = self.budget.transient_headroom_bytes
        self.headroom = HeadroomTracker(cotenants=CotenantSteps(clock))
        self.headroom_bytes: int | None = None
        self.cotenant_reserve_bytes = 0  # of the headroom, kept for the other processes' next step
        self.profiled_cap_bytes = 0
        self.headroom_max = 0
        # The most the readings say the headroom can reach (`Headroom.reachable`), at its largest;
        # None until a life's baseline came before its first step with every process's use shown
        self.reachable_max: int | None = None
        self.held_region_bytes = 0  # the profile region's segments the engine took and kept this life
        # Whether this life's GPU baseline was read before the engine computed any prompt token:
        # only then is its growth since the baseline all of its allocator's cache (`_engine_idle`)
        self.baseline_before_steps = False
        self.gpu_total: int | None = None  # bytes of one GPU, from the last reading
        self.last_scrape = self.last_gpu = clock()
        self.snapshot: BackendSnapshot | None = None
        self.decode_rate: float | None = None
        self._engine_reported = False  # /metrics or /health answered 5xx as the backend went away
        self._needs_resync = False
        self._preempted = 0.0
        self.first_tokens = FirstTokenCount()  # closes non-streaming requests' prefills
        metrics.scrape_age.set_function(lambda: self.clock() - self.last_scrape)
        metrics.gpu_probe_up.set(1 if probe.available else 0)
        metrics.set_mode(self.mode)

    # ----- the loop ---------------------------------------------------------------------------
    async def tick(self) -> None:
        """One round: scrape, read the GPU, set the budget."""
        now = self.clock()
        started = time.perf_counter()
        admitted = set(self.in_flight.requests)
        try:
            snapshot = await fetch_snapshot(self.client, request_timeout_s=self.settings.max_staleness)
        except (httpx.HTTPError, ValueError) as exc:
            await self._scrape_failed(exc)
        else:
            self.metrics.scrape_duration.observe(time.perf_counter() - started)
            if not await self._engine_dead():
                await self._scraped(snapshot, now, admitted == set(self.in_flight.requests))
        if self.probe.available and self.backend.up:
            idle_before = self._engine_idle()
            reading = await self.probe.read()
            self._gpu(reading, self.clock(), idle_before is not None and idle_before == self._engine_idle())
        self._apply(self.clock())

    async def _scrape_failed(self, exc: Exception) -> None:
        kind = _failure_kind(exc)
        self.metrics.scrape_errors.labels(kind).inc()
        detail = (
            f"answered {exc.response.status_code}"
            if isinstance(exc, httpx.HTTPStatusError)
            else f"{type(exc).__name__}: {exc}"
        )
        self.problem = f"scrape of /metrics failed ({detail})"
        if kind == "parse":
            return
        health = await self._health()
        if health == 200:  # /metrics alone is slow or failing: conservative mode (by age) covers it
            return
        self._engine_reported |= kind == "status" or (isinstance(health, int) and health >= 500)
        if kind == "timeout" and health == "timeout":
            self._enter("hung", f"{self.problem}; /health silent for {HEALTH_TIMEOUT_S:g} s")
        else:
            self._enter("down", f"{self.problem}; /health {health}")

    async def _engine_dead(self) -> bool:
        """vLLM's API server answers /metrics after its engine died: until its watchdog stops it
        (vllm/entrypoints/launchers/launcher.py terminate_if_errored), or for good with
        VLLM_KEEP_ALIVE_ON_ENGINE_DEATH, while requests get 500 and /health 503. So /health is
        asked, only when there is a reason (a request ended with a 5xx since the last scrape that
        answered, or the backend is not up yet again): a 5xx there is a backend down."""
        if self.backend.up and self.in_flight.last_backend_error < self.last_scrape:
            return False
        health = await self._health()
        if not (isinstance(health, int) and health >= 500):
            return False
        self._engine_reported = True
        self.problem = f"/metrics answers but /health answered {health}: vLLM's engine is dead"
        self._enter("down", self.problem)
        return True

    async def _health(self) -> int | str:
        """/health's status code, or why there is none: "timeout" or "unreachable"."""
        try:
            return (await self.client.get("/health", timeout=HEALTH_TIMEOUT_S)).status_code
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:
            return "unreachable"

    def _enter(self, status: Status, why: str) -> None:
        if self.budget.set_backend(status, why):
            log.warning("backend %s (%s): holding new admissions in the queue", status, why)

    async def _scraped(self, snapshot: BackendSnapshot, now: float, admissions_still: bool) -> None:
        previous = self.snapshot
        restarted = previous is not None and _restarted(previous, snapshot)
        if restarted:
            self._on_restart(now)
        changed = previous is not None and previous.cache_config != snapshot.cache_config
        if restarted or changed or not self.backend.up or self._needs_resync:
            try:
                await self.resync()
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                self._needs_resync = True
                self.problem = f"backend answered but resynchronising failed: {exc}"
                return
            self._needs_resync = False
            if changed and not restarted:
                log.info("backend's cache_config_info changed: configuration re-read")
        if not self.backend.up:
            was = self.backend.status
            self.budget.set_backend("up")
            log.info(
                "backend back (was %s)%s: resynchronised, admitting again", was, " after a restart" if restarted else ""
            )
        self._engine_reported = False
        self._count(previous, snapshot, now)
        self.snapshot, self.last_scrape, self.problem = snapshot, now, None
        self._reconcile_kv(snapshot, now, admissions_still)
        self._close_plain_prefills(snapshot, admissions_still)
        if snapshot.lora is not None and self.lora_seen is not None:
            await self.lora_seen(snapshot.lora)

    def _on_restart(self, now: float) -> None:
        """Count the restart; back the transient margin off if it was likely a CUDA OOM.

        A sidecar does not see how vLLM's process ended, only how it went away. vLLM 0.32 raises
        a CUDA OOM inside its engine core; its API server outlives the engine long enough to say
        so: in-flight requests are answered 500 (`engine_error_handler` for EngineDeadError,
        vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py) or get an error event,
        and /health answers 503 (vllm/entrypoints/serve/instrumentator/health.py) until the
        server exits. A SIGKILL (or a container or node lost) answers nothing: every in-flight
        connection is cut. So: the restart is taken as an OOM when the backend was busy (vLLM ran
        requests at the last scrape, or kvgate had some in flight) unless it vanished without a
        word: since the last scrape that answered before it went, an admitted request's
        connection was cut, and neither a request, /metrics nor /health got a 5xx answer.
        Anything else busy stays an OOM, the safe side (see docs/telemetry.md for the limits).
        """
        self.metrics.restarts.inc()
        since = self.last_scrape  # when the last scrape that answered before the restart began
        ended = self.in_flight
        reported = self._engine_reported or ended.last_backend_error >= since
        cut = ended.last_cut >= since
        busy = bool(self.snapshot and self.snapshot.running) or self.gate.in_flight > 0 or cut or reported
        if busy and cut and not reported:
            log.warning(
                "backend restarted after it vanished without an answer (connections cut, no 5xx: killed, "
                "not an engine OOM): transient safety margin stays %.2f; resynchronising",
                self.budget.transient_margin,
            )
        elif busy:
            before = self.budget.transient_margin
            after = self.calibration.oom_restart(now)
            log.warning(
                "backend restarted after steps kvgate admitted (likely a CUDA OOM): transient safety "
                "margin %.2f -> %.2f; highest transient reservation this life %d MiB, headroom %s MiB",
                before,
                after,
                self.gate.peak_transient_bytes // MiB,
                "?" if self.headroom_bytes is None else self.headroom_bytes // MiB,
            )
        else:
            log.warning("backend restarted (no admitted step was running): resynchronising")
        self.headroom.reset()
        self.held_region_bytes = 0
        self.gate.reset_peak()
        self.calibration.new_life()

    def _count(self, previous: BackendSnapshot | None, snapshot: BackendSnapshot, now: float) -> None:
        m = self.metrics
        if snapshot.kv_usage is not None:
            m.kv_usage.set(snapshot.kv_usage)
        if snapshot.kv_blocks_used is not None:
            m.kv_blocks_used.set(snapshot.kv_blocks_used)
        m.running.set(snapshot.running or 0)
        m.waiting.set(snapshot.waiting or 0)
        lora = snapshot.lora
        m.lora_adapters.labels("running").set(len(lora.running) if lora else 0)
        m.lora_adapters.labels("waiting").set(len(lora.waiting) if lora else 0)
        m.max_loras.set(lora.max_loras or 0 if lora else 0)
        if previous is None:
            return
        before, after = previous.counter("preemptions") or 0, snapshot.counter("preemptions") or 0
        self._preempted = after - before if after >= before else after
        if self._preempted > 0:
            m.preemptions.inc(self._preempted)
        generated = (snapshot.counter("generation_tokens") or 0) - (previous.counter("generation_tokens") or 0)
        dt = now - self.last_scrape
        if generated > 0 and dt > 0 and snapshot.running:
            rate = generated / dt / snapshot.running
            self.decode_rate = rate if self.decode_rate is None else self.decode_rate + 0.3 * (rate - self.decode_rate)

    def _close_plain_prefills(self, snapshot: BackendSnapshot, admissions_still: bool) -> None:
        """Tell the gate how many non-streaming requests have surely finished their prefill, from
        vLLM's count of first tokens (kvgate/telemetry/first_tokens.py); a page without the
        count relieves nothing."""
        count = snapshot.counter("first_tokens")
        if count is None:
            return
        accounted, others, in_flight = self.gate.first_token_account()
        account = FirstTokenAccount(accounted, others, in_flight)
        finished = self.first_tokens.finished(
            count, snapshot.running or 0, snapshot.waiting or 0, account, admissions_still
        )
        open_, surely = self.gate.plain_prefills_finished(finished)
        self.metrics.plain_prefills.labels("open").set(open_)
        self.metrics.plain_prefills.labels("finished").set(surely)

    def _reconcile_kv(self, snapshot: BackendSnapshot, now: float, admissions_still: bool) -> None:
        """Predicted vs observed blocks in use; the error counts only at settled moments.

        Settled: nothing was admitted or released while the page was fetched, and vLLM runs
        exactly the requests kvgate has in flight with none waiting. Otherwise some are in
        transit between the two (tokenizing, on the wire, being answered) and the difference
        says nothing about the memory model.
        """
        observed, usable = snapshot.kv_blocks_used, snapshot.kv_blocks_usable
        if observed is None or usable is None:
            return
        predicted = blocks_in_use(self.in_flight.requests.values(), self.block_size(), now, self.decode_rate)
        settled = admissions_still and snapshot.running == len(self.in_flight.requests) and not snapshot.waiting
        reason = self.calibration.observe_kv(
            now,
            predicted,
            observed,
            usable,
            self._preempted,
            self.gate.head_shortfall() == KV_BUSY,
            settled,
        )
        self._preempted = 0
        m, c = self.metrics, self.calibration
        m.predicted_kv_in_use.set(predicted)
        if settled:
            m.kv_error.set(c.kv_error_blocks)
            m.kv_abs_error.set(c.kv_abs_error_blocks)
            m.kv_reconciled_requests.set(len(self.in_flight.requests))
        if reason:
            log.info("calibration: %s", reason)

    def utilization(self) -> float:
        """vLLM's gpu_memory_utilization (its cache_config_info, else the flag): the envelope its
        engine sizes itself to, the profile region included."""
        cache = self.snapshot.cache_config if self.snapshot else None
        reported = cache.gpu_memory_utilization if cache else None
        return reported or self.settings.gpu_memory_utilization

    def _engine_idle(self) -> int | None:
        """The count of admissions ever made, while the engine runs nothing (kvgate has nothing in
        flight and vLLM's last scrape showed nothing running or waiting); else None. Equal before
        and after a GPU reading: the reading shows the cache an idle engine holds."""
        snapshot = self.snapshot
        if self.gate.in_flight or (snapshot is not None and (snapshot.running or snapshot.waiting)):
            return None
        return self.gate.admissions

    def _gpu(self, reading: GpuReading, now: float, idle: bool = False) -> None:
        """`idle`: the engine ran nothing while the GPU was read (`_engine_idle`): the server's
        growth since start-up is then its caching allocator's cache, every block of it free, where
        the baseline was read before the engine's first prompt token (kvgate started beside an
        engine that had served requests takes their cache for start-up's, and learns nothing)."""
        if reading.error is not None:
            self.metrics.gpu_probe_up.set(0)
            self.problem = self.problem or reading.error
            return
        self.metrics.gpu_probe_up.set(1)
        for device in reading.devices:
            self.metrics.gpu_free.labels(device.gpu).set(device.free)
        if reading.devices:  # the smallest card of vLLM's: what `GET /advice` predicts the start-up on
            self.gpu_total = min(device.total for device in reading.devices)
        if not self.headroom.started:  # this reading sets the life's baseline
            prompts = self.snapshot.counter("prompt_tokens") if self.snapshot else None
            self.baseline_before_steps = prompts == 0
            if not self.baseline_before_steps:  # its cache holds steps kvgate never saw
                self.gate.unseen_steps()
        headroom = self.headroom.update(
            reading,
            self.utilization(),
            self.budget.profiled_peak_bytes,
            self.budget.profile_emptied_bytes,
        )
        if headroom is None:
            return
        self.last_gpu = now
        cache = headroom.server_growth if self.baseline_before_steps else None
        if idle and cache is not None and self.budget.idle_cache_bytes != cache:
            self.budget.update(idle_cache_bytes=cache, grown_cache_bytes=cache)  # lone requests may now fit
        elif self.budget.grown_cache_bytes != cache:
            self.budget.update(grown_cache_bytes=cache)  # what a drain would leave cached
        if self.headroom_bytes is None or abs(headroom.bytes - self.headroom_bytes) > self.headroom_bytes // 20:
            log.info(
                "transient headroom %s -> %d MiB (min free %d MiB, server growth %d MiB)",
                "?" if self.headroom_bytes is None else self.headroom_bytes // MiB,
                headroom.bytes // MiB,
                headroom.min_free // MiB,
                headroom.server_growth // MiB,
            )
        self.headroom_bytes = headroom.bytes
        if headroom.cotenant_reserve != self.cotenant_reserve_bytes:
            log.info(
                "co-tenants' reserve %d -> %d MiB of the %d MiB headroom (the largest step another process "
                "on the GPU took that still fits)",
                self.cotenant_reserve_bytes // MiB,
                headroom.cotenant_reserve // MiB,
                headroom.bytes // MiB,
            )
        self.cotenant_reserve_bytes = headroom.cotenant_reserve
        self.profiled_cap_bytes = headroom.profiled_cap
        self.headroom_max = max(self.headroom_max, headroom.bytes)
        if self.baseline_before_steps and headroom.reachable is not None:
            self.reachable_max = max(self.reachable_max or 0, headroom.reachable)
        self.metrics.transient_headroom.set(headroom.bytes)
        if headroom.profiled_cap > 0:  # the region comes out of free memory: its segments show
            tightened = self.calibration.observe_region(
                headroom.server_growth,
                self.gate.peak_transient_bytes,
                self.budget.profiled_peak_bytes,
                self.budget.charged_segment_overhead,
            )
            if tightened:
                log.warning("calibration: %s", tightened)
        overhead = max(self.budget.charged_segment_overhead, self.calibration.segment_overhead)
        # the profile region's part that comes out of free memory (none on V1: the engine holds it)
        region = region_segments(min(self.budget.profiled_peak_bytes, headroom.profiled_cap), overhead)
        self.held_region_bytes = region_held(headroom.server_growth, self.gate.peak_transient_bytes, region)
        reason = self.calibration.observe_transient(
            now,
            headroom.server_growth,
            self.gate.peak_transient_bytes + region,
            # the rest of the region stays in the tolerance, as it always did
            growth_tolerance(headroom.bytes) + region_segments(self.budget.profiled_peak_bytes, overhead) - region,
            self.gate.head_shortfall() == TRANSIENT_BUSY,
        )
        self.metrics.transient_error.set(self.calibration.transient_error_bytes)
        if reason:
            log.warning("calibration: %s", reason)
        relaxed = self.calibration.observe_slack(
            headroom.server_growth,
            headroom.bytes,
            headroom.min_free,
            # the margin on the whole headroom, as before the held region counted; no co-tenants' reserve:
            # requests it holds back say nothing about kvgate's charges
            self.budget.transient_limit(0, beside_cotenants=False),
            self.gate.head_shortfall() == TRANSIENT_BUSY,
        )
        if relaxed:
            log.info("calibration: %s", relaxed)

    def detail(self) -> dict[str, object]:
        """What /readyz says about the live budget (GPU readings present or not, and why)."""
        return {
            "budget_mode": self.mode,
            "scrape_age_s": round(self.clock() - self.last_scrape, 3),
            "gpu_probe": self.probe.kind,
            "gpu_readings": self.probe.available and self.headroom_bytes is not None,
            "gpu_problem": self.probe.problem,
            "transient_headroom_bytes": self.headroom_bytes,
            "cotenant_reserve_bytes": self.cotenant_reserve_bytes,
            "kv_overcommit": round(self.calibration.kv_overcommit, 3),
            "transient_margin": round(self.calibration.transient_margin, 3),
            "segment_overhead": round(self.budget.charged_segment_overhead, 3),
            "sampler_overhead_scale": self.calibration.sampler_overhead.value,
            "problem": self.problem,
        }

    # ----- the budget -------------------------------------------------------------------------
    def _reachable_bound(self) -> int:
        """The most headroom this engine can offer, which "never fits" is judged against (with the
        largest seen): what the readings say it can reach once its co-tenants leave, where they
        show every process's use from a baseline before any step, and the profile region the
        engine held at that baseline (V1's warm-up blocks: its steps' tensors go there, as R93a's
        steps did with the engine's growth at 0; without them its chats were refused as never
        fitting). Else the static headroom from the flags, which on a fixed pool leaves out the
        CUDA graphs (R91a at vLLM's advised pool: 1.64 GiB static against 501 MiB read, so prompts
        that can never run waited for their deadline instead of a 400 at once)."""
        if self.reachable_max is None:
            return self.static_headroom or 0
        peak, emptied = self.budget.profiled_peak_bytes, self.budget.profile_emptied_bytes
        return self.reachable_max + max(0, peak - (emptied or 0))

    def age(self, now: float) -> float:
        """Age of the oldest source the budget relies on."""
        age = now - self.last_scrape
        return max(age, now - self.last_gpu) if self.probe.available else age

    def _set_mode(self, mode: str) -> None:
        if mode != self.mode:
            if {mode, self.mode}.isdisjoint(("down", "hung")):  # those moves are logged with their reason
                log.warning("budget mode %s -> %s (readings %.2f s old)", self.mode, mode, self.age(self.clock()))
            self.mode = mode
            self.metrics.set_mode(mode)

    def _apply(self, now: float) -> None:
        if not self.backend.up:
            self._set_mode(self.backend.status)
        else:
            self._set_mode("conservative" if self.age(now) > self.settings.max_staleness else "live")
        conservative = self.mode == "conservative"
        c = self.calibration
        wanted: dict[str, object] = {
            "scale": self.settings.stale_budget_fraction if conservative else 1.0,
            "kv_overcommit": min(1.0, c.kv_overcommit) if conservative else c.kv_overcommit,
            "transient_margin": c.transient_margin,
        }
        if self.headroom_bytes is not None:
            wanted["transient_headroom_bytes"] = self.headroom_bytes
            wanted["cotenant_reserve_bytes"] = self.cotenant_reserve_bytes
            wanted["profiled_cap_bytes"] = self.profiled_cap_bytes
            wanted["learned_segment_overhead"] = c.segment_overhead
            wanted["held_region_bytes"] = self.held_region_bytes
            wanted["sampler_overhead_scale"] = c.sampler_overhead.value
            wanted["max_transient_headroom_bytes"] = max(self.headroom_max, self._reachable_bound())
        changes = {k: v for k, v in wanted.items() if getattr(self.budget, k) != v}
        if changes:
            self.budget.update(**changes)
        self.metrics.kv_overcommit.set(self.budget.kv_overcommit)
        self.metrics.transient_margin.set(self.budget.transient_margin)


def _failure_kind(exc: Exception) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.HTTPStatusError):
        return "status"
    if isinstance(exc, httpx.TransportError):
        return "connect"
    return "parse"


def _restarted(previous: BackendSnapshot, snapshot: BackendSnapshot) -> bool:
    """A new process, a counter that went backwards, or engines that came or went."""
    if previous.process_start is not None and snapshot.process_start != previous.process_start:
        return True
    if set(previous.engines) != set(snapshot.engines):
        return True
    return any((snapshot.counter(name) or 0) < (previous.counter(name) or 0) for name in COUNTERS)
