"""The live budget against the simulated vLLM: a co-tenant shrinks the headroom and kvgate holds
instead of letting the engine OOM; an OOM restart is detected, requests sent meanwhile complete
after it and the transient margin tightens; stale metrics switch kvgate to conservative and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from kvgate.units import GiB
from support.kvgate_server import KvgateServer, running_kvgate
from support.sim_model import ENGINE_FLAGS, MODEL
from support.vllm_server import free_port
from support.waiting import wait_for

# 6001 tokens with the tiny tokenizer, one prefill chunk: prompt_logprobs allocates
# 6001 x 128256 x 6 B = 4.3 GiB the start-up profile never saw.
LONG_PROMPT = " ".join(f"word{i % 97}" for i in range(1500))
LOGPROBS_BODY = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "prompt_logprobs": 1}
# The same prompt plain: only terms the profile measured (hidden states 94 MiB, MLP 492 MiB). With
# expandable segments the engine keeps no cache after its warm-up, so they need the profile region
# vLLM emptied after start-up: the region a co-tenant takes.
PLAIN_BODY = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}
LEFT = GiB // 4  # free memory a co-tenant leaves: too little for that request (beside torch's cache)


@pytest.fixture(scope="module")
def sim_config(sim_model_dir: Path) -> Callable[..., SimConfig]:
    def make(**kw: object) -> SimConfig:
        return SimConfig(
            **{
                "model": str(sim_model_dir),
                "served_model_name": MODEL,
                "gpu": "h100-80gb",
                "max_model_len": 8192,
                "speedup": 50,
                **kw,
            }
        )  # type: ignore[arg-type]

    return make


def mode(kvgate: KvgateServer) -> str:
    return kvgate.readyz()["telemetry"]["budget_mode"]


def set_cotenant(sim: SimRunner, nbytes: int) -> None:
    httpx.post(sim.url + "/sim/cotenant", json={"name": "trainer", "bytes": nbytes}).raise_for_status()


@pytest.mark.parametrize(
    ("body", "allocator"),
    [
        (LOGPROBS_BODY, {}),
        (PLAIN_BODY, {"expandable_segments": True}),
    ],
    ids=["unprofiled-terms", "profiled-terms-only"],
)
def test_cotenant_makes_kvgate_hold_instead_of_oom(
    body: dict, allocator: dict, sim_model_dir: Path, sim_config: Callable[..., SimConfig], tmp_path: Path
) -> None:
    with (
        SimRunner(sim_config(**allocator)) as sim,
        running_kvgate(sim.url, sim_model_dir, tmp_path, *ENGINE_FLAGS) as kvgate,
    ):
        free = httpx.get(sim.url + "/sim/gpu").json()["free"]
        # kvgate picks its GPU probe once the backend is synchronised, which /readyz can report
        # a moment before it: on CI's loaded machine the first read said "none"
        wait_for(lambda: kvgate.readyz()["telemetry"]["gpu_probe"] == "sim", timeout_s=15, what="the sim's GPU probe")
        set_cotenant(sim, free - LEFT)
        wait_for(lambda: kvgate.metric("kvgate_transient_headroom_bytes") == LEFT, timeout_s=15, what="headroom")
        assert kvgate.metric("kvgate_gpu_free_bytes", gpu="GPU-51510000-0000-0000-0000-000000000000") == LEFT
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=body, timeout=60)
            wait_for(lambda: kvgate.metric("kvgate_queue_depth") == 1, timeout_s=15, what="the request to queue")
            # held through two more budget readings, not just until the next one
            scrapes = kvgate.metric("kvgate_scrape_duration_seconds_count")
            wait_for(
                lambda: kvgate.metric("kvgate_scrape_duration_seconds_count") >= scrapes + 2,
                timeout_s=15,
                what="two more scrapes",
            )
            assert not pending.done()
            assert sim.engine.ooms == []
            set_cotenant(sim, 0)  # the co-tenant leaves: the next reading lets the request in
            response = pending.result()
        assert response.status_code == 200, response.text
        assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="transient_memory_busy") == 1
        assert sim.engine.ooms == []
        assert "transient headroom" in kvgate.log()
    # Control: the same request sent straight to a fresh simulator with the same co-tenant dies.
    with SimRunner(sim_config(**allocator)) as sim:
        set_cotenant(sim, free - LEFT)
        direct = httpx.post(sim.url + "/v1/completions", json=body, timeout=60)
        assert direct.status_code == 500
        assert len(sim.engine.ooms) == 1


def test_oom_restart_is_detected_and_queued_requests_complete_after_it(
    sim_model_dir: Path, sim_config: Callable[..., SimConfig], tmp_path: Path
) -> None:
    # Speed-up 10: the two long requests need ~10 wall seconds, so they are still running when the
    # engine is killed however slowly this machine gets there (at 50 they could finish first).
    cfg = sim_config(restart_seconds=50, speedup=10)  # 5 s down
    with SimRunner(cfg) as sim, running_kvgate(sim.url, sim_model_dir, tmp_path, *ENGINE_FLAGS) as kvgate:
        margin = kvgate.metric("kvgate_transient_safety_margin")
        long_body = {"model": MODEL, "prompt": "a long story", "max_tokens": 8000, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            in_flight = [
                pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=long_body, timeout=60)
                for _ in range(2)
            ]
            wait_for(
                lambda: kvgate.metric("kvgate_backend_running_requests") == 2, timeout_s=15, what="running requests"
            )
            # Someone else's request, straight to vLLM, kills the engine (a co-tenant squeezed it).
            set_cotenant(sim, httpx.get(sim.url + "/sim/gpu").json()["free"] - LEFT)
            assert httpx.post(sim.url + "/v1/completions", json=LOGPROBS_BODY, timeout=60).status_code == 500
            set_cotenant(sim, 0)
            assert [f.result().status_code for f in in_flight] == [500, 500]  # failed cleanly
            wait_for(lambda: mode(kvgate) == "down", timeout_s=15, what="kvgate to see the backend down")
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8}
            queued = [
                pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=body, timeout=60) for _ in range(3)
            ]
            wait_for(lambda: kvgate.metric("kvgate_queue_depth") == 3, timeout_s=15, what="requests held in the queue")
            # not serving yet: the three were held while it was down (on a loaded machine the
            # steps above can outlast the downtime and find the engine booting again)
            assert sim.engine.state in ("dead", "starting")
            assert [f.result().status_code for f in queued] == [200, 200, 200]
        assert sim.engine.restarts == 1
        assert kvgate.metric("kvgate_backend_restarts_total") == 1
        held = kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down")
        assert held >= 1
        assert held + kvgate.metric("kvgate_decisions_total", decision="queue", reason="behind_queue") == 3
        assert kvgate.metric("kvgate_transient_safety_margin") > margin
        assert "likely a CUDA OOM" in kvgate.log()
        assert mode(kvgate) == "live"
        assert kvgate.metric("kvgate_in_flight_requests") == 0
        assert kvgate.metric("kvgate_reserved_kv_blocks") == 0


class FreezableProxy:
    """Forwards everything to the simulator; while `frozen`, /metrics never answers."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.frozen = False

    def app(self) -> Starlette:
        async def forward(request: Request) -> Response:
            if self.frozen and request.url.path == "/metrics":
                await asyncio.sleep(30)  # the fault under test: a /metrics that does not answer
            async with httpx.AsyncClient(base_url=self.target, timeout=60) as client:
                upstream = await client.request(
                    request.method,
                    request.url.path,
                    content=await request.body(),
                    headers={"content-type": request.headers.get("content-type", "application/json")},
                )
            return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


@contextlib.contextmanager
def running_proxy(target: str) -> Iterator[tuple[FreezableProxy, str]]:
    proxy, port = FreezableProxy(target), free_port()
    server = uvicorn.Server(uvicorn.Config(proxy.app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=10, what="the proxy")
    try:
        yield proxy, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_stale_metrics_switch_to_conservative_mode_and_back(
    sim_model_dir: Path, sim_config: Callable[..., SimConfig], tmp_path: Path
) -> None:
    with SimRunner(sim_config()) as sim, running_proxy(sim.url) as (proxy, url):
        # Waits, not one-shot reads: on a loaded 2-core machine a late scrape may flip the mode
        # for a moment by itself, and the test must not depend on when it samples.
        with running_kvgate(url, sim_model_dir, tmp_path, *ENGINE_FLAGS, "--max-staleness", "1.0") as kvgate:
            # vLLM's pool less its null block; live: x the default KV overcommit (nothing preempted)
            wait_for(lambda: "num_gpu_blocks=" in kvgate.log(), timeout_s=15, what="the backend's pool")
            pool = int(re.search(r"num_gpu_blocks=(\d+)", kvgate.log()).group(1)) - 1
            live = int(pool * 1.2)
            wait_for(
                lambda: mode(kvgate) == "live" and kvgate.metric("kvgate_budget_kv_blocks") == live,
                timeout_s=15,
                what="live mode",
            )
            proxy.frozen = True
            wait_for(lambda: mode(kvgate) == "conservative", timeout_s=15, what="conservative mode")
            assert kvgate.metric("kvgate_budget_mode", mode="conservative") == 1
            assert kvgate.metric("kvgate_scrape_age_seconds") > 1.0
            wait_for(
                lambda: kvgate.metric("kvgate_scrape_errors_total", kind="timeout") >= 1, timeout_s=15, what="a timeout"
            )
            assert kvgate.metric("kvgate_budget_kv_blocks") == pool  # overcommit off; the pool is not halved
            body = {"model": MODEL, "prompt": "still serving", "max_tokens": 4}
            assert httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
            proxy.frozen = False
            wait_for(
                lambda: mode(kvgate) == "live" and kvgate.metric("kvgate_budget_kv_blocks") == live,
                timeout_s=15,
                what="live mode again",
            )
            log = kvgate.log()
            assert "budget mode live -> conservative" in log
            # The way back is logged either as the mode's move or, when the loaded machine also let
            # /health miss its 1 s while /metrics was frozen (kvgate then took the backend as hung),
            # as the backend's return; the operator reads the return in both.
            assert "budget mode conservative -> live" in log or "backend back (was hung)" in log
