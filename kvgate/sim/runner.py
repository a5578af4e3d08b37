"""Run a simulator on a free port in a background thread, for tests, benchmarks and the demo.

with SimRunner(SimConfig(model="llama-3.1-8b", gpu="h100-80gb", speedup=50)) as sim:
    httpx.get(sim.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.server import create_sim_app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SimRunner:
    """A started simulator (start-up errors raise from the constructor, before any thread)."""

    def __init__(self, config: SimConfig, host: str = "127.0.0.1", port: int | None = None):
        self.app: FastAPI = create_sim_app(config)
        self.host, self.port = host, port or free_port(host)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        return self.app.state.engine

    def start(self, timeout: float = 10.0) -> SimRunner:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("simulator HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> SimRunner:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
