"""predict_footprint: KV blocks at full growth, hashes and transient terms together."""

from __future__ import annotations

from kvgate.memory.activation import EngineShape, SamplingShape
from kvgate.memory.footprint import predict_footprint
from kvgate.memory.kv import block_hashes
from support.geometry import layout

ENGINE = EngineShape(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256)


def test_single_sample_footprint() -> None:
    prompt = list(range(100))
    fp = predict_footprint(layout("llama-3-8b"), ENGINE, prompt, 50, SamplingShape())
    assert (fp.prompt_tokens, fp.max_new_tokens, fp.n) == (100, 50, 1)
    assert fp.kv_blocks == 10  # cdiv(150, 16)
    assert fp.block_hashes == tuple(block_hashes(prompt, 16))
    assert len(fp.block_hashes) == 6  # 100 // 16 full blocks
    assert fp.transient.term("mlp").bytes == 3 * 100 * 14336 * 2


def test_samples_share_prompt_blocks_only_with_prefix_caching() -> None:
    prompt = list(range(100))
    shared = predict_footprint(layout("llama-3-8b"), ENGINE, prompt, 50, SamplingShape(n=3))
    assert shared.kv_blocks == 6 + 3 * 4  # 6 shared prompt blocks + 3 tails of 10 - 6
    private = predict_footprint(
        layout("llama-3-8b"), ENGINE, prompt, 50, SamplingShape(n=3), enable_prefix_caching=False
    )
    assert private.kv_blocks == 30
    assert private.block_hashes == ()


def test_growth_is_capped_at_max_model_len() -> None:
    fp = predict_footprint(layout("llama-3-8b"), ENGINE, list(range(100)), 100_000, SamplingShape())
    assert fp.kv_blocks == 8192 // 16


def test_sliding_window_footprint_is_capped() -> None:
    engine = EngineShape(max_model_len=32_768, max_num_batched_tokens=2048, max_num_seqs=256)
    fp = predict_footprint(layout("mistral-7b-v0.1"), engine, [1] * 10_000, 10_000, SamplingShape())
    assert fp.kv_blocks == 385  # cdiv(min(4095 + 2048, 32768), 16) + 1, not cdiv(20000, 16) = 1250
