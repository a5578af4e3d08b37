"""Disconnects honoured while a non-streaming request waits for vLLM's answer (issue 15,
finding 3): vLLM sends that answer's head only when it is complete, so kvgate must watch the
client before the head, close the upstream connection (vLLM aborts) and release as
`disconnected`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from support.fake_backend import running_fake_backend
from support.kvgate_server import KvgateServer, assert_ledger_empty, running_kvgate
from support.waiting import wait_for_async


def test_a_client_leaving_before_the_answer_frees_its_reservation(tiny_model_dir: Path, tmp_path: Path) -> None:
    with (
        running_fake_backend(completion_mode="slow", slow_s=30) as backend,
        running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate,
    ):

        async def leave_early() -> None:
            async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60) as client:
                waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500}))
                await wait_for_async(lambda: backend.received, timeout_s=10, what="the request to reach the backend")
                assert kvgate.metric("kvgate_in_flight_requests") == 1
                waiting.cancel()  # the client hangs up while vLLM is still generating

        asyncio.run(leave_early())
        assert_ledger_empty(kvgate, timeout_s=5)  # not after the 30 s answer
        assert kvgate.metric("kvgate_reservations_released_total", outcome="disconnected") == 1
        assert kvgate.metric("kvgate_client_disconnects_total", stage="awaiting_response") == 1
        assert kvgate.metric("kvgate_reservations_released_total", outcome="completed") == 0


async def _read_stream_then_hang_up(base_url: str, until: bytes) -> bytes:
    """Stream a completion, read until `until` has arrived, then close the connection."""
    seen = b""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        body = {"prompt": "hi", "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for chunk in response.aiter_raw():
                seen += chunk
                if until in seen:
                    break
    return seen


def _released(kvgate: KvgateServer, outcome: str) -> float:
    return kvgate.metric("kvgate_reservations_released_total", outcome=outcome)


def test_a_client_hanging_up_right_after_done_completed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's chunked body ends a moment after its `data: [DONE]` event; a client that closes on
    [DONE] (most do) may be seen leaving before that end arrives. It had its whole answer: the
    release says completed, and no disconnect is counted anywhere (the race of issue 21, made
    certain here by a backend that waits a second between [DONE] and the end of its body)."""
    with (
        running_fake_backend(completion_mode="done_then_linger", slow_s=1.0) as backend,
        running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate,
    ):
        seen = asyncio.run(_read_stream_then_hang_up(kvgate.base_url, b"data: [DONE]\n\n"))
        assert seen.endswith(b"data: [DONE]\n\n")
        assert_ledger_empty(kvgate, timeout_s=5)
        assert _released(kvgate, "completed") == 1
        assert _released(kvgate, "disconnected") == 0
        assert kvgate.metric("kvgate_client_disconnects_total", stage="response_body") == 0


def test_a_client_leaving_mid_stream_is_one_disconnect_in_both_counters(tiny_model_dir: Path, tmp_path: Path) -> None:
    with (
        running_fake_backend(completion_mode="linger_before_done", slow_s=30) as backend,
        running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate,
    ):
        seen = asyncio.run(_read_stream_then_hang_up(kvgate.base_url, b'"text": "a"'))
        assert b"[DONE]" not in seen
        assert_ledger_empty(kvgate, timeout_s=5)  # not after the backend's 30 s
        assert _released(kvgate, "disconnected") == 1
        assert kvgate.metric("kvgate_client_disconnects_total", stage="response_body") == 1
        assert _released(kvgate, "completed") == 0
