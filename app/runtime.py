"""The pieces of one running kvgate and the evaluation every gated request goes through.

Start-up loads the model geometry and the tokenizer, then learns the backend's real
configuration (served names, max_model_len, cache_config_info) in the background, retrying
until the backend answers. Until then kvgate is not ready and gated requests get a 503.
Then the live loop (app.telemetry.live) keeps the budget true every --scrape-interval.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.deployment import Deployment, build_predictor, resolve, static_budget
from app.gate.gate import Gate
from app.memory.budget import Budget
from app.memory.geometry import ModelGeometry
from app.memory.outputs import OutputLengths
from app.metrics import KvgateMetrics
from app.openai import ApiError, Endpoint, RequestSpec, parse_request
from app.predict import Prediction, Predictor
from app.proxy import Backend
from app.settings import Settings
from app.telemetry.gpu import detect_probe
from app.telemetry.live import LiveBudget
from app.telemetry.vllm import fetch_models, fetch_snapshot, fetch_version
from app.tokens import BackendTokenizeError, TokenizationError, Tokenizer, load_tokenizer

log = logging.getLogger("kvgate.runtime")


def freeze_start_up_heap() -> None:
    """Exempt what start-up loaded (modules, tokenizer, templates: ~110k objects) from the
    garbage collector. A full collection walked them all, ~40 ms on the 2-core machine, stalling
    every request in flight; frozen, collections walk only what requests created since."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Evaluation:
    spec: RequestSpec
    prediction: Prediction
    tokenize_s: float


class Runtime:
    """Everything a kvgate process holds, built once at start-up."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = KvgateMetrics()
        self.backend = Backend(settings.backend, settings.upstream_timeout)
        outputs = OutputLengths(settings.kv_output_quantile)
        self.budget = Budget(transient_margin=settings.transient_safety_margin, kv_margin_z=outputs.z)
        self.gate = Gate(
            self.budget, self.metrics, settings.max_queue, settings.max_queue_wait, outputs=outputs,
        )
        self.geometry: ModelGeometry | None = None
        self.tokenizer: Tokenizer | None = None
        self.deployment: Deployment | None = None
        self.predictor: Predictor | None = None
        self.served_names: set[str] = set()
        self.startup_error: str | None = None
        self._sync_task: asyncio.Task | None = None
        self.live: LiveBudget | None = None

    async def start(self) -> None:
        model_dir = self.settings.model
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            raise SystemExit(
                f"kvgate needs the model folder vLLM serves (config.json and tokenizer): "
                f"--model {model_dir!r} has no config.json"
            )
        self.geometry = ModelGeometry.from_folder(model_dir)
        if self.settings.served_model_name:
            self.served_names.add(self.settings.served_model_name)
        self._sync_task = asyncio.create_task(self._sync_backend())

    async def stop(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        await self.backend.aclose()

    async def _sync_backend(self, retry_s: float = 1.0) -> None:
        """Learn the backend's configuration; retry until it answers."""
        while True:
            try:
                await self.sync_once()
                break
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                problem = f"backend not synchronised yet: {type(exc).__name__}: {exc}"
                if problem != self.startup_error:
                    log.warning("%s (retrying every %g s)", problem, retry_s)
                self.startup_error = problem
                await asyncio.sleep(retry_s)
        await self._watch_backend()

    async def _watch_backend(self) -> None:
        """Keep the budget true: one LiveBudget tick every --scrape-interval, forever."""
        client = self.backend.client
        probe = await detect_probe(self.settings.gpu_probe, client, self.settings.gpu_devices)
        log.info("GPU probe: %s%s", probe.kind, f" ({probe.problem})" if probe.problem else "")
        self.live = LiveBudget(
            self.settings, client, self.gate, self.metrics.telemetry, probe, self.sync_once,
            lambda: self.deployment.block_size if self.deployment else 16,
        )
        interval = self.settings.scrape_interval
        while True:
            started = time.monotonic()
            try:
                await self.live.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad reading
                log.exception("telemetry tick failed; the budget keeps its last values")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def sync_once(self) -> None:
        assert self.geometry is not None
        client = self.backend.client
        models = await fetch_models(client)
        snapshot = await fetch_snapshot(client)
        version = await fetch_version(client)
        served = next((m for m in models if m.name == self.settings.served_model_name), None)
        served = served or (models[0] if models else None)
        self.served_names.update(m.name for m in models)
        deployment = resolve(self.settings, self.geometry, snapshot.cache_config, served, version)
        model_name = self.settings.served_model_name or (served.name if served else "")
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.settings.model, self.backend.tokenize_client, model_name)
            freeze_start_up_heap()
        predictor = build_predictor(deployment, self.geometry, self.settings, self.gate.outputs)
        budget = static_budget(deployment, self.settings, predictor)
        self.deployment, self.predictor = deployment, predictor
        self.startup_error = None
        self.budget.update(
            kv_blocks=budget.kv_blocks,
            transient_headroom_bytes=budget.transient_headroom_bytes,
            max_transient_headroom_bytes=budget.max_transient_headroom_bytes,
            profiled_peak_bytes=budget.profiled_peak_bytes,
        )
        if deployment.runtime.warning and (self.deployment is None or self.deployment.runtime != deployment.runtime):
            log.warning("%s", deployment.runtime.warning)
        self.metrics.telemetry.set_backend_info(deployment.runtime.labels())
        log.info(
            "backend synchronised: vLLM %s (modelled as %s), %s model runner (%s), %s sampler; "
            "max_model_len=%s block_size=%s num_gpu_blocks=%s prefix_caching=%s",
            deployment.runtime.version, deployment.runtime.model_version, deployment.runtime.runner.upper(),
            deployment.runtime.runner_source, deployment.runtime.sampler_backend,
            deployment.max_model_len, deployment.block_size, deployment.num_gpu_blocks,
            deployment.enable_prefix_caching,
        )

    @property
    def ready(self) -> bool:
        return self.predictor is not None and self.tokenizer is not None and self.budget.known

    def configure_offline(self) -> None:
        """Build the predictor from flags alone (no backend), for `kvgate explain` without --url."""
        if self.settings.model is None:
            raise SystemExit("kvgate explain without --url needs --model (the model folder)")
        self.geometry = ModelGeometry.from_folder(self.settings.model)
        self.deployment = resolve(self.settings, self.geometry, None, None)
        if self.deployment.runtime.warning:
            log.warning("%s", self.deployment.runtime.warning)
        self.tokenizer = load_tokenizer(self.settings.model, self.backend.tokenize_client, self.settings.served_model_name or "")
        self.predictor = build_predictor(self.deployment, self.geometry, self.settings, self.gate.outputs)
        budget = static_budget(self.deployment, self.settings, self.predictor)
        self.budget.update(
            kv_blocks=budget.kv_blocks,
            transient_headroom_bytes=budget.transient_headroom_bytes,
            max_transient_headroom_bytes=budget.max_transient_headroom_bytes,
            profiled_peak_bytes=budget.profiled_peak_bytes,
        )

    async def evaluate(self, endpoint: Endpoint, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict a request; ApiError for anything that can never go through."""
        evaluation = await self.predict(endpoint, raw)
        assert self.predictor is not None
        self.predictor.check_fits_ever(evaluation.prediction, self.budget)
        return evaluation

    async def predict(self, endpoint: Endpoint, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict, without judging whether it could ever fit."""
        spec = parse_request(endpoint, raw)
        if self.predictor is None or self.tokenizer is None:
            raise ApiError(
                503, f"kvgate is starting and does not know the backend yet ({self.startup_error}).",
                "kvgate_not_ready", headers={"Retry-After": "2"},
            )
        if spec.model is not None and self.served_names and spec.model not in self.served_names:
            raise ApiError(
                404, f"The model `{spec.model}` does not exist.", "model_not_found", param="model"
            )
        started = time.perf_counter()
        prompts = await self._token_ids(spec)
        tokenize_s = time.perf_counter() - started
        self.metrics.tokenization.observe(tokenize_s)
        prediction = self.predictor.predict(spec, prompts)
        return Evaluation(spec, prediction, tokenize_s)

    async def _token_ids(self, spec: RequestSpec) -> list[list[int]]:
        assert self.tokenizer is not None
        try:
            if spec.chat is not None:
                return [await self.tokenizer.encode_chat(spec.chat)]
            # A loop, not a comprehension: one with an await inside is a coroutine of its own.
            prompts: list[list[int]] = []
            for p in spec.prompts:
                prompts.append(p if isinstance(p, list) else await self.tokenizer.encode_prompt(p, spec.add_special_tokens))
            return prompts
        except TokenizationError as exc:
            raise ApiError(400, f"Could not tokenize the request: {exc}", "tokenization_failed") from exc
        except BackendTokenizeError as exc:
            if self.budget.hold is not None:
                raise ApiError(
                    503, f"The backend is down ({self.budget.hold}) and kvgate tokenizes through it.",
                    "backend_unavailable", headers={"Retry-After": "5"},
                ) from exc
            raise ApiError(
                424,
                f"kvgate has no local tokenizer and the backend's /tokenize failed: {exc}. "
                "Give kvgate the model folder with its tokenizer files (--model).",
                "tokenizer_unavailable",
            ) from exc
