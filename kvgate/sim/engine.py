"""The engine core: start-up, the step loop, CUDA OOM -> engine death -> restart.

A step: the scheduler picks the batch, the step's tensors are played on the caching allocator,
the loop waits out the step time (less the CPU work since the last step), then every request that computed all its known tokens samples
one. An allocation that fails kills the engine as it kills vLLM's EngineCore: every request,
running or waiting, fails; the process's memory goes back to the device; after the restart
time the engine starts afresh (profile, KV pool, empty queues, new counters), or stays down
while start-up fails (e.g. a co-tenant took the memory), retrying each restart period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvgate.sim import startup
from kvgate.sim.blocks import BlockPool, KVCacheManager
from kvgate.sim.carryover import CrossStepTensors
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.metrics import SimMetrics, cache_config_labels
from kvgate.sim.model import SimModel
from kvgate.sim.oom_record import oom_record
from kvgate.sim.request import Request, Status
from kvgate.sim.scheduler import Scheduler, SchedulerOutput
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.sim.timing import StepTimer, now
from kvgate.sim.vision import EncoderCache, EncoderScheduling, VisionTower, encoder_budget

log = logging.getLogger("kvgate.sim")

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
PROCESS = "vllm"
# vLLM 0.32.0 vllm/exceptions.py QueueOverflowError and MaxQueuedTokensError, word for word.
QUEUE_OVERFLOW_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
QUEUED_TOKENS_MESSAGE = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
)

Sampler = Callable[[Request], tuple[int, bool]]  # -> (token id, is end of sequence)


class Engine:
    """One simulated vLLM engine on one simulated GPU (TP ranks are identical; rank 0 is played)."""

    def __init__(self, cfg: SimConfig, model: SimModel, device: Device, sampler: Sampler, model_name: str) -> None:
        self.cfg = cfg
        self.model = model
        self.device = device
        self.sampler = sampler
        self.model_name = model_name
        self.state = "down"
        self.error: str | None = None
        self.boot_time = self._t0 = now()
        self.restart_at: float | None = None
        self.restarts = 0
        self.ooms: list[str] = []
        # beside each message, what the step asked and where the allocator stood (kvgate/sim/oom_record.py)
        self.oom_details: list[dict[str, Any]] = []
        self._closest_call_before: int | None = None  # over the lives before this one
        self.log_lines: list[str] = []
        self.cotenant_override: dict[str, int] = {}
        self._wake = asyncio.Event()
        # Simulated seconds: the sum of every step's simulated duration (advances only by steps).
        self.sim_clock = 0.0
        # When the last step's simulated GPU time ended (wall); None while the engine idles.
        self._gpu_done_at: float | None = None
        # Held: requests are taken in but no step runs. The demo holds the engine while it
        # submits a workload one request at a time, so every run starts from the same state
        # whatever the wall clock did.
        self.held = False

    # ----- lifecycle --------------------------------------------------------------------------
    def boot(self) -> None:
        """Start (or restart) the engine; raises startup.StartupError as vLLM would exit."""
        self.state = "starting"
        self.device.set_usage(PROCESS, 0)
        self.alloc = CachingAllocator(self.device, PROCESS, self.cfg.expandable_segments)
        try:
            self.resolved, self.report = startup.start(self.cfg, self.model, self.device, self.alloc)
        except startup.StartupError as exc:
            self.device.set_usage(PROCESS, 0)
            self.state, self.error = "failed", str(exc)
            for line in exc.log:
                self._log(logging.INFO, line)
            self._log(logging.ERROR, f"EngineCore failed to start. {exc}")
            raise
        r, rep = self.resolved, self.report
        for line in rep.log:
            self._log(logging.INFO, line)
        self.steps, self.draft_steps = startup.step_memories(r)
        self.encoder = None
        if self.model.vision is not None:
            budget = encoder_budget(self.model.vision, r.max_num_batched_tokens, r.max_model_len)
            self.encoder = EncoderScheduling(EncoderCache(self.alloc, budget), budget)
        self.kv = KVCacheManager(
            BlockPool(rep.num_gpu_blocks, self.cfg.enable_prefix_caching), r.block_size, r.layout.groups
        )
        self.scheduler = Scheduler(
            self.kv,
            r.max_num_batched_tokens,
            r.max_num_seqs,
            r.max_model_len,
            self.cfg.long_prefill_token_threshold,
            r.num_speculative_tokens,
            self.encoder,
        )
        self.timer = StepTimer(rep.weights, self.cfg.speedup)
        self.metrics = SimMetrics(
            self.model_name,
            cache_config_labels(
                block_size=r.block_size,
                cache_dtype=self.cfg.kv_cache_dtype,
                enable_prefix_caching=self.cfg.enable_prefix_caching,
                gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                kv_cache_memory_bytes=self.cfg.kv_cache_memory_bytes,
                num_gpu_blocks=rep.num_gpu_blocks,
                num_gpu_blocks_override=self.cfg.num_gpu_blocks_override,
                max_model_len=r.max_model_len,
                sliding_window=self.model.sliding_window,
                concurrency=rep.max_concurrency,
            ),
        )
        self.carry = CrossStepTensors(self.alloc, v1=not self.resolved.flavor.v2)
        self.alloc.watch_closest_call()
        self._prefix_seen = (0, 0)
        self.state, self.error, self.boot_time = "ready", None, now()
        self.boot_wall_time = time.time()
        self.metrics.process_start.set(self.boot_wall_time)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def clock(self) -> float:
        """The clock latency metrics are measured on: wall seconds, or with
        `metrics_clock="sim"` the step clock, so a benchmark that plays minutes of traffic in
        seconds reads minutes in its TTFT and latency histograms."""
        return self.sim_clock if self.cfg.metrics_clock == "sim" else now()

    def sim_time(self) -> float:
        """Simulated seconds since the simulator started (drives co-tenant schedules)."""
        return (now() - self._t0) * self.cfg.speedup

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        while True:
            self.apply_cotenants()
            if self.state in ("dead", "failed") and self.restart_at and now() >= self.restart_at:
                self._restart()
            if not self.ready or self.held or not self.scheduler.has_work():
                self._gpu_done_at = None
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                continue
            await self.step()

    def _restart(self) -> None:
        self.restarts += 1
        try:
            self.boot()
        except startup.StartupError:
            self.restart_at = now() + self.cfg.restart_seconds / self.cfg.speedup

    # ----- requests ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.arrival_time = self.clock()
        self.scheduler.add(req)
        self._gauges()
        self._wake.set()

    def queue_refusal(self, n: int) -> str | None:
        """vLLM's waiting-queue admission, or None to admit a request of `n` sequences.

        vLLM 0.32.0 vllm/v1/engine/async_llm.py `AsyncLLM.check_admission` (called by
        vllm/entrypoints/generate/base/serving.py `_preflight` before a response starts, and by
        `add_request` with the request's n): refused when the unfinished requests (waiting and
        running, one per sequence: `OutputProcessor.request_states`) plus n would pass
        --max-num-queued-reqs (QueueOverflowError), or when the prompt tokens of the requests
        still prefilling (`get_num_queued_tokens`: each one's whole prompt_len until its first
        output) are already at --max-num-queued-tokens (MaxQueuedTokensError). Both are
        GracefulHTTPErrors: HTTP 503, type "Service Unavailable" (vllm/exceptions.py,
        vllm/entrypoints/serve/exception_handling/error_response.py `create_error_response`).
        """
        most_reqs, most_tokens = self.cfg.max_num_queued_reqs, self.cfg.max_num_queued_tokens
        sched = self.scheduler
        if most_reqs is not None and len(sched.waiting) + len(sched.running) + n > most_reqs:
            return QUEUE_OVERFLOW_MESSAGE
        if most_tokens is not None:
            prefilling = sum(
                r.num_prompt_tokens for q in (sched.waiting, sched.running) for r in q if not r.output_token_ids
            )
            if prefilling >= most_tokens:
                return QUEUED_TOKENS_MESSAGE
        return None

    def abort(self, req: Request) -> None:
        if self.ready and req.status != Status.FINISHED:
            self.scheduler.abort(req)
            self.metrics.success["abort"].inc()
            self._gauges()

    # ----- one step ---------------------------------------------------------------------------
    async def step(self) -> None:
        """Schedule, play the step's memory, then wait out its simulated GPU time. The CPU work
        since the last step's GPU time ended (emitting its tokens, scheduling this one) counts
        toward that wait, as vLLM overlaps it with the GPU (async scheduling): a big batch's
        Python cost does not slow the simulated GPU down as long as the step outlasts it."""
        start = self.clock()
        cpu_from = self._gpu_done_at or now()
        out = self.scheduler.schedule()
        self._count_preemptions(out)
        if not out.scheduled:
            await asyncio.sleep(0.001)
            return
        shape = self.shape(out)
        cache_before = self.alloc.snapshot()  # the splits this step meets, for a replay of an OOM
        phase = "sampling_metadata"
        try:
            self.carry.start_step([s.request for s in out.scheduled])
            phase = "encoder"
            self._encode(out)
            phase = "forward"
            self.carry.keep_outputs(run_tape(self.alloc, self.steps.plan(shape), self.carry.held))
            phase = "draft"
            if self.draft_steps:  # its proposals go straight to the next step's input ids
                for block in run_tape(self.alloc, self.draft_steps.plan(startup.draft_shape(shape))):
                    self.alloc.free(block)
        except CudaOutOfMemory as exc:
            self.oom_details.append(oom_record(exc, phase, out, shape, cache_before))
            self.die(exc)
            return
        context = sum(s.num_context for s in out.scheduled)
        await asyncio.sleep(max(0.0, self.timer.wall_seconds(out.num_tokens, context) - (now() - cpu_from)))
        self._gpu_done_at = now()
        self.sim_clock += self.timer.sim_seconds(out.num_tokens, context)
        if self.ready:
            self._update(out, start)

    def _encode(self, out: SchedulerOutput) -> None:
        if self.encoder is not None and self.model.vision is not None:
            play_encoder(self.model.vision, self.encoder, self.alloc, out)

    @staticmethod
    def shape(out: SchedulerOutput) -> StepShape:
        """What the scheduled batch asks of the GPU."""
        reqs = []
        for s in out.scheduled:
            req, sp = s.request, s.request.sampling
            samples = s.num_context + s.num_new_tokens >= req.num_tokens
            prompt_lp = 0
            if sp.prompt_logprobs is not None:
                prompt_lp = max(0, min(s.num_new_tokens, req.num_prompt_tokens - s.num_context))
            reqs.append(
                ReqSlice(
                    s.num_new_tokens + s.num_draft_tokens,
                    s.num_context,
                    samples,
                    prompt_lp,
                    sp.prompt_logprobs or 0,
                    sp.logprobs,
                    sp.penalties,
                    sp.top_p_k,
                    sp.random,
                    sp.structured,
                    s.num_draft_tokens,
                    sp.seed is not None,
                    sp.processes_logits,
                    req.request_id,
                    max(0, req.num_prompt_tokens - s.num_context - s.num_new_tokens),
                    top_k=sp.random and sp.top_k > 0,
                    top_p=sp.random and sp.top_p < 1.0,
                )
            )
        return StepShape(tuple(reqs))

    def _update(self, out: SchedulerOutput, start: float) -> None:
        t = self.clock()
        m = self.metrics
        for s in out.scheduled:
            req = s.request
            if req.status != Status.RUNNING:
                continue
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
            req.num_computed_tokens += s.num_new_tokens
            if self.encoder is not None:
                for i, item in enumerate(req.mm_items):  # _free_encoder_inputs: the prompt has it
                    if item.start + item.length <= req.num_computed_tokens:
                        self.encoder.cache.release((req.request_id, i))
            if req.num_computed_tokens < req.num_tokens:
                continue
            token, eos = self.sampler(req)
            req.output_token_ids.append(token)
            m.generation_tokens.inc()
            if req.first_token_time is None:
                req.first_token_time = t
                m.prompt_tokens.inc(req.num_prompt_tokens)
                m.ttft.observe(t - req.arrival_time)
            req.sink("token", token)
            sp = req.sampling
            if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= (self.resolved.max_model_len):
                self._finish(req, "length", t)
            elif eos and not sp.ignore_eos and len(req.output_token_ids) >= sp.min_tokens:
                self._finish(req, "stop", t)
        self._gauges()

    def _finish(self, req: Request, reason: str, t: float) -> None:
        self.scheduler.finish(req)
        req.finish_reason = reason
        m = self.metrics
        m.success[reason].inc()
        m.e2e.observe(t - req.arrival_time)
        m.queue.observe((req.first_scheduled_time or t) - req.arrival_time)
        req.sink("finish", reason)

    def _count_preemptions(self, out: SchedulerOutput) -> None:
        if out.preempted:
            self.metrics.preemptions.inc(len(out.preempted))
        q, h = self.scheduler.prefix.queries, self.scheduler.prefix.hits
        dq, dh = q - self._prefix_seen[0], h - self._prefix_seen[1]
        if dq > 0:
            self.metrics.prefix_queries.inc(dq)
        if dh > 0:
            self.metrics.prefix_hits.inc(dh)
        self._prefix_seen = (q, h)

    def _gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.kv_usage.set(self.kv.pool.usage())

    def closest_call(self) -> int | None:
        """The least margin any step's allocation had, over every life of the engine (None: no
        step allocated): how many bytes more would have run the closest one out of memory
        (kvgate/sim/gpu.py `CachingAllocator._margin`; negative when one did)."""
        seen = [self._closest_call_before, self.alloc.closest_call if self.ready else None]
        known = [n for n in seen if n is not None]
        return min(known) if known else None

    # ----- death ------------------------------------------------------------------------------
    def die(self, exc: CudaOutOfMemory) -> None:
        """CUDA OOM inside a step: fail everything, free the process's memory, plan a restart."""
        self._closest_call_before = self.closest_call()
        msg = f"torch.OutOfMemoryError: {exc}"
        self.ooms.append(msg)
        self._log(logging.ERROR, "EngineCore encountered a fatal error.")
        self._log(logging.ERROR, msg)
        victims = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.state, self.error = "dead", msg
        self.device.set_usage(PROCESS, 0)
        self.restart_at = now() + self.cfg.restart_seconds / self.cfg.speedup
        for req in victims:
            req.status = Status.FINISHED
            req.finish_reason = "error"
            req.sink("error", ENGINE_DEAD_MESSAGE)

    # ----- co-tenants -------------------------------------------------------------------------
    def apply_cotenants(self) -> None:
        """Other processes take and release memory on their schedule (if the device has it)."""
        t = self.sim_time()
        wanted = dict(self.cotenant_override)
        for c in self.cfg.cotenants:
            active = c.start_s <= t and (c.end_s is None or t < c.end_s)
            wanted[c.name] = wanted.get(c.name, 0) + (c.bytes if active else 0)
        for name, nbytes in wanted.items():
            held = self.device.processes.get(name, 0)
            if nbytes <= held or nbytes - held <= self.device.free():
                self.device.set_usage(name, nbytes)

    def _log(self, level: int, line: str) -> None:
        self.log_lines.append(line)
        log.log(level, line)


def play_encoder(
    vision: VisionTower, encoder: EncoderScheduling, alloc: CachingAllocator, out: SchedulerOutput
) -> None:
    """A step's encoder call over the images the scheduler gave it (before the decoder's forward,
    v1/worker/gpu_model_runner.py `execute_model`): freeable entries evicted for room first, then
    the tower's activations, its outputs kept in the encoder cache."""
    if not encoder.to_encode:
        return
    scheduled = {s.request.request_id: s.request for s in out.scheduled}
    keys, items = [], []
    for request_id, indices in encoder.to_encode.items():
        if (req := scheduled.get(request_id)) is not None:
            keys += [(request_id, i) for i in indices]
            items += [req.mm_items[i].length for i in indices]
    if not items:
        return
    encoder.cache.make_room(sum(items))
    outputs = run_tape(alloc, vision.encode_tape(items))
    for key, length, block in zip(keys, items, outputs, strict=True):
        encoder.cache.add(key, length, block)
