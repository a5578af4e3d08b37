"""A connection to the backend not had in time is backpressure, not an outage: the request goes
back through the gate and is sent again, the backend stays up (admissions are not held); a
refused connection still marks it down at once (tests/integration/test_backend_faults.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.composition import Runtime
from kvgate.errors import BackendBusy, BackendTimedOut
from kvgate.http.gated_routes import GatedRoutes
from kvgate.settings import Settings


async def test_a_connect_timeout_is_retried_and_does_not_mark_the_backend_down(tiny_model_dir: Path) -> None:
    rt = Runtime(Settings(model=str(tiny_model_dir), block_size=16, max_model_len=2048, num_gpu_blocks=100))
    rt.configure_offline()
    seen: list[str] = []

    async def open_(method: str, target: bytes, headers: object, body: bytes) -> object:
        seen.append(rt.budget.backend.status)
        if len(seen) <= 2:  # the accept queue full under a burst, twice
            raise BackendBusy("The backend is unavailable: the backend did not accept a connection in 5 s.")
        raise BackendTimedOut()  # the third is sent, and the backend stays silent: answered

    rt.backend.open = open_  # type: ignore[method-assign]
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "scheme": "http",
    }
    await GatedRoutes(rt)("completions", scope, receive, send)
    assert seen == ["up", "up", "up"]  # tried again at once, never held as down
    assert sent[0]["status"] == 504
    assert rt.budget.backend.status == "up"
    assert rt.budget.hold is None
    assert rt.metrics.upstream_errors.labels("backend_unavailable")._value.get() == 2
    await rt.stop()
