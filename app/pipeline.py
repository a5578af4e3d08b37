"""One request's way to a demand: parse -> token ids -> prediction -> never-fits check.

Apart from the composition root (app.runtime) so that the path every gated request takes reads
top to bottom in one place; the runtime only configures it (tokenizer, predictor, served names)
once it has learned the backend. Each step raises a domain error (app.errors), never HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import BackendDown, ModelNotFound, NotReady, TokenizationFailed, TokenizerUnavailable
from app.gate.budget import Budget
from app.openai import Endpoint, RequestSpec, parse_request
from app.predict import Prediction, Predictor
from app.tokens import BackendTokenizeError, TokenizationError, Tokenizer


@dataclass(frozen=True)
class Evaluation:
    spec: RequestSpec
    prediction: Prediction
    tokenize_s: float


class RequestPipeline:
    def __init__(
        self, budget: Budget, why_not_ready: Callable[[], str | None], on_tokenized: Callable[[float], None]
    ) -> None:
        self.budget = budget
        self.tokenizer: Tokenizer | None = None
        self.predictor: Predictor | None = None
        self.served_names: set[str] = set()
        self._why_not_ready = why_not_ready
        self._on_tokenized = on_tokenized

    async def evaluate(self, endpoint: Endpoint, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict a request; a KvgateError for anything that cannot go through."""
        evaluation = await self.predict(endpoint, raw)
        assert self.predictor is not None
        self.predictor.check_fits_ever(evaluation.prediction, self.budget)
        return evaluation

    async def predict(self, endpoint: Endpoint, raw: bytes) -> Evaluation:
        """Parse, tokenize and predict, without judging whether it could ever fit."""
        spec = parse_request(endpoint, raw)
        if self.predictor is None or self.tokenizer is None:
            raise NotReady(self._why_not_ready())
        if spec.model is not None and self.served_names and spec.model not in self.served_names:
            raise ModelNotFound(spec.model)
        started = time.perf_counter()
        prompts = await self._token_ids(spec)
        tokenize_s = time.perf_counter() - started
        self._on_tokenized(tokenize_s)
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
            raise TokenizationFailed(str(exc)) from exc
        except BackendTokenizeError as exc:
            if self.budget.hold is not None:
                raise BackendDown(
                    f"The backend is down ({self.budget.hold}) and kvgate tokenizes through it."
                ) from exc
            raise TokenizerUnavailable(str(exc)) from exc
