"""Backend faults (down, gone mid-run, broken stream, no /tokenize): clean errors, exact ledger.

These use a scripted stand-in for vLLM because the real one cannot be made to break on cue.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx

from support.fake_backend import running_fake_backend
from support.kvgate_server import KvgateServer, running_kvgate
from support.vllm_server import free_port


def assert_ledger_empty(kvgate: KvgateServer) -> None:
    assert kvgate.metric("kvgate_reserved_kv_blocks") == 0
    assert kvgate.metric("kvgate_in_flight_requests") == 0


def test_backend_never_reachable(tiny_model_dir: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with running_kvgate(dead, tiny_model_dir, tmp_path, wait_ready=False) as kvgate:
        ready = httpx.get(kvgate.base_url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["backend_reachable"] is False and "ConnectError" in ready.json()["problem"]
        response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "kvgate_not_ready"
        assert int(response.headers["retry-after"]) >= 1


def test_backend_down_mid_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend_cm = running_fake_backend()
    backend = backend_cm.__enter__()
    # A scrape interval longer than the test: kvgate has not noticed yet and forwards the request.
    # (test_telemetry_sim covers what happens once it notices: requests are held.)
    with running_kvgate(backend.base_url, tiny_model_dir, tmp_path, "--scrape-interval", "600") as kvgate:
        backend_cm.__exit__(None, None, None)
        response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "backend_unavailable"
        assert kvgate.metric("kvgate_reservations_released_total", outcome="upstream_error") == 1
        assert_ledger_empty(kvgate)
        assert httpx.get(kvgate.base_url + "/readyz").status_code == 503


def test_broken_stream_ends_with_an_error_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_fake_backend(completion_mode="broken_stream") as backend:
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate:
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            response = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[0].startswith('data: {"choices"')
            assert '"backend_stream_broken"' in events[-2] and events[-1] == "data: [DONE]"
            assert kvgate.metric("kvgate_reservations_released_total", outcome="upstream_error") == 1
            assert_ledger_empty(kvgate)


def test_no_tokenizer_anywhere_is_a_clear_4xx(tiny_model_dir: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", config_only / "config.json")
    with running_fake_backend(tokenize_fails=True) as backend:
        with running_kvgate(backend.base_url, config_only, tmp_path) as kvgate:
            response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == 424
            error = response.json()["error"]
            assert error["code"] == "tokenizer_unavailable" and "--model" in error["message"]
            assert backend.seen == []  # never forwarded
            assert_ledger_empty(kvgate)


def test_a_burst_tokenized_through_the_backend_queues_and_scrapes_go_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    """110 arrivals at once, each waiting 2 s for the backend's /tokenize: they queue for its
    connections instead of failing, and the scrapes the budget needs are not stuck behind them."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", config_only / "config.json")
    with running_fake_backend(tokenize_delay_s=2.0) as backend:
        with running_kvgate(backend.base_url, config_only, tmp_path, "--max-staleness", "1.0") as kvgate:

            async def burst() -> list[httpx.Response]:
                limits = httpx.Limits(max_connections=200)
                async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60, limits=limits) as client:
                    sent = [
                        client.post("/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 4}) for i in range(110)
                    ]
                    modes = []

                    async def watch() -> None:
                        for _ in range(12):
                            await asyncio.sleep(0.5)
                            ready = (await client.get("/readyz")).json()
                            modes.append(ready["telemetry"]["budget_mode"])

                    *responses, _ = await asyncio.gather(*sent, watch())
                    assert modes and set(modes) == {"live"}, modes
                    return responses

            responses = asyncio.run(burst())
            assert [r.status_code for r in responses] == [200] * 110
            assert_ledger_empty(kvgate)
