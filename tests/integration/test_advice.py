"""`GET /advice` and `kvgate advise --from URL` (issue #26 item 2) on a kvgate in front of a simulated
vLLM (Llama-3.1-8B's geometry on an H100, max_model_len 8,192, a pool of 800 blocks of 16 tokens).

One module-scoped pair of servers and one traffic: completions of known lengths (one with n = 2,
one with logprobs, three sharing a 1,024-token prefix, sent one after the other while a holder keeps
that prefix in flight), a chat request, a prompt past max_model_len (refused), and a large request
that waits for KV blocks behind the holder (383 + 444 blocks > 800) until the test hangs the holder
up. Nothing depends on speed: the holder streams 5,000 tokens (at least 60 s at speed-up 1) and is
cut by the test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.cli import main
from kvgate.sim.runner import SimRunner
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty
from support.sim_model import ENGINE_FLAGS, MODEL, small_pool_config
from support.waiting import wait_for, wait_for_async

POOL_BLOCKS = 800
PREFIX = [3000 + i for i in range(1024)]  # 64 full blocks
HOLDER = {"prompt": PREFIX + [2000 + i for i in range(100)], "max_tokens": 5000, "ignore_eos": True}  # 383 blocks
LARGE = {"prompt": [9000 + i for i in range(7000)], "max_tokens": 100, "ignore_eos": True}  # 444 blocks
SHORT = [
    {"prompt": PREFIX + [100 + i for i in range(20)], "max_tokens": 16},
    {"prompt": PREFIX + [200 + i for i in range(40)], "max_tokens": 16},
    {"prompt": PREFIX + [300 + i for i in range(60)], "max_tokens": 16, "n": 2},
    {"prompt": [400 + i for i in range(300)], "max_tokens": 32, "logprobs": 2},
]
TOO_LONG = {"prompt": [5 + i for i in range(9000)], "max_tokens": 10}


@pytest.fixture(scope="module")
def sim(sim_model_dir: Path) -> Iterator[SimRunner]:
    with SimRunner(small_pool_config(sim_model_dir, POOL_BLOCKS)) as runner:
        yield runner


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, sim: SimRunner, sim_model_dir: Path) -> KvgateServer:
    return kvgate_factory(
        sim.url, sim_model_dir, *ENGINE_FLAGS, "--max-queue-wait", "300", "--max-kv-overcommit", "1.0"
    )


async def _traffic(kvgate: KvgateServer) -> None:
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=120) as client:
        holder = await client.send(
            client.build_request("POST", "/v1/completions", json={"model": MODEL, "stream": True, **HOLDER}),
            stream=True,
        )
        assert holder.status_code == 200
        lines = holder.aiter_lines()
        while not (await anext(lines)).startswith("data: "):  # its first token: it runs
            pass
        for body in SHORT:  # one at a time: each finds only the holder in flight
            answer = await client.post("/v1/completions", json={"model": MODEL, **body})
            assert answer.status_code == 200, answer.text
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        )
        assert chat.status_code == 200, chat.text
        too_long = await client.post("/v1/completions", json={"model": MODEL, **TOO_LONG})
        assert too_long.status_code == 400
        large = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, **LARGE}))
        await wait_for_async(
            lambda: kvgate.metric("kvgate_queue_depth") == 1, timeout_s=30, what="the large request to queue"
        )
        await holder.aclose()  # its blocks come back; the large request goes in
        answer = await asyncio.wait_for(large, 120)
        assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def advice(kvgate: KvgateServer) -> dict:
    asyncio.run(_traffic(kvgate))
    assert_ledger_empty(kvgate, timeout_s=30)
    wait_for(  # the first GPU reading gives the size advise predicts on
        lambda: httpx.get(kvgate.base_url + "/advice", timeout=60).json()["advice"] is not None,
        timeout_s=30,
        what="GET /advice to know the GPU",
    )
    return httpx.get(kvgate.base_url + "/advice", timeout=60).json()


def test_advice_reports_the_traffic_it_measured(advice: dict) -> None:
    measured = advice["measured"]
    completions, chat = measured["routes"]["completions"], measured["routes"]["chat"]
    # the holder, four short ones and the large one: the refused prompt was never predicted
    assert completions["requests"] == 6
    assert chat["requests"] == 1
    assert completions["n_above_one"] == 1
    assert completions["logprobs"] == 1
    # prompt + max_tokens: the large one's 7,000 + 100 is the longest; its bucket's edge is within 4.4 %
    longest = len(LARGE["prompt"]) + LARGE["max_tokens"]
    assert longest <= completions["request_tokens"]["max_at_most"] <= longest * 1.044
    assert len(LARGE["prompt"]) <= completions["prompt_tokens"]["max_at_most"] <= len(LARGE["prompt"]) * 1.044
    # every completed answer counted: 16, 16, 32 (n = 2), 32 and 100 tokens; the holder was cut
    assert completions["output_tokens"]["count"] == 5
    assert measured["refusals"] == {"context_length_exceeded": 1}
    assert measured["queue_waits"]["kv_cache_busy"]["count"] == 1
    assert measured["peak_kv_demand_blocks"] >= 383 + 444
    assert measured["kv_pool_blocks"] == POOL_BLOCKS - 1  # vLLM's null block
    # three requests of the 64-block prefix, each admitted beside the holder that holds it
    assert measured["prefix_reuse"]["held_in_flight"] == 3 * 64


def test_advice_recommends_max_model_len_from_the_requests_seen(advice: dict) -> None:
    body = advice["advice"]
    assert body["startup"]["max_model_len"] == 8192
    flags = {r["flag"]: r for r in body["recommended"]}
    # the longest request, 7,100 tokens (its bucket: at most 4.4 % more), rounded up to 256
    length = flags["--max-model-len"]["value"]
    assert 7100 <= length <= 7424
    assert length % 256 == 0
    assert "refused 0.0-0.0%" in flags["--max-model-len"]["reason"]
    assert {"--max-num-batched-tokens", "--kv-cache-memory-bytes", "--max-num-seqs"} <= set(flags)
    table = {row["max_model_len"]: row for row in body["traffic"]["capacity_table"]}
    assert table[2048]["fits"]
    assert table[2048]["max_concurrency"] > table[8192]["max_concurrency"]
    effects = {e["configuration"]: e for e in body["effects"]}
    deployed = effects["as deployed"]
    assert deployed["kv_waits"] == 1
    # the pool vLLM reported (the simulator's 800 less the null block) held less than the peak demand
    assert deployed["kv_pool_blocks"] == POOL_BLOCKS - 1
    assert not deployed["kv_waits_avoided"]
    # the advised --kv-cache-memory-bytes is larger than what 0.9 x the H100 leaves: the measured
    # pool scaled by the predicted change; the verdict is that pool against the peak
    advised = effects["advised"]
    assert advised["kv_pool_blocks"] > POOL_BLOCKS - 1
    assert advised["kv_waits_avoided"] == (advised["kv_pool_blocks"] >= advice["measured"]["peak_kv_demand_blocks"])
    low, high = effects["max_model_len 2,048"]["refused_too_long_share"]
    assert 0 < low <= high  # the holder, the large one: longer than 2,048


def test_advise_from_url_gives_the_same_advice(kvgate: KvgateServer, advice: dict, capsys) -> None:
    assert main(["advise", "--from", kvgate.base_url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["deployment"] == advice["deployment"]
    assert printed["advice"]["recommended"] == advice["advice"]["recommended"]
    assert printed["advice"]["effects"] == advice["advice"]["effects"]
    assert main(["advise", "--from", kvgate.base_url + "/advice"]) == 0
    text = capsys.readouterr().out
    assert "traffic (kvgate's record" in text
    assert "queued for kv_cache_busy: 1" in text
    assert "as deployed: refuses 0.0% of the 7 requests seen as longer than 8,192 tokens; 1 request waited" in text
