"""Start-up numbers against vLLM's formulas and public figures (docs/calibration.md)."""

from __future__ import annotations

import pytest

from app.sim import startup
from app.sim.config import GiB, SimConfig
from app.sim.gpu import CachingAllocator, Device
from app.sim.model import load_model
from app.sim.presets import gpu_total_bytes


def boot(**kw) -> tuple[startup.Resolved, startup.StartupReport, Device]:
    cfg = SimConfig(**kw)
    g = load_model(cfg.model, cfg.dtype)
    dev = Device(gpu_total_bytes(cfg.gpu))
    r, rep = startup.start(cfg, g, dev, CachingAllocator(dev, "vllm"))
    return r, rep, dev


PR_10511 = dict(model="llama-3-8b", gpu="h100-80gb", max_num_seqs=256,
                max_num_batched_tokens=8192)


@pytest.mark.parametrize(("tp", "weights", "non_torch"), [(1, 14.96, 1.79), (2, 7.48, 3.58)])
def test_llama3_8b_h100_matches_vllm_pr_10511(tp: int, weights: float, non_torch: float) -> None:
    _, rep, _ = boot(**PR_10511, tensor_parallel_size=tp)
    assert rep.weights / GiB == pytest.approx(weights, abs=0.01)
    assert rep.non_torch / GiB == pytest.approx(non_torch, abs=0.01)
    # Reported activation peak 1.26 GiB (vLLM 0.6, V0 sampler); the V1 tape gives ~1.04 GiB.
    assert rep.activation_peak / GiB == pytest.approx(1.26, rel=0.2)


def test_kv_pool_is_sized_as_vllm_sizes_it() -> None:
    r, rep, _ = boot(**PR_10511)
    expected = rep.requested - rep.weights - rep.activation_peak - rep.non_torch - rep.cudagraph
    assert rep.kv_available == expected
    page = 2 * 16 * 8 * 128 * 2 * 32  # K and V, block 16, 8 KV heads, dim 128, bf16, 32 layers
    assert r.page_bytes == page and rep.num_gpu_blocks == expected // page
    assert rep.max_concurrency == rep.num_gpu_blocks / (8192 // 16)
    assert rep.kv_tokens == int(rep.max_concurrency * 8192)
    assert (f"GPU KV cache size: {rep.kv_tokens:,} tokens, Maximum concurrency for 8,192 tokens "
            f"per request: {rep.max_concurrency:.2f}x") in rep.log


def test_explicit_kv_cache_memory_bytes_and_graphs_outside_budget() -> None:
    _, rep, _ = boot(**PR_10511, kv_cache_memory_bytes=10 * GiB)
    assert rep.kv_available == 10 * GiB
    _, a, _ = boot(**PR_10511, cudagraph_memory_in_budget=False)
    _, b, _ = boot(**PR_10511)
    assert a.kv_available - b.kv_available == b.cudagraph > 0
    _, eager, _ = boot(**PR_10511, enforce_eager=True)
    assert eager.cudagraph == 0


def test_defaults_follow_the_gpu() -> None:
    big, _, _ = boot(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192)
    a100, _, _ = boot(model="llama-3.1-8b", gpu="a100-80gb", max_model_len=8192)
    assert (big.max_num_batched_tokens, big.max_num_seqs) == (8192, 1024)
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    assert big.max_model_len == 8192 and big.block_size == 16


def test_mla_page_and_block_size() -> None:
    r, rep, _ = boot(model="deepseek-v2-lite", gpu="h100-80gb", max_model_len=32768)
    assert r.block_size == 64 and r.backend == "mla"
    assert r.page_bytes == 64 * (512 + 64) * 2 * 27  # no factor 2 for K and V


def test_fp8_kv_halves_the_page() -> None:
    r, _, _ = boot(**PR_10511, kv_cache_dtype="fp8")
    assert r.page_bytes == 2 * 16 * 8 * 128 * 1 * 32


def test_refuses_max_model_len_that_does_not_fit() -> None:
    with pytest.raises(startup.StartupError, match=r"To serve at least one request with the "
                       r"model's max seq len \(131072\)"):
        boot(model="llama-3.1-8b", gpu="l4-24gb")


def test_tp_must_divide_heads() -> None:
    with pytest.raises(startup.StartupError, match="divisible by tensor parallel size"):
        boot(model="qwen2.5-7b", gpu="h100-80gb", tensor_parallel_size=3)
