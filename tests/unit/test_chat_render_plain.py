"""kvgate/chat_template.py renders a plain chat (string messages, the operator's template, no tools,
documents or final message to continue) straight from the compiled template, without
apply_chat_template's copies of the conversation: the same text, or the same refusal, as
apply_chat_template gives, on generated chats and several template shapes; anything else goes
through apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate import chat_template
from kvgate.chat_template import TokenizationError, render_chat
from kvgate.openai import parse_request
from support.tiny_model import CHAT_TEMPLATE

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# A template variable from chat_template_kwargs, a message's name, and what the template does not see.
VARIABLES = (
    "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}: {{ m.content }}"
    "{% if m.tool_calls is defined %}[calls]{% endif %}\n{% endfor %}"
    "{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}"
    "{% if tools %}tools{% endif %}{% if documents %}documents{% endif %}{{ pad_token }}{{ unk_token }}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEMPLATES = {"llama3": CHAT_TEMPLATE, "chatml": CHATML, "alternating": ALTERNATING, "variables": VARIABLES}

contents = st.one_of(
    st.sampled_from(["", "Hello", "{{ bos_token }}", "<s>", "</s>", "<|im_end|>", "{% raw %}", "\n\n", " "]),
    st.text(max_size=30),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": contents},
        optional={"name": st.sampled_from(["alice", "b o b"])},
    ),
    min_size=1,
    max_size=5,
)
kwargs = st.one_of(st.none(), st.just({}), st.just({"enable_thinking": True}), st.just({"enable_thinking": False}))


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = {}
    for name, template in TEMPLATES.items():
        tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
        tok.chat_template = template
        out[name] = tok
    return out


def _chat(body: dict[str, Any]) -> Any:
    return parse_request("chat", json.dumps({"model": "m", **body}).encode()).input


def _render(tok: Any, chat: Any) -> str | tuple[str, str]:
    try:
        rendered = render_chat(tok, chat)
    except TokenizationError as error:
        return ("refused", str(error))
    assert isinstance(rendered, str)
    return rendered


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=messages, add_generation_prompt=st.booleans(), template_kwargs=kwargs)
def test_a_plain_chat_renders_as_apply_chat_template_does(
    tokenizers: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> None:
    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs
    chat = _chat(body)
    for tok in tokenizers.values():
        fast = _render(tok, chat)
        with monkeypatch.context() as m:
            m.setattr(chat_template, "_plain_chat", lambda *_: False)
            assert _render(tok, chat) == fast


def test_a_plain_chat_never_calls_apply_chat_template(
    tokenizers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above compares two paths only if the plain one is taken."""
    tok = tokenizers["llama3"]
    chat = _chat({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
    expected = render_chat(tok, chat)
    monkeypatch.setattr(type(tok), "apply_chat_template", lambda *a, **k: pytest.fail("not a plain render"))
    assert render_chat(tok, chat) == expected
    assert expected.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.</s>")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            },
            id="tools",
        ),
        pytest.param(
            {
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            id="continue-final-message",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "Hi"}], "documents": [{"title": "t", "text": "x"}]},
            id="documents",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a", "reasoning": "r"}]},
            id="reasoning-to-alias",
        ),
        pytest.param(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                ]
            },
            id="tool-calls",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": {"a": 1}}},
            id="non-scalar-kwarg",
        ),
    ],
)
def test_other_chats_go_through_apply_chat_template(
    tokenizers: dict[str, Any], monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    tok = tokenizers["variables"]
    chat = _chat(body)
    calls = []
    original = type(tok).apply_chat_template

    def counted(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append(kw)
        return original(self, *args, **kw)

    monkeypatch.setattr(type(tok), "apply_chat_template", counted)
    render_chat(tok, chat)
    assert len(calls) == 1
