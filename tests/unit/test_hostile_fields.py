"""Every field of a completion and a chat request, and of a chat message, given a value of every
wrong kind, through kvgate's gated routes (in-process, a scripted backend: tests/support/
gated_exchange.py): each answer is a 200 (vLLM would judge it, and kvgate forwards it) or a 4xx in
OpenAI's shape, never an exception out of the handler (uvicorn's plain-text 500), and nothing stays
reserved.

Systematic where tests/integration/test_hostile_server.py's fuzz samples: a field kvgate reads and
one it only forwards are both here, with each value. The field lists are vLLM 0.32.0's request
models (vllm/entrypoints/openai/completion/protocol.py CompletionRequest, chat_completion/protocol.py
ChatCompletionRequest; OpenAI's message fields).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.composition import Runtime
from kvgate.http.gated_routes import GatedRoutes
from kvgate.settings import Settings
from kvgate.vllm_routes import Route
from support.gated_exchange import Client, ScriptedBackend, exchange

COMPLETION_FIELDS = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "prompt_embeds",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
    "best_of",
]
CHAT_FIELDS = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
]
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")
PART_FIELDS = ("type", "text", "image_url", "input_audio", "video_url")

# A value of every wrong kind: JSON's types, numbers past every range a field may have (json.dumps
# writes inf and nan as Infinity and NaN, which Python's json and vLLM's FastAPI both read),
# text Unicode makes awkward, and containers empty, nested and long.
HOSTILE: dict[str, Any] = {
    "null": None,
    "true": True,
    "false": False,
    "zero": 0,
    "minus-one": -1,
    "2^63": 2**63,
    "minus-2^63-1": -(2**63) - 1,
    "400-digits": 10**400,
    "float-max": 1.7976931348623157e308,
    "minus-1e308": -1e308,
    "denormal": 5e-324,
    "fraction": 0.5,
    "inf": math.inf,
    "minus-inf": -math.inf,
    "nan": math.nan,
    "empty-text": "",
    "nul": "\x00",
    "lone-surrogate": "\ud800",
    "noncharacter": "\uffff\U0010ffff",
    "combining": "a" + "\u0301" * 10_000,
    "text": "x",
    "empty-list": [],
    "list-of-null": [None],
    "nested-lists": [[[[[]]]]],
    "long-list": list(range(20_000)),
    "empty-object": {},
    "object": {"a": {"b": [1, "x", None]}, "type": "text"},
}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[Runtime, GatedRoutes]]:
    """One kvgate for the module (the ledger is checked after each request): a request it admits
    gets a short answer of its kind from the scripted backend."""
    rt = Runtime(Settings(model=str(tiny_model_dir), block_size=16, max_model_len=2048, num_gpu_blocks=1000))
    rt.configure_offline()
    ScriptedBackend().install(rt)
    yield rt, GatedRoutes(rt)
    rt.backend.pool.close()


async def assert_answered(served: tuple[Runtime, GatedRoutes], route: Route, body: dict[str, Any]) -> None:
    rt, routes = served
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    client = await exchange(routes, Client(body, path), route)
    assert client.raised is None, f"{client.raised!r} for {str(body)[:300]}"
    assert client.status is not None
    assert client.status == 200 or 400 <= client.status < 500, client.body[:300]
    if client.status >= 400:
        error = client.error()  # OpenAI's four keys
        assert error["message"], error
    ledger = rt.gate.ledger
    assert (ledger.in_flight, ledger.kv_blocks, rt.gate.waiting) == (0, 0, 0)


def _values() -> list[Any]:
    return list(HOSTILE.values())


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
async def test_every_completion_field_of_every_wrong_kind(served: tuple[Runtime, GatedRoutes], field: str) -> None:
    for value in _values():
        await assert_answered(
            served, "completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, field: value}
        )


@pytest.mark.parametrize("field", CHAT_FIELDS)
async def test_every_chat_field_of_every_wrong_kind(served: tuple[Runtime, GatedRoutes], field: str) -> None:
    base = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for value in _values():
        await assert_answered(served, "chat", base | {field: value})


@pytest.mark.parametrize("field", MESSAGE_FIELDS)
async def test_every_message_field_of_every_wrong_kind(served: tuple[Runtime, GatedRoutes], field: str) -> None:
    for value in _values():
        message = {"role": "user", "content": "hi", field: value}
        await assert_answered(served, "chat", {"model": "tiny-llama", "messages": [message], "max_tokens": 4})


async def test_a_message_and_a_conversation_of_every_wrong_kind(served: tuple[Runtime, GatedRoutes]) -> None:
    for value in _values():
        await assert_answered(served, "chat", {"model": "tiny-llama", "messages": [value], "max_tokens": 4})
        await assert_answered(served, "chat", {"model": "tiny-llama", "messages": value, "max_tokens": 4})


@pytest.mark.parametrize("field", PART_FIELDS)
async def test_every_content_part_field_of_every_wrong_kind(served: tuple[Runtime, GatedRoutes], field: str) -> None:
    for value in _values():
        part = {"type": "text", "text": "hi", field: value}
        for content in ([part], [value], [part, {"type": "image_url", field: value}]):
            message = {"role": "user", "content": content}
            await assert_answered(served, "chat", {"model": "tiny-llama", "messages": [message], "max_tokens": 4})
