"""Start and stop a real vLLM (CPU build) OpenAI server for tests.

vLLM lives in its own venv (.venv-vllm) so that kvgate never depends on torch;
the server runs as a child process in its own process group, stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "tiny-llama"

# Small on purpose: 16 blocks of 128 tokens lets a test fill the KV pool.
SERVER_ARGS = (
    "--max-model-len", "1024",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "1024",
    "--dtype", "float32",
    "--enforce-eager",
    "--num-gpu-blocks-override", "16",
    # Lets tests send their own chat_template, as a client of a trusting server may.
    "--trust-request-chat-template",
    # Serves /inference/v1/generate (vLLM answers it 403 otherwise), which kvgate gates.
    "--enable-scale-out",
)  # fmt: skip


@dataclass(frozen=True)
class VllmServer:
    base_url: str
    model_dir: Path
    served_name: str
    log_path: Path
    pid: int
    startup_s: float


class VllmPython(Protocol):
    """The `vllm_python` fixture (tests/integration/conftest.py): `.venv-vllm/bin/python *argv`
    with `input` on its stdin, its stdout returned (a failure fails the test)."""

    def __call__(self, *argv: str, input: str = "") -> str: ...


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(scratch: Path, cache: Path | None) -> dict[str, str]:
    """VLLM_CPU.md's settings; every cache goes to scratch (or to `cache`, a folder of the same test
    session) so runs stay hermetic."""
    cache = cache or scratch / "cache"
    for folder in (cache, scratch / "inductor", scratch / "tmp", scratch / "hf"):
        folder.mkdir(parents=True, exist_ok=True)
    return os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "TMPDIR": str(scratch / "tmp"),
        "HF_HOME": str(scratch / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }


def _log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, deadline: float) -> None:
    """Poll /health until the `time.monotonic()` deadline, at least once (a server launched long
    before it is needed is asked even when its start-up time is over); fail fast with the log tail
    when the process dies."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"vLLM not healthy by its deadline:\n{_log_tail(log)}")
        time.sleep(0.5)  # polls a process that announces nothing else


def _stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM the server's process group (API server + engine core), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
    proc.wait()


@dataclass
class BootingVllm:
    """A vLLM launched and not yet waited for: a test scope launches the servers its tests will use
    at once, so that their start-ups (1-2 min of mostly one core each on CI's 2 cores) overlap each
    other and the tests that run meanwhile; `ready` waits for one when a test needs it."""

    proc: subprocess.Popen
    base_url: str
    model_dir: Path
    log_path: Path
    started: float
    timeout_s: float
    _server: VllmServer | None = None

    def ready(self) -> VllmServer:
        """The server once /health answers (at most `timeout_s` after the launch)."""
        if self._server is None:
            _wait_healthy(self.proc, self.base_url, self.log_path, self.started + self.timeout_s)
            startup_s = time.monotonic() - self.started
            self._server = VllmServer(
                self.base_url, self.model_dir, SERVED_NAME, self.log_path, self.proc.pid, startup_s
            )
        return self._server


@contextlib.contextmanager
def launching_vllm(
    model_dir: Path,
    scratch: Path,
    *,
    python: Path = VLLM_PYTHON,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    cache: Path | None = None,
    timeout_s: float = 180,
) -> Iterator[BootingVllm]:
    """Launch vLLM serving `model_dir` as SERVED_NAME on a free port; stopped when the block exits.

    `cache` (VLLM_CACHE_ROOT; scratch's own folder when None): the test session's `vllm_cache`, so
    that only the session's first vLLM start-up inspects the model class in a subprocess that
    imports torch and vLLM once more (vllm/model_executor/models/registry.py, vllm-cpu 0.32.0
    `_LazyRegisteredModel.inspect_model_cls`: the answer is cached under VLLM_CACHE_ROOT/modelinfos,
    keyed by a hash of the model's source file). The folder holds nothing else on the CPU:
    --enforce-eager compiles nothing. `timeout_s` counts from the launch: servers launched
    together share the cores, so a caller launching n at once gives each n times one's time."""
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: run `make test` (see README) to install vllm-cpu.")
    port = free_port()
    log_path = scratch / "vllm.log"
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        *SERVER_ARGS, *extra_args,
    ]  # fmt: skip
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(scratch, cache) | (extra_env or {}),
            cwd=scratch, start_new_session=True,
        )  # fmt: skip
    try:
        yield BootingVllm(proc, f"http://127.0.0.1:{port}", model_dir, log_path, started, timeout_s)
    finally:
        _stop(proc)


@contextlib.contextmanager
def running_vllm(model_dir: Path, scratch: Path, **options: Any) -> Iterator[VllmServer]:
    """`launching_vllm`'s server, healthy before the block runs."""
    with launching_vllm(model_dir, scratch, **options) as booting:
        yield booting.ready()


def wanted(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether a selected test of the requesting fixture's scope (its module, or the session) uses
    the fixture `name`: a scope launches only the servers its tests will wait for."""
    module = request.module if request.scope == "module" else None
    items = [item for item in request.session.items if module is None or getattr(item, "module", None) is module]
    return any(name in getattr(item, "fixturenames", ()) for item in items)


# A server of a test scope: its model folder, its extra flags and its VLLM_CACHE_ROOT (None: its own).
Launch = tuple[Path, tuple[str, ...], Path | None]


@contextlib.contextmanager
def launching_wanted(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    servers: Mapping[str, Callable[[], Launch]],
) -> Iterator[dict[str, BootingVllm]]:
    """Launch together the servers (named by the fixtures that serve them) that the selected tests
    of the requesting scope use, each right after its `Launch` is made (folders are built while
    the earlier servers boot), so that their start-ups overlap instead of running one after
    another. Each gets 180 s per server launched, since they share the cores."""
    names = [name for name in servers if wanted(request, name)]
    with contextlib.ExitStack() as stack:
        launched = {}
        for name in names:
            model_dir, extra_args, cache = servers[name]()
            scratch = tmp_path_factory.mktemp(f"vllm-{name}")
            booting = launching_vllm(model_dir, scratch, extra_args=extra_args, cache=cache, timeout_s=180 * len(names))
            launched[name] = stack.enter_context(booting)
        yield launched
