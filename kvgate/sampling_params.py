"""An OpenAI body read as vLLM reads it: the sampling parameters its server derives.

vLLM 0.32.0 builds `SamplingParams` with `CompletionRequest.to_sampling_params`
(vllm/entrypoints/openai/completion/protocol.py) and `ChatCompletionRequest.to_sampling_params`
(vllm/entrypoints/openai/chat_completion/protocol.py), with `max_tokens` from `get_max_tokens`
(vllm/entrypoints/serve/utils/api_utils.py). What changes memory is mapped here, once:

- `echo: true` turns the request's logprobs into prompt logprobs when `prompt_logprobs` is unset
  (completions: `logprobs`; chat: `top_logprobs`, whose default is 0);
- completions: `max_tokens` absent (or null) is 16, and `echo` with `max_tokens: 0` generates 1;
  chat: `max_completion_tokens`, else `max_tokens`; absent: what the context leaves;
- chat: sample logprobs are `top_logprobs` only when `logprobs` is true;
- temperature 0 is greedy (Model Runner V2 then skips its top-k/top-p); which rows make Model
  Runner V2 copy the batch's logits to fp32 and filter them: `v2_sampler_needs` (with the
  server's defaults from the model's generation_config.json, kvgate/model_folder.py);
- /inference/v1/generate sends vLLM's SamplingParams itself (`engine`): its fields as they are,
  a missing max_tokens is what the context leaves
  (vllm/entrypoints/scale_out/token_in_token_out/serving.py);
- pooling requests (embeddings, classify, score, rerank) never decode: one greedy step is what
  kvgate reserves for them, a conservative bound on a prefill-only request.

The other routes (/v1/responses, /v1/messages, /invocations) are translated to a completions or
chat body first (kvgate/vllm_routes.py).

The fields are assumed type-checked (kvgate/openai.py answers a malformed one with a 400).
`tests/integration/test_sampling_params_vllm.py` compares this mapping with vLLM's own, field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.errors import InvalidField
from kvgate.frozen_values import direct_init
from kvgate.vllm_routes import Sampling

# vllm/entrypoints/openai/completion/protocol.py: CompletionRequest.max_tokens default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@direct_init
@dataclass(frozen=True)
class SamplingParams:
    """The memory-relevant part of the `SamplingParams` vLLM builds for one request."""

    n: int = 1
    max_tokens: int | None = None  # None: what max_model_len leaves after the prompt
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: bool = False  # a guided decoding constraint (bitmask per step)
    logit_bias: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    # As the body gives them (None: the server's default, else vLLM's neutral value).
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature_given: bool = True
    thinking_token_budget: int | None = None
    # `use_beam_search`: vLLM runs the request as engine requests of one token each, one per beam
    # per output token (vllm 0.32.0 entrypoints/generate/beam_search/online.py `beam_search`).
    beam_search: bool = False

    @property
    def penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def engine_logprobs(self) -> int | None:
        """The logprobs vLLM's engine computes for each row: beam search asks 2 x the beam width
        of each of its engine requests (online.py `beam_search`: `SamplingParams(logprobs=2 *
        beam_width, max_tokens=1)`, whatever the request's own logprobs), else the request's."""
        return 2 * self.n if self.beam_search else self.logprobs

    @property
    def greedy(self) -> bool:
        """vllm/sampling_params.py: a temperature under _SAMPLING_EPS (1e-5) samples greedily."""
        return self.temperature < 1e-5


# vllm 0.32.0 config/model.py:1869-1878 get_diff_sampling_param: the generation_config.json keys
# the server takes as its requests' defaults (with --generation-config auto, vLLM's default).
SAMPLING_DEFAULT_KEYS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
)  # fmt: skip


def v2_sampler_needs(
    p: SamplingParams, defaults: Mapping[str, float] | None = None, filters: tuple[bool, bool] | None = None
) -> tuple[bool, bool]:
    """(logits processing, top-k/top-p) for one request on Model Runner V2, vllm 0.32.0 and 0.33.0:

    - `SamplingStates.add_request` (v1/worker/gpu/sample/states.py:67-72): a random row needs
      processing unless its temperature is 1.0 and it sets no top-k, top-p or min-p;
    - the logits processors, greedy rows too: penalties (gpu/sample/penalties.py:55-64),
      logit_bias, allowed_token_ids and min_tokens' stop-token masking (gpu/sample/logit_bias.py:
      57-110), bad_words (gpu/sample/bad_words.py:40-44), a thinking budget (thinking_budget.py:82);
    - top-k/top-p run when a row sets one (`get_top_k_top_p`, states.py:105-112); a greedy row's
      are reset by SamplingParams (`_verify_greedy_sampling`).

    A field the body leaves out takes the server's default (`defaults`, generation_config.json).
    `filters`: v2_filters(p, defaults) if the caller has it already."""
    d = defaults or {}
    temperature = p.temperature if p.temperature_given else float(d.get("temperature", 1.0))
    sets_top_k, sets_top_p = filters if filters is not None else v2_filters(p, defaults)
    min_p = p.min_p if p.min_p is not None else float(d.get("min_p", 0.0))
    penalties = p.penalties or any(
        float(d.get(name, neutral)) != neutral
        for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
    )
    random = temperature >= 1e-5
    filtered = sets_top_k or sets_top_p
    processors = penalties or p.logit_bias or bool(p.allowed_token_ids) or bool(p.bad_words)
    processors = processors or p.min_tokens > 0 or p.thinking_token_budget is not None
    return processors or (random and (temperature != 1.0 or min_p != 0.0 or filtered)), filtered


def v2_filters(p: SamplingParams, defaults: Mapping[str, float] | None = None) -> tuple[bool, bool]:
    """(sets top-k, sets top-p) for a random row on Model Runner V2 (a greedy row's are reset):
    a batch in which rows set both passes FlashInfer both (``top_k_top_p_sampling_from_logits``),
    else one of them (v1/sample/ops/topk_topp_sampler.py ``flashinfer_sample``)."""
    d = defaults or {}
    temperature = p.temperature if p.temperature_given else float(d.get("temperature", 1.0))
    if temperature < 1e-5:
        return False, False
    top_k = p.top_k if p.top_k is not None else int(d.get("top_k", 0))
    top_p = p.top_p if p.top_p is not None else float(d.get("top_p", 1.0))
    return top_k > 0, top_p < 1.0


# vllm 0.32.0 protocol.py extract_structured_outputs: the fields that set a constraint.
_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_FORMATS = ("json_schema", "json_object", "structural_tag")


def _structured(body: Mapping[str, Any]) -> bool:
    if any(body.get(name) for name in _STRUCTURED_FIELDS):
        return True
    response_format = body.get("response_format")
    return isinstance(response_format, Mapping) and response_format.get("type") in _STRUCTURED_FORMATS


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    """A float field as vLLM's pydantic model reads it (lax: numeric strings too); a 400 for what it
    would refuse (a list, a word, an integer past float range)."""
    value = body.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidField(f"'{name}' must be a number within float range.", name) from None


# A pooling request's footprint: its prompt and one greedy step (it never samples).
POOLING = SamplingParams(max_tokens=1, temperature=0.0)


def vllm_sampling_params(endpoint: Sampling, body: Mapping[str, Any]) -> SamplingParams:
    """What vLLM's `to_sampling_params` makes of this body (before the server's defaults from
    generation_config, which only change temperature, top-k/p and the penalties)."""
    if endpoint == "pooling":
        return POOLING
    echo = bool(body.get("echo") or False)
    if endpoint == "engine":
        logprobs, echoed, max_tokens = body.get("logprobs"), None, body.get("max_tokens")
    elif endpoint == "chat":
        top_logprobs = body.get("top_logprobs")
        top_logprobs = 0 if top_logprobs is None else top_logprobs
        logprobs = top_logprobs if body.get("logprobs") else None
        echoed = top_logprobs
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
    else:
        logprobs = body.get("logprobs")
        echoed = logprobs
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        if echo and max_tokens == 0:
            max_tokens = 1
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and echo:
        prompt_logprobs = echoed
    allowed = _list(body, "allowed_token_ids")
    bad_words = _list(body, "bad_words")
    return SamplingParams(
        n=body.get("n") or 1,
        max_tokens=max_tokens,
        min_tokens=body.get("min_tokens") or 0,
        ignore_eos=bool(body.get("ignore_eos") or False),
        temperature=_number(body, "temperature", 1.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        structured_outputs=_structured(body),
        logit_bias=bool(body.get("logit_bias")),
        allowed_token_ids=allowed,
        bad_words=tuple(bad_words) if bad_words else None,
        top_k=_optional_int(body, "top_k"),
        top_p=_optional_number(body, "top_p"),
        min_p=_optional_number(body, "min_p"),
        temperature_given=body.get("temperature") is not None,
        thinking_token_budget=_optional_int(body, "thinking_token_budget"),
        beam_search=_lax_true(body.get("use_beam_search")),
    )


# pydantic's lax booleans that read as False (vLLM's request models take `use_beam_search: bool`).
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_true(value: Any) -> bool:
    """True where vLLM's pydantic model could read True. A value it refuses (a 400 from vLLM)
    counts as True too: its reservation is then only larger until vLLM's answer releases it."""
    if value is None or value is False or (type(value) is int and value == 0):
        return False
    return not (isinstance(value, str) and value.strip().lower() in _FALSE_WORDS)


def _list(body: Mapping[str, Any], name: str) -> tuple[Any, ...] | None:
    """A list field (vLLM 0.32.0's request models: `allowed_token_ids: list[int] | None`,
    `bad_words: list[str]`); a 400 for a value that is no list, which vLLM's pydantic model refuses
    too (a number or a boolean here was a TypeError, a 500). What the list holds is vLLM's to judge."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidField(f"'{name}' must be a list.", name)
    return tuple(value)


def _optional_number(body: Mapping[str, Any], name: str) -> float | None:
    return None if body.get(name) is None else _number(body, name, 0.0)


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    """An integer field; a value that is no integer counts as set (vLLM answers its own 400)."""
    value = body.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return 1
