"""Image sizes read from headers (kvgate/media.py): what vLLM would read is measured as vLLM sees it
(EXIF orientation included), what it would refuse is a 400-class MediaError, and a header that
claims a huge image costs no more memory than its bytes."""

from __future__ import annotations

import base64
import io
import tracemalloc

import pytest
from PIL import Image, ImageFile

from bench.media_read import png_header
from kvgate.media import ImageByUrl, ImageSize, MediaError, image_size, read_image


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(width: int, height: int, fmt: str = "PNG", **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, fmt, **save)
    return buffer.getvalue()


@pytest.mark.parametrize(("fmt", "save"), [("PNG", {}), ("JPEG", {}), ("WEBP", {}), ("GIF", {}), ("BMP", {})])
def test_sizes_of_formats_vllm_reads(fmt: str, save: dict) -> None:
    assert read_image(_data_url(_png(37, 91, fmt, **save))) == ImageSize(37, 91)


def test_exif_orientation_swaps_sides_as_vllms_exif_transpose_does() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: vLLM's normalize_image turns a 40 x 20 file into 20 x 40
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20)).save(buffer, "JPEG", exif=exif.tobytes())
    assert read_image(_data_url(buffer.getvalue(), "image/jpeg")) == ImageSize(20, 40)
    exif[0x0112] = 3  # rotate 180: sides unchanged
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20)).save(buffer, "JPEG", exif=exif.tobytes())
    assert read_image(_data_url(buffer.getvalue(), "image/jpeg")) == ImageSize(40, 20)


def test_the_bytes_decide_not_the_media_type() -> None:
    """vLLM's ImageMediaIO.load_base64 ignores the data URL's media type: so does kvgate."""
    assert read_image(_data_url(_png(8, 9), "text/plain")) == ImageSize(8, 9)


def test_urls_are_not_fetched() -> None:
    for url in ("https://example.com/cat.png", "HTTP://example.com/x", "file:///etc/passwd"):
        assert read_image(url) == ImageByUrl(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,iVBORw0KGgo!!!!", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo=\n", "not valid base64"),
        ("data:image/png,rawbytes", "Only base64 data URLs"),
        ("data:image/png;base64", "missing ','"),
        ("ftp://example.com/cat.png", "scheme must be"),
        (_data_url(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\0" * 32, "audio/wav"), "Failed to load image"),
        (_data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "image/eps"), "Failed to load image"),
        (_data_url(_png(10, 10)[:20]), "Failed to load image"),  # cut inside the header
        (_data_url(b""), "Failed to load image"),
        (_data_url(png_header(0, 16)), "Failed to load image"),
        (_data_url(png_header(50_000, 50_000)), "too large"),  # PIL's bomb limit, vLLM's too
    ],
    ids=[
        "bad-base64",
        "base64-with-newline",
        "not-base64",
        "no-comma",
        "other-scheme",
        "wav-as-image",
        "eps-not-allowed",
        "truncated-header",
        "empty",
        "zero-width",
        "bomb",
    ],
)
def test_what_vllm_would_not_read_is_refused(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        read_image(url)


def test_vllms_pixel_limit_is_kept() -> None:
    """VLLM_MAX_IMAGE_PIXELS's default is PIL's own bomb limit; a lower one is kvgate's too."""
    with pytest.raises(MediaError, match="30x40 \\(1200 pixels\\) exceed the maximum of 1000 pixels"):
        read_image(_data_url(_png(30, 40)), max_pixels=1000)


def test_a_lying_header_is_counted_by_the_header_without_decoding() -> None:
    """A 50,000 x 1 header over 16 bytes of pixels: kvgate counts what vLLM would count were the
    image readable (vLLM refuses it when it decodes); reading it cost no more than its bytes."""
    data = png_header(50_000, 1)
    tracemalloc.start()
    try:
        assert image_size(data) == ImageSize(50_000, 1)
        bomb = png_header(13_000, 13_000)  # 169 Mpx: under the limit, 507 MB were it decoded
        assert image_size(bomb) == ImageSize(13_000, 13_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "TIFF"])
def test_no_pixels_are_ever_decoded(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIL's PngImageFile.getexif decodes the whole image to look for EXIF after the pixels (a
    solid 8000 x 8000 PNG is 190 KB sent, 192 MB decoded): kvgate reads headers only, so no
    image's load() runs, whatever the format."""
    data = _png(300, 200, fmt)

    def refuse_to_load(self: object) -> None:
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse_to_load)
    monkeypatch.setattr(Image.Image, "load", refuse_to_load)
    assert image_size(data) == ImageSize(300, 200)
