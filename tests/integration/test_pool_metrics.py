"""kvgate's /metrics as llm-d's endpoint picker and an autoscaler read it (issue 25, items 1, 2, 5):
vLLM's gauges with kvgate's queue and reservations in them, one series each, on a page Prometheus'
Go parser and prometheus_client's both accept; a saturated kvgate's 429 in the picker's words; and
vLLM's page unmodified behind --metrics-page vllm.

In front of a simulated vLLM whose KV pool holds 800 blocks. The memory is held by a streamed
request the test ends itself (it hangs up), so nothing depends on how fast the machine runs: at
speedup 1 that stream needs at least 84 s of steps, beyond everything else the test waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.sim.runner import SimRunner
from support.exposition import declared_types, go_parse_error, python_samples
from support.fake_backend import running_fake_backend
from support.kvgate_server import KvgateFactory, KvgateServer, metrics_at, running_kvgate
from support.sim_model import ENGINE_FLAGS, MODEL, small_pool_config
from support.waiting import wait_for, wait_for_async

POOL_BLOCKS = 800  # of 16 tokens
HOLDER = {"prompt": [2000 + i for i in range(500)], "max_tokens": 7000, "ignore_eos": True}  # 469 blocks
LARGE = {"prompt": [9000 + i for i in range(7000)], "max_tokens": 100, "ignore_eos": True}  # 444 blocks
MAX_QUEUE = 3
ROUTING = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
IDLE_S = 1.0


@pytest.fixture(scope="module")
def sim(sim_model_dir: Path) -> Iterator[SimRunner]:
    with SimRunner(small_pool_config(sim_model_dir, POOL_BLOCKS)) as runner:
        yield runner


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, sim: SimRunner, sim_model_dir: Path) -> KvgateServer:
    flags = ("--max-queue", str(MAX_QUEUE), "--max-queue-wait", "300", "--max-kv-overcommit", "1.0")
    # kvgate's own families cached as in production: the routing gauges must be fresh regardless.
    return kvgate_factory(sim.url, sim_model_dir, *ENGINE_FLAGS, *flags, "--metrics-cache-seconds", "30")


def page(kvgate: KvgateServer) -> str:
    return httpx.get(kvgate.base_url + "/metrics", timeout=5).text


def routing(text: str) -> dict[str, float]:
    """The routing gauges of one page, each asserted to be a single series."""
    found: dict[str, list[float]] = {name: [] for name in ROUTING}
    for s in python_samples(text):
        if s.name in found:
            found[s.name].append(s.value)
    assert all(len(v) == 1 for v in found.values()), found
    return {name: values[0] for name, values in found.items()}


def own(kvgate: KvgateServer, *names: str) -> dict[str, float]:
    """kvgate's own families rendered now (/kvgate/metrics: /metrics caches them for 30 s here)."""
    return metrics_at(kvgate.base_url + "/kvgate", *names)


def assert_one_valid_page(text: str) -> None:
    assert go_parse_error(text) is None, go_parse_error(text)
    assert all(n == 1 for n in declared_types(text).values()), declared_types(text)
    python_samples(text)


async def test_a_burst_that_queues_in_kvgate_shows_in_the_routing_gauges(kvgate: KvgateServer, sim: SimRunner) -> None:
    pool = kvgate.readyz()["kv_pool_blocks"]
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=120) as client:
        holder = await client.send(
            client.build_request("POST", "/v1/completions", json={"model": MODEL, "stream": True, **HOLDER}),
            stream=True,
        )
        assert holder.status_code == 200
        lines = holder.aiter_lines()
        while not (await anext(lines)).startswith("data: "):  # its first token: it runs
            pass
        reserved = own(kvgate, "kvgate_reserved_kv_blocks")["kvgate_reserved_kv_blocks"]
        assert reserved > 0.5 * pool  # what kvgate holds for the stream, far above what vLLM uses yet
        await wait_for_async(
            lambda: routing(page(kvgate))["vllm:num_requests_running"] == 1,
            timeout_s=30,
            what="a scrape of the simulator to see the stream running",
        )
        gauges = routing(page(kvgate))
        assert gauges["vllm:num_requests_waiting"] == 0
        assert gauges["vllm:kv_cache_usage_perc"] == pytest.approx(reserved / pool)  # kvgate's share, the larger

        queued = [
            asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, **LARGE}))
            for _ in range(MAX_QUEUE)
        ]
        await wait_for_async(
            lambda: routing(page(kvgate))["vllm:num_requests_waiting"] == MAX_QUEUE,
            timeout_s=30,
            what=f"{MAX_QUEUE} requests waiting in kvgate's queue (469 + 444 blocks > 800)",
        )
        text = page(kvgate)
        assert_one_valid_page(text)
        gauges = routing(text)
        assert gauges["vllm:kv_cache_usage_perc"] == 1.0  # the queue is full: kvgate refuses new work
        assert gauges["vllm:num_requests_running"] == 1
        assert {s.name for s in python_samples(text)} >= {"kvgate_queue_depth", "kvgate_decisions_total"}
        info = [s for s in python_samples(text) if s.name == "vllm:cache_config_info"]
        vllm_info = [
            s
            for s in python_samples((await client.get(sim.url + "/metrics")).text)
            if s.name == "vllm:cache_config_info"
        ]
        assert [s.labels for s in info] == [s.labels for s in vllm_info]  # vLLM's one engine, passed through
        assert "vllm:lora_requests_info" not in declared_types(text)  # vLLM serves it only with --enable-lora
        assert own(kvgate, "kvgate_scrape_interval_seconds")["kvgate_scrape_interval_seconds"] == 0.25

        refused = await client.post("/v1/completions", json={"model": MODEL, **LARGE})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"

        await holder.aclose()  # the client hangs up: its blocks come back and the queue drains
        answers = await asyncio.gather(*queued)
    assert [a.status_code for a in answers] == [200] * MAX_QUEUE, [a.text for a in answers]
    wait_for(
        lambda: routing(page(kvgate)) == {n: 0.0 for n in ROUTING},
        timeout_s=30,
        what=lambda: f"the routing gauges to read an idle pod: {routing(page(kvgate))}",
    )
    wait_for(
        lambda: own(kvgate, "kvgate_scrape_interval_seconds")["kvgate_scrape_interval_seconds"] == IDLE_S,
        timeout_s=30,
        what="kvgate to scrape vLLM at its idle pace once nothing is in flight",
    )


def test_the_vllm_page_switch_serves_vllms_page_and_keeps_kvgates_own(
    kvgate_factory: KvgateFactory, sim: SimRunner, sim_model_dir: Path
) -> None:
    passthrough = kvgate_factory(sim.url, sim_model_dir, *ENGINE_FLAGS, "--metrics-page", "vllm")
    served = httpx.get(passthrough.base_url + "/metrics").text
    direct = httpx.get(sim.url + "/metrics").text
    assert declared_types(served) == declared_types(direct)
    assert {(s.name, tuple(sorted(s.labels.items()))) for s in python_samples(served)} == {
        (s.name, tuple(sorted(s.labels.items()))) for s in python_samples(direct)
    }
    own_page = httpx.get(passthrough.base_url + "/kvgate/metrics").text
    names = {s.name for s in python_samples(own_page)}
    assert "kvgate_queue_depth" in names
    assert not any(n.startswith("vllm:") for n in names)


def test_a_dead_engine_behind_a_live_api_server_takes_the_pod_out(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's API server outlives its engine (for up to 5 s, its watchdog's period, or for good with
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): /metrics answers, requests get 500, /health 503. The first
    500 makes kvgate ask /health: the backend is down, /readyz takes the pod out and the gauges
    read full, until /health answers 200 again."""
    with (
        running_fake_backend() as backend,
        running_kvgate(backend.base_url, tiny_model_dir, tmp_path, "--max-queue-wait", "2") as kvgate,
    ):
        backend.completion_mode = "engine_dead"
        answer = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert answer.status_code == 500  # vLLM's own answer, relayed
        wait_for(
            lambda: httpx.get(kvgate.base_url + "/readyz").status_code == 503,
            timeout_s=20,
            what=lambda: f"/readyz to take the pod out: {kvgate.readyz()}",
        )
        assert "/health answered 503" in kvgate.readyz()["backend"]["why"]
        assert routing(page(kvgate))["vllm:kv_cache_usage_perc"] == 1.0
        refused = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503  # held in the queue, then answered as vLLM being down
        assert refused.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
        backend.completion_mode = "ok"
        wait_for(
            lambda: httpx.get(kvgate.base_url + "/readyz").status_code == 200,
            timeout_s=20,
            what=lambda: f"/readyz to put the pod back: {kvgate.readyz()}",
        )


def test_the_go_parser_check_refuses_a_page_prometheus_refuses() -> None:
    """The check above is not vacuous: a second TYPE for a family fails Prometheus' parser, where
    prometheus_client's reads the page."""
    twice = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n" * 2
    assert "second TYPE line" in (go_parse_error(twice) or "")
    python_samples(twice)
