"""A tiny Phi-4-multimodal folder for kvgate alone (no weights: vLLM would load the checkpoint's
remote code, which is not here): the tiny Llama's tokenizer with Phi-4's feature tokens
(<|endoftext10|>, <|endoftext11|>) as special tokens and " <" as one token, as Phi-4's o200k
vocabulary has it (so a placeholder after a space tokenizes differently in the prompt than
alone), and a phi4mm config.json (img_processor null, the checkpoint's audio_processor and
embd_layer.audio_embd_layer: its Conformer, audio compression rate 8) with
preprocessor_config.json's dynamic_hd 36, the released checkpoint's values."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fidelity.encoder import phi4mm_audio_config
from support.tiny_media import folder_with_media_tokens

FEATURE_TOKENS = ["<|endoftext10|>", "<|endoftext11|>"]
_CHECKPOINT = phi4mm_audio_config()
PHI4MM_CONFIG = {
    "model_type": "phi4mm",
    "architectures": ["Phi4MMForCausalLM"],
    "img_processor": None,
    "audio_processor": _CHECKPOINT["audio_processor"],
    "embd_layer": _CHECKPOINT["embd_layer"],
}


def tiny_phi4mm(llama: Path, out: Path) -> Path:
    _, config = folder_with_media_tokens(llama, out, FEATURE_TOKENS)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    model = tokenizer["model"]
    model["vocab"]["\u0120<"] = 4096  # past the vocabulary and the added tokens
    model["merges"].insert(0, ["\u0120", "<"])
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "config.json").write_text(json.dumps({**config, **PHI4MM_CONFIG}))
    (out / "preprocessor_config.json").write_text(json.dumps({"dynamic_hd": 36}))
    return out
