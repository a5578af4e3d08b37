"""OpenAI request parsing and OpenAI-shaped errors.

Parsing is hand-written rather than a pydantic model of the whole body because kvgate forwards the
body byte for byte and reads only the fields that change memory; everything else is vLLM's to
judge. Each bad field gets a 400 that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import JSONResponse

from app.chat_template import ChatRequest
from app.sampling_params import SamplingParams, vllm_sampling_params

Endpoint = Literal["completions", "chat"]


class ApiError(Exception):
    """An error the client sees, in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, extra_headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers={**self.headers, **(extra_headers or {})}
        )


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param=param)


@dataclass
class RequestSpec:
    """The fields of an OpenAI request that decide its memory, plus the untouched raw body."""

    endpoint: Endpoint
    raw: bytes
    model: str | None
    stream: bool
    max_tokens: int | None
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    penalties: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)  # as vLLM derives them
    priority: int = 0
    prompts: list[str | list[int]] = field(default_factory=list)
    add_special_tokens: bool = True
    chat: ChatRequest | None = None


def _int(body: dict[str, Any], name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(value)[:40]}.", name)
    if value < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {value}.", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{name}' must be at most {maximum}, got {value}.", name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", name)
    return value


def _optional_list_of_dicts(body: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise bad_request(f"'{name}' must be a list of objects.", name)
    return value


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"The body is not valid JSON: {exc}.", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    return body


def _penalties(body: dict[str, Any]) -> bool:
    """Penalties make vLLM's sampler build batch x vocab tensors its start-up profile skipped."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"'{name}' must be a number.", name)
        if value != neutral:
            return True
    return False


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    message = "'prompt' must be a non-empty string, list of strings, list of token ids, or list of lists of token ids."
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt)
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise bad_request(message, "prompt")
    if any(p == "" for p in prompts):
        raise bad_request("'prompt' must not be empty.", "prompt")
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages.", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(
                f"messages[{index}] must be an object with a string 'role'.", "messages"
            )
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("'chat_template' must be a string.", "chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    return ChatRequest(
        messages=messages,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        continue_final_message=_bool(body, "continue_final_message", False),
        tools=_optional_list_of_dicts(body, "tools"),
        chat_template=template,
        chat_template_kwargs=kwargs,
        add_special_tokens=_bool(body, "add_special_tokens", False),
        documents=_optional_list_of_dicts(body, "documents"),
    )


def parse_request(endpoint: Endpoint, raw: bytes) -> RequestSpec:
    """Read what matters to memory from a completions or chat body; 400 on anything malformed."""
    body = parse_json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    # Type checks only: the values are read as vLLM reads them (app/sampling_params.py), and the
    # logprob limits are the server's --max-logprobs (app/predict.py).
    echo = _bool(body, "echo", False)
    if endpoint == "chat":
        _int(body, "max_completion_tokens", minimum=1)
        _int(body, "max_tokens", minimum=1)
        _bool(body, "logprobs", False)
        _int(body, "top_logprobs", minimum=-1)
    else:
        _int(body, "max_tokens", minimum=0 if echo else 1)
        _int(body, "logprobs", minimum=-1)
    _int(body, "min_tokens", minimum=0)
    _bool(body, "ignore_eos", False)
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise bad_request("'temperature' must be a number.", "temperature")
    n = _int(body, "n", minimum=1)
    best_of = _int(body, "best_of", minimum=1)
    if best_of is not None and best_of < (n or 1):
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n}).", "best_of")
    priority = _int(body, "priority", minimum=-(2**31))
    _int(body, "prompt_logprobs", minimum=-1)
    _penalties(body)
    sampling = vllm_sampling_params(endpoint, body)
    spec = RequestSpec(
        endpoint=endpoint,
        raw=raw,
        model=model,
        stream=_bool(body, "stream", False),
        max_tokens=sampling.max_tokens,
        n=n or 1,
        best_of=best_of,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        penalties=sampling.penalties,
        sampling=sampling,
        priority=priority or 0,
    )
    if endpoint == "chat":
        spec.chat = _chat(body)
    else:
        spec.prompts = _prompts(body)
        spec.add_special_tokens = _bool(body, "add_special_tokens", True)
    return spec
