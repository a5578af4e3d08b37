"""Backend faults (down, gone mid-run, broken stream, no /tokenize): clean errors, exact ledger.

These use a scripted stand-in for vLLM because the real one cannot be made to break on cue.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from support.fake_backend import fake_backend_process, running_fake_backend
from support.kvgate_server import KvgateServer, assert_ledger_empty, running_kvgate
from support.vllm_server import free_port
from support.waiting import wait_for


def test_backend_never_reachable(tiny_model_dir: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with running_kvgate(dead, tiny_model_dir, tmp_path, wait_ready=False) as kvgate:
        ready = httpx.get(kvgate.base_url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["backend_reachable"] is False
        assert "ConnectError" in ready.json()["problem"]
        response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "kvgate_not_ready"
        assert int(response.headers["retry-after"]) >= 1


def test_a_refused_connection_goes_back_to_the_queue_until_its_deadline(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 15, finding 9: the backend died and kvgate's scrape has not noticed yet (an interval
    longer than the test), so the request is admitted and its connection refused. Nothing reached
    vLLM: it waits in the queue for the backend instead of an immediate 503, and /readyz, which
    reads the same view of the backend, says 503 from that moment."""
    backend_cm = running_fake_backend()
    backend = backend_cm.__enter__()
    args = ("--scrape-interval", "600", "--max-queue-wait", "2")
    with running_kvgate(backend.base_url, tiny_model_dir, tmp_path, *args) as kvgate:
        backend_cm.__exit__(None, None, None)
        started = time.monotonic()
        response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert time.monotonic() - started >= 1.9  # it waited for its deadline (it was 503 at once)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "backend_unavailable", error
        assert "has been down" in error["message"], error
        assert int(response.headers["retry-after"]) >= 1
        assert kvgate.metric("kvgate_reservations_released_total", outcome="requeued") == 1
        assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down") == 1
        assert_ledger_empty(kvgate)
        ready = httpx.get(kvgate.base_url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["backend"]["status"] == "down"


def test_readyz_and_the_gate_share_one_view_of_the_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The moment /readyz says 503 after the backend died, a new request is held in the queue,
    not forwarded to a dead socket (/readyz used to probe /health on its own and say 503 while
    the budget still admitted); it is admitted once the backend is back."""
    port = free_port()
    backend_cm = running_fake_backend(port)
    backend_cm.__enter__()
    with running_kvgate(f"http://127.0.0.1:{port}", tiny_model_dir, tmp_path, "--scrape-interval", "1") as kvgate:
        backend_cm.__exit__(None, None, None)
        _queued_until_the_backend_is_back(kvgate, port, 30)
        assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down") == 1
        assert_ledger_empty(kvgate)


def test_a_hung_backend_holds_new_arrivals_in_the_queue(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 15, finding 9: a SIGSTOPped backend accepts connections and answers nothing. kvgate
    declares it hung (a scrape timed out and /health stayed silent) and holds new arrivals in
    the queue instead of forwarding them to wait out the upstream timeout: refused at their
    deadline with Retry-After, or admitted once the backend answers again."""
    with fake_backend_process() as (proc, url):
        args = ("--max-staleness", "1", "--max-queue-wait", "4")
        with running_kvgate(url, tiny_model_dir, tmp_path, *args) as kvgate:
            body = {"prompt": "hi", "max_tokens": 4}
            assert httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                wait_for(
                    lambda: kvgate.readyz()["telemetry"]["budget_mode"] == "hung",
                    timeout_s=20,
                    what="the backend to be declared hung",
                )
                assert httpx.get(kvgate.base_url + "/readyz").status_code == 503
                assert kvgate.readyz()["backend"]["status"] == "hung"
                refused = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30)
                assert refused.status_code == 503, refused.text
                assert "has been hung" in refused.json()["error"]["message"]
                assert int(refused.headers["retry-after"]) >= 1
                with ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=body, timeout=30)
                    wait_for(
                        lambda: kvgate.metric("kvgate_queue_depth") == 1, timeout_s=20, what="the request to queue"
                    )
                    os.kill(proc.pid, signal.SIGCONT)
                    assert pending.result().status_code == 200
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_hung") == 2
            assert kvgate.metric("kvgate_upstream_errors_total", kind="backend_timeout") == 0
            wait_for(
                lambda: kvgate.readyz()["backend"]["status"] == "up", timeout_s=20, what="the backend to be up again"
            )
            assert_ledger_empty(kvgate)


def test_broken_stream_ends_with_an_error_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_fake_backend(completion_mode="broken_stream") as backend:
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate:
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            response = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 200
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[0].startswith('data: {"choices"')
            assert '"backend_stream_broken"' in events[-2]
            assert events[-1] == "data: [DONE]"
            assert_ledger_empty(kvgate)  # the release may follow the last event the client read
            assert kvgate.metric("kvgate_reservations_released_total", outcome="upstream_error") == 1


def test_no_tokenizer_anywhere_is_a_clear_4xx(tiny_model_dir: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", config_only / "config.json")
    with running_fake_backend(tokenize_fails=True) as backend:
        with running_kvgate(backend.base_url, config_only, tmp_path) as kvgate:
            response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == 424
            error = response.json()["error"]
            assert error["code"] == "tokenizer_unavailable"
            assert "--model" in error["message"]
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

                    async def watch() -> None:  # samples the mode while the burst runs (not a wait)
                        for _ in range(12):
                            await asyncio.sleep(0.5)
                            ready = (await client.get("/readyz")).json()
                            modes.append(ready["telemetry"]["budget_mode"])

                    *responses, _ = await asyncio.gather(*sent, watch())
                    assert modes, modes
                    assert set(modes) == {"live"}, modes
                    return responses

            responses = asyncio.run(burst())
            assert [r.status_code for r in responses] == [200] * 110
            assert_ledger_empty(kvgate)


def test_a_killed_backend_is_not_taken_for_an_oom(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 15, finding 11: a SIGKILL restart while requests ran was read as a CUDA OOM and the
    transient margin went 0.10 -> 0.28. A killed server answers nothing: its connections are
    cut. vLLM's engine OOM is answered (500, /health 503) by its surviving API server; that
    case is test_telemetry_sim's test_oom_restart_is_detected_and_queued_requests_complete_after_it."""
    port = free_port()
    with fake_backend_process(port, completion_mode="slow") as (proc, url):
        with running_kvgate(url, tiny_model_dir, tmp_path, "--max-queue-wait", "20") as kvgate:
            margin = kvgate.metric("kvgate_transient_safety_margin")
            body = {"prompt": "hi", "max_tokens": 4}
            with ThreadPoolExecutor(2) as pool:
                running = [
                    pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=body, timeout=30)
                    for _ in range(2)
                ]
                wait_for(
                    lambda: kvgate.metric("kvgate_backend_running_requests") == 2,
                    timeout_s=20,
                    what="two requests running",
                )
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                cut = [f.result() for f in running]
                assert [r.status_code for r in cut] == [502, 502]  # cut, not retried
                assert all(r.headers["retry-after"] == "5" for r in cut)  # issue 28: it carried none
            with fake_backend_process(port):  # the pod restarts it
                wait_for(
                    lambda: kvgate.metric("kvgate_backend_restarts_total") == 1,
                    timeout_s=20,
                    what="the restart to be seen",
                )
                wait_for(
                    lambda: httpx.get(kvgate.base_url + "/readyz").status_code == 200,
                    timeout_s=20,
                    what="kvgate to be ready again",
                )
                assert httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
            assert kvgate.metric("kvgate_transient_safety_margin") == margin
            assert "likely a CUDA OOM" not in kvgate.log()
            assert "vanished without an answer" in kvgate.log()


def _config_only(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A model folder without tokenizer files: kvgate tokenizes through the backend's /tokenize."""
    folder = tmp_path / "config-only"
    folder.mkdir(exist_ok=True)
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    return folder


def test_tokenizing_through_a_down_backend_waits_in_the_queue_until_its_deadline(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 21: without tokenizer files an arrival needs the backend's /tokenize before it can
    be judged; the backend died and kvgate's scrape has not noticed (an interval longer than the
    test). The refused /tokenize marks it down and the request waits in the queue, as a locally
    tokenized one does, until its deadline: then 503 with the outage's Retry-After (it was 503 at
    once, "kvgate tokenizes through it")."""
    backend_cm = running_fake_backend()
    backend = backend_cm.__enter__()
    args = ("--scrape-interval", "600", "--max-queue-wait", "2")
    with running_kvgate(backend.base_url, _config_only(tiny_model_dir, tmp_path), tmp_path, *args) as kvgate:
        backend_cm.__exit__(None, None, None)
        started = time.monotonic()
        response = httpx.post(kvgate.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert time.monotonic() - started >= 1.9
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "backend_unavailable", error
        assert "has been down" in error["message"], error
        assert int(response.headers["retry-after"]) >= 1
        assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down") == 1
        assert kvgate.metric("kvgate_decisions_total", decision="reject", reason="backend_unavailable") == 1
        assert kvgate.metric("kvgate_queue_depth") == 0
        assert_ledger_empty(kvgate)
        assert httpx.get(kvgate.base_url + "/readyz").json()["backend"]["status"] == "down"


def test_tokenizing_through_a_down_backend_is_served_once_it_is_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    backend_cm = running_fake_backend(port)
    backend_cm.__enter__()
    folder = _config_only(tiny_model_dir, tmp_path)
    with running_kvgate(f"http://127.0.0.1:{port}", folder, tmp_path, "--max-queue-wait", "30") as kvgate:
        backend_cm.__exit__(None, None, None)
        _queued_until_the_backend_is_back(kvgate, port, 60)
        assert kvgate.metric("kvgate_decisions_total", decision="queue", reason="backend_down") >= 1
        assert kvgate.metric("kvgate_decisions_total", decision="reject", reason="backend_unavailable") == 0
        assert kvgate.metric("kvgate_queue_depth") == 0
        assert_ledger_empty(kvgate)


def _queued_until_the_backend_is_back(kvgate: KvgateServer, port: int, timeout: float) -> None:
    """With the backend on `port` down, a request queues; once a backend is up there again it is
    served, and that backend received it once."""
    wait_for(lambda: httpx.get(kvgate.base_url + "/readyz").status_code == 503, timeout_s=20, what="/readyz to say 503")
    with ThreadPoolExecutor(1) as pool:
        body = {"prompt": "hi", "max_tokens": 4}
        pending = pool.submit(httpx.post, kvgate.base_url + "/v1/completions", json=body, timeout=timeout)
        wait_for(
            lambda: kvgate.metric("kvgate_queue_depth") == 1 or pending.done(),
            timeout_s=20,
            what="the request to queue",
        )
        assert not pending.done(), pending.result().text
        with running_fake_backend(port) as back:
            response = pending.result()
            assert response.status_code == 200, response.text
            assert len(back.received) == 1
            # Admitted, so the shared view said "up": /readyz agrees while that backend still runs
            # (once this block stops it, a scrape may see it down again).
            assert httpx.get(kvgate.base_url + "/readyz").status_code == 200
