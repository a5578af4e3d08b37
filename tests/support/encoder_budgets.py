"""kvgate's reading of what vLLM's start-up profile encodes, for a model folder on the tiny
deployment the in-process vLLM checks use (tests/support/vllm_profiled_media.py): shared by
tests/unit/test_profiled_media.py and tests/integration/test_multimodal_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.engine_config import Deployment, encoder_budget
from kvgate.memory.encoder import EncoderBudget
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.vllm_runner import resolve_runtime
from kvgate.multimodal import media_options

TINY_BATCHED_TOKENS = 2048
TINY_SEQUENCES = 8


def deployment(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> Deployment:
    """A V1 deployment of vLLM 0.32.0 with these sizes."""
    return Deployment(
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        block_size=16,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        kv_cache_dtype="auto",
        gpu_memory_utilization=0.9,
        long_prefill_token_threshold=0,
        enable_prefix_caching=True,
        attention_backend="FLASH_ATTN",
        num_gpu_blocks=None,
        runtime=resolve_runtime("0.32.0"),
    )


def tiny_budget(
    folder: Path, limits: dict | None, kwargs: dict | None = None, max_model_len: int = 8192
) -> EncoderBudget:
    """engine_config.encoder_budget for `folder` at max_num_batched_tokens 2,048, 8 sequences."""
    geometry = ModelGeometry.from_config(json.loads((folder / "config.json").read_text()))
    settings = deployment(max_model_len, TINY_BATCHED_TOKENS, TINY_SEQUENCES)
    budget = encoder_budget(str(folder), settings, media_options(kwargs, limits), geometry)
    assert budget is not None
    return budget


def profile_of(budget: EncoderBudget) -> tuple[int, int, int, int]:
    """(M, B, K, D): the most embeddings an item, the encoder budget, the dummy items the profile
    encodes and each one's embeddings, as kvgate reads them."""
    dummy = budget.max_item if budget.profiled_item is None else budget.profiled_item
    return budget.max_item, budget.compute_budget, budget.profiled_items, dummy
