"""A scriptable stand-in for vLLM, used only to inject faults the real one cannot be made to show
on demand (a broken stream, a failing /tokenize, a slow answer) and to record exactly what kvgate
forwarded. Everything else is tested against real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from demo.processes import stop_process
from kvgate.vllm_routes import ROUTE_PATHS
from support.vllm_server import free_port
from support.waiting import wait_for

METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="64"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
"""


class BrokenStream(Exception):
    """Raised mid-body so the server drops the connection, as a dying backend would."""


@dataclass(frozen=True)
class Received:
    """A completions request as the backend saw it."""

    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class FakeBackend:
    base_url: str = ""
    tokenize_fails: bool = False
    tokenize_delay_s: float = 0.0
    tokenize_calls: int = 0  # /tokenize requests answered (not in `received`: kvgate tokenizes through it)
    # ok | broken_stream | slow | done_then_linger (a stream whose body ends slow_s after its
    # `data: [DONE]`) | linger_before_done (one event, then slow_s before the rest) |
    # engine_dead (vLLM's API server after its engine died: 500 here, 503 on /health, /metrics as ever)
    completion_mode: str = "ok"
    slow_s: float = 30.0
    started: float = field(default_factory=time.time)  # process_start_time_seconds: a new one is a restart
    running: int = 0  # slow completions being answered: vllm:num_requests_running
    seen: list[str] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    version: str | None = None  # GET /version's answer (None: no such route, as an old proxy)
    # POST /v1/chat/completions/render's answer (None: vLLM 0.32.0 without --enable-scale-out, a 403)
    render: dict | None = None

    def app(self) -> Starlette:
        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 1024}]})

        async def metrics(_: Request) -> Response:
            running = f'model_name="tiny-llama"}} {self.running}.0'
            page = METRICS.replace('model_name="tiny-llama"} 0.0', running)
            return PlainTextResponse(page + f"process_start_time_seconds {self.started}\n")

        async def health(_: Request) -> Response:
            return Response(status_code=503 if self.completion_mode == "engine_dead" else 200)

        async def version(_: Request) -> Response:
            if self.version is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"version": self.version})

        async def tokenize(request: Request) -> Response:
            if self.tokenize_fails:
                return JSONResponse({"error": {"message": "tokenizer disabled", "code": 500}}, status_code=500)
            await asyncio.sleep(self.tokenize_delay_s)
            self.tokenize_calls += 1
            return JSONResponse({"count": 3, "max_model_len": 1024, "tokens": [1, 2, 3], "token_strs": None})

        async def render(request: Request) -> Response:
            raw = await request.body()
            self.received.append(Received(request.url.path, request.url.query, request.headers.items(), raw))
            if self.render is None:  # vllm/entrypoints/scale_out/factories.py disabled_scale_out
                message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
                error = {"message": message, "type": "PermissionDeniedError", "param": None, "code": 403}
                return JSONResponse({"error": error}, status_code=403)
            return JSONResponse(self.render)

        async def completions(request: Request) -> Response:
            raw = await request.body()
            json.loads(raw)  # what kvgate forwards parses as vLLM's FastAPI parses it (Infinity and NaN too)
            self.seen.append(request.url.path)
            self.received.append(Received(request.url.path, request.url.query, request.headers.items(), raw))
            if self.completion_mode == "engine_dead":  # vLLM 0.32.0 engine_error_handler's answer
                return JSONResponse({"error": {"message": "EngineCore encountered an issue.", "code": 500}}, 500)
            if self.completion_mode == "broken_stream":

                async def chunks():
                    yield b'data: {"choices": [{"text": "a"}]}\n\n'
                    await asyncio.sleep(0.05)
                    raise BrokenStream()

                return StreamingResponse(chunks(), media_type="text/event-stream")
            if self.completion_mode in ("done_then_linger", "linger_before_done"):
                done_first = self.completion_mode == "done_then_linger"

                async def lingering():
                    yield b'data: {"choices": [{"text": "a"}]}\n\n'
                    if done_first:
                        yield b"data: [DONE]\n\n"
                    await asyncio.sleep(self.slow_s)
                    if not done_first:
                        yield b"data: [DONE]\n\n"

                return StreamingResponse(lingering(), media_type="text/event-stream")
            if self.completion_mode == "slow":
                self.running += 1
                try:
                    await asyncio.sleep(self.slow_s)
                finally:
                    self.running -= 1
            # The answer does not echo the body: a body holding Infinity or NaN (valid to Python's json, as
            # to vLLM's) would fail Starlette's strict JSONResponse here, a 500 of the fake's own.
            return JSONResponse({"choices": [{"text": "ok"}]})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/metrics", metrics),
                Route("/health", health),
                Route("/version", version),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/v1/chat/completions/render", render, methods=["POST"]),
                *(Route(path, completions, methods=["POST"]) for path in ROUTE_PATHS),
            ]
        )


@contextlib.contextmanager
def running_fake_backend(port: int | None = None, **options: object) -> Iterator[FakeBackend]:
    """A FakeBackend on `port` (a free one if None: give the same port again to bring a
    stopped backend back at the address kvgate knows)."""
    backend = FakeBackend(**options)  # type: ignore[arg-type]
    port = port or free_port()
    # Stopping it cuts what it is still answering after a second, as a backend that goes away
    # would: uvicorn would otherwise wait for a slow answer (slow_s, up to 30 s) to end, and the
    # join below gave up only after 10 s of it.
    config = uvicorn.Config(
        backend.app(), host="127.0.0.1", port=port, log_level="critical", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=10, what="the fake backend to start")
    backend.base_url = f"http://127.0.0.1:{port}"
    try:
        yield backend
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def fake_backend_process(
    port: int | None = None, completion_mode: str = "ok"
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A FakeBackend in a process of its own, for faults a thread cannot show: it can be
    stopped (SIGSTOP: it accepts connections and answers nothing) and killed (SIGKILL)."""
    port = port or free_port()
    tests = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": str(tests.parent)}  # this checkout's app, whatever is installed
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.fake_backend", str(port), completion_mode], cwd=tests, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise TimeoutError("fake backend process did not start")
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            stop_process(proc)


if __name__ == "__main__":
    app = FakeBackend(completion_mode=sys.argv[2]).app()
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="critical")
