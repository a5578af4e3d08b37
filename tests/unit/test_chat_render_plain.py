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
from kvgate.chat_template import ChatRenderer, TokenizationError, render_chat
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

# Claude Code's per-request system header, whose first line vLLM drops from a system message.
BILLING_HEADERS = ["x-anthropic-billing-header: cc_version=1", "x-anthropic-billing-header: v\nBe brief."]
contents = st.one_of(
    st.sampled_from(
        ["", "Hello", "{{ bos_token }}", "<s>", "</s>", "<|im_end|>", "{% raw %}", "\n\n", " ", *BILLING_HEADERS]
    ),
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
            m.setattr(chat_template, "_plain_messages", lambda *_: False)
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


# An "openai"-format template: content stays a list of parts, whose texts it writes itself.
PARTS = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def renderers(tokenizers: dict[str, Any], tiny_model_dir: Path) -> dict[str, tuple[Any, ChatRenderer]]:
    """One renderer a tokenizer, kept across every example as LocalTokenizer keeps its own."""
    from transformers import AutoTokenizer

    parts = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    parts.chat_template = PARTS
    return {name: (tok, ChatRenderer(tok)) for name, tok in {**tokenizers, "parts": parts}.items()}


any_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "critic"]),
                "content": contents,
            },
            optional={"name": st.sampled_from(["alice", "b o b"])},
        ),
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "critic"]),
                "content": st.one_of(
                    st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": contents}), max_size=2)
                ),
            }
        ),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=any_messages,
    add_generation_prompt=st.booleans(),
    continue_final_message=st.booleans(),
    template_kwargs=kwargs,
    namespace_aliases=st.booleans(),
)
def test_a_kept_renderer_renders_as_a_fresh_one(
    renderers: dict[str, tuple[Any, ChatRenderer]],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
    namespace_aliases: bool,
) -> None:
    """What a renderer keeps from one chat to the next (the settled options of chats that set
    none, the template's globals and special tokens) changes no render: each one, or its
    refusal, is what a renderer made for it alone gives, for plain and other messages, both
    content formats and every combination of the generation flags."""
    body: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs
    chat = _chat(body)
    for tok, kept in renderers.values():
        outcomes = []
        for renderer in (kept, ChatRenderer(tok)):
            try:
                outcomes.append(renderer.render(chat, namespace_aliases))
            except TokenizationError as error:
                outcomes.append(("refused", str(error)))
        assert outcomes[0] == outcomes[1]


def test_each_tokenizer_renders_with_its_own_template(renderers: dict[str, tuple[Any, ChatRenderer]]) -> None:
    """The renderer keeps nothing across tokenizers: a tokenizer loaded anew (a backend sync
    that loads another model folder) renders with its own template, the last one's chats
    notwithstanding."""
    chat = _chat({"messages": [{"role": "user", "content": "Hi"}]})
    rendered = {name: renderer.render(chat) for name, (_, renderer) in renderers.items()}
    assert rendered["chatml"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered["parts"] == "user:[text:Hi]assistant:"  # trim_blocks eats the newline
    assert rendered["llama3"].startswith("<s><|start_header_id|>user<|end_header_id|>\n\nHi")
    assert len(set(rendered.values())) == len(rendered)


def test_a_local_tokenizer_keeps_one_renderer_for_its_template(tiny_model_dir: Path) -> None:
    """LocalTokenizer renders through the renderer it made with its tokenizer; another
    LocalTokenizer has another."""
    from kvgate.tokens import LocalTokenizer

    first, second = LocalTokenizer(tiny_model_dir), LocalTokenizer(tiny_model_dir)
    chat = _chat({"messages": [{"role": "user", "content": "Hi"}]})
    assert first.render_chat(chat) == second.render_chat(chat) == render_chat(first._tok, chat)
    assert first._renderer.tokenizer is first._tok
    assert first._renderer is not second._renderer


@settings(max_examples=300, deadline=None)
@given(messages=any_messages, wrap=st.booleans())
def test_a_message_is_handed_to_the_template_as_vllm_hands_it(messages: list[dict[str, Any]], wrap: bool) -> None:
    """The shortcut for a message of one string content (chat_template._message_of) gives what
    the parts machinery (chat_template._message, vLLM's preprocessing) gives, or its refusal."""
    for message in messages:
        outcomes = []
        for convert in (chat_template._message_of, chat_template._message):
            try:
                outcomes.append(convert(message, wrap))
            except TokenizationError as error:
                outcomes.append(("refused", str(error)))
        assert outcomes[0] == outcomes[1]
