"""Start and stop a real `kvgate serve` process for tests, as a user would run it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from demo.processes import stop_process
from support.vllm_server import free_port


@dataclass(frozen=True)
class KvgateServer:
    base_url: str
    log_path: Path
    pid: int = 0

    def metric(self, name: str, **labels: str) -> float:
        """One sample of kvgate's /metrics (0 when absent)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


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
            time.sleep(0.2)
        yield KvgateServer(url, log_path, proc.pid)
    finally:
        stop_process(proc)
