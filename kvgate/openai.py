"""OpenAI request parsing: a body in, a ParsedRequest (kvgate/request.py) out, or a 400.

Parsing is hand-written rather than a pydantic model of the whole body because kvgate forwards the
body byte for byte and reads only the fields that change memory; everything else is vLLM's to
judge. Each bad field raises an InvalidField that names it. JSON and field checks only: the
checks against the server's limits are kvgate/request.py's, rendering and tokenizing
kvgate/preparation.py's (this module never loads transformers or jinja2).
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.errors import InvalidField, TooManyJsonValues, VllmRefusal
from kvgate.json_text import load_json
from kvgate.request import ChatInput, ParsedRequest, PromptInput, TokenIds, Truncation, ValidRequest
from kvgate.sampling_params import vllm_sampling_params
from kvgate.vllm_routes import Route, Translated, translate

# Integer fields end up in vLLM's int64 tensors; beyond this they can only be a client's mistake,
# and the predictor's float arithmetic would overflow on them (1e309 has no float).
MAX_INT = 2**63 - 1
# JSON values in one body. Python's parser holds the event loop for the whole parse, about
# 0.15 us a value here (0.3 s for 2 million token ids; 12 s for 7 million one-id lists in a
# 28 MiB body): past this count a body is refused before it is parsed. It allows 1,024 prompts
# of 488 token ids each; text prompts and messages cost one value per string, whatever its size.
MAX_JSON_VALUES = 500_000
_FEW_STRINGS = 20_000  # quotes: below this, telling commas in strings from others is cheap
# Prompts in one completions body (vLLM sets no limit): each is tokenized and predicted, so the
# count bounds a request's CPU time; a million one-word prompts took 10 s of the event loop.
MAX_PROMPTS = 1024


def _int(body: dict[str, Any], name: str, *, minimum: int, maximum: int = MAX_INT) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(f"'{name}' must be an integer, got {json.dumps(value)[:40]}.", name)
    if value < minimum:
        raise InvalidField(f"'{name}' must be at least {minimum}, got {value}.", name)
    if value > maximum:
        raise InvalidField(f"'{name}' must be at most {maximum}, got {value}.", name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidField(f"'{name}' must be a boolean.", name)
    return value


def _optional_list_of_dicts(body: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidField(f"'{name}' must be a list of objects.", name)
    return value


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it.

    Python's parser takes bodies no client should send: nesting past the recursion limit
    (RecursionError), integers past 4,300 digits (ValueError) and text that is not Unicode
    (invalid UTF-8, lone surrogates: kvgate/json_text.py, which names the field). Each is the
    client's fault and answered 400 here rather than failing later in the tokenizer, the
    predictor or the error response itself.
    """
    _refuse_too_many_values(raw)
    try:
        body = load_json(raw)
    except RecursionError:
        raise InvalidField("The body is not valid JSON: it is nested too deeply.", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the digit limit
        raise InvalidField(f"The body is not valid JSON: {str(exc)[:200]}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidField("The body must be a JSON object.", code="invalid_json")
    return body


def _refuse_too_many_values(raw: bytes) -> None:
    """413 for a body of more than MAX_JSON_VALUES values, counted by the commas between them
    (C-speed: 40 ms for 32 MiB). Commas inside strings are discounted when the body has few
    strings (a long text full of commas).
    A body of many strings whose commas lie inside them is refused: rare, and over 500,000
    commas in prompt text is in any case more tokens than most models' context."""
    if raw.count(b",") < MAX_JSON_VALUES:
        return
    values = raw.count(b",") + 1
    if raw.count(b'"') <= _FEW_STRINGS:
        values -= _commas_in_strings(raw)
    if values > MAX_JSON_VALUES:
        raise TooManyJsonValues(values, MAX_JSON_VALUES)


def _commas_in_strings(raw: bytes) -> int:
    """Commas inside the JSON strings of `raw`, counted in place between unescaped quotes."""
    inside, opened, at = 0, -1, raw.find(b'"')
    while at != -1:
        backslashes = 0  # counted up to 1,024: a longer run only blurs the estimate
        while backslashes < 1024 and at - backslashes > 0 and raw[at - backslashes - 1] == 0x5C:
            backslashes += 1
        if backslashes % 2 == 0:  # not an escaped quote
            if opened < 0:
                opened = at
            else:
                inside += raw.count(b",", opened + 1, at)
                opened = -1
        at = raw.find(b'"', at + 1)
    return inside


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM 0.32.0 `validate_cache_salt` (vllm/entrypoints/generate/base/protocol.py): absent or
    null is no salt; anything but a non-empty string is refused with vLLM's message. (Its length
    and character rules differ by route and are left to vLLM, which answers them with a 400.)"""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidField("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def _check_number(body: dict[str, Any], name: str) -> None:
    """A float field kvgate reads strictly (a JSON number, not a bool or a string)."""
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise InvalidField(f"'{name}' must be a number.", name)


def _prompts(body: dict[str, Any], texts_per_prompt: int = 1) -> tuple[str | TokenIds, ...]:
    """The prompts of a completions body; a score body's come as (query, document) pairs in a row,
    two texts to a prompt."""
    prompt = body.get("prompt")
    message = "'prompt' must be a non-empty string, list of strings, list of token ids, or list of lists of token ids."
    limit = MAX_PROMPTS * texts_per_prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > limit:
        raise InvalidField(
            f"'prompt' holds {len(prompt) // texts_per_prompt:,} prompts; kvgate accepts at most {MAX_PROMPTS:,} in one request.",
            "prompt",
        )
    prompts: tuple[str | TokenIds, ...]
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif _is_token_ids(prompt):
        prompts = (tuple(prompt or ()),)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        prompts = tuple(tuple(p) for p in prompt)
    else:
        raise InvalidField(message, "prompt")
    if texts_per_prompt == 1 and any(p == "" for p in prompts):  # a pair's empty side is a text pair's
        raise InvalidField("'prompt' must not be empty.", "prompt")
    return prompts


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of token ids (ints, not bools, in vLLM's int64 range). Checked with
    C-level builtins: 1,024 prompts of 400 ids took 0.23 s item by item."""
    return (
        isinstance(value, list)
        and bool(value)
        and set(map(type, value)) == {int}
        and min(value) >= 0
        and max(value) <= MAX_INT
    )


def _prompt_input(body: dict[str, Any], paired: bool) -> PromptInput:
    return PromptInput(_prompts(body, 2 if paired else 1), _bool(body, "add_special_tokens", True), paired)


def _from_text(prompts: PromptInput) -> tuple[bool, ...]:
    """Per prompt vLLM runs, whether it came as text (a pair: either side)."""
    sides = prompts.prompts
    if prompts.paired:
        return tuple(isinstance(q, str) or isinstance(d, str) for q, d in zip(sides[::2], sides[1::2], strict=True))
    return tuple(isinstance(p, str) for p in sides)


# vLLM 0.32.0's refusal of a request's own template without --trust-request-chat-template
# (vllm/renderers/online_renderer.py, OnlineRenderer.validate_chat_template), word for word.
UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


UNTRUSTED_TEMPLATE_CODE = "untrusted_chat_template"


def _chat(body: dict[str, Any], trust_request_chat_template: bool) -> ChatInput:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("'messages' must be a non-empty list of messages.", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidField(f"messages[{index}] must be an object with a string 'role'.", "messages")
        _check_part_types(message.get("content"))
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise InvalidField("'chat_template' must be a string.", "chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidField("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final_message = _bool(body, "continue_final_message", False)
    tools = _optional_list_of_dicts(body, "tools")
    add_special_tokens = _bool(body, "add_special_tokens", False)
    documents = _optional_list_of_dicts(body, "documents")
    mm_kwargs = body.get("mm_processor_kwargs")
    if mm_kwargs is not None and not isinstance(mm_kwargs, dict):
        raise InvalidField("'mm_processor_kwargs' must be an object.", "mm_processor_kwargs")
    media_io = body.get("media_io_kwargs")
    if media_io is not None and not isinstance(media_io, dict):
        raise InvalidField("'media_io_kwargs' must be an object.", "media_io_kwargs")
    effort = body.get("reasoning_effort")  # anything but a string: vLLM's own 400 answers it
    chat = ChatInput(
        messages=tuple(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=None if tools is None else tuple(tools),
        chat_template=template,
        chat_template_kwargs=kwargs,
        add_special_tokens=add_special_tokens,
        documents=None if documents is None else tuple(documents),
        mm_processor_kwargs=mm_kwargs,
        media_io_kwargs=media_io,
        reasoning_effort=effort if isinstance(effort, str) else None,
    )
    if chat.carries_template and not trust_request_chat_template:
        raise InvalidField(UNTRUSTED_TEMPLATE_MESSAGE, "chat_template", code=UNTRUSTED_TEMPLATE_CODE)
    return chat


def parse_request(route: Route, raw: bytes, *, trust_request_chat_template: bool = False) -> ParsedRequest:
    """Read what matters to memory from a body of one of the gated routes; 400 on anything
    malformed. Every route is first translated to the completions or chat body it amounts to
    (kvgate/vllm_routes.py).

    /invocations is dispatched by shape as vllm/entrypoints/serve/sagemaker/api_router.py does:
    the first of ChatCompletionRequest, CompletionRequest that the body validates as (for a
    generative model; a pooling model's request types are not tried)."""
    body = parse_json_object(raw)
    if route != "invocations":
        translated = translate(route, body)
        try:
            return _parse(translated, trust_request_chat_template)
        except InvalidField as error:
            raise _renamed(error, dict(translated.renames)) from None
    if "messages" in body:
        try:
            return _parse(Translated("chat", body, "chat"), trust_request_chat_template)
        except InvalidField:
            if "prompt" not in body:
                raise
    if "prompt" not in body:
        raise InvalidField(
            "/invocations takes a chat completions body ('messages') or a completions body ('prompt').", "messages"
        )
    return _parse(Translated("completions", body, "completions"), trust_request_chat_template)


def _renamed(error: InvalidField, renames: dict[str, str]) -> InvalidField:
    """The error in the words of the route's own body: it names the field the client sent
    (`token_ids`, `input`, `max_output_tokens`), not the one kvgate translated it to."""
    sent = renames.get(error.param or "")
    if sent is None:
        return error
    return InvalidField(error.message.replace(f"'{error.param}'", f"'{sent}'"), sent, error.code)


def _check_part_types(content: Any) -> None:
    """A content part's `type`, when given, is a string: vLLM 0.32.0 refuses any other
    (vllm/renderers/chat_utils.py `_parse_chat_message_content_mm_part`, "Invalid 'type' field in
    multimodal part."), and kvgate's own look-ups of the part by its type failed on a list or an
    object (a TypeError, a 500). A missing or null one is vLLM's to read from the part's keys."""
    if not isinstance(content, list):
        return
    for part in content:
        if isinstance(part, dict) and part.get("type") is not None and not isinstance(part["type"], str):
            raise VllmRefusal("Invalid 'type' field in multimodal part.", "type")


def _parse(translated: Translated, trust_request_chat_template: bool) -> ParsedRequest:
    """A completions or chat body's memory fields and input. A chat request's own template is
    refused unless trusted, as vLLM refuses it without --trust-request-chat-template: it is code,
    run by kvgate as well as by vLLM."""
    shape, body, reading = translated.shape, translated.body, translated.sampling
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidField("'model' must be a string.", "model")
    # Type checks only: the values are read as vLLM reads them (kvgate/sampling_params.py), and the
    # logprob limits are the server's --max-logprobs (kvgate/request.py check_limits).
    echo = _bool(body, "echo", False)
    if shape == "chat":
        _int(body, "max_completion_tokens", minimum=1)
        _int(body, "max_tokens", minimum=1)
        _bool(body, "logprobs", False)
        _int(body, "top_logprobs", minimum=-1)
    else:
        _int(body, "max_tokens", minimum=0 if echo else 1)
        _int(body, "logprobs", minimum=-1)
    _int(body, "min_tokens", minimum=0)
    _bool(body, "ignore_eos", False)
    _check_number(body, "temperature")
    n = _int(body, "n", minimum=1)
    best_of = _int(body, "best_of", minimum=1)
    if best_of is not None and best_of < (n or 1):
        raise InvalidField(f"'best_of' ({best_of}) must be at least 'n' ({n}).", "best_of")
    priority = _int(body, "priority", minimum=-(2**31))
    _int(body, "prompt_logprobs", minimum=-1)
    for penalty in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        _check_number(body, penalty)
    sampling = vllm_sampling_params(reading, body)
    stream = _bool(body, "stream", False)
    cache_salt = _cache_salt(body)
    truncation = None
    if reading in ("pooling", "completions", "chat"):  # CompletionRequest, ChatCompletionRequest too
        tokens = _int(body, "truncate_prompt_tokens", minimum=-1)
        side = body.get("truncation_side")
        if side not in (None, "left", "right"):
            raise InvalidField("'truncation_side' must be 'left' or 'right'.", "truncation_side")
        truncation = None if tokens is None else Truncation(tokens, side == "left")
    prompt_input: PromptInput | ChatInput
    if shape == "chat":
        prompt_input = _chat(body, trust_request_chat_template)
        from_text: tuple[bool, ...] = (True,)
    else:
        prompt_input = _prompt_input(body, translated.paired)
        from_text = _from_text(prompt_input)
    request = ValidRequest(
        model=model,
        stream=stream,
        sampling=sampling,
        prompts_from_text=from_text,
        best_of=best_of,
        max_tokens_param="max_completion_tokens"
        if shape == "chat" and body.get("max_completion_tokens") is not None
        else "max_tokens",
        priority=priority or 0,
        cache_salt=cache_salt,
        unseen_history=translated.unseen_history,
        context_caps_output=translated.context_caps_output,
        prefill_only=reading == "pooling",
        truncation=truncation,
    )
    return ParsedRequest(request, prompt_input)
