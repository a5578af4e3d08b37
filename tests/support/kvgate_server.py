"""Start and stop a real `kvgate serve` process for tests, as a user would run it, and read what a
user can read of it: its metrics, its log, its reservation ledger."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from demo.processes import stop_process
from support.vllm_server import free_port
from support.waiting import wait_for

# What kvgate holds for requests: every reservation (KV blocks, transient bytes), every admitted
# request, every queued one.
LEDGER = (
    "kvgate_reserved_kv_blocks",
    "kvgate_reserved_transient_bytes",
    "kvgate_in_flight_requests",
    "kvgate_queue_depth",
)


def scrape(base_url: str) -> list[Sample]:
    """Every sample of one /metrics page (kvgate's or vLLM's): values read together are from the
    same moment."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metrics_at(base_url: str, *names: str, **labels: str) -> dict[str, float]:
    """Samples of several metrics from one scrape of base_url's /metrics (0 when absent)."""
    found = dict.fromkeys(names, 0.0)
    for s in scrape(base_url):
        if s.name in found and all(s.labels.get(k) == v for k, v in labels.items()):
            found[s.name] = s.value
    return found


@dataclass(frozen=True)
class KvgateServer:
    base_url: str
    log_path: Path
    pid: int = 0

    def metric(self, name: str, **labels: str) -> float:
        """One sample of kvgate's /metrics (0 when absent)."""
        return self.metrics(name, **labels)[name]

    def metrics(self, *names: str, **labels: str) -> dict[str, float]:
        """Samples of several metrics from one scrape of /metrics (0 when absent)."""
        return metrics_at(self.base_url, *names, **labels)

    def scrape(self) -> list[Sample]:
        """Every sample of one page of this kvgate's /metrics."""
        return scrape(self.base_url)

    def readyz(self) -> dict:
        """kvgate's /readyz body (backend, telemetry and budget state), whatever its status."""
        return httpx.get(f"{self.base_url}/readyz", timeout=5).json()

    def ledger(self) -> dict[str, float]:
        """Reserved KV blocks and transient bytes, requests in flight and queued, from one scrape."""
        return self.metrics(*LEDGER)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class KvgateFactory(Protocol):
    """tests/conftest.py's `kvgate_factory`: a `kvgate serve` that lives until the test module ends."""

    def __call__(self, backend_url: str, model_dir: Path, *flags: str, wait_ready: bool = True) -> KvgateServer: ...


def assert_ledger_empty(kvgate: KvgateServer, timeout_s: float = 10) -> None:
    """Nothing reserved, in flight or queued. The release runs on kvgate's loop as a response ends,
    so this polls up to timeout_s; a leaked reservation (or one released twice) never reads 0."""
    wait_for(
        lambda: not any(kvgate.ledger().values()),
        timeout_s=timeout_s,
        what=lambda: f"kvgate's ledger to empty: {kvgate.ledger()}",
    )


@contextlib.contextmanager
def running_kvgate(
    backend_url: str,
    model_dir: Path,
    scratch: Path,
    *args: str,
    wait_ready: bool = True,
    timeout_s: float = 60,
) -> Iterator[KvgateServer]:
    """`kvgate serve` on a free 127.0.0.1 port, ready (or just alive) before the block runs."""
    port = free_port()
    scratch.mkdir(parents=True, exist_ok=True)
    log_path = scratch / f"kvgate-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "kvgate.cli",
        "serve",
        "--backend",
        backend_url,
        "--model",
        str(model_dir),
        "--listen",
        f"127.0.0.1:{port}",
        # kvgate's own families rendered on every scrape: a test reads them right after what it
        # checks (its own --metrics-cache-seconds, later in the line, wins).
        "--metrics-cache-seconds",
        "0",
        *args,
    ]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        probe = "/readyz" if wait_ready else "/healthz"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvgate exited with {proc.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvgate not {probe} after {timeout_s} s:\n{log_path.read_text()}")
            time.sleep(0.05)  # the start-up poll's interval; the deadline above bounds it
        yield KvgateServer(url, log_path, proc.pid)
    finally:
        stop_process(proc)


def assert_chat_refused_before_backend(kvgate: KvgateServer, backend_seen: Sized, body: dict, message: str) -> None:
    """kvgate answers the chat `body` 400 in OpenAI's error shape naming `message`, forwards
    nothing to the backend (whose received requests are `backend_seen`) and holds nothing after."""
    forwarded = len(backend_seen)
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert len(backend_seen) == forwarded
    assert_ledger_empty(kvgate)
