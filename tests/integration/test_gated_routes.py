"""vLLM 0.32.0's other generation routes are gated like completions and chat (issue 15, finding 7):
each body is parsed, tokenized, predicted and admitted, forwarded byte for byte, and released;
a bad body is a 400 in OpenAI's shape that never reaches the backend.

A scripted backend answers; kvgate runs as `kvgate serve` with the tiny model's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.fake_backend import FakeBackend
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty

MAX_MODEL_LEN = 1024  # the scripted backend's /v1/models
USER = [{"role": "user", "content": "hello there"}]

VALID = {
    "/invocations": {"model": "tiny-llama", "messages": USER, "max_tokens": 5},
    "/v1/responses": {
        "model": "tiny-llama",
        "input": "hello there",
        "instructions": "Be terse.",
        "max_output_tokens": 5,
    },
    "/v1/messages": {"model": "tiny-llama", "system": "Be terse.", "messages": USER, "max_tokens": 5},
    "/inference/v1/generate": {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5}},
    "/v1/embeddings": {"model": "tiny-llama", "input": ["hello there", "general kenobi"]},
    "/v2/embed": {"model": "tiny-llama", "texts": ["hello there"]},
    "/pooling": {"model": "tiny-llama", "input": [5, 6, 7]},
    "/classify": {"model": "tiny-llama", "input": "hello there"},
    "/score": {"model": "tiny-llama", "text_1": "hello", "text_2": ["a", "b"]},
    "/v1/score": {"model": "tiny-llama", "queries": ["q1", "q2"], "documents": ["a", "b"]},
    "/rerank": {"model": "tiny-llama", "query": "hello", "documents": ["a", "b", "c"]},
    "/v1/rerank": {"model": "tiny-llama", "query": "hello", "documents": [{"text": "a"}]},
    "/v2/rerank": {"model": "tiny-llama", "query": "hello", "documents": ["a"]},
}

BAD = [
    ("/invocations", {"model": "tiny-llama"}, "messages"),
    ("/invocations", {"messages": "hi", "max_tokens": 5}, "messages"),
    ("/invocations", {"prompt": "hi", "n": "two"}, "n"),
    ("/v1/responses", {"model": "tiny-llama"}, "input"),
    ("/v1/responses", {"input": 7}, "input"),
    ("/v1/responses", {"input": [{"type": "no_such_item"}]}, "input"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "previous_response_id": 3}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),  # would outlive its reservation
    ("/v1/messages", {"model": "tiny-llama", "messages": USER}, "max_tokens"),
    ("/v1/messages", {"messages": USER, "max_tokens": 5}, "model"),
    (
        "/v1/messages",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": 5}], "max_tokens": 5},
        "messages",
    ),
    ("/v1/messages", {"model": "tiny-llama", "system": 5, "messages": USER, "max_tokens": 5}, "system"),
    ("/inference/v1/generate", {"token_ids": [1, 2]}, "sampling_params"),
    ("/inference/v1/generate", {"token_ids": [-1], "sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 0}}, "n"),
    ("/v1/embeddings", {"model": "tiny-llama"}, "input"),
    ("/v1/embeddings", {"input": [True]}, "input"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/rerank", {"query": 5, "documents": ["a"]}, "query"),
]


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, backend: FakeBackend, tiny_model_dir: Path) -> KvgateServer:
    return kvgate_factory(backend.base_url, tiny_model_dir)


@pytest.fixture(scope="module")
def client(kvgate: KvgateServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=kvgate.base_url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("path", list(VALID))
def test_each_route_is_gated_and_forwarded_byte_for_byte(
    path: str, client: httpx.Client, backend: FakeBackend, kvgate: KvgateServer
) -> None:
    raw = json.dumps(VALID[path]).encode()
    before = len(backend.received)
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert int(response.headers["x-kvgate-kv-blocks"]) >= 1  # the gate admitted it with a reservation
    assert [(r.path, r.body) for r in backend.received[before:]] == [(path, raw)]
    assert_ledger_empty(kvgate)


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}-{param}" for p, _, param in BAD])
def test_bad_bodies_are_refused_before_the_backend(
    path: str, body: dict, param: str, client: httpx.Client, backend: FakeBackend, kvgate: KvgateServer
) -> None:
    before = len(backend.received)
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert f"'{param}'" in error["message"] or param in ("messages", "text_1", "text_2", "query", "input"), error
    assert len(backend.received) == before
    assert_ledger_empty(kvgate)


@pytest.mark.parametrize("path", list(VALID))
def test_trailing_slash_and_other_methods_never_reach_the_backend(
    path: str, client: httpx.Client, backend: FakeBackend
) -> None:
    before = len(backend.received)
    slashed = client.post(path + "/", json=VALID[path])
    assert slashed.status_code == 404
    assert slashed.json()["error"]["code"] == "route_not_forwarded"
    assert "location" not in slashed.headers
    assert client.get(path).status_code == 405
    assert len(backend.received) == before


def explain(client: httpx.Client, route: str, body: dict) -> dict:
    response = client.post("/kvgate/explain", params={"endpoint": route}, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_invocations_is_read_as_chat_or_completions_by_its_shape(client: httpx.Client) -> None:
    chat = {"messages": USER, "max_tokens": 5}
    completion = {"prompt": "hello there", "max_tokens": 5}
    assert explain(client, "invocations", chat)["prompt_tokens"] == explain(client, "chat", chat)["prompt_tokens"]
    assert (
        explain(client, "invocations", completion)["prompt_tokens"]
        == explain(client, "completions", completion)["prompt_tokens"]
    )
    # vLLM tries ChatCompletionRequest first and falls back to CompletionRequest when it fails
    both = {"messages": "not a list", "prompt": "hello there", "max_tokens": 5}
    assert (
        explain(client, "invocations", both)["prompt_tokens"]
        == explain(client, "completions", completion)["prompt_tokens"]
    )


def test_a_responses_request_reads_as_the_chat_request_vllm_builds(client: httpx.Client) -> None:
    responses = {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
        "instructions": "Be terse.",
        "max_output_tokens": 7,
    }
    chat = {
        "messages": [{"role": "system", "content": "Be terse."}, *USER],
        "max_completion_tokens": 7,
        "add_special_tokens": True,
    }
    ours, theirs = explain(client, "responses", responses), explain(client, "chat", chat)
    assert (ours["prompt_tokens"], ours["max_new_tokens"]) == (theirs["prompt_tokens"], 7)


def test_an_anthropic_request_reads_as_the_chat_request_vllm_builds(client: httpx.Client) -> None:
    anthropic = {
        "model": "tiny-llama",
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_tokens": 9,
    }
    chat = {"messages": [{"role": "system", "content": "Be terse."}, *USER], "max_tokens": 9}
    ours, theirs = explain(client, "messages", anthropic), explain(client, "chat", chat)
    assert (ours["prompt_tokens"], ours["max_new_tokens"]) == (theirs["prompt_tokens"], 9)


def test_a_previous_response_is_taken_to_fill_the_context(client: httpx.Client) -> None:
    """vLLM prepends a stored conversation kvgate never saw: the reservation covers the context."""
    body = {"input": "hi", "previous_response_id": "resp_1", "max_output_tokens": 24}
    found = explain(client, "responses", body)
    assert (found["prompt_tokens"], found["max_new_tokens"]) == (MAX_MODEL_LEN - 24, 24)


def test_generate_output_is_capped_by_the_context_not_refused(client: httpx.Client) -> None:
    found = explain(client, "generate", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5000}})
    assert (found["prompt_tokens"], found["max_new_tokens"]) == (3, MAX_MODEL_LEN - 3)
    missing = explain(client, "generate", {"token_ids": [5, 6, 7], "sampling_params": {}})
    assert missing["max_new_tokens"] == MAX_MODEL_LEN - 3  # not SamplingParams' default of 16


def test_pooling_requests_are_prefill_only(client: httpx.Client) -> None:
    """A (query, document) pair is one prompt of both texts, each with its special tokens, as a
    cross-encoder's `tokenizer(text, text_pair)` builds it for the tiny Llama (`<s> A <s> B`;
    tests/integration/test_pooling_vllm.py checks it against vLLM's usage)."""
    found = explain(client, "rerank", {"query": "hello", "documents": ["a", "b", "c"]})
    sides = explain(client, "completions", {"prompt": ["hello", "a", "hello", "b", "hello", "c"], "max_tokens": 1})
    assert found["prompt_tokens"] == sides["prompt_tokens"]
    assert found["max_new_tokens"] == 1
    cohere = {"inputs": [{"content": [{"type": "text", "text": "hello there"}]}]}
    assert (
        explain(client, "embeddings", cohere)["prompt_tokens"]
        == explain(client, "completions", {"prompt": "hello there"})["prompt_tokens"]
    )


def test_rerank_takes_as_many_documents_as_completions_takes_prompts(client: httpx.Client) -> None:
    """Each pair is two texts to tokenize but one prompt: the 1,024-prompt cap counts pairs."""
    found = explain(client, "rerank", {"query": "hello", "documents": ["a"] * 1024})
    assert (
        found["prompt_tokens"]
        == 1024 * explain(client, "rerank", {"query": "hello", "documents": ["a"]})["prompt_tokens"]
    )
    empty = explain(client, "rerank", {"query": "hello", "documents": ["", "a"]})["prompt_tokens"]
    assert empty == 2 * explain(client, "completions", {"prompt": "hello", "max_tokens": 1})["prompt_tokens"] + 2
    too_many = client.post("/rerank", json={"model": "tiny-llama", "query": "hello", "documents": ["a"] * 1025})
    assert too_many.status_code == 400
    assert "1,025 prompts" in too_many.json()["error"]["message"]


def test_pooling_chat_has_no_generation_prompt_unless_asked(client: httpx.Client) -> None:
    """vLLM's pooling chat requests default add_generation_prompt to false (ChatRequestOptionsMixin,
    vllm/entrypoints/pooling/base/protocol.py), a chat completion's to true."""
    plain = explain(client, "embeddings", {"messages": USER})["prompt_tokens"]
    asked = explain(client, "embeddings", {"messages": USER, "add_generation_prompt": True})["prompt_tokens"]
    chat = explain(client, "chat", {"messages": USER, "max_tokens": 1})["prompt_tokens"]
    unprompted = {"messages": USER, "max_tokens": 1, "add_generation_prompt": False}
    assert (plain, asked) == (explain(client, "chat", unprompted)["prompt_tokens"], chat)
    assert plain < asked


def test_pooling_input_takes_add_special_tokens(client: httpx.Client) -> None:
    with_bos = explain(client, "embeddings", {"input": "hello there"})["prompt_tokens"]
    without = explain(client, "embeddings", {"input": "hello there", "add_special_tokens": False})["prompt_tokens"]
    assert without == with_bos - 1  # the tiny tokenizer adds one BOS


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"input": [7] * 2000, "truncate_prompt_tokens": 12}, 12),
        ({"input": [7] * 2000, "truncate_prompt_tokens": -1}, MAX_MODEL_LEN),
        ({"input": [7] * 5, "truncate_prompt_tokens": 12}, 5),
        ({"input": [7] * 2000, "truncate_prompt_tokens": 12, "truncation_side": "left"}, 12),
        ({"input": "hello there " * 2000, "truncate_prompt_tokens": 30}, 30),
        ({"input": [7] * MAX_MODEL_LEN}, MAX_MODEL_LEN),  # no output: the prompt may fill the context
        ({"texts": ["hello there " * 2000]}, MAX_MODEL_LEN),  # /v2/embed cuts to the context by default
        ({"texts": ["hello there " * 2000], "truncate": "START", "max_tokens": 9}, 9),
    ],
    ids=["ids", "to-context", "shorter", "left", "text", "whole-context", "v2-embed", "v2-embed-start"],
)
def test_pooling_prompt_is_truncated_as_vllm_truncates_it(client: httpx.Client, body: dict, tokens: int) -> None:
    assert explain(client, "embeddings", body)["prompt_tokens"] == tokens


@pytest.mark.parametrize(
    ("route", "body", "tokens"),
    [
        ("completions", {"prompt": [7] * 2000, "truncate_prompt_tokens": 12, "max_tokens": 5}, 12),
        ("completions", {"prompt": [7] * 2000, "truncate_prompt_tokens": -1, "max_tokens": 5}, MAX_MODEL_LEN - 1),
        # a completion's max_tokens defaults to 16 (CompletionRequest): one token of output kept
        ("completions", {"prompt": [7] * 2000, "truncate_prompt_tokens": -1}, MAX_MODEL_LEN - 1),
        ("chat", {"messages": [{"role": "user", "content": "hello there " * 2000}], "truncate_prompt_tokens": 20}, 20),
    ],
    ids=["ids", "to-context", "to-context-no-max-tokens", "chat"],
)
def test_generation_prompt_is_truncated_as_vllm_0_32_truncates_it(
    client: httpx.Client, route: str, body: dict, tokens: int
) -> None:
    """CompletionRequest and ChatCompletionRequest take truncate_prompt_tokens too (vLLM 0.32.0
    renderers/params.py): -1 keeps max_model_len - 1 when max_tokens is given (one token of
    output). The scripted backend names no version: vLLM 0.32's rule."""
    assert explain(client, route, body)["prompt_tokens"] == tokens


def test_pooling_prompt_past_the_context_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/embeddings", json={"model": "tiny-llama", "input": [7] * (MAX_MODEL_LEN + 1)})
    assert response.status_code == 400
    error = response.json()["error"]
    # vLLM 0.32.0's body (renderers/params.py _token_len_check): kvgate answers as vLLM would.
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
    assert f"your prompt contains {MAX_MODEL_LEN + 1} input tokens" in error["message"]


def test_v2_embed_without_truncation_past_the_context_is_refused(client: httpx.Client) -> None:
    body = {"model": "tiny-llama", "texts": ["hello there " * 2000], "truncate": "NONE"}
    response = client.post("/v2/embed", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
