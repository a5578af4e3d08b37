"""`kvgate advise` judged by the simulator's own, independent reading of vLLM's start-up
(kvgate/sim/startup.py; the import contracts keep the two apart): on a grid of models, GPUs,
releases and flags both must agree on whether vLLM starts and, where it does, on the pool within
max(0.6 GiB, 4 %). --enforce-eager where the batch is huge: the simulator plays the eager tape,
and advise's compiled-profile factor (docs/advise.md) is the one term the simulator has not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate.advise_flags import recommend
from kvgate.advise_startup import Request, predict
from kvgate.sim import startup as sim_startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.units import GiB
from support.geometry import write_config

GRID: list[tuple[str, dict[str, Any]]] = [
    ("llama-3.1-8b-instruct", dict(gpu="h100-80gb", vllm_version="0.11.0", max_model_len=32768)),
    (
        "llama-3.1-8b-instruct",
        dict(gpu="l4-24gb", vllm_version="0.32.0", max_model_len=20000, gpu_memory_utilization=0.92),
    ),
    ("llama-3.1-8b-instruct", dict(gpu="l4-24gb", vllm_version="0.11.0")),  # 131,072 tokens: refused
    ("llama-3.1-8b-instruct", dict(gpu="a100-40gb", vllm_version="0.19.0", max_model_len=65536)),
    ("llama-3.1-8b-instruct", dict(gpu="a100-40gb", vllm_version="0.20.0", max_model_len=65536)),
    ("qwen3-32b", dict(gpu="h100-80gb", vllm_version="0.11.0", max_model_len=16000)),
    ("qwen3-8b", dict(gpu="rtx-4090-24gb", vllm_version="0.24.0", max_model_len=16384, sampler="triton")),
    (
        "mistral-7b-instruct-v0.2",
        dict(gpu="l4-24gb", vllm_version="0.11.0", max_num_batched_tokens=65536, enforce_eager=True),
    ),
    (
        "mistral-7b-instruct-v0.2",
        dict(gpu="h100-80gb", vllm_version="0.11.0", max_num_batched_tokens=32768, enforce_eager=True),
    ),
]


def simulate(folder: Path, flags: dict[str, Any]) -> int | None:
    """The simulator's available KV memory, or None where it refuses or dies starting."""
    cfg = SimConfig(model=str(folder), **flags)
    device = Device(gpu_total_bytes(cfg.gpu))
    try:
        _, report = sim_startup.start(cfg, load_model(cfg.model, cfg.dtype), device, CachingAllocator(device, "vllm"))
    except sim_startup.StartupError:
        return None
    return report.kv_available


@pytest.mark.parametrize(("model", "flags"), GRID)
def test_advise_agrees_with_the_simulator(tmp_path: Path, model: str, flags: dict[str, Any]) -> None:
    folder = write_config(tmp_path, model)
    advised = predict(Request(str(folder), **flags))
    simulated = simulate(folder, flags)
    assert advised.fits == (simulated is not None), advised.failure
    if simulated is not None:
        logged = simulated / GiB
        assert advised.kv_cache_bytes / GiB == pytest.approx(logged, abs=max(0.6, 0.04 * logged))


ADVISED: list[tuple[str, dict[str, Any]]] = [
    # dies in the profile: 200,000 batched tokens (eager, so the simulator's tape can die too)
    (
        "mistral-7b-instruct-v0.2",
        dict(gpu="l4-24gb", vllm_version="0.11.0", max_num_batched_tokens=131072, enforce_eager=True),
    ),
    # refuses: 131,072 tokens of Llama-3.1-8B on an L4
    ("llama-3.1-8b-instruct", dict(gpu="l4-24gb", vllm_version="0.11.0")),
    # refuses: Qwen3-32B's 40,960 tokens on one H100
    ("qwen3-32b", dict(gpu="h100-80gb", vllm_version="0.11.0")),
]
FLAG_FIELDS = {
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-num-seqs": "max_num_seqs",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tensor_parallel_size",
}


@pytest.mark.parametrize(("model", "flags"), ADVISED)
def test_the_simulator_starts_with_the_advised_flags(tmp_path: Path, model: str, flags: dict[str, Any]) -> None:
    """A start-up both readings say fails, and the flags advise proposes for it: the simulator
    starts with them."""
    folder = write_config(tmp_path, model)
    startup = predict(Request(str(folder), **flags))
    assert startup.failure is not None
    assert simulate(folder, flags) is None
    _, recommended = recommend(startup)
    advised = {**flags, **{FLAG_FIELDS[r.flag]: r.value for r in recommended if r.flag in FLAG_FIELDS}}
    assert simulate(folder, advised) is not None, advised
