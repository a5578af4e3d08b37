"""A request's --max-queue-wait runs from its arrival at kvgate's HTTP edge, reading its body
included, and the queue wait kvgate reports counts from there too: a client that took seconds to
send its body has used those seconds of its wait (benchmark S4 under load: most refused requests
had lost over 5 s of their 30 s before they reached the queue, and still waited 30 s there)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import generate_latest

from kvgate.composition import Runtime
from kvgate.errors import BackendTimedOut
from kvgate.http.gated_routes import GatedRoutes
from kvgate.memory.demand import Demand
from kvgate.settings import Settings

BODY = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "query_string": b"",
    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
    "client": ("127.0.0.1", 1),
    "scheme": "http",
}


def runtime(tiny_model_dir: Path, max_queue_wait: float) -> Runtime:
    rt = Runtime(
        Settings(
            model=str(tiny_model_dir),
            block_size=16,
            max_model_len=2048,
            num_gpu_blocks=100,
            max_queue_wait=max_queue_wait,
        )
    )
    rt.configure_offline()
    return rt


def slow_body(delay_s: float) -> Callable[[], Awaitable[dict]]:
    """A client that sends its body `delay_s` after its head, then stays connected."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # connected until the answer
        sent = True
        await asyncio.sleep(delay_s)
        return {"type": "http.request", "body": BODY, "more_body": False}

    return receive


async def test_the_queue_deadline_counts_the_time_the_body_took(tiny_model_dir: Path) -> None:
    """The body arrives 2 s after the head, memory is full: refused 3 s after arrival, with the
    refusal saying how little of the wait the queue had, not 3 s after the body was read."""
    rt = runtime(tiny_model_dir, max_queue_wait=3.0)
    limit = rt.budget.kv_limit()
    assert limit is not None
    holder = await rt.gate.acquire(Demand(1, 1, (), limit, 0), 0, "other")  # every KV block held
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    started = time.monotonic()
    await GatedRoutes(rt)("completions", SCOPE, slow_body(2.0), send)
    took = time.monotonic() - started
    assert sent[0]["status"] == 429
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "queue_timeout"
    assert 3.0 <= took < 4.5  # from the body it would be 5 s
    assert error["message"].startswith("Waited 3 s for GPU memory (kv_cache_busy; ")
    queued_s = float(error["message"].split("; ")[1].split(" s of it in the queue")[0])
    assert queued_s < 2.0
    holder.release()
    await rt.stop()


async def test_the_reported_queue_wait_counts_from_arrival(tiny_model_dir: Path) -> None:
    """A request admitted at once after a 0.5 s body: kvgate_queue_wait_seconds says it waited
    that long before kvgate let it through."""
    rt = runtime(tiny_model_dir, max_queue_wait=30.0)

    async def open_(method: str, target: bytes, headers: object, body: bytes) -> object:
        raise BackendTimedOut()  # sent, the backend silent: answered 504

    rt.backend.open = open_  # type: ignore[method-assign]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await GatedRoutes(rt)("completions", SCOPE, slow_body(0.5), send)
    assert sent[0]["status"] == 504
    page = generate_latest(rt.metrics.registry).decode()
    waited = next(float(ln.split()[1]) for ln in page.splitlines() if ln.startswith("kvgate_queue_wait_seconds_sum"))
    assert waited >= 0.5
    await rt.stop()
