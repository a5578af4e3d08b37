"""The real vLLM fixture serves the tiny model with the small KV pool the tests rely on."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.vllm


async def test_serves_completions_chat_and_metrics(vllm_server):
    async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [vllm_server.served_name]

        completion = await client.post(
            "/v1/completions",
            json={"model": vllm_server.served_name, "prompt": "The model", "max_tokens": 8},
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 8

        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": vllm_server.served_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
        )
        assert chat.status_code == 200, chat.text

        metrics = (await client.get("/metrics")).text
    cache_info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info"))
    assert 'num_gpu_blocks="16"' in cache_info
    assert 'block_size="128"' in cache_info


async def test_too_long_prompt_is_a_400(vllm_server):
    async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=60) as client:
        reply = await client.post(
            "/v1/completions",
            json={"model": vllm_server.served_name, "prompt": "memory " * 1100, "max_tokens": 1},
        )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == 400
