"""A scriptable stand-in for vLLM, used only to inject faults the real one cannot be made to show
on demand (a broken stream, a failing /tokenize, a slow answer) and to record exactly what kvgate
forwarded. Everything else is tested against real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from app.vllm_routes import ROUTE_PATHS
from support.vllm_server import free_port

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
    completion_mode: str = "ok"  # ok | broken_stream | slow
    slow_s: float = 30.0
    seen: list[str] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)

    def app(self) -> Starlette:
        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 1024}]})

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(METRICS)

        async def health(_: Request) -> Response:
            return Response(status_code=200)

        async def tokenize(request: Request) -> Response:
            if self.tokenize_fails:
                return JSONResponse({"error": {"message": "tokenizer disabled", "code": 500}}, status_code=500)
            await asyncio.sleep(self.tokenize_delay_s)
            return JSONResponse({"count": 3, "max_model_len": 1024, "tokens": [1, 2, 3], "token_strs": None})

        async def completions(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw)
            self.seen.append(request.url.path)
            self.received.append(Received(request.url.path, request.url.query, request.headers.items(), raw))
            if self.completion_mode == "broken_stream":

                async def chunks():
                    yield b'data: {"choices": [{"text": "a"}]}\n\n'
                    await asyncio.sleep(0.05)
                    raise BrokenStream()

                return StreamingResponse(chunks(), media_type="text/event-stream")
            if self.completion_mode == "slow":
                await asyncio.sleep(self.slow_s)
            return JSONResponse({"choices": [{"text": "ok"}], "echo": body})

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/metrics", metrics),
                Route("/health", health),
                Route("/tokenize", tokenize, methods=["POST"]),
                *(Route(path, completions, methods=["POST"]) for path in ROUTE_PATHS),
            ]
        )


@contextlib.contextmanager
def running_fake_backend(**options: object) -> Iterator[FakeBackend]:
    backend = FakeBackend(**options)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(backend.app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("fake backend did not start")
        time.sleep(0.02)
    backend.base_url = f"http://127.0.0.1:{port}"
    try:
        yield backend
    finally:
        server.should_exit = True
        thread.join(10)
