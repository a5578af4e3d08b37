"""MP4 and WebM headers built box by box and element by element (ISO 14496-12; Matroska's EBML
spec), for tests of kvgate/video_container.py: no pixel data, just the header a demuxer reads."""

from __future__ import annotations

import struct

IDENTITY = (0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
TURNED = (0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000)  # 90 degrees


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def mp4(
    width: int = 320,
    height: int = 240,
    stts: tuple[tuple[int, int], ...] = ((30, 512),),
    timescale: int = 15360,
    matrix: tuple[int, ...] = IDENTITY,
    elst: tuple[int, int] | None = None,  # (media_time, rate) of one edit
    handler: bytes = b"vide",
    mdhd_version: int = 0,
) -> bytes:
    tkhd = box(b"tkhd", bytes(4 + 4 + 4 + 4 + 4 + 4 + 8 + 8), struct.pack(">9i", *matrix), struct.pack(">II", 0, 0))
    if mdhd_version == 1:
        mdhd = box(b"mdhd", b"\x01\0\0\0", bytes(16), struct.pack(">IQ", timescale, 0), bytes(4))
    else:
        mdhd = box(b"mdhd", bytes(4 + 8), struct.pack(">II", timescale, 0), bytes(4))
    hdlr = box(b"hdlr", bytes(8), handler, bytes(12), b"\0")
    entry = box(b"mp4v", bytes(6), b"\0\x01", bytes(16), struct.pack(">HH", width, height), bytes(50))
    stsd = box(b"stsd", bytes(4), struct.pack(">I", 1), entry)
    stts_box = box(b"stts", bytes(4), struct.pack(">I", len(stts)), *(struct.pack(">II", n, d) for n, d in stts))
    stbl = box(b"stbl", stsd, stts_box)
    mdia = box(b"mdia", mdhd, hdlr, box(b"minf", stbl))
    edits = []
    if elst is not None:
        edits = [box(b"edts", box(b"elst", bytes(4), struct.pack(">IIihH", 1, 1000, elst[0], elst[1], 0)))]
    trak = box(b"trak", tkhd, *edits, mdia)
    return box(b"ftyp", b"isom", bytes(4)) + box(b"moov", trak) + box(b"mdat", bytes(100))


def element(element_id: int, payload: bytes) -> bytes:
    id_bytes = element_id.to_bytes((element_id.bit_length() + 7) // 8, "big")
    return id_bytes + b"\x01" + len(payload).to_bytes(7, "big") + payload


def uint(element_id: int, value: int) -> bytes:
    return element(element_id, value.to_bytes(8, "big"))


def webm(
    width: int = 320,
    height: int = 240,
    duration_ms: float = 2000.0,
    default_duration: int | None = 40_000_000,
    doc_type: bytes = b"webm",
    track_type: int = 1,
) -> bytes:
    header = element(0x1A45DFA3, element(0x4282, doc_type))
    info = element(0x1549A966, uint(0x2AD7B1, 1_000_000) + element(0x4489, struct.pack(">d", duration_ms)))
    video = element(0xE0, uint(0xB0, width) + uint(0xBA, height))
    entry = uint(0xD7, 1) + uint(0x83, track_type) + video
    if default_duration is not None:
        entry += uint(0x23E383, default_duration)
    tracks = element(0x1654AE6B, element(0xAE, entry))
    cluster = element(0x1F43B675, bytes(64))
    return header + element(0x18538067, info + tracks + cluster)


def _children(data: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    out = []
    while start < end:
        size, kind = struct.unpack_from(">I4s", data, start)
        out.append((kind, start, start + size))
        start += size
    return out


def with_long_last_frame(data: bytes, ticks: int) -> bytes:
    """A one-track MP4 (moov after mdat, one stts entry, as OpenCV's FFmpeg muxer writes it) whose
    last frame lasts `ticks`: its stts split into (n - 1, d) and (1, ticks), the boxes above it
    grown by the new entry's 8 bytes (no chunk offset moves: mdat comes first)."""
    out = bytearray(data)
    parents, start, end = [], 0, len(out)
    for name in (b"moov", b"trak", b"mdia", b"minf", b"stbl"):
        _, start, end = next(c for c in _children(bytes(out), start, end) if c[0] == name)
        parents.append(start)
        start += 8
    _, at, stop = next(c for c in _children(bytes(out), start, end) if c[0] == b"stts")
    entries, count, delta = struct.unpack_from(">III", out, at + 12)
    assert entries == 1
    out[at:stop] = struct.pack(">I4s4sIIIII", 40, b"stts", bytes(4), 2, count - 1, delta, 1, ticks)
    for parent in parents:
        struct.pack_into(">I", out, parent, struct.unpack_from(">I", out, parent)[0] + 8)
    return bytes(out)
