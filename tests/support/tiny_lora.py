"""Build a tiny LoRA adapter for the tiny Llama (tests/support/tiny_model.py) offline.

PEFT's on-disk format, written with safetensors alone (no peft, no torch): adapter_config.json
and adapter_model.safetensors with `lora_A` [rank, in] and `lora_B` [out, rank] per target
module, named as PEFT saves them (`base_model.model.<module>.lora_A.weight`) and as vLLM 0.32.0
reads them (vllm/lora/lora_model.py LoRAModel.from_local_checkpoint, vllm/lora/utils.py
parse_fine_tuned_lora_name). lora_B is random, not zero, so the adapter really changes the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from support.tiny_model import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS

# (module, in features, out features) of each layer's projections the adapter targets.
TARGETS = {
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
}


def build_tiny_lora(dest: Path, base_model: Path, rank: int = 8, seed: int = 0) -> Path:
    """Write a rank-`rank` adapter for the tiny Llama at `base_model` into `dest`; deterministic."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in TARGETS.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            weights[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.05).astype(np.float32)
            weights[f"{name}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.05).astype(np.float32)
    save_file(weights, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(m.rsplit(".", 1)[1] for m in TARGETS),
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
