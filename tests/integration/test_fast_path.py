"""The gated routes' bare-ASGI fast path: same answers, headers, limits and bookkeeping as the
FastAPI routes beside it, and nothing else taken off FastAPI.

A scripted backend records what kvgate forwards; kvgate runs as `kvgate serve`, as users run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty, running_kvgate
from support.waiting import wait_for, wait_for_async

BODY = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4}


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, backend: FakeBackend, tiny_model_dir: Path) -> KvgateServer:
    return kvgate_factory(backend.base_url, tiny_model_dir, "--max-body-bytes", "4096")


def test_body_query_and_headers_reach_the_backend(kvgate: KvgateServer, backend: FakeBackend) -> None:
    raw = b'{"prompt":  "hello there",   "max_tokens": 4, "extra": [1, 2]}'  # odd spacing: not re-encoded
    response = httpx.post(
        kvgate.base_url + "/v1/completions?trace=1",
        content=raw,
        headers={
            "content-type": "application/json",
            "x-request-id": "rid-1",
            "x-custom": "kept",
            "authorization": "Bearer k",
            "connection": "keep-alive",
        },
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "rid-1"
    assert int(response.headers["x-kvgate-kv-blocks"]) >= 1
    assert int(response.headers["x-kvgate-transient-bytes"]) >= 0
    # from its arrival to its admission: reading and preparing it only, it did not queue
    assert 0 <= float(response.headers["x-kvgate-queue-wait"]) < 1
    seen = backend.received[-1]
    assert (seen.path, seen.query, seen.body) == ("/v1/completions", "trace=1", raw)
    forwarded = dict(seen.headers)
    assert forwarded["x-custom"] == "kept"
    assert forwarded["authorization"] == "Bearer k"
    assert forwarded["x-request-id"] == "rid-1"
    assert [k for k, _ in seen.headers].count("x-request-id") == 1


def test_serve_runs_with_the_malloc_tunable(kvgate: KvgateServer) -> None:
    from kvgate.cli import MALLOC_TUNABLE, on_glibc

    if not on_glibc():
        pytest.skip(
            "GLIBC_TUNABLES is read only by glibc; on this C library kvgate serve runs "
            "without re-executing (tests/integration/test_cli.py::test_not_on_other_c_libraries)"
        )
    environ = Path(f"/proc/{kvgate.pid}/environ").read_bytes().split(b"\0")
    assert any(v.startswith(b"GLIBC_TUNABLES=") and MALLOC_TUNABLE.encode() in v for v in environ)


def test_request_id_generated_and_forwarded(kvgate: KvgateServer, backend: FakeBackend) -> None:
    response = httpx.post(
        kvgate.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert dict(backend.received[-1].headers)["x-request-id"] == request_id


@pytest.mark.parametrize("content", [b"{not json", b"[1]", b"x" * 5000])
def test_errors_equal_the_fastapi_routes(kvgate: KvgateServer, content: bytes) -> None:
    """Bad bodies get the same OpenAI-shaped answer on the fast path as on /kvgate/explain."""
    fast = httpx.post(kvgate.base_url + "/v1/completions", content=content)
    slow = httpx.post(kvgate.base_url + "/kvgate/explain", content=content)
    assert fast.status_code == slow.status_code
    assert fast.status_code in (400, 413)
    assert fast.json() == slow.json()
    assert set(fast.json()["error"]) == {"message", "type", "param", "code"}
    assert fast.headers["content-type"] == slow.headers["content-type"] == "application/json"


def test_oversized_body_without_content_length_is_413(kvgate: KvgateServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        yield b"y" * 5000
        yield b'"}'

    response = httpx.post(kvgate.base_url + "/v1/completions", content=chunks())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.headers["x-request-id"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_on_gated_paths_get_openais_405(kvgate: KvgateServer, backend: FakeBackend, method: str) -> None:
    direct = httpx.request(method, backend.base_url + "/v1/completions")
    answered = httpx.request(method, kvgate.base_url + "/v1/completions")
    assert answered.status_code == direct.status_code == 405
    assert answered.headers["allow"] == "POST"
    error = answered.json()["error"]  # OpenAI's shape, not the backend's {"detail": ...}
    assert error["code"] == "method_not_allowed"
    assert method in error["message"]


def test_decisions_metrics_and_log(kvgate: KvgateServer) -> None:
    added = kvgate.metric("kvgate_added_latency_seconds_count")
    tokenized = kvgate.metric("kvgate_tokenization_seconds_count")
    admitted = kvgate.metric("kvgate_decisions_total", decision="admit", reason="fits")
    rejected = kvgate.metric("kvgate_decisions_total", decision="reject", reason="invalid_json")
    assert (
        httpx.post(kvgate.base_url + "/v1/completions", json=BODY, headers={"x-request-id": "logged"}).status_code
        == 200
    )
    assert httpx.post(kvgate.base_url + "/v1/completions", content=b"{").status_code == 400
    assert kvgate.metric("kvgate_added_latency_seconds_count") == added + 1
    assert kvgate.metric("kvgate_tokenization_seconds_count") == tokenized + 1
    assert kvgate.metric("kvgate_decisions_total", decision="admit", reason="fits") == admitted + 1
    assert kvgate.metric("kvgate_decisions_total", decision="reject", reason="invalid_json") == rejected + 1
    assert_ledger_empty(kvgate)  # the release may follow the answer the client read
    assert kvgate.metric("kvgate_reservations_released_total", outcome="completed") >= 1

    def decisions() -> list[dict]:
        """The decision log so far, one dict per line."""
        lines = kvgate.log().splitlines()
        return [json.loads(line.split("kvgate.decision ", 1)[1]) for line in lines if "kvgate.decision " in line]

    # A line is written as its answer goes out, so it may reach the file just after the client has it.
    wait_for(
        lambda: decisions()[-1:] and decisions()[-1]["reason"] == "invalid_json",
        timeout_s=10,
        what="the refusal's log line",
    )
    logged = decisions()
    assert {"request_id": "logged", "decision": "admit", "reason": "fits"}.items() <= logged[-2].items()
    assert logged[-1]["decision"] == "reject"
    assert logged[-1]["reason"] == "invalid_json"


def test_client_leaving_the_queue_is_noticed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The fast path's disconnect watch: a queued client that leaves frees its place at once."""
    big = {"prompt": "hi", "max_tokens": 1000}  # 63 of the backend's 64 blocks: one at a time
    with running_fake_backend(completion_mode="slow", slow_s=3) as backend:
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate:

            async def scenario() -> int:
                async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=30) as first:
                    running = asyncio.create_task(first.post("/v1/completions", json=big))
                    await wait_for_async(lambda: backend.received, timeout_s=10, what="the first request to run")
                    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=30) as second:
                        queued = asyncio.create_task(second.post("/v1/completions", json=big))
                        await wait_for_async(
                            lambda: kvgate.metric("kvgate_queue_depth") == 1, timeout_s=10, what="the second to queue"
                        )
                        queued.cancel()  # the client goes away while it waits
                    await wait_for_async(
                        lambda: kvgate.metric("kvgate_queue_depth") == 0, timeout_s=10, what="the queue to empty"
                    )
                    assert kvgate.metric("kvgate_client_disconnects_total", stage="queued") == 1
                    return (await running).status_code

            assert asyncio.run(scenario()) == 200
            assert_ledger_empty(kvgate)
            assert len(backend.received) == 1


def test_a_request_held_while_the_backend_is_down_is_refused_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A request queued while the backend is down and refused at its deadline is one decision:
    one 503 for the client, one `reject` in the metrics and one in the decision log."""
    with contextlib.ExitStack() as backend_running:
        backend = backend_running.enter_context(running_fake_backend())
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path, "--max-queue-wait", "0.5") as kvgate:
            backend_running.close()  # the backend goes away; kvgate tokenizes locally
            wait_for(
                lambda: kvgate.readyz()["telemetry"]["budget_mode"] == "down",
                timeout_s=30,
                what=lambda: f"kvgate to see the backend down:\n{kvgate.log()}",
            )
            response = httpx.post(kvgate.base_url + "/v1/completions", json=BODY, headers={"x-request-id": "held"})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "backend_unavailable"
            assert response.headers["retry-after"] == "5"
            assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down") == 1
            assert kvgate.metric("kvgate_decisions_total", decision="reject", reason="backend_unavailable") == 1
            logged = [line for line in kvgate.log().splitlines() if '"request_id": "held"' in line]
            assert len(logged) == 1
            assert '"decision": "reject"' in logged[0]
