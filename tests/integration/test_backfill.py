"""Backfilling seen by kvgate's clients (issue 24, item 1): small requests are no longer stuck
behind a large one that waits for memory, and the large one is still served, in front of a
simulated vLLM whose KV pool holds 800 blocks.

The memory is held by a streamed request the test ends itself (it hangs up), so nothing depends
on how fast the machine runs: at speedup 1 that stream needs at least 84 s of steps (7,000 tokens
of 12 ms or more), far beyond everything else the test waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.sim.runner import SimRunner
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty
from support.sim_model import ENGINE_FLAGS, MODEL, small_pool_config
from support.waiting import wait_for, wait_for_async

POOL_BLOCKS = 800  # of 16 tokens
HOLDER = {"prompt": [2000 + i for i in range(500)], "max_tokens": 7000, "ignore_eos": True}  # 469 blocks
LARGE = {"prompt": [9000 + i for i in range(7000)], "max_tokens": 100, "ignore_eos": True}  # 444 blocks
SMALL = {"prompt": "Say something short.", "max_tokens": 30, "ignore_eos": True}
SMALL_COUNT = 20


@pytest.fixture(scope="module")
def sim(sim_model_dir: Path) -> Iterator[SimRunner]:
    with SimRunner(small_pool_config(sim_model_dir, POOL_BLOCKS)) as runner:
        yield runner


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, sim: SimRunner, sim_model_dir: Path) -> KvgateServer:
    # No KV overcommit (it would let both large requests in, counting on vLLM's preemption).
    flags = ("--max-queue-wait", "300", "--max-kv-overcommit", "1.0")
    return kvgate_factory(sim.url, sim_model_dir, *ENGINE_FLAGS, *flags)


async def test_small_requests_pass_a_large_one_waiting_for_memory_and_it_is_served_after(
    kvgate: KvgateServer, sim: SimRunner
) -> None:
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=120) as client:
        holder = await client.send(
            client.build_request("POST", "/v1/completions", json={"model": MODEL, "stream": True, **HOLDER}),
            stream=True,
        )
        assert holder.status_code == 200
        lines = holder.aiter_lines()
        while not (await anext(lines)).startswith("data: "):  # its first token: it runs
            pass
        large = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, **LARGE}))
        await wait_for_async(
            lambda: kvgate.metric("kvgate_queue_depth") == 1,
            timeout_s=30,
            what="the large request to wait in kvgate's queue (469 + 444 blocks > 800)",
        )

        smalls = await asyncio.gather(
            *(client.post("/v1/completions", json={"model": MODEL, **SMALL}) for _ in range(SMALL_COUNT))
        )
        assert [s.status_code for s in smalls] == [200] * SMALL_COUNT, [s.text for s in smalls]
        assert all(s.json()["usage"]["completion_tokens"] == 30 for s in smalls)
        assert not large.done()  # the small ones are done; the large one still waits
        assert kvgate.metric("kvgate_queue_depth") == 1
        passed = kvgate.metric("kvgate_decisions_total", decision="admit", reason="backfilled")
        assert passed == SMALL_COUNT

        await holder.aclose()  # the client hangs up: its 469 blocks come back
        answer = await asyncio.wait_for(large, 120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 100
    assert float(answer.headers["x-kvgate-queue-wait"]) > 0
    assert sim.engine.ooms == []
    assert sim.engine.restarts == 0
    assert_ledger_empty(kvgate, timeout_s=30)
    wait_for(
        lambda: not sim.engine.scheduler.has_work(),
        timeout_s=30,
        what="the simulated engine to hold no request",
    )
