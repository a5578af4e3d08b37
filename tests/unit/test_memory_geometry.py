"""ModelGeometry.from_config against hand-copied public config.json files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.memory.geometry import (
    ATTENTION_AND_STATE,
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    NO_CACHE,
    RECURRENT_STATE,
    SLIDING_ATTENTION,
    ModelGeometry,
)
from kvgate.model_folder import load_geometry
from support.geometry import config_json, config_path, model_geometry


def test_llama_3_8b_fields_and_parameters() -> None:
    g = model_geometry("llama-3-8b")
    assert (g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_dim) == (32, 32, 8, 128)
    assert (g.hidden_size, g.intermediate_size, g.vocab_size, g.dtype_bytes) == (4096, 14336, 128256, 2)
    assert g.max_position_embeddings == 8192
    assert not g.is_mla
    assert not g.is_moe
    assert g.sliding_window is None
    # embeddings + lm_head: 2 x 128256 x 4096 = 1,050,673,152
    # per layer: q,o 2 x 4096^2 + k,v 2 x 4096 x 1024 = 41,943,040; MLP 3 x 4096 x 14336 = 176,160,768;
    #            norms 2 x 4096 -> 218,112,000 x 32 = 6,979,584,000; final norm 4,096
    assert g.parameter_count() == 1_050_673_152 + 6_979_584_000 + 4_096  # 8.03 B, as published


def test_nested_llava_text_config_gets_llama_class_defaults() -> None:
    g = model_geometry("llava-1.5-7b-hf")  # text_config lists only what differs from LlamaConfig
    assert (g.num_layers, g.hidden_size, g.intermediate_size) == (32, 4096, 11008)
    assert (g.num_attention_heads, g.num_kv_heads, g.head_dim) == (32, 32, 128)
    assert (g.vocab_size, g.max_position_embeddings, g.dtype_bytes) == (32064, 4096, 2)
    assert round(g.parameter_count() / 1e9, 2) == 6.74  # vicuna-7b


def test_nested_gemma3_layer_pattern() -> None:
    g = model_geometry("gemma-3-4b-it")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (34, 4, 256, 262208)
    assert g.sliding_window == 1024
    assert g.tie_word_embeddings
    # sliding_window_pattern 6: layer i is full iff (i + 1) % 6 == 0
    full = [i for i, kind in enumerate(g.layer_types) if kind == FULL_ATTENTION]
    assert full == [5, 11, 17, 23, 29]


def test_gemma2_alternates_and_ties_embeddings() -> None:
    g = model_geometry("gemma-2-9b")
    assert g.layer_types[:4] == (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    assert g.layer_types.count(SLIDING_ATTENTION) == 21
    assert g.dtype_bytes == 4  # the checkpoint says float32
    assert round(g.parameter_count() / 1e9, 2) == 9.24  # only with tied embeddings


def test_mistral_window_on_every_layer_and_qwen_window_disabled() -> None:
    mistral = model_geometry("mistral-7b-v0.1")
    assert mistral.sliding_window == 4096
    assert mistral.layer_types == ()
    assert set(mistral.attention_types) == {SLIDING_ATTENTION}
    qwen = model_geometry("qwen2.5-7b-instruct")  # sliding_window 131072 but use_sliding_window false
    assert qwen.sliding_window is None
    assert set(qwen.attention_types) == {FULL_ATTENTION}


def test_deepseek_v2_lite_mla_and_moe() -> None:
    g = model_geometry("deepseek-v2-lite")
    assert g.is_mla
    assert g.is_moe
    assert (g.kv_lora_rank, g.qk_rope_head_dim, g.qk_nope_head_dim, g.v_head_dim) == (512, 64, 128, 128)
    assert (g.num_experts, g.experts_per_token, g.moe_intermediate_size) == (64, 6, 1408)
    assert (g.num_shared_experts, g.shared_expert_intermediate_size, g.num_dense_layers) == (2, 2816, 1)
    assert round(g.parameter_count() / 1e9, 1) == 15.7  # published 15.7 B


def test_mixtral_experts_use_intermediate_size() -> None:
    g = model_geometry("mixtral-8x7b-v0.1")
    assert (g.num_experts, g.experts_per_token, g.moe_intermediate_size) == (8, 2, 14336)
    assert round(g.parameter_count() / 1e9, 1) == 46.7  # published 46.7 B


def test_unreadable_configs_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ModelGeometry.from_config({"model_type": "bert-ish", "num_hidden_layers": 2, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="dtype"):
        ModelGeometry.from_config({**config_json("llama-3-8b"), "torch_dtype": "int3"})
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_geometry(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_geometry(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_geometry(tmp_path)


def test_load_geometry_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(config_path("llama-3-8b").read_text())
    assert load_geometry(tmp_path) == model_geometry("llama-3-8b")


# Hybrid models: tests/configs holds the fields kvgate reads from each published config.json.


def base(**fields: object) -> dict:
    return {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 1000,
        **fields,
    }


def test_qwen3_next_linear_attention_layers_keep_a_state() -> None:
    g = model_geometry("qwen3-next-80b-a3b")
    assert g.is_hybrid_state
    assert [i for i, kind in enumerate(g.layer_types) if kind == FULL_ATTENTION] == list(range(3, 48, 4))
    assert g.layer_types.count(RECURRENT_STATE) == 36
    # Qwen3.5-style configs list the same pattern explicitly
    listed = ["linear_attention"] * 3 + ["full_attention"]
    assert ModelGeometry.from_config(base(layer_types=listed)).layer_types == (
        RECURRENT_STATE,
        RECURRENT_STATE,
        RECURRENT_STATE,
        FULL_ATTENTION,
    )


def test_nemotron_h_pattern_and_attention_head_dim() -> None:
    g = model_geometry("nemotron-h-8b-base-8k")
    kinds = g.layer_types
    assert (kinds.count(RECURRENT_STATE), kinds.count(FULL_ATTENTION), kinds.count(NO_CACHE)) == (24, 4, 24)
    assert g.head_dim == 128
    small = ModelGeometry.from_config(
        {
            **config_json("nemotron-h-8b-base-8k"),
            "hidden_size": 3136,
            "num_attention_heads": 40,
        }
    )
    assert small.head_dim == 128  # attention_head_dim, not 3136 // 40


def test_jamba_bamba_minimax_and_falcon_h1_patterns() -> None:
    jamba = model_geometry("jamba-v0.1")
    assert [i for i, kind in enumerate(jamba.layer_types) if kind == FULL_ATTENTION] == [4, 12, 20, 28]
    bamba = ModelGeometry.from_config(base(model_type="bamba", attn_layer_indices=[1]))
    assert bamba.layer_types == (RECURRENT_STATE, FULL_ATTENTION, RECURRENT_STATE, RECURRENT_STATE)
    minimax = ModelGeometry.from_config(base(attn_type_list=[0, 0, 0, 1]))
    assert minimax.layer_types == (RECURRENT_STATE,) * 3 + (FULL_ATTENTION,)
    falcon = ModelGeometry.from_config(base(model_type="falcon_h1"))
    assert falcon.layer_types == (ATTENTION_AND_STATE,) * 4
    assert falcon.is_hybrid_state
    lfm2 = ModelGeometry.from_config(base(layer_types=["conv", "conv", "full_attention", "conv"]))
    assert lfm2.layer_types.count(RECURRENT_STATE) == 3


def test_llama4_chunked_local_layers() -> None:
    g = model_geometry("llama-4-scout-17b-16e")
    assert g.attention_chunk_size == 8192
    assert not g.is_hybrid_state
    assert [i for i, kind in enumerate(g.layer_types) if kind == FULL_ATTENTION] == list(range(3, 48, 4))
    assert g.layer_types.count(CHUNKED_ATTENTION) == 36


def test_plain_models_stay_uniform() -> None:
    qwen3 = ModelGeometry.from_config(base(layer_types=["full_attention"] * 4))
    assert qwen3.layer_types == ()
    assert not qwen3.is_hybrid_state
    # Qwen2/3 list sliding layers but ignore them when use_sliding_window is false
    off = ModelGeometry.from_config(
        base(sliding_window=4096, use_sliding_window=False, layer_types=["sliding_attention"] * 4)
    )
    assert off.layer_types == ()
    assert off.sliding_window is None
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        ModelGeometry.from_config(base(layer_types=["mamba", "attention", "mamba"]))
