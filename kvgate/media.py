"""An image content part's size, read from its header as vLLM will see it, within bounded work.

kvgate counts an image's prompt tokens from its width and height alone, so it never decodes pixels:
a base64 data URL is decoded (vLLM 0.32.0 vllm/multimodal/media/image.py ImageMediaIO.load_base64:
`pybase64.b64decode(data, validate=True)`; kvgate's strict `binascii.a2b_base64` refuses the same
text: characters outside the alphabet, newlines included, and bad padding)
and PIL's lazy `Image.open` reads the header only, restricted to the formats vLLM opens
(vllm/multimodal/image.py ALLOWED_IMAGE_FORMATS, open_image). vLLM then checks
`VLLM_MAX_IMAGE_PIXELS` (envs.py, 178,956,970 by default: PIL's own decompression-bomb limit) and
turns the image by its EXIF orientation (image.py normalize_image: ImageOps.exif_transpose), which
swaps width and height for orientations 5-8; kvgate does both from the header. The media type a
data URL names is not checked by vLLM for images (load_base64 ignores it), so kvgate does not
either: the bytes decide.

Anything vLLM would fail to read is refused here with a 400 before any memory is reserved: bad
base64, bytes that are not an image of an allowed format, a header cut short, a side of 0 pixels,
more pixels than vLLM's limit. An image whose header is whole but whose pixel data is cut short or
lies is counted by its header (what vLLM would count were it readable) and vLLM refuses it.

Images by URL (http, https, file) are not fetched: kvgate is no fetcher of arbitrary URLs. Their
size is unknown, and kvgate.multimodal counts them at the processor's largest count.
"""

from __future__ import annotations

import binascii
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from kvgate.chat_template import TokenizationError

# vllm/multimodal/image.py ALLOWED_IMAGE_FORMATS (vLLM 0.32.0; unchanged in 0.33.0).
VLLM_IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS",
    "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG",
    "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)  # fmt: skip
# vllm/envs.py VLLM_MAX_IMAGE_PIXELS default (0.32.0, 0.33.0): larger images are refused by vLLM.
VLLM_MAX_IMAGE_PIXELS = 178_956_970
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})  # transpose, rotate 270, transverse, rotate 90


# PIL imports its format plugins on the first open; done here, at start-up, they are part of the
# process's (and each preparation worker's) start-up heap, not of the first image request's work,
# whose memory the worker's grant bounds (a worker's first image otherwise grew it by megabytes).
Image.init()


class MediaError(TokenizationError):
    """An image vLLM would not read: answered 400 like any request kvgate cannot tokenize."""


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int


@dataclass(frozen=True)
class ImageByUrl:
    """An image kvgate does not fetch: its size is unknown until vLLM fetches it."""

    url: str


def image_url(part: dict) -> str | None:
    """The URL of an image part ({"type": "image_url", "image_url": {"url"} or a string}, or
    {"type": "input_image", "image_url": ...}); None for parts without one (image_pil, image_embeds)."""
    if part.get("type") not in ("image_url", "input_image"):
        return None
    value = part.get("image_url")
    value = value.get("url") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def data_url_cost(url: str) -> int:
    """Memory reading a data URL takes beside the body, at most: its ASCII copy and the decoded
    bytes (the work kvgate charges before reading it; bench/media_read.py measures it)."""
    return len(url) + len(url) * 3 // 4


def read_image(url: str, max_pixels: int = VLLM_MAX_IMAGE_PIXELS) -> ImageSize | ImageByUrl:
    """The image's size as vLLM will process it (after EXIF orientation), from a data URL's header;
    ImageByUrl for an http(s) or file URL; MediaError for anything vLLM would not read."""
    scheme = url[:8].lower().partition(":")[0]
    if scheme in ("http", "https", "file"):
        return ImageByUrl(url)
    if scheme != "data":
        raise MediaError(f"Invalid image URL {url[:32]!r}: the URL scheme must be data, http, https or file.")
    comma = url.find(",")
    if comma < 0:
        raise MediaError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    if url[5:comma].rpartition(";")[2] != "base64":
        raise MediaError("Only base64 data URLs are supported for now.")
    try:
        # One copy of the URL as bytes, decoded from a view of it: no copy of the payload as text.
        data = binascii.a2b_base64(memoryview(url.encode("ascii"))[comma + 1 :], strict_mode=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise MediaError(f"The image's data URL is not valid base64: {exc}") from None
    return image_size(data, max_pixels)


def image_size(data: bytes, max_pixels: int = VLLM_MAX_IMAGE_PIXELS) -> ImageSize:
    """Width and height from the header alone (PIL's lazy open never decodes the pixels)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=VLLM_IMAGE_FORMATS) as image:
                width, height = image.size
                orientation = _orientation(image)
    except Image.DecompressionBombError as exc:
        raise MediaError(f"The image is too large to read: {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        kinds = ", ".join(VLLM_IMAGE_FORMATS)
        raise MediaError(f"Failed to load image: {exc} (vLLM reads only these image formats: {kinds})") from None
    if width < 1 or height < 1:
        raise MediaError(f"Failed to load image: it is {width}x{height} pixels (no pixels to process).")
    if width * height > max_pixels:
        raise MediaError(
            f"Image dimensions {width}x{height} ({width * height} pixels) exceed the maximum of "
            f"{max_pixels} pixels. Set VLLM_MAX_IMAGE_PIXELS to increase this limit."
        )
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return ImageSize(width, height)


def _orientation(image: Image.Image) -> int | None:
    """The EXIF orientation vLLM's exif_transpose applies; None where the header has none or it
    does not parse (vLLM suppresses any error there and keeps the image as it is). A PNG's EXIF
    is read only where it comes before the pixel data: PIL's PngImageFile.getexif decodes the whole
    image to find one after it, which kvgate never does (the families counted today give a turned
    image the same count: their rules are symmetric in width and height)."""
    if image.format == "PNG" and "exif" not in image.info:
        return None
    try:
        value = image.getexif().get(_EXIF_ORIENTATION)
    except Exception:  # noqa: BLE001 - vLLM's normalize_image suppresses every error here too
        return None
    return value if isinstance(value, int) else None


# vllm/multimodal/media/video.py VideoMediaIO.__init__'s num_frames (0.32.0, 0.33.0): the frames of
# a video vLLM keeps unless --media-io-kwargs or the request's media_io_kwargs say otherwise.
VLLM_VIDEO_FRAMES = 32


@dataclass(frozen=True)
class VideoFrames:
    """A video sent as its frames: how many of them vLLM keeps, and their size."""

    frames: int
    size: ImageSize


def video_frames(url: str, num_frames: int = VLLM_VIDEO_FRAMES) -> VideoFrames | None:
    """The frames of a "video/jpeg" data URL as vLLM loads them (vllm/multimodal/media/video.py
    VideoMediaIO.load_base64, 0.32.0 and 0.33.0: the base64 images between its commas, the first
    `num_frames` of them (-1: all), each opened as an image, and all of one shape for np.stack),
    each frame's size from its header; None for a video kvgate does not read (a URL, which it does
    not fetch, or a container such as MP4, which it does not parse); MediaError for what vLLM
    would not read."""
    scheme = url[:8].lower().partition(":")[0]
    if scheme in ("http", "https", "file"):
        return None
    if scheme != "data":
        raise MediaError(f"Invalid video URL {url[:32]!r}: the URL scheme must be data, http, https or file.")
    comma = url.find(",")
    if comma < 0:
        raise MediaError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    header = url[5:comma]
    if header.rpartition(";")[2] != "base64":
        raise MediaError("Only base64 data URLs are supported for now.")
    if header.partition(";")[0].lower() != "video/jpeg":
        return None
    if num_frames == 0:
        raise MediaError("num_frames must be greater than 0 or -1")
    try:
        data = memoryview(url.encode("ascii"))
    except UnicodeEncodeError as exc:
        raise MediaError(f"The video's data URL is not valid base64: {exc}") from None
    sizes: set[ImageSize] = set()
    frames, start = 0, comma + 1
    while num_frames < 0 or frames < num_frames:
        end = url.find(",", start)
        last = end < 0
        stop = len(url) if last else end
        try:
            frame = binascii.a2b_base64(data[start:stop], strict_mode=True)
        except binascii.Error as exc:
            raise MediaError(f"The video's frame {frames + 1} is not valid base64: {exc}") from None
        sizes.add(image_size(frame))
        frames += 1
        if last:
            break
        start = end + 1
    if len(sizes) > 1:
        raise MediaError("all input arrays must have the same shape")
    return VideoFrames(frames, sizes.pop())
