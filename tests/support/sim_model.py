"""The simulator's model for tests that put kvgate in front of it: Llama-3.1-8B's config.json (the
simulator's preset) with the tiny model's tokenizer, so kvgate tokenizes locally and can hold
requests while the backend is down."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvgate.sim.config import SimConfig
from kvgate.sim.presets import model_config

MODEL = "llama-3.1-8b"
# The simulator's batch defaults on an H100 (vLLM's): kvgate is told them, as an operator would.
ENGINE_FLAGS = ("--max-num-batched-tokens", "8192", "--max-num-seqs", "1024")


def build_sim_model_dir(tiny_model_dir: Path, folder: Path) -> Path:
    """MODEL's config.json beside the tiny model's tokenizer files (no weights) in `folder`."""
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(model_config(MODEL)))
    return folder


def small_pool_config(sim_model_dir: Path, pool_blocks: int) -> SimConfig:
    """MODEL on a simulated H100 whose KV pool is held to `pool_blocks` blocks of 16 tokens, in
    real time (speed-up 1): a few long requests fill it, so kvgate's queue is what a test sees."""
    return SimConfig(
        model=str(sim_model_dir),
        served_model_name=MODEL,
        gpu="h100-80gb",
        max_model_len=8192,
        num_gpu_blocks_override=pool_blocks,
        speedup=1,
    )
