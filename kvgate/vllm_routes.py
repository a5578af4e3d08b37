"""vLLM's other generation routes, each read as the completions or chat request it amounts to.

vLLM 0.32.0 serves generation on more paths than /v1/completions and /v1/chat/completions (the
table is docs/routes.md). Each of them ends in the same engine call as one of those two: the
Responses API and Anthropic's Messages API build chat messages and render them with the chat
template, /inference/v1/generate takes token ids and a SamplingParams object, /invocations picks
chat or completions by the body's shape, and the pooling routes run a prompt through the model
without decoding. Translating each body into the equivalent completions or chat body once lets
one parser, tokenizer and predictor (kvgate/openai.py, kvgate/pipeline.py, kvgate/predict.py) serve them
all, and `tests/integration/test_sampling_params_vllm.py` checks the translation against vLLM's own
`to_sampling_params`.

Only the fields that decide memory are translated: the prompt (messages, system text, tools),
the output budget, the number of sequences, logprobs, penalties, temperature and structured
output. Everything else is vLLM's to judge; kvgate forwards the original body byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.errors import InvalidField
from kvgate.frozen_values import direct_init

# The body shapes kvgate parses (kvgate/openai.py).
Shape = Literal["completions", "chat"]
# How the output budget and sampling fields are read (kvgate/sampling_params.py): as a completions or
# chat body, as vLLM's SamplingParams object (/inference/v1/generate), or as a pooling request,
# which never decodes.
Sampling = Literal["completions", "chat", "engine", "pooling"]

Route = Literal[
    "completions",
    "chat",
    "invocations",
    "responses",
    "messages",
    "generate",
    "embeddings",
    "pooling",
    "classify",
    "score",
    "rerank",
    "tokenize",
]

# Path -> route, for every POST path of vLLM 0.32.0 that kvgate gates (docs/routes.md says which
# vLLM file serves each).
ROUTE_PATHS: dict[str, Route] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/invocations": "invocations",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/inference/v1/generate": "generate",
    "/v1/embeddings": "embeddings",
    "/v2/embed": "embeddings",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}


@direct_init
@dataclass(frozen=True)
class Translated:
    """A route's body as the completions or chat body vLLM effectively runs."""

    shape: Shape
    body: dict[str, Any]
    sampling: Sampling
    # /v1/responses with previous_response_id: vLLM prepends a stored conversation kvgate never
    # saw, so the prompt is taken to fill the context (the most it can be).
    unseen_history: bool = False
    # /inference/v1/generate: vLLM's engine takes max_tokens as sent and stops the request at
    # max_model_len (vllm/v1/core/sched/utils.py check_stop), where the OpenAI routes refuse a
    # prompt plus max_tokens past the context (before vLLM 0.32.0; from it they clamp max_tokens
    # but refuse a max_tokens past max_model_len: kvgate/memory/vllm_runner.py).
    context_caps_output: bool = False
    # /score and /rerank: the prompts are (query, document) pairs in a row, each pair one prompt
    # of both texts' token ids (kvgate/pipeline.py joins them).
    paired: bool = False
    # Translated field -> the field the client sent, for error messages that name what they sent.
    renames: tuple[tuple[str, str], ...] = ()


# Fields read the same way on every route (type-checked by kvgate/openai.py); every route's request
# model in vLLM 0.32.0 takes `cache_salt`.
_COMMON = ("model", "stream", "priority", "cache_salt")


def _common(body: dict[str, Any]) -> dict[str, Any]:
    return {name: body[name] for name in _COMMON if name in body}


def translate(route: Route, body: dict[str, Any]) -> Translated:
    """The completions or chat body this route's body amounts to; /invocations is dispatched by
    the caller (kvgate/openai.py), which needs to try chat first."""
    if route in ("completions", "chat"):
        return Translated(route, body, route)
    if route == "responses":
        return _responses(body)
    if route == "messages":
        return _anthropic_messages(body)
    if route == "generate":
        return _generate(body)
    if route in ("score", "rerank"):
        return _scoring(route, body)
    if route in ("embeddings", "pooling", "classify"):
        return _pooling(body)
    if route == "tokenize":
        return _tokenize(body)
    raise AssertionError(f"route {route} is dispatched by its caller")


# ---------------------------------------------------------------- /v1/responses


def _responses(body: dict[str, Any]) -> Translated:
    """vllm/entrypoints/openai/responses/utils.py construct_input_messages (instructions as a
    system message, then the input items as chat messages), ResponsesRequest.build_chat_params
    (continue the final message when it is an unfinished assistant message) and
    ResponsesRequest.to_sampling_params (max_output_tokens; logprobs only when `include` asks for
    message.output_text.logprobs; text.format as structured output). A prompt of vLLM's
    built-in tools (--tool-server) is not modelled."""
    if "input" not in body:
        raise InvalidField("'input' is required: a string or a list of input items.", "input")
    if body.get("background"):
        # vllm/entrypoints/openai/responses/serving.py _create_responses: a background request
        # answers at once and generates in a task that outlives the exchange, and the client's
        # hanging up does not abort it: no reservation kvgate holds could cover it.
        raise InvalidField(
            "kvgate does not admit background Responses requests ('background': true): vLLM would "
            "go on generating after the answer, outside any reservation. Send it without 'background'.",
            "background",
            "background_not_gated",
        )
    source = body["input"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidField("'instructions' must be a string.", "instructions")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(source, str):
        messages.append({"role": "user", "content": source})
        continue_final = False
    elif isinstance(source, list) and all(isinstance(item, dict) for item in source):
        for item in source:
            _response_item(item, messages)
        last = source[-1] if source else {}
        continue_final = last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
            "in_progress",
            "incomplete",
        )
    else:
        raise InvalidField("'input' must be a string or a list of input items.", "input")
    if not messages:
        raise InvalidField("'input' holds no message.", "input")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise InvalidField("'include' must be a list.", "include")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise InvalidField("'text' must be an object.", "text")
    out = _common(body) | {
        "messages": messages,
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "logprobs": bool(include and "message.output_text.logprobs" in include),
        # ResponsesRequest.build_tok_params leaves TokenizeParams.add_special_tokens at its
        # default, True (vllm/renderers/params.py): the rendered prompt gets the tokenizer's
        # special tokens too, unlike a chat completion's.
        "add_special_tokens": True,
    }
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    for name in _RESPONSES_SAMPLING:
        if name in body:
            out[name] = body[name]
    fmt = (text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        out["response_format"] = {"type": fmt["type"]}
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _response_tools(tools)
    # ResponsesRequest.build_chat_params (responses/protocol.py:432-447): reasoning.effort goes to
    # the chat template as a chat's reasoning_effort does, and to Harmony's system message
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidField("'previous_response_id' must be a string.", "previous_response_id")
    return Translated(
        "chat",
        out,
        "chat",
        unseen_history=previous is not None,
        renames=(("max_completion_tokens", "max_output_tokens"),),
    )


_RESPONSES_SAMPLING = (
    "top_logprobs",
    "temperature",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "structured_outputs",
    "chat_template_kwargs",
)


def _response_item(item: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """One input item as chat messages, as vllm/entrypoints/openai/responses/utils.py
    _construct_message_from_response_item does (function calls join the assistant message before
    them; tool outputs become tool messages)."""
    kind = item.get("type")
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments") if kind == "function_call" else item.get("input")
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": arguments if isinstance(arguments, str) else ""},
        }
        if previous is not None and isinstance(previous.get("tool_calls", []), list):
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        reasoning = parts[0].get("text", "") if isinstance(parts, list) and parts and isinstance(parts[0], dict) else ""
        messages.append({"role": "assistant", "reasoning": reasoning})
    elif isinstance(item.get("role"), str):
        messages.append({k: v for k, v in item.items() if k not in ("type", "status", "id")})
    else:
        raise InvalidField(f"Unsupported input item type: {json.dumps(kind)[:40]}.", "input")


def _response_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools as chat tools (vllm/entrypoints/openai/responses/utils.py
    construct_tool_dicts); built-in tools (web search, code interpreter) add no prompt text."""
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidField("'tools' must be a list of objects.", "tools")
    return [
        {
            "type": "function",
            "function": {
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
            },
        }
        for tool in tools
        if tool.get("type") == "function"
    ]


# ---------------------------------------------------------------- /v1/messages (Anthropic)


def _anthropic_messages(body: dict[str, Any]) -> Translated:
    """vllm/entrypoints/anthropic/serving.py AnthropicServingMessages.to_chat_completion_request:
    `system` (a string or text blocks) as a leading system message, content blocks as chat
    content, tool_use as tool calls, a user's tool_result as a tool message, and the required
    `max_tokens` as both max_tokens and max_completion_tokens."""
    if not isinstance(body.get("model"), str):
        raise InvalidField("'model' is required and must be a string.", "model")
    if body.get("max_tokens") is None:
        raise InvalidField("'max_tokens' is required.", "max_tokens")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not all(isinstance(m, dict) for m in raw_messages):
        raise InvalidField("'messages' must be a list of messages.", "messages")
    messages: list[dict[str, Any]] = []
    system = _anthropic_system(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in raw_messages:
        _anthropic_message(message, messages)
    out = _common(body) | {
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "max_completion_tokens": body["max_tokens"],
    }
    for name in ("temperature", "chat_template_kwargs"):
        if name in body:
            out[name] = body[name]
    output = body.get("output_config")
    fmt = output.get("format") if isinstance(output, dict) else None
    if isinstance(fmt, dict) and fmt.get("schema"):  # AnthropicJsonOutputFormat.json_schema's alias
        out["response_format"] = {"type": "json_schema"}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise InvalidField("'tools' must be a list of objects.", "tools")
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
        ]
    return Translated("chat", out, "chat")


def _anthropic_system(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list) and all(isinstance(block, dict) for block in system):
        return "".join(block["text"] for block in system if isinstance(block.get("text"), str))
    raise InvalidField("'system' must be a string or a list of text blocks.", "system")


def _anthropic_message(message: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidField("Each message must have a string 'role'.", "messages")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise InvalidField("A message's 'content' must be a string or a list of content blocks.", "messages")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            messages.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": _tool_result_text(block)}
            )
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    out: dict[str, Any] = {"role": role}
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if role == "system":
        if parts:
            messages.append({"role": "system", "content": "".join(p["text"] for p in parts)})
    elif not (role == "user" and "content" not in out):
        messages.append(out)


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            item["text"]
            for item in content
            if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str)
        )
    return ""


# ---------------------------------------------------------------- /inference/v1/generate


def _generate(body: dict[str, Any]) -> Translated:
    """vllm/entrypoints/scale_out/token_in_token_out/protocol.py GenerateRequest: `token_ids`
    (non-empty, non-negative) and a `sampling_params` object read as vLLM's SamplingParams; a
    missing max_tokens is what the context leaves (serving.py applies get_max_tokens)."""
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise InvalidField("'sampling_params' is required and must be an object.", "sampling_params")
    if "token_ids" not in body:
        raise InvalidField("'token_ids' is required: a non-empty list of token ids.", "token_ids")
    out = params | _common(body) | {"prompt": body["token_ids"]}
    out.pop("echo", None)
    return Translated("completions", out, "engine", context_caps_output=True, renames=(("prompt", "token_ids"),))


# ---------------------------------------------------------------- /tokenize (passed through, bounded)


def _tokenize(body: dict[str, Any]) -> Translated:
    """A /tokenize body as the prompt vLLM 0.32.0 renders and tokenizes for it
    (vllm/entrypoints/serve/tokenize/protocol.py): TokenizeCompletionRequest's `prompt` (one
    string, add_special_tokens default true) or TokenizeChatRequest's `messages`, rendered as a
    chat completion's (add_generation_prompt default true, add_special_tokens default false,
    `tools`, the request's own template). Not gated: kvgate prepares it only to bound the work it
    forwards (kvgate/passthrough_body.py), read as a prefill-only request that asks for no output."""
    messages = body.get("messages")
    if not isinstance(messages, list):  # pydantic's smart union takes the chat form when it validates
        special = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
        return Translated("completions", _common(body) | special | {"prompt": body.get("prompt")}, "pooling")
    chat = {name: body[name] for name in _TOKENIZE_CHAT if name in body}
    return Translated("chat", _common(body) | chat | {"messages": messages}, "pooling")


_TOKENIZE_CHAT = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)


# ---------------------------------------------------------------- pooling: embeddings, pooling, classify, score, rerank


def _pooling(body: dict[str, Any]) -> Translated:
    """vllm/entrypoints/pooling/{embed,pooling,classify}/protocol.py: `input` (a string, strings,
    token ids or lists of them), chat `messages`, or /v2/embed's `texts` or `inputs` (text parts
    only). Gated as prefill-only requests (kvgate/sampling_params.py), with the tokenizer options of
    vllm/entrypoints/pooling/base/protocol.py: `add_special_tokens` (default true for `input`,
    false for `messages`, `CompletionRequestMixin` / `ChatRequestOptionsMixin`), a chat's
    `add_generation_prompt` (default false there, unlike a chat completion's), and
    `truncate_prompt_tokens` / `truncation_side` (`PoolingBasicRequestMixin`)."""
    truncation = {name: body[name] for name in _POOLING_TRUNCATION if name in body}
    messages = body.get("messages")
    source = body["input"] if "input" in body else body.get("texts")
    if messages is None and isinstance(source, list) and source and all(isinstance(item, dict) for item in source):
        messages = source  # EmbeddingChatInputRequest: `input` is a list of chat messages
    if messages is not None:
        chat = {"add_generation_prompt": False} | {name: body[name] for name in _POOLING_CHAT if name in body}
        return Translated("chat", _common(body) | chat | truncation | {"messages": messages}, "pooling")
    if source is None and body.get("inputs") is not None:  # /v2/embed's CohereEmbedInput list
        source = _texts(body["inputs"], "inputs")
    if "texts" in body or "inputs" in body:
        truncation = _cohere_truncation(body)
    if source is None:
        raise InvalidField("'input' is required: a string, a list of strings or of token ids.", "input")
    special = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
    return Translated(
        "completions",
        _common(body) | special | truncation | {"prompt": source},
        "pooling",
        renames=(("prompt", "input" if "input" in body else "texts"),),
    )


def _cohere_truncation(body: dict[str, Any]) -> dict[str, Any]:
    """/v2/embed's `truncate` and `max_tokens` as the truncation they amount to
    (vllm/entrypoints/pooling/embed/io_processor.py `_resolve_cohere_truncation`): by default
    ("END") each text is cut to the context, or to `max_tokens`; "START" keeps its end; "NONE"
    cuts nothing."""
    truncate = body.get("truncate", "END")
    if truncate not in ("NONE", "START", "END"):
        raise InvalidField("'truncate' must be NONE, START or END.", "truncate")
    if truncate == "NONE":
        return {}
    keep = body.get("max_tokens")
    return {"truncate_prompt_tokens": -1 if keep is None else keep} | (
        {"truncation_side": "left"} if truncate == "START" else {}
    )


# The chat fields of a pooling request that change its prompt (ChatRequestOptionsMixin), and the
# truncation fields of every pooling request (PoolingBasicRequestMixin).
_POOLING_CHAT = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)
_POOLING_TRUNCATION = ("truncate_prompt_tokens", "truncation_side")


def _scoring(route: Route, body: dict[str, Any]) -> Translated:
    """vllm/entrypoints/pooling/scoring/protocol.py: ScoreRequest pairs (text_1/text_2,
    data_1/data_2, queries/documents, queries/items) and RerankRequest (query, documents).
    Each pair is taken as one prompt of both texts, each encoded with its special tokens: what a
    cross-encoder runs (io_processor.py CrossEncoderIOProcessor.get_score_prompt encodes
    `tokenizer(text=query, text_pair=document)`; a Llama-style pair template `<s> A <s> B` is
    exactly both encodings, a BERT-style `[CLS] A [SEP] B [SEP]` one token less), and more than an
    embedding model runs, which embeds the query once and each document alone
    (BiEncoderIOProcessor)."""
    if route == "rerank":
        firsts: Any = [body.get("query")]
        seconds = body.get("documents")
    else:
        pair = next(
            (
                (a, b)
                for a, b in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
                if a in body
            ),
            None,
        )
        if pair is None:
            raise InvalidField("A score request needs text_1 and text_2 (or queries and documents).", "text_1")
        firsts, seconds = body.get(pair[0]), body.get(pair[1])
    firsts = _texts(firsts, "query" if route == "rerank" else "text_1")
    seconds = _texts(seconds, "documents" if route == "rerank" else "text_2")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise InvalidField("Score inputs must be one to many or pairwise of equal length.", "text_1")
    pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
    prompts = [text for pair in pairs for text in pair]
    truncation = {name: body[name] for name in _POOLING_TRUNCATION if name in body}
    return Translated("completions", _common(body) | truncation | {"prompt": prompts}, "pooling", paired=True)


def _texts(value: Any, param: str) -> list[str]:
    """A score side as its texts: a string, a list of strings, or documents whose `text` and
    content parts carry text (multimodal parts are not counted)."""
    items = value if isinstance(value, list) else [value]
    texts = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):
            content = item.get("content")
            parts = content if isinstance(content, list) else [item]
            texts.append(" ".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)))
        else:
            raise InvalidField(f"'{param}' must be a string, a list of strings or documents.", param)
    if not texts or not any(texts):
        raise InvalidField(f"'{param}' must not be empty.", param)
    return texts
