"""A video container's header read as vLLM's OpenCV loader sees it, without decoding a frame, and
the frames vLLM's Qwen2-VL and Qwen3-VL loaders keep of it.

vLLM 0.32.0 loads a video sent in a container (vllm/multimodal/video_decoders/opencv.py
`decode_opencv`, `OpenCVVideoBackendMixin.get_video_metadata`) through OpenCV's FFmpeg backend:
CAP_PROP_FRAME_WIDTH / HEIGHT, CAP_PROP_FRAME_COUNT and CAP_PROP_FPS decide which frames its
sampler keeps (vllm/multimodal/video.py), and a frame of more than VLLM_MAX_IMAGE_PIXELS is
refused (video_decoders/base.py `check_frame_pixel_limit`). kvgate reads the same four numbers
from the header alone, as FFmpeg's demuxers compute them:

- MP4 / MOV (ISO BMFF): the first track whose `hdlr` is `vide`; its `stsd` sample entry's width and
  height, turned by the `tkhd` matrix's quarter turns (OpenCV's CAP_PROP_ORIENTATION_AUTO swaps
  them for 90 and 270 degrees); the frames are the `stts` sample counts' sum (FFmpeg
  libavformat/mov.c `mov_read_stts`: st->nb_frames) and the rate is av_reduce(timescale x frames,
  the `stts` durations' sum, INT_MAX) (mov.c `mov_read_header`: avg_frame_rate, `mdhd`'s
  timescale). An edit list other than one whole-track entry changes what FFmpeg presents (mov.c
  `mov_fix_index`; vLLM's get_video_metadata then seeks to the end to recount): not counted here.
- WebM / Matroska (EBML): Segment/Info's TimestampScale and Duration, the first Tracks/TrackEntry
  of type video: PixelWidth, PixelHeight and DefaultDuration; the rate is av_reduce(10^9,
  DefaultDuration, 30000) (libavformat/matroskadec.c `matroska_parse_tracks`), Matroska has no
  frame count, so OpenCV's is floor(duration x rate + 0.5) (OpenCV cap_ffmpeg_impl.hpp
  `get_total_frames`, `get_duration_sec`; the duration in FFmpeg's microseconds, matroskadec.c
  `matroska_read_header`). A video track without DefaultDuration has a rate FFmpeg estimates from
  packet timestamps, which a header does not give: not counted.

The walk reads box and element headers only and skips the media data by their sizes: at most
MAX_ELEMENTS headers, MAX_DEPTH levels. A container that lies (a size past its parent's end, a
header cut short, a box of fewer bytes than its own header, a loop of empty boxes past the budget,
no video track, a side of 0 pixels, more pixels than vLLM's limit) is a MediaError, a 400.
"""

from __future__ import annotations

import binascii
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from kvgate.media import VLLM_MAX_IMAGE_PIXELS, MediaError

MAX_ELEMENTS = 4096  # box / element headers one container may make kvgate read
MAX_DEPTH = 8
_INT_MAX = 2**31 - 1
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
_MP4_FIRST_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"})


class VideoNotCounted(Exception):
    """A well-formed container whose frames kvgate cannot tell from its header (the reason)."""


@dataclass(frozen=True)
class VideoHeader:
    """What OpenCV reports of the container's video stream."""

    width: int
    height: int
    frames: int  # CAP_PROP_FRAME_COUNT
    fps: float  # CAP_PROP_FPS


def is_container(data: bytes) -> bool:
    """Whether the bytes start as an ISO BMFF or EBML (Matroska / WebM) file."""
    return data[:4] == _EBML_MAGIC or data[4:8] in _MP4_FIRST_BOXES


def read_container(data: bytes, max_pixels: int = VLLM_MAX_IMAGE_PIXELS) -> VideoHeader:
    """The video stream's header; MediaError for what FFmpeg would not open or vLLM refuses,
    VideoNotCounted for a container whose frame count the header does not settle (none given
    included: what vLLM makes of it differs by release)."""
    header = _read_ebml(data) if data[:4] == _EBML_MAGIC else _read_mp4(data)
    if header.width < 1 or header.height < 1:
        raise MediaError(f"Invalid video frame size: width={header.width}, height={header.height}")
    if header.width * header.height > max_pixels:
        raise MediaError(
            f"Video frame dimensions {header.width}x{header.height} ({header.width * header.height} pixels) "
            f"exceed the maximum of {max_pixels} pixels. Set VLLM_MAX_IMAGE_PIXELS to increase this limit."
        )
    if header.frames < 1:
        # OpenCV reports no frame count: vLLM 0.33.0 then counts the frames by demuxing the whole
        # file (video_decoders/opencv.py OpenCVVideoBackendMixin.get_video_metadata,
        # demux_count_frames), which a header does not settle; 0.32.0 takes the header's count.
        raise VideoNotCounted("a container whose header gives no frame count (a WebM without Duration, an empty stts)")
    return header


def av_reduce(num: int, den: int, limit: int) -> tuple[int, int]:
    """FFmpeg's libavutil/rational.c av_reduce: num / den as the closest fraction whose terms are
    at most `limit` (continued fractions, the last step's best semiconvergent)."""
    sign = -1 if (num < 0) != (den < 0) else 1
    num, den = abs(num), abs(den)
    if den == 0:
        return 0, 0
    a0n, a0d, a1n, a1d = 0, 1, 1, 0
    divisor = math.gcd(num, den)
    if divisor:
        num //= divisor
        den //= divisor
    if num <= limit and den <= limit:
        a1n, a1d = num, den
        den = 0
    while den:
        x = num // den
        next_den = num - den * x
        a2n, a2d = x * a1n + a0n, x * a1d + a0d
        if a2n > limit or a2d > limit:
            if a1n:
                x = (limit - a0n) // a1n
            if a1d:
                x = min(x, (limit - a0d) // a1d)
            if den * (2 * x * a1d + a0d) > num * a1d:
                a1n, a1d = x * a1n + a0n, x * a1d + a0d
            break
        a0n, a0d, a1n, a1d = a1n, a1d, a2n, a2d
        num, den = den, next_den
    return sign * a1n, a1d


# ISO BMFF (MP4 / MOV)


def _boxes(data: bytes, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, box end) of each box in data[start:end]."""
    at = start
    while at < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise MediaError(f"Invalid video: more than {MAX_ELEMENTS} boxes in its header")
        if end - at < 8:
            raise MediaError("Invalid video: a box header is cut short")
        size, kind = struct.unpack_from(">I4s", data, at)
        payload = at + 8
        if size == 1:
            if end - at < 16:
                raise MediaError("Invalid video: a box header is cut short")
            size = struct.unpack_from(">Q", data, at + 8)[0]
            payload = at + 16
        elif size == 0:
            size = end - at
        if size < payload - at:
            raise MediaError(f"Invalid video: box {kind!r} is smaller than its own header")
        if at + size > end:
            raise MediaError(f"Invalid video: box {kind!r} runs past the end of the data (cut short or lying)")
        yield kind, payload, at + size
        at += size


def _child(data: bytes, start: int, end: int, kind: bytes, budget: list[int]) -> tuple[int, int] | None:
    for found, payload, box_end in _boxes(data, start, end, budget):
        if found == kind:
            return payload, box_end
    return None


def _need(found: tuple[int, int] | None, path: str) -> tuple[int, int]:
    if found is None:
        raise MediaError(f"Invalid video: no {path} box")
    return found


def _fields(data: bytes, fmt: str, at: int, end: int, box: str) -> tuple[int, ...]:
    if at + struct.calcsize(fmt) > end:
        raise MediaError(f"Invalid video: box {box} is cut short")
    return struct.unpack_from(fmt, data, at)


def _read_mp4(data: bytes) -> VideoHeader:
    budget = [MAX_ELEMENTS]
    moov = _need(_child(data, 0, len(data), b"moov", budget), "moov")
    for kind, start, end in _boxes(data, *moov, budget):
        if kind != b"trak":
            continue
        mdia = _need(_child(data, start, end, b"mdia", budget), "mdia")
        hdlr = _need(_child(data, *mdia, b"hdlr", budget), "hdlr")
        if _fields(data, ">8x4s", hdlr[0], hdlr[1], "hdlr")[0] == b"vide":
            return _mp4_track(data, start, end, mdia, budget)
    raise MediaError("Could not open video stream: the file has no video track")


def _mp4_track(data: bytes, start: int, end: int, mdia: tuple[int, int], budget: list[int]) -> VideoHeader:
    mdhd = _need(_child(data, *mdia, b"mdhd", budget), "mdhd")
    version = data[mdhd[0]] if mdhd[0] < mdhd[1] else 0
    timescale = _fields(data, ">20xI" if version == 1 else ">12xI", mdhd[0], mdhd[1], "mdhd")[0]
    minf = _need(_child(data, *mdia, b"minf", budget), "minf")
    stbl = _need(_child(data, *minf, b"stbl", budget), "stbl")
    stsd = _need(_child(data, *stbl, b"stsd", budget), "stsd")
    entries = _fields(data, ">4xI", stsd[0], stsd[1], "stsd")[0]
    if entries < 1:
        raise MediaError("Invalid video: its stsd box has no sample entry")
    # A VisualSampleEntry (ISO 14496-12 12.1.3): size, format, 6 reserved + data_reference_index,
    # 16 bytes pre_defined / reserved, then width and height.
    width, height = _fields(data, ">32xHH", stsd[0] + 8, stsd[1], "stsd")
    stts = _need(_child(data, *stbl, b"stts", budget), "stts")
    count = _fields(data, ">4xI", stts[0], stts[1], "stts")[0]
    if stts[0] + 8 + 8 * count > stts[1]:
        raise MediaError("Invalid video: its stts box holds fewer entries than it says")
    frames = duration = 0
    for i in range(count):
        samples, delta = struct.unpack_from(">II", data, stts[0] + 8 + 8 * i)
        if delta > _INT_MAX:
            raise VideoNotCounted("an MP4 whose stts has a negative or huge sample duration")
        frames += samples
        duration += samples * delta
    edts = _child(data, start, end, b"edts", budget)
    if edts is not None and not _whole_track_edit(data, edts, budget):
        raise VideoNotCounted("an MP4 with an edit list (FFmpeg presents only part of its frames)")
    tkhd = _need(_child(data, start, end, b"tkhd", budget), "tkhd")
    if _quarter_turned(data, tkhd):
        width, height = height, width
    fps = 0.0
    if frames > 0 and duration > 0 and timescale > 0:
        num, den = av_reduce(timescale * frames, duration, _INT_MAX)
        fps = num / den if den else 0.0
    return VideoHeader(width, height, frames, fps)


def _whole_track_edit(data: bytes, edts: tuple[int, int], budget: list[int]) -> bool:
    """An edit list of one entry that starts the media at 0 at normal speed (what muxers write for
    a plain track, FFmpeg's included): FFmpeg then presents every sample."""
    elst = _child(data, *edts, b"elst", budget)
    if elst is None:
        return True
    version, count = _fields(data, ">B3xI", elst[0], elst[1], "elst")
    if count != 1:
        return False
    fmt = ">8xQqhH" if version == 1 else ">8xIihH"
    _, media_time, rate, _ = _fields(data, fmt, elst[0], elst[1], "elst")
    return media_time == 0 and rate == 1


def _quarter_turned(data: bytes, tkhd: tuple[int, int]) -> bool:
    """Whether the track header's display matrix turns the picture by 90 or 270 degrees."""
    version = data[tkhd[0]] if tkhd[0] < tkhd[1] else 0
    matrix_at = tkhd[0] + (4 + 8 + 8 + 4 + 4 + 8 + 8 if version == 1 else 4 + 4 + 4 + 4 + 4 + 4 + 8) + 8
    a, b, _, c, d = _fields(data, ">iiiii", matrix_at, tkhd[1], "tkhd")
    return a == 0 and d == 0 and b != 0 and c != 0


# EBML (Matroska / WebM)

_SEGMENT, _INFO, _TRACKS, _CLUSTER = 0x18538067, 0x1549A966, 0x1654AE6B, 0x1F43B675
_TRACK_ENTRY, _TRACK_TYPE, _DEFAULT_DURATION, _VIDEO = 0xAE, 0x83, 0x23E383, 0xE0
_PIXEL_WIDTH, _PIXEL_HEIGHT, _TIMESTAMP_SCALE, _DURATION = 0xB0, 0xBA, 0x2AD7B1, 0x4489
_DOC_TYPE = 0x4282
_UNKNOWN = -1  # an element of unknown size: it runs to its parent's end


def _vint(data: bytes, at: int, end: int, is_id: bool) -> tuple[int, int]:
    """An EBML variable-length integer at `at`: (value, next offset); an ID keeps its marker bit."""
    if at >= end:
        raise MediaError("Invalid video: an EBML element header is cut short")
    first = data[at]
    length = 9 - first.bit_length() if first else 9
    if length > (4 if is_id else 8):
        raise MediaError("Invalid video: an EBML element header is malformed")
    if at + length > end:
        raise MediaError("Invalid video: an EBML element header is cut short")
    value = int.from_bytes(data[at : at + length], "big")
    if not is_id:
        value &= (1 << (7 * length)) - 1
        if value == (1 << (7 * length)) - 1:
            value = _UNKNOWN
    return value, at + length


def _elements(data: bytes, start: int, end: int, budget: list[int], depth: int) -> Iterator[tuple[int, int, int]]:
    """(ID, payload start, payload end) of each element in data[start:end]."""
    if depth > MAX_DEPTH:
        raise MediaError(f"Invalid video: EBML elements nested more than {MAX_DEPTH} deep")
    at = start
    while at < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise MediaError(f"Invalid video: more than {MAX_ELEMENTS} elements in its header")
        element, at = _vint(data, at, end, True)
        size, at = _vint(data, at, end, False)
        stop = end if size == _UNKNOWN else at + size
        if stop > end:
            raise MediaError(f"Invalid video: EBML element {element:#x} runs past the end of its parent")
        yield element, at, stop
        at = stop


def _uint(data: bytes, start: int, end: int) -> int:
    if end - start > 8:
        raise MediaError("Invalid video: an EBML integer of more than 8 bytes")
    return int.from_bytes(data[start:end], "big")


def _float(data: bytes, start: int, end: int) -> float:
    if end - start == 4:
        return float(struct.unpack_from(">f", data, start)[0])
    if end - start == 8:
        return float(struct.unpack_from(">d", data, start)[0])
    if end == start:
        return 0.0
    raise MediaError("Invalid video: an EBML float of neither 4 nor 8 bytes")


def _read_ebml(data: bytes) -> VideoHeader:
    budget = [MAX_ELEMENTS]
    elements = _elements(data, 0, len(data), budget, 0)
    _, start, end = next(elements)  # the EBML header, which the magic number opened
    doc_types = [data[s:e].rstrip(b"\0") for i, s, e in _elements(data, start, end, budget, 1) if i == _DOC_TYPE]
    if doc_types and doc_types[0] not in (b"webm", b"matroska"):
        raise MediaError(f"Could not open video stream: EBML document type {doc_types[0]!r}")
    segment = next(((s, e) for i, s, e in elements if i == _SEGMENT), None)
    if segment is None:
        raise MediaError("Invalid video: no Matroska Segment")
    scale, duration, track = 1_000_000, 0.0, None
    for element, start, end in _elements(data, *segment, budget, 1):
        if element == _INFO:
            for child, s, e in _elements(data, start, end, budget, 2):
                if child == _TIMESTAMP_SCALE:
                    scale = _uint(data, s, e)
                elif child == _DURATION:
                    duration = _float(data, s, e)
        elif element == _TRACKS:
            track = _video_track(data, start, end, budget)
        elif element == _CLUSTER:
            break
    if track is None:
        raise MediaError("Could not open video stream: no video track before the first Cluster")
    width, height, default_duration = track
    if not default_duration:
        raise VideoNotCounted("a Matroska / WebM video track without DefaultDuration (FFmpeg guesses its rate)")
    num, den = av_reduce(1_000_000_000, default_duration, 30000)
    fps = num / den if den else 0.0
    # matroskadec.c matroska_read_header: duration x time_scale x 1000 / AV_TIME_BASE, to int64.
    microseconds = duration * scale * 1000 / 1_000_000
    if not microseconds < 2**63:
        raise MediaError("Invalid video: its Duration is out of range")
    seconds = int(microseconds) / 1_000_000
    frames = math.floor(seconds * fps + 0.5) if fps else 0
    return VideoHeader(width, height, frames, fps)


def _video_track(data: bytes, start: int, end: int, budget: list[int]) -> tuple[int, int, int] | None:
    for element, s, e in _elements(data, start, end, budget, 2):
        if element != _TRACK_ENTRY:
            continue
        kind, width, height, default_duration = 0, 0, 0, 0
        for child, cs, ce in _elements(data, s, e, budget, 3):
            if child == _TRACK_TYPE:
                kind = _uint(data, cs, ce)
            elif child == _DEFAULT_DURATION:
                default_duration = _uint(data, cs, ce)
            elif child == _VIDEO:
                for field, fs, fe in _elements(data, cs, ce, budget, 4):
                    if field == _PIXEL_WIDTH:
                        width = _uint(data, fs, fe)
                    elif field == _PIXEL_HEIGHT:
                        height = _uint(data, fs, fe)
        if kind == 1:
            return width, height, default_duration
    return None


# vllm/multimodal/video.py Qwen2VLVideoBackend (0.32.0): the loader vLLM picks for a processor named
# Qwen2VLVideoProcessor (multimodal/media/connector.py fetch_video,
# get_video_loader_backend_for_processor), Qwen2-VL's and Qwen2.5-VL's.
QWEN2_VL_FPS = 2.0  # Qwen2VLVideoBackend.load_bytes's fps, unless media_io_kwargs' "fps" says
_QWEN2_VL_MAX_FPS = 30
_QWEN2_VL_FRAMES = (4, 768)  # min_frames, max_frames


def qwen2_vl_frames(header: VideoHeader, fps: float = QWEN2_VL_FPS, temporal_patch_size: int = 2) -> int:
    """The frames Qwen2VLVideoBackend.compute_frames_index_to_sample keeps of the video: total /
    rate x min(fps, 30) of them, within [4, 768] and the video's own, floored to a multiple of
    temporal_patch_size, at torch.arange(0, total, total / n).int() clamped to the last frame;
    OpenCV reads each distinct index once (opencv.py `_read_frames_no_recovery` takes a set).
    torch's float arange has ceil(total / step) elements (computed in float64), each start + step x
    i rounded to float32."""
    total = header.frames
    if header.fps <= 0:
        raise MediaError(
            "Qwen2-VL video sampling needs a known source fps, but the container reported 0 (variable or "
            "unknown frame rate)."
        )
    low, high = _QWEN2_VL_FRAMES
    high = math.floor(min(high, total) / temporal_patch_size) * temporal_patch_size
    wanted = min(max(total / header.fps * min(fps, _QWEN2_VL_MAX_FPS), low), high, total)
    kept = math.floor(wanted / temporal_patch_size) * temporal_patch_size
    if kept < 1:
        raise MediaError(f"The video has {total} frame(s): Qwen2-VL's loader samples none of it")
    step = total / kept
    indices = {min(int(_float32(step * i)), total - 1) for i in range(math.ceil(total / step))}
    return len(indices)


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def container_video(url: str) -> VideoHeader | None:
    """The header of a video sent in a base64 data URL of any media type but "video/jpeg" (vLLM's
    VideoMediaIO.load_base64 hands those bytes to the video loader whatever the type says); None
    for a video by URL (not fetched) or bytes that are neither MP4 / MOV nor Matroska / WebM."""
    if url[:5].lower() != "data:":
        return None
    comma = url.find(",")
    try:
        data = binascii.a2b_base64(memoryview(url.encode("ascii"))[comma + 1 :], strict_mode=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise MediaError(f"The video's data URL is not valid base64: {exc}") from None
    return read_container(data) if is_container(data) else None


# vllm/multimodal/video.py Qwen3VLVideoBackend (0.32.0): the loader for Qwen3VLVideoProcessor.
QWEN3_VL_FPS = 2.0  # its load_bytes' fps, unless media_io_kwargs' "fps" says
_QWEN3_VL_UNKNOWN_FPS = 24.0  # _prepare_source: HF's Qwen3VLVideoProcessor assumes 24 fps then


def linspace_indices(total: int, count: int) -> list[int]:
    """numpy's np.linspace(0, total - 1, count).round().astype(int): i x step in float64, the last
    exactly total - 1, rounded half to even (Python's round on floats, as numpy's)."""
    if count <= 1:
        return [0] * max(count, 0)
    step = (total - 1) / (count - 1)
    return [round(i * step) for i in range(count - 1)] + [total - 1]


def qwen3_vl_indices(header: VideoHeader, fps: float = QWEN3_VL_FPS) -> tuple[list[int], float]:
    """Qwen3VLVideoBackend.compute_frames_index_to_sample: int(total / rate x min(fps, 30)) frames,
    within [4, 768] and the video's own, at np.linspace(0, total - 1, n).round(); and the rate
    vLLM's metadata carries (24 where OpenCV reports none)."""
    rate = header.fps if header.fps > 0 else _QWEN3_VL_UNKNOWN_FPS
    low, high = _QWEN2_VL_FRAMES  # the same 4 and 768
    count = min(max(int(header.frames / rate * min(fps, _QWEN2_VL_MAX_FPS)), low), high, header.frames)
    return linspace_indices(header.frames, count), rate
