"""Hostile bodies (issue 15, findings 1, 2 and 4): each costs kvgate bounded memory and event-loop
time, and each is answered with a 400 in OpenAI's shape, never a 500.

The parsing and tokenizing layers are tested directly here; tests/integration/test_hostile_server.py sends
the same bodies through a running kvgate.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import unicodedata
from collections.abc import Awaitable, Callable
from pathlib import Path

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer, normalizers

from bench.work_cost import reset_peak_rss, vm_bytes
from kvgate.chat_template import TokenizationError
from kvgate.errors import KvgateError
from kvgate.http.errors import status_of
from kvgate.openai import MAX_JSON_VALUES, MAX_PROMPTS, parse_request
from kvgate.request import ChatInput, PromptInput
from kvgate.tokens import LocalTokenizer, PromptTooLong, max_chars_per_token
from support.hostile_templates import STRING_BUILDERS
from support.waiting import wait_for_async

CHAT = [{"role": "user", "content": "hi"}]
VLLM_UNTRUSTED = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def refusal(endpoint: str, raw: bytes, **kwargs: bool) -> KvgateError:
    with pytest.raises(KvgateError) as caught:
        parse_request(endpoint, raw, **kwargs)  # type: ignore[arg-type]
    assert status_of(caught.value) == 400
    return caught.value


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError in json
        b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",  # over Python's 4,300 digits
        b'{"prompt": "\\ud800"}',  # lone surrogate: no encoder takes it
        b'{"prompt": "hi", "model": "\\udfff"}',
        b'{"prompt": ["ok", "\\uDBFF x"]}',
    ],
    ids=["nested", "digits", "surrogate-prompt", "surrogate-model", "surrogate-upper"],
)
def test_bodies_python_cannot_use_are_invalid_json(raw: bytes) -> None:
    assert refusal("completions", raw).code == "invalid_json"


def test_surrogates_in_messages_and_paired_ones() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode()
    assert refusal("chat", raw).code == "invalid_json"
    paired = json.dumps({"prompt": "\U0001f600"}).encode()  # escaped as a surrogate pair: fine
    assert b"\\ud83d" in paired
    assert parse_request("completions", paired).input == PromptInput(("\U0001f600",))


# Text that is not UTF-8, as raw bytes inside a JSON string (issue 28): an encoded lone surrogate,
# CESU-8 (a surrogate pair encoded as two 3-byte sequences), overlongs, a byte no UTF-8 holds and
# a sequence cut short.
INVALID_UTF8 = {
    "lone-surrogate": b"a\xed\xa0\x80",
    "cesu-8": b"\xed\xa0\xbd\xed\xb8\x80",
    "overlong-2": b"\xc0\xaf",
    "overlong-3": b"\xe0\x80\xaf",
    "ff": b"x\xff",
    "truncated": b"a\xe2\x82",
}


@pytest.mark.parametrize("bad", INVALID_UTF8.values(), ids=INVALID_UTF8.keys())
@pytest.mark.parametrize(
    ("route", "template", "param"),
    [
        ("completions", b'{"model": "m", "prompt": "%s", "max_tokens": 4}', "prompt"),
        ("completions", b'{"model": "m%s", "prompt": "hi"}', "model"),
        ("completions", b'{"prompt": "hi", "user": "%s"}', "user"),  # a field kvgate never reads
        ("completions", b'{"prompt": "hi", "stop": ["ok", "%s"]}', "stop[1]"),
        (
            "chat",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages[0].content[0].text",
        ),
        ("responses", b'{"input": "%s"}', "input"),
        ("messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": "%s"}]}', "messages[0].content"),
        ("embeddings", b'{"input": ["ok", "%s"]}', "input[1]"),
        ("rerank", b'{"query": "q", "documents": ["%s"]}', "documents[0]"),
        ("generate", b'{"token_ids": [1], "sampling_params": {"stop": "%s"}}', "sampling_params.stop"),
    ],
)
def test_text_that_is_not_utf8_is_a_400_naming_the_field(route: str, template: bytes, param: str, bad: bytes) -> None:
    error = refusal(route, template % bad)
    assert (error.code, error.param) == ("invalid_json", param)
    assert "not valid UTF-8" in error.message
    json.dumps(error.message).encode()  # the error body itself can be written


def test_invalid_text_in_a_key_is_named_with_escapes() -> None:
    error = refusal("completions", b'{"prompt": "hi", "x\xed\xa0\x80": 1}')
    assert error.param == "x\\udced\\udca0\\udc80"  # the bytes, as the escapes an encoder can write
    error.param.encode("utf-8")


@pytest.mark.parametrize(
    "encoding", ["utf-8-sig", "utf-16", "utf-32", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"]
)
def test_bodies_in_the_encodings_vllm_reads_still_parse(encoding: str) -> None:
    """vLLM's json.loads(bytes) reads UTF-8 with a BOM, UTF-16 and UTF-32, with a BOM or told by
    the NUL bytes (json.detect_encoding): a little-endian body opens with `{` then NUL."""
    raw = json.dumps({"prompt": "h\u00e9 \U0001f600"}, ensure_ascii=False).encode(encoding)
    assert parse_request("completions", raw).input == PromptInput(("h\u00e9 \U0001f600",))
    lone = '{"prompt": "\\ud800"}'.encode(encoding)  # an escaped lone surrogate in UTF-16: refused too
    assert refusal("completions", lone).param == "prompt"


@pytest.mark.parametrize("name", ["n", "best_of", "max_tokens"])
def test_huge_integers_are_refused_naming_the_field(name: str) -> None:
    body = {"prompt": "hi", name: 10**400}
    error = refusal("completions", json.dumps(body).encode())
    assert error.param == name
    assert "at most" in error.message


def test_huge_token_ids_are_not_a_prompt() -> None:
    assert refusal("completions", json.dumps({"prompt": [1, 10**400]}).encode()).param == "prompt"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [' + b"1," * (15 * 2**20) + b"1]}",  # 30 MiB of token ids: 11 s before
        b'{"prompt": [' + b"[1]," * (7 * 2**20) + b"[1]]}",  # 7 million prompts: 38 s before
        json.dumps({"messages": [{"role": "user", "content": "a"}] * 2**20}).encode(),
    ],
    ids=["token-ids", "prompt-lists", "messages"],
)
def test_bodies_of_too_many_values_are_413_before_parsing(raw: bytes) -> None:
    started = time.perf_counter()
    with pytest.raises(KvgateError) as caught:
        parse_request("chat" if raw.startswith(b'{"messages"') else "completions", raw)
    assert time.perf_counter() - started < 0.5
    assert (status_of(caught.value), caught.value.code) == (413, "request_too_large")
    assert f"{MAX_JSON_VALUES:,}" in caught.value.message


def test_commas_inside_a_text_are_not_values() -> None:
    text = "a," * MAX_JSON_VALUES
    assert parse_request("completions", json.dumps({"prompt": text}).encode()).input == PromptInput((text,))
    ids = list(range(MAX_JSON_VALUES - 10))
    assert parse_request("completions", json.dumps({"prompt": ids}).encode()).input == PromptInput((tuple(ids),))


def test_prompt_count_is_bounded_before_any_work() -> None:
    body = json.dumps({"prompt": ["a"] * (MAX_PROMPTS + 1)}).encode()
    error = refusal("completions", body)
    assert error.param == "prompt"
    assert f"{MAX_PROMPTS:,}" in error.message
    most = parse_request("completions", json.dumps({"prompt": ["a"] * MAX_PROMPTS}).encode())
    assert most.input == PromptInput(("a",) * MAX_PROMPTS)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": CHAT, "chat_template": "{{ 'x' }}"},
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
    ],
    ids=["field", "kwargs"],
)
def test_request_chat_template_refused_unless_trusted(body: dict) -> None:
    raw = json.dumps(body).encode()
    error = refusal("chat", raw)
    assert (error.code, error.param, error.message) == ("untrusted_chat_template", "chat_template", VLLM_UNTRUSTED)
    assert isinstance(parse_request("chat", raw, trust_request_chat_template=True).input, ChatInput)


# ------------------------------------------------------------------ tokenization, bounded


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer(tiny_model_dir, template_seconds=0.5)


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tokenizer: LocalTokenizer) -> None:
    longest = tokenizer.max_chars_per_token
    assert longest is not None
    assert longest >= max(len(t) for t in tokenizer._tok.get_vocab())
    prompt = "x" * (30 * 1024 * 1024)
    started = time.perf_counter()
    with pytest.raises(PromptTooLong) as caught:
        await tokenizer.encode_prompt(prompt, max_tokens=1024)
    assert time.perf_counter() - started < 0.05  # tokenizing 30 MiB took 22 s before
    assert caught.value.tokens_at_least > 1024
    assert "maximum context length is 1024" in str(caught.value)


async def test_the_character_bound_never_refuses_a_prompt_that_fits(tokenizer: LocalTokenizer) -> None:
    """At the bound the text is still tokenized exactly; the bound only skips hopeless texts."""
    longest = tokenizer.max_chars_per_token
    assert longest is not None
    text = ("hello world " * 100_000)[: 64 * longest]
    ids = await tokenizer.encode_prompt(text, max_tokens=64)
    assert ids == await tokenizer.encode_prompt(text)
    assert len(ids) < 64 * longest  # tokenized, and far fewer tokens than the bound's worst case


async def max_loop_gap(work: Callable[[], Awaitable[object]]) -> tuple[float, float, object]:
    """Run `work` while a 10 ms ticker measures the longest the event loop was held."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.01)  # the ticker's period: what it measures is how late it wakes
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    try:
        result: object = await work()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        result = exc
    elapsed = time.perf_counter() - started
    done = True
    await ticker
    return elapsed, max(gaps, default=0.0), result


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for i in range(100) %}{{ 'ab ' * 33333 }}{% endfor %}", "budget of"),  # 1.9 GiB before
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "0.5 s"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            "budget",
        ),
        ("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}", "output passed its budget"),
    ],
    ids=["multiply", "nested-loops", "doubling", "output"],
)
async def test_a_trusted_request_template_renders_within_budget(
    tokenizer: LocalTokenizer, template: str, reason: str
) -> None:
    chat = ChatInput(messages=[{"role": "user", "content": "y" * 1000}], chat_template=template)
    threads = threading.active_count()
    elapsed, gap, result = await max_loop_gap(lambda: tokenizer.encode_chat(chat, max_tokens=1024))
    assert isinstance(result, TokenizationError), result
    assert reason in str(result), result
    # Bounds that a blocked loop or a budget that never fires fail by far (the nested loops alone
    # run for hours; the budget is 0.5 s), with room for a loaded 2-core machine's scheduling: one
    # run at load 6 took the rendering thread past 1 s.
    assert elapsed < 3.0
    assert gap < 0.4
    await wait_for_async(  # the rendering thread was stopped, not left spinning
        lambda: threading.active_count() <= threads, timeout_s=1, what="the rendering thread to stop"
    )


def _peak_rss_reset() -> int:
    """This process's resident memory, with its peak (VmHWM) reset to it."""
    reset_peak_rss()
    return vm_bytes("VmRSS")


@pytest.mark.parametrize("template", STRING_BUILDERS.values(), ids=STRING_BUILDERS)
async def test_a_trusted_template_cannot_build_a_string_past_its_budget(
    tokenizer: LocalTokenizer, template: str
) -> None:
    """Every string-building operation is sized before it allocates: a 400 within the time
    budget, and this process's peak memory grows by less than 64 MiB."""
    chat = ChatInput(messages=CHAT, chat_template=template)
    before = _peak_rss_reset()
    elapsed, _, result = await max_loop_gap(lambda: tokenizer.encode_chat(chat, max_tokens=1024))
    assert isinstance(result, TokenizationError), result
    assert "budget" in str(result), result
    assert vm_bytes("VmHWM") - before < 64 * 2**20
    assert elapsed < 3.0


async def test_a_trusted_template_within_budget_builds_what_jinja_builds(tokenizer: LocalTokenizer) -> None:
    """The counted operations return what jinja2's own do."""
    template = (
        "{{ bos_token }}{{ range(3)|join('-') }} {{ 'a' ~ 1 ~ 'b' }} {{ '%3s|%-3d' % ('x', 7) }} "
        "{{ 'x'|center(5) }} {{ '%s!'|format('y') }} {{ '{}{}'.format('p', 'q') }} {{ 'ab'.replace('b', 'c') }} "
        "{{ 'a\nb'|indent(2, first=True) }} {{ ['u', 'v']|join(attribute=0) }} {{ 'q'.ljust(3) }}|"
    )
    chat = ChatInput(messages=CHAT, chat_template=template, add_generation_prompt=False)
    rendered = await asyncio.to_thread(tokenizer.render_chat, chat)
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
    assert rendered == plain.render(bos_token=tokenizer._tok.bos_token)
    assert "0-1-2 a1b   x|7     x   y! pq ac   a\n  b uv q  |" in rendered


async def test_a_trusted_request_template_renders_as_the_model_template_would(tokenizer: LocalTokenizer) -> None:
    own = tokenizer._tok.chat_template
    plain = await tokenizer.encode_chat(ChatInput(messages=CHAT))
    budgeted = await tokenizer.encode_chat(ChatInput(messages=CHAT, chat_template=own), max_tokens=1024)
    assert budgeted == plain


async def test_a_batch_of_prompts_is_one_encode_with_the_same_ids(tokenizer: LocalTokenizer) -> None:
    prompts = ["hello world", "x" * 50, "Grüße \U0001f680"]
    batch = await tokenizer.encode_prompts(prompts, max_tokens=1024)
    assert batch == [await tokenizer.encode_prompt(p) for p in prompts]
    assert [list(ids) for ids in batch] == [tokenizer._tok.encode(p) for p in prompts]


@pytest.mark.parametrize(
    ("normalizer", "factor"),
    [
        (None, 1),
        (normalizers.NFC(), 4),
        (normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]), 1),
        (normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), 4),
        (normalizers.StripAccents(), None),
        (normalizers.Strip(), None),
        (normalizers.Replace(" ", ""), None),
    ],
    ids=["none", "nfc", "sentencepiece", "nfkc-lower", "strip-accents", "strip", "replace-to-nothing"],
)
def test_the_character_bound_follows_the_normalizer(
    tiny_model_dir: Path, normalizer: object, factor: int | None
) -> None:
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.normalizer = normalizer
    longest = max(len(entry) for entry in rust.get_vocab(with_added_tokens=True))
    bound = max_chars_per_token(rust)
    assert bound == (None if factor is None else factor * longest)
    if bound is not None:  # what NFC composes most: 4 code points into one (U+1FAF)
        text = unicodedata.normalize("NFD", "\u1faf") * 2000
        assert len(rust.encode(text).ids) >= len(text) / bound


@pytest.mark.parametrize("value", [10**400, "many", [1.0]])
def test_a_float_sampling_field_out_of_float_range_or_not_a_number_is_400(value: object) -> None:
    """Found by the fuzz: presence_penalty of a 400-digit integer overflowed float() into a 500."""
    error = refusal("completions", json.dumps({"prompt": "hi", "presence_penalty": value}).encode())
    assert error.param == "presence_penalty"


@pytest.mark.parametrize("value", [True, 5, 1.5, 10**400], ids=["bool", "int", "float", "huge"])
@pytest.mark.parametrize("name", ["allowed_token_ids", "bad_words"])
def test_a_list_field_given_a_number_or_boolean_is_400(name: str, value: object) -> None:
    """Found by test_hostile_fields.py: iterating the value raised a TypeError, a 500."""
    for route, body in (("completions", {"prompt": "hi"}), ("chat", {"messages": CHAT})):
        assert refusal(route, json.dumps(body | {name: value}).encode()).param == name


def test_a_content_part_type_that_is_no_string_is_vllms_400() -> None:
    """vLLM 0.32.0 refuses it ("Invalid 'type' field in multimodal part."); kvgate's look-up of a
    list or object type raised a TypeError, a 500 (found by test_hostile_fields.py). A null type is
    vLLM's to read from the part's keys, and still parses."""
    for kind in ([], {}, 5, True):
        message = {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": kind, "text": "x"}]}
        error = refusal("chat", json.dumps({"messages": [message]}).encode())
        assert error.message.startswith("Invalid 'type' field in multimodal part.")
        assert error.param == "type"
    untyped = {"role": "user", "content": [{"type": None, "image_url": {"url": "http://example.com/a.png"}}]}
    assert isinstance(parse_request("chat", json.dumps({"messages": [untyped]}).encode()).input, ChatInput)
