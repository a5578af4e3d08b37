"""One request's way to a demand: parse -> token ids -> prediction -> never-fits check.

Apart from the composition root (kvgate.composition) so that the path every gated request takes reads
top to bottom in one place; the runtime only configures it (tokenizer, predictor, served names)
once it has learned the backend. Each step raises a domain error (kvgate.errors), never HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.errors import BackendDown, ModelNotFound, NotReady, TokenizerUnavailable
from kvgate.gate.budget import Budget
from kvgate.openai import RequestSpec, parse_request
from kvgate.predict import Prediction, Predictor
from kvgate.preparation import Prepared, prepare
from kvgate.preparation_workers import Job, PreparationWorkers
from kvgate.served_names import ServedNames
from kvgate.tokens import TOKEN_ARRAY, BackendTokenizeError, Tokenizer
from kvgate.units import MiB
from kvgate.vllm_routes import Route
from kvgate.work_budget import Grant, WorkBudget, body_values, charging, preparation_cost

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
class Evaluation:
    spec: RequestSpec
    prediction: Prediction
    tokenize_s: float


class RequestPipeline:
    def __init__(
        self,
        budget: Budget,
        why_not_ready: Callable[[], str | None],
        on_tokenized: Callable[[float], None],
        trust_request_chat_template: bool = False,
        work_budget: WorkBudget | None = None,
        template_seconds: float = 1.0,
    ) -> None:
        self.budget = budget
        self.work_budget = work_budget or WorkBudget(2**62)
        self.workers: PreparationWorkers | None = None  # set once the tokenizer is the model folder's
        self.template_seconds = template_seconds
        self.tokenizer: Tokenizer | None = None
        self.predictor: Predictor | None = None
        self.max_model_len: int | None = None  # tokenization stops once a prompt is known to pass it
        self.content_format_namespace_aliases = False  # the backend's release rule (VllmRuntime)
        self.served_names = ServedNames()  # the composition root gives it the backend's /v1/models
        self.trust_request_chat_template = trust_request_chat_template
        self._why_not_ready = why_not_ready
        self._on_tokenized = on_tokenized

    async def evaluate(self, route: Route, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict a request; a KvgateError for anything that cannot go through."""
        evaluation = await self.predict(route, raw)
        assert self.predictor is not None
        self.predictor.check_fits_ever(evaluation.prediction, self.budget.ceiling())
        return evaluation

    async def predict(self, route: Route, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict, without judging whether it could ever fit. Preparation
        (parse, render, tokenize) holds its bounded cost of the shared work budget while it runs."""
        if self.predictor is None or self.tokenizer is None:
            if len(raw) <= INLINE_BODY_BYTES:  # a malformed body is a 400 even before kvgate is ready
                parse_request(route, raw, trust_request_chat_template=self.trust_request_chat_template)
            raise NotReady(self._why_not_ready())
        carries_template = self.trust_request_chat_template and b"chat_template" in raw
        values = body_values(raw)
        offload = self.workers is not None and (
            len(raw) > INLINE_BODY_BYTES or values > INLINE_BODY_VALUES or carries_template
        )
        cost = preparation_cost(raw, values) + (TEMPLATE_WORK_BYTES if carries_template else 0)
        async with self.work_budget.hold(cost) as grant:
            if offload:
                prepared = await self._prepare_in_worker(route, raw, grant)
            else:
                with charging(grant.grow):
                    prepared = await self._prepare_here(route, raw)
        spec, prompts = prepared.spec, prepared.prompts
        if spec.model is not None and self.served_names and not await self.served_names.knows(spec.model):
            raise ModelNotFound(spec.model, self._valid_aliases())
        self._on_tokenized(prepared.tokenize_s)
        adapter = self.served_names.get(spec.model)
        # vLLM keys an adapter's prefix-cache blocks by its name and path (vLLM 0.32.0
        # vllm/v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys): no block is shared with the
        # base model or another adapter, so kvgate counts them apart too.
        cache_key = ("lora", adapter.name, adapter.path) if adapter is not None and adapter.is_adapter else None
        if spec.truncate_prompt_tokens is not None:
            keep = self.predictor.truncation_length(spec)
            prompts = [self._truncated(ids, keep, spec.truncate_left) for ids in prompts]
        if spec.unseen_history:
            prompts = [self._with_unseen_history(ids, spec.max_tokens) for ids in prompts]
        if len(prompts) > PREDICT_OFFLOAD_PROMPTS:
            prediction = await asyncio.to_thread(self.predictor.predict, spec, prompts, cache_key)
        else:
            prediction = self.predictor.predict(spec, prompts, cache_key)
        return Evaluation(spec, prediction, prepared.tokenize_s)

    async def _prepare_here(self, route: Route, raw: bytes) -> Prepared:
        assert self.tokenizer is not None
        try:
            return await prepare(
                route,
                raw,
                self.tokenizer,
                trust_request_chat_template=self.trust_request_chat_template,
                max_model_len=self.max_model_len,
                content_format_namespace_aliases=self.content_format_namespace_aliases,
            )
        except BackendTokenizeError as exc:
            if exc.unreachable:  # as a refused connection for a request: the backend is down now
                self.budget.set_backend("down", str(exc))
            if self.budget.hold is not None:  # the caller waits for it (Gate.wait_for_backend)
                raise BackendDown(
                    f"The backend is down ({self.budget.hold}) and kvgate tokenizes through it.",
                    self.budget.backend.retry_after_s(),
                ) from exc
            raise TokenizerUnavailable(str(exc)) from exc

    async def _prepare_in_worker(self, route: Route, raw: bytes, grant: Grant) -> Prepared:
        assert self.workers is not None
        job = Job(route, self.trust_request_chat_template, self.max_model_len, self.content_format_namespace_aliases)
        seconds = PREPARE_SECONDS + len(raw) / MiB * PREPARE_SECONDS_PER_MIB + self.template_seconds
        return await self.workers.run(job, raw, grant, seconds)

    def _valid_aliases(self) -> list[str] | None:
        """What vLLM lists after an unknown model name: from 0.32.0 its served base names, in the
        order /v1/models lists them, adapters left out (`base_model_paths`); 0.31.0 none (the
        release before the one that also clamps max_tokens, VllmRuntime.max_tokens_past_context_refused)."""
        assert self.predictor is not None
        if self.predictor.engine.max_tokens_past_context_refused:
            return None
        served = (self.served_names.get(name) for name in self.served_names.names())
        return [s.name for s in served if s is not None and not s.is_adapter]

    @staticmethod
    def _truncated(ids: array[int], keep: int, left: bool) -> array[int]:
        """The prompt as vLLM truncates it (vllm/renderers/params.py TokenizeParams
        `_truncation_slice`, vLLM 0.32.0): its first `keep` tokens, its last with truncation_side
        "left" (`keep` from Predictor.truncation_length). vLLM falls back to the tokenizer's own
        side when the request names none; kvgate takes the first tokens then (the count is the
        same)."""
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if left else ids[:keep]

    def _with_unseen_history(self, ids: array[int], max_tokens: int | None) -> array[int]:
        """The prompt grown to fill what the context leaves after the output budget: vLLM prepends
        a stored conversation kvgate never saw (a Responses request's previous_response_id), and
        the context bounds it. The filler starts with a random id so that its blocks are never
        taken for another request's cached prefix."""
        assert self.predictor is not None
        length = self.predictor.engine.max_model_len - (max_tokens or 1)
        if len(ids) >= length:
            return ids
        filler = array(TOKEN_ARRAY, [-1 - secrets.randbits(62)]) + array(TOKEN_ARRAY, [-1]) * (length - len(ids) - 1)
        return filler + ids
