"""kvgate/video_container.py on containers built here box by box and element by element: what it
reads from well-formed MP4 and WebM headers, and the 400s hostile ones get. Real files (OpenCV's
FFmpeg muxers) are compared with vLLM's own reading in tests/integration/test_video_containers.py."""

from __future__ import annotations

import base64
import contextlib
import struct

import pytest

from kvgate.media import MediaError
from kvgate.video_container import (
    MAX_ELEMENTS,
    VideoHeader,
    VideoNotCounted,
    av_reduce,
    container_video,
    qwen2_vl_frames,
    read_container,
)
from support.tiny_containers import TURNED, box, element, mp4, webm


def test_mp4_header_gives_size_frames_and_rate() -> None:
    """30 samples of 512 ticks at 15,360 a second: 30 fps (FFmpeg's avg_frame_rate)."""
    assert read_container(mp4()) == VideoHeader(320, 240, 30, 30.0)
    assert read_container(mp4(mdhd_version=1)) == VideoHeader(320, 240, 30, 30.0)
    # 29.97 fps as muxers write it: 1001 ticks at 30,000 a second.
    ntsc = read_container(mp4(stts=((100, 1001),), timescale=30000))
    assert ntsc.frames == 100
    assert ntsc.fps == 30000 / 1001
    # Two runs: 10 + 5 frames over 10 x 100 + 5 x 200 ticks of 1000 a second.
    assert read_container(mp4(stts=((10, 100), (5, 200)), timescale=1000)).fps == 7.5
    # A last frame held 100 frames long is part of the rate (OpenCV 5.0's FFmpeg, checked in
    # tests/integration/test_video_containers.py): 15,360 x 201 / (200 x 512 + 51,200).
    assert read_container(mp4(stts=((200, 512), (1, 51200)))).fps == 15360 * 201 / (200 * 512 + 51200)
    # A quarter turn swaps width and height (OpenCV's CAP_PROP_ORIENTATION_AUTO).
    assert read_container(mp4(matrix=TURNED)) == VideoHeader(240, 320, 30, 30.0)


def test_webm_header_gives_size_frames_and_rate() -> None:
    """DefaultDuration 40 ms: 25 fps; 2 s: 50 frames (OpenCV's floor(duration x fps + 0.5))."""
    assert read_container(webm()) == VideoHeader(320, 240, 50, 25.0)
    assert read_container(webm(doc_type=b"matroska", duration_ms=1990.0)) == VideoHeader(320, 240, 50, 25.0)
    assert read_container(webm(duration_ms=1970.0)).frames == 49


def test_headers_that_do_not_settle_the_frames_are_not_counted() -> None:
    with pytest.raises(VideoNotCounted, match="edit list"):
        read_container(mp4(elst=(1024, 1)))
    assert read_container(mp4(elst=(0, 1))).frames == 30  # one whole-track edit: every frame
    with pytest.raises(VideoNotCounted, match="DefaultDuration"):
        read_container(webm(default_duration=None))
    # No frame count in the header (no Duration, an empty stts): vLLM 0.33.0 demuxes the file to
    # count them, 0.32.0 does not; the backend's render endpoint says which.
    for data in (webm(duration_ms=0.0), mp4(stts=())):
        with pytest.raises(VideoNotCounted, match="no frame count"):
            read_container(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (mp4(width=0), "Invalid video frame size"),
        (mp4(width=65535, height=65535), "exceed the maximum of 178956970 pixels"),
        (webm(width=100_000, height=100_000), "exceed the maximum"),
        (mp4(handler=b"soun"), "no video track"),
        (webm(track_type=2), "no video track"),
        (webm(doc_type=b"other"), "document type"),
        (webm(duration_ms=1e300), "out of range"),
        (box(b"ftyp", b"isom") + box(b"mdat", bytes(10)), "no moov"),
        # A moov that says it is larger than the file (cut short, or lying).
        (box(b"ftyp", b"isom") + struct.pack(">I4s", 10_000, b"moov") + bytes(100), "runs past the end"),
        (box(b"ftyp", b"isom") + struct.pack(">I4s", 4, b"moov"), "smaller than its own header"),
        (box(b"ftyp", b"isom") + struct.pack(">I4sQ", 1, b"moov", 2**63), "runs past the end"),
        # A loop of empty boxes: bounded by the header budget, not by the file's size.
        (box(b"ftyp", b"isom") + box(b"moov", box(b"free") * (MAX_ELEMENTS + 1)), "more than 4096 boxes"),
        (b"\x1a\x45\xdf\xa3" + b"\x80" + element(0x18538067, element(0xEC, b"") * (MAX_ELEMENTS + 1)), "more than"),
        (b"\x1a\x45\xdf\xa3\x00", "malformed"),
    ],
)
def test_hostile_containers_get_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        read_container(data)


@pytest.mark.parametrize("build", [mp4, webm])
def test_every_truncation_is_an_error_never_a_crash(build: object) -> None:
    """Cut at every byte: a MediaError (400), a header without frames (not counted), or, past the
    header, the same header."""
    data = build()  # type: ignore[operator]
    whole = read_container(data)
    for cut in range(len(data)):
        with contextlib.suppress(MediaError, VideoNotCounted):
            assert read_container(data[:cut]) == whole


def test_data_urls() -> None:
    url = "data:video/mp4;base64," + base64.b64encode(mp4()).decode()
    assert container_video(url) == VideoHeader(320, 240, 30, 30.0)
    assert container_video("https://example.com/v.mp4") is None
    assert container_video("data:video/avi;base64," + base64.b64encode(b"RIFF....AVI LIST").decode()) is None
    with pytest.raises(MediaError, match="not valid base64"):
        container_video("data:video/mp4;base64,@@@@")


def test_av_reduce_is_ffmpegs() -> None:
    """Exact fractions pass; others become the closest with terms up to the limit."""
    assert av_reduce(15360 * 30, 15360, 2**31 - 1) == (30, 1)
    assert av_reduce(1_000_000_000, 40_000_000, 30000) == (25, 1)
    assert av_reduce(1_000_000_000, 33_333_333, 30000) == (30, 1)
    assert av_reduce(314159, 100000, 1000) == (355, 113)


def test_qwen2_vl_loader_samples_two_frames_a_second() -> None:
    """vLLM's Qwen2VLVideoBackend: total / fps x 2 frames, at least 4, at most 768 and the video's
    own, an even number; tests/integration compares 14,616 cases with vLLM's function."""
    assert qwen2_vl_frames(VideoHeader(1, 1, 300, 30.0)) == 20  # 10 s
    assert qwen2_vl_frames(VideoHeader(1, 1, 300, 30.0), fps=1) == 10
    assert qwen2_vl_frames(VideoHeader(1, 1, 9, 30.0)) == 4  # at least 4
    assert qwen2_vl_frames(VideoHeader(1, 1, 3, 30.0)) == 2  # no more than its own, even
    assert qwen2_vl_frames(VideoHeader(1, 1, 100_000, 1.0)) == 768
    with pytest.raises(MediaError, match="samples none"):
        qwen2_vl_frames(VideoHeader(1, 1, 1, 30.0))
    with pytest.raises(MediaError, match="known source fps"):
        qwen2_vl_frames(VideoHeader(1, 1, 10, 0.0))
