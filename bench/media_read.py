"""`python -m bench.media_read [--out DIR]`: what reading one image's size costs kvgate
(kvgate/media.py read_image: base64 decode, PIL's header-only open), in time and in peak Python
memory, for large data URLs and for headers that claim huge images.

What it shows: the cost grows with the bytes sent (the base64 decode), never with the pixels an
image claims; a 24 MiB data URL is what kvgate/multimodal.py READ_IN_THREAD_CHARS moves off the
event loop. Times are the best of `--repeat` runs on this machine (shared CPUs: compare rows, not
machines); memory is tracemalloc's peak during one read.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from kvgate.media import read_image


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _noise(width: int, height: int, fmt: str) -> bytes:
    """Random pixels: they do not compress, so the file is as large as its pixels make it."""
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT: the header lies about the data
    (also tests/unit/test_media.py's decompression bomb)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _cases() -> dict[str, Callable[[], str]]:
    return {
        "PNG 640x480 (noise)": lambda: _data_url(_noise(640, 480, "PNG"), "image/png"),
        "JPEG 4000x3000 q95 (noise)": lambda: _data_url(_noise(4000, 3000, "JPEG"), "image/jpeg"),
        "PNG 2900x2900 (noise, ~24 MiB)": lambda: _data_url(_noise(2900, 2900, "PNG"), "image/png"),
        "PNG header claiming 13000x13000": lambda: _data_url(png_header(13_000, 13_000), "image/png"),
        "PNG header claiming 60000x60000 (refused)": lambda: _data_url(png_header(60_000, 60_000), "image/png"),
    }


def measure(url: str, repeat: int) -> dict[str, object]:
    best = float("inf")
    outcome = ""
    for _ in range(repeat):
        started = time.perf_counter()
        try:
            outcome = str(read_image(url))
        except ValueError as exc:  # MediaError: the 400 kvgate answers
            outcome = f"refused: {str(exc)[:60]}"
        best = min(best, time.perf_counter() - started)
    tracemalloc.start()
    with contextlib.suppress(ValueError):
        read_image(url)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"url_bytes": len(url), "best_ms": round(best * 1000, 3), "peak_bytes": peak, "outcome": outcome}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = {name: measure(make(), args.repeat) for name, make in _cases().items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "media_read.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Reading an image's size (`python -m bench.media_read`)",
        "",
        f"Best of {args.repeat} reads; {os.cpu_count()} CPUs, load average {load:.1f} at the start"
        " (shared: times are upper bounds).",
        "",
        "| image | data URL bytes | best ms | peak Python memory | result |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['url_bytes']:,} | {row['best_ms']} | {row['peak_bytes'] / 2**20:.2f} MiB | {row['outcome']} |"
        )
    (args.out / "media_read.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
