"""Real models (their public config.json values) and GPUs (the capacity CUDA reports).

Model configs are trimmed to the fields that shape memory; `kvgate.sim.model.read_config` reads them
as it reads a Hugging Face config.json. GPU totals are what `torch.cuda.mem_get_info` reports
(slightly below the marketing size: e.g. 79.25 GiB on an H100 80GB, as in the OOM message of
docs/sources.md#large-max-num-batched-tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.gpus import GPUS, gpu_total_bytes

_LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

MODELS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3.1-8b": {**_LLAMA_3_8B, "max_position_embeddings": 131072},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2.5-vl-7b": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    },
}


# preprocessor_config.json of the presets that take images (Qwen/Qwen2.5-VL-7B-Instruct's).
PROCESSORS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
}


def processor_config(name: str) -> dict[str, Any]:
    """A preset's preprocessor_config.json ({} for a model without images)."""
    return dict(PROCESSORS.get(name.lower(), {}))


def model_config(name: str) -> dict[str, Any]:
    """A copy of a preset's config.json, or KeyError naming the presets."""
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(sorted(MODELS))}")
    return dict(MODELS[key])


def write_model_folder(name: str, folder: str | Path) -> Path:
    """Write a preset's config.json (and preprocessor_config.json) into `folder` (created) and
    return the folder.

    kvgate's `--model` wants a folder with config.json; without tokenizer files it counts tokens
    through the backend's `/tokenize`, which the simulator serves with its stand-in tokenizer.
    """
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(name), indent=2) + "\n")
    if processor := processor_config(name):
        (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return path


__all__ = ["GPUS", "gpu_total_bytes"]
