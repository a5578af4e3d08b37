"""One request's way to a demand: parse -> check -> token ids -> prediction -> never-fits check.

Apart from the composition root (kvgate.composition) so that the path every gated request takes reads
top to bottom in one place. What it reads of the backend (tokenizer, predictor, the limits and
rendering rule of its release) is one frozen PipelineConfig, swapped in whole on each backend sync
(`configure`, by the composition root): a request is evaluated against one configuration from start
to end. Each step raises a domain error (kvgate.errors), never HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.backend import calls_until
from kvgate.errors import (
    BackendBroke,
    BackendDown,
    BackendTimedOut,
    InvalidField,
    InvalidText,
    ModelNotFound,
    NotReady,
    TokenizerUnavailable,
)
from kvgate.gate.budget import Budget
from kvgate.openai import UNTRUSTED_TEMPLATE_CODE, parse_request
from kvgate.passthrough_body import TOKENIZE_PATH, check_passthrough_body, is_json
from kvgate.predict import Prediction, Predictor
from kvgate.preparation import Prepared, prepare
from kvgate.preparation_workers import Job, PassthroughJob, PreparationWorkers
from kvgate.request import RequestLimits, Truncation, ValidRequest
from kvgate.served_names import ServedNames
from kvgate.tokens import TOKEN_ARRAY, BackendTokenizeError, Tokenizer
from kvgate.units import MiB
from kvgate.vllm_routes import Route
from kvgate.work_budget import Grant, WorkBudget, charging, count_body_values, preparation_cost

# Prompts beyond which a completions request is predicted in a worker thread: the prediction is
# Python, so from a thread the event loop still gets its turn every few milliseconds.
PREDICT_OFFLOAD_PROMPTS = 16
# Bodies beyond which preparation runs in a worker process: what costs is the values (each a
# Python object to build, each message, tool or part a pass of the template): an 8 KiB body of 144
# tools took 20-70 ms to parse and render with the tests' Llama-3-style template, 64 values a few
# ms; bytes alone cost little (a long prompt is tokenized in a thread, without the GIL). A request
# carrying its own chat template always goes to a worker.
INLINE_BODY_BYTES = 64 * 1024
INLINE_BODY_VALUES = 64
# A request's own template may hold more than its body's size says: its output budget
# (kvgate/tokens.py DEFAULT_TEMPLATE_CHARS, up to 4 bytes a character) and the values it builds.
TEMPLATE_WORK_BYTES = 64 * MiB
# Time a worker may take to prepare a body (a 28 MiB body of 1,024 long prompts took about 6 s of
# tokenizing on a busy 2-core machine), beyond the request template's own time budget.
PREPARE_SECONDS = 10.0
PREPARE_SECONDS_PER_MIB = 3.0


@dataclass(frozen=True)
class PipelineConfig:
    """What the request path reads from one sync with the backend (kvgate/engine_config.py's
    Deployment, resolved by the composition root), built and swapped in whole."""

    tokenizer: Tokenizer
    predictor: Predictor  # built for the deployment (engine_config.build_predictor)
    limits: RequestLimits  # max_model_len, --max-logprobs, the vocabulary (kvgate/request.py)
    # The backend release's rule for a chat template's content format
    # (VllmRuntime.content_format_namespace_aliases).
    content_format_namespace_aliases: bool = False
    workers: PreparationWorkers | None = None  # only with the model folder's own tokenizer


@dataclass(slots=True)  # not frozen: made once a request, only read after (gated_routes.Caller says why)
class Evaluation:
    request: ValidRequest
    prediction: Prediction
    predictor: Predictor  # the one that made `prediction`: the never-fits check and explain judge with it
    tokenize_s: float


class RequestPipeline:
    def __init__(
        self,
        budget: Budget,
        served_names: ServedNames,
        why_not_ready: Callable[[], str | None],
        on_tokenized: Callable[[float], None],
        trust_request_chat_template: bool = False,
        work_budget: WorkBudget | None = None,
        template_seconds: float = 1.0,
    ) -> None:
        self.budget = budget
        self.served_names = served_names  # the backend's /v1/models, kept live by its own re-reads
        self.work_budget = work_budget or WorkBudget(2**62)
        self.template_seconds = template_seconds
        self.trust_request_chat_template = trust_request_chat_template
        self._why_not_ready = why_not_ready
        self._on_tokenized = on_tokenized
        self._config: PipelineConfig | None = None

    @property
    def config(self) -> PipelineConfig | None:
        """The backend's configuration as last synchronised; None until the first sync."""
        return self._config

    def configure(self, config: PipelineConfig) -> None:
        """Swap in a new configuration; requests already on their way finish with the old one."""
        self._config = config

    async def evaluate(self, route: Route, raw: bytes, deadline: float | None = None) -> Evaluation:
        """Parse, tokenize and predict a request; a KvgateError for anything that cannot go through.
        `deadline` (time.monotonic): how long it may wait for kvgate's work memory (the one it
        waits for the gate with)."""
        evaluation = await self.predict(route, raw, deadline)
        evaluation.predictor.check_fits_ever(evaluation.prediction, self.budget.ceiling())
        return evaluation

    async def predict(self, route: Route, raw: bytes, deadline: float | None = None) -> Evaluation:
        """Parse, tokenize and predict, without judging whether it could ever fit. Preparation
        (parse, render, tokenize) holds its bounded cost of the shared work budget while it runs."""
        config = self._config
        if config is None:
            if len(raw) <= INLINE_BODY_BYTES:  # a malformed body is a 400 even before kvgate is ready
                parse_request(route, raw, trust_request_chat_template=self.trust_request_chat_template)
            raise NotReady(self._why_not_ready())
        prepared = await self._prepare(config, route, raw, deadline)
        request, prompts, predictor = prepared.request, prepared.prompts, config.predictor
        if request.model is not None and self.served_names and not await self.served_names.knows(request.model):
            raise ModelNotFound(request.model, self._valid_aliases(config))
        self._on_tokenized(prepared.tokenize_s)
        adapter = self.served_names.get(request.model)
        # vLLM keys an adapter's prefix-cache blocks by its name and path (vLLM 0.32.0
        # vllm/v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys): no block is shared with the
        # base model or another adapter, so kvgate counts them apart too.
        cache_key = ("lora", adapter.name, adapter.path) if adapter is not None and adapter.is_adapter else None
        if request.truncation is not None:
            keep = predictor.truncation_length(request)
            prompts = [self._truncated(ids, keep, request.truncation) for ids in prompts]
        if request.unseen_history:
            prompts = [self._with_unseen_history(ids, request, config) for ids in prompts]
        if len(prompts) > PREDICT_OFFLOAD_PROMPTS:
            prediction = await asyncio.to_thread(predictor.predict, request, prompts, cache_key)
        else:
            prediction = predictor.predict(request, prompts, cache_key)
        return Evaluation(request, prediction, predictor, prepared.tokenize_s)

    async def _prepare(
        self, config: PipelineConfig, route: Route, raw: bytes, deadline: float | None = None
    ) -> Prepared:
        """Parse, render and tokenize, holding the body's bounded cost of the shared work budget:
        in a worker process when the body could take more than a few milliseconds."""
        carries_template = self.trust_request_chat_template and b"chat_template" in raw
        values = await count_body_values(raw)
        offload = config.workers is not None and (
            len(raw) > INLINE_BODY_BYTES or values > INLINE_BODY_VALUES or carries_template
        )
        cost = preparation_cost(raw, values) + (TEMPLATE_WORK_BYTES if carries_template else 0)
        async with self.work_budget.hold(cost, deadline, len(raw)) as grant:
            if offload:
                return await self._prepare_in_worker(config, route, raw, grant)
            with charging(grant.grow):
                return await self._prepare_here(config, route, raw, deadline)

    async def _prepare_here(
        self, config: PipelineConfig, route: Route, raw: bytes, deadline: float | None = None
    ) -> Prepared:
        """In the event loop; a /tokenize call to the backend waits for a connection at most
        until `deadline` (kvgate/backend.py TokenizeCalls), then is refused as a queue timeout."""
        try:
            with calls_until(deadline):
                return await prepare(
                    route,
                    raw,
                    config.tokenizer,
                    trust_request_chat_template=self.trust_request_chat_template,
                    limits=config.limits,
                    content_format_namespace_aliases=config.content_format_namespace_aliases,
                )
        except BackendTokenizeError as exc:
            if exc.unreachable:  # as a refused connection for a request: the backend is down now
                self.budget.set_backend("down", str(exc))
            if self.budget.hold is not None:  # the caller waits for it (Gate.wait_for_backend)
                raise BackendDown(
                    f"The backend is down ({self.budget.hold}) and kvgate tokenizes through it.",
                    self.budget.backend.retry_after_s(),
                ) from exc
            if exc.cause == "timeout":  # a busy or hung backend, as a forwarded request finds it
                raise BackendTimedOut() from exc
            if exc.cause == "broke":
                raise BackendBroke(f"its /tokenize failed: {exc}") from exc
            raise TokenizerUnavailable(str(exc)) from exc

    async def _prepare_in_worker(self, config: PipelineConfig, route: Route, raw: bytes, grant: Grant) -> Prepared:
        assert config.workers is not None
        job = Job(route, self.trust_request_chat_template, config.limits, config.content_format_namespace_aliases)
        seconds = PREPARE_SECONDS + len(raw) / MiB * PREPARE_SECONDS_PER_MIB + self.template_seconds
        prepared = await config.workers.run(job, raw, grant, seconds)
        assert prepared is not None
        return prepared

    async def check_passthrough(self, method: str, path: str, content_type: str | None, body: bytes) -> None:
        """A pass-through body's bounds (kvgate/passthrough_body.py), a domain error if it must
        not reach the backend. A body a gated route would prepare in a worker is checked in one
        too, charged to the same work budget: its parse is the same work."""
        config = self._config
        if (
            config is not None
            and config.tokenizer.source == "local"
            and method == "POST"
            and path == TOKENIZE_PATH
            and body
            and is_json(content_type)
        ):
            # Rendered and tokenized as a gated chat or prompt is (the same limits, work budget
            # and worker), so that the backend is sent only what a gated route would send it:
            # 160,000 messages took the simulator's /tokenize 49.5 s to render.
            try:
                await self._prepare(config, "tokenize", body)
            except InvalidField as malformed:  # vLLM's to answer, in its words (kvgate's parse is stricter)
                if isinstance(malformed, InvalidText) or malformed.code == UNTRUSTED_TEMPLATE_CODE:
                    raise
            return
        values = await count_body_values(body)
        if (
            config is None
            or config.workers is None
            or (len(body) <= INLINE_BODY_BYTES and values <= INLINE_BODY_VALUES)
        ):
            max_model_len = config.limits.max_model_len if config is not None else None
            check_passthrough_body(method, path, content_type, body, max_model_len)
            return
        job = PassthroughJob(method, path, content_type, config.limits.max_model_len)
        async with self.work_budget.hold(preparation_cost(body, values), body_bytes=len(body)) as grant:
            await config.workers.run(job, body, grant, PREPARE_SECONDS + len(body) / MiB * PREPARE_SECONDS_PER_MIB)

    def _valid_aliases(self, config: PipelineConfig) -> list[str] | None:
        """What vLLM lists after an unknown model name: from 0.32.0 its served base names, in the
        order /v1/models lists them, adapters left out (`base_model_paths`); 0.31.0 none (the
        release before the one that also clamps max_tokens, VllmRuntime.max_tokens_past_context_refused)."""
        if config.predictor.engine.max_tokens_past_context_refused:
            return None
        served = (self.served_names.get(name) for name in self.served_names.names())
        return [s.name for s in served if s is not None and not s.is_adapter]

    @staticmethod
    def _truncated(ids: array[int], keep: int, truncation: Truncation) -> array[int]:
        """The prompt as vLLM truncates it (vllm/renderers/params.py TokenizeParams
        `_truncation_slice`, vLLM 0.32.0): its first `keep` tokens, its last with truncation_side
        "left" (`keep` from Predictor.truncation_length). vLLM falls back to the tokenizer's own
        side when the request names none; kvgate takes the first tokens then (the count is the
        same)."""
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if truncation.left else ids[:keep]

    @staticmethod
    def _with_unseen_history(ids: array[int], request: ValidRequest, config: PipelineConfig) -> array[int]:
        """The prompt grown to fill what the context leaves after the output budget: vLLM prepends
        a stored conversation kvgate never saw (a Responses request's previous_response_id), and
        the context bounds it. The filler starts with a random id so that its blocks are never
        taken for another request's cached prefix."""
        length = config.limits.max_model_len - (request.sampling.max_tokens or 1)
        if len(ids) >= length:
            return ids
        filler = array(TOKEN_ARRAY, [-1 - secrets.randbits(62)]) + array(TOKEN_ARRAY, [-1]) * (length - len(ids) - 1)
        return filler + ids
