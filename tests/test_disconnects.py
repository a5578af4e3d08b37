"""Disconnects honoured while a non-streaming request waits for vLLM's answer (issue 15,
finding 3): vLLM sends that answer's head only when it is complete, so kvgate must watch the
client before the head, close the upstream connection (vLLM aborts) and release as
`disconnected`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from support.fake_backend import running_fake_backend
from support.kvgate_server import running_kvgate


def test_a_client_leaving_before_the_answer_frees_its_reservation(tiny_model_dir: Path, tmp_path: Path) -> None:
    with (
        running_fake_backend(completion_mode="slow", slow_s=30) as backend,
        running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate,
    ):

        async def leave_early() -> None:
            async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60) as client:
                waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500}))
                while not backend.received:
                    await asyncio.sleep(0.02)
                assert kvgate.metric("kvgate_in_flight_requests") == 1
                waiting.cancel()  # the client hangs up while vLLM is still generating

        asyncio.run(leave_early())
        deadline = time.monotonic() + 5
        while kvgate.metric("kvgate_in_flight_requests") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kvgate.metric("kvgate_in_flight_requests") == 0  # not after the 30 s answer
        assert kvgate.metric("kvgate_reserved_kv_blocks") == 0
        assert kvgate.metric("kvgate_reservations_released_total", outcome="disconnected") == 1
        assert kvgate.metric("kvgate_client_disconnects_total", stage="awaiting_response") == 1
        assert kvgate.metric("kvgate_reservations_released_total", outcome="completed") == 0
