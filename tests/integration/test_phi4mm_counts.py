"""Phi-4-multimodal counted as vLLM 0.32.0's own code counts it (tests/support/vllm_phi4mm_counts.py,
run in the vLLM venv): its images over many sizes, aspect ratios and dynamic_hd settings
(phi4mm.py Phi4MMProcessingInfo.get_num_image_tokens), its audio over lengths and sample rates
(vLLM's scipy resampler, get_audio_num_frames, _compute_audio_embed_size), and whole prompts: the
ids vLLM's Phi4MMMultiModalProcessor makes of a tokenized chat with numbered placeholders
(BaseMultiModalProcessor._apply_prompt_updates, by tokens or, where the tokenizer splits a
placeholder differently in the prompt, by text) against kvgate's count of the same chat.

No Phi-4-multimodal is served here: vLLM loads its config, processor and tokenizer as the
checkpoint's remote code (trust_remote_code), which is not in this offline machine, so no tiny
random-weight Phi-4-multimodal can be built without writing that code ourselves."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import wave
from collections.abc import Sequence
from pathlib import Path

import pytest
from PIL import Image

from kvgate.audio import AudioError, AudioLength, audio_tokens
from kvgate.image_rules import HdCrops, image_tokens
from kvgate.media import ImageSize
from kvgate.multimodal import MediaCounting, plan_matches, with_placeholders
from kvgate.request import ChatInput
from kvgate.tokens import LocalTokenizer
from support.encoder_budgets import TINY_BATCHED_TOKENS, TINY_SEQUENCES, profile_of, tiny_budget
from support.geometry import config_json
from support.tiny_media import input_audio, silent_wav
from support.tiny_phi4mm import FEATURE_TOKENS, tiny_phi4mm
from support.tiny_phi4mm import PHI4MM_CONFIG as CONFIG
from support.vllm_server import VllmPython

SCRIPT = str(Path(__file__).parents[1] / "support" / "vllm_phi4mm_counts.py")
# Sides around the crop (448) and patch (14) edges, and far beyond: every pair is an image.
SIDES = [1, 2, 13, 14, 15, 27, 28, 100, 223, 224, 447, 448, 449, 500, 895, 896, 897, 1000, 1343, 1344, 1500,
         2000, 2688, 3000, 4032, 5000, 8000, 16000]  # fmt: skip
DYNAMIC_HD = [1, 4, 12, 16, 36, 64]


def _vllm(vllm_python: VllmPython, cases: dict) -> dict:
    return json.loads(vllm_python(SCRIPT, input=json.dumps(cases)).strip().splitlines()[-1])


@pytest.mark.vllm
def test_phi4mm_image_counts_equal_vllms(vllm_python: VllmPython) -> None:
    """784 sizes under six dynamic_hd settings: kvgate's count is vLLM's, and an image it cannot
    see counts as vLLM's largest (its profile's dummy), above every image's."""
    sizes = [(w, h) for w in SIDES for h in SIDES]
    theirs = _vllm(vllm_python, {"images": sizes, "dynamic_hd": DYNAMIC_HD})
    rule = image_tokens(CONFIG, {"dynamic_hd": 36})
    assert isinstance(rule, HdCrops)
    searched = 0
    for dynamic_hd in DYNAMIC_HD:
        kwargs = {"dynamic_hd": dynamic_hd}
        ours = [rule.replacement(ImageSize(w, h), kwargs).features for w, h in sizes]
        assert ours == theirs["images"][str(dynamic_hd)], dynamic_hd
        assert rule.replacement(None, kwargs).features == theirs["largest"][str(dynamic_hd)]
        assert rule.most_features(None, kwargs) == theirs["largest"][str(dynamic_hd)] >= max(ours)
        searched += sum(1 for w, h in sizes if -(-w // 448) * -(-h // 448) > dynamic_hd)
    assert searched > 1000  # the crop-ratio search (more crops than dynamic_hd) is well exercised
    assert theirs["largest"]["36"] == 10065  # the released checkpoint's dynamic_hd


# tests/data/phi4mm-resampled-lengths.json: [frames, rate, samples vLLM's scipy resampler keeps].
RESAMPLED = json.loads((Path(__file__).parents[1] / "data" / "phi4mm-resampled-lengths.json").read_text())["cases"]


@pytest.mark.vllm
def test_phi4mm_audio_counts_equal_vllms(vllm_python: VllmPython) -> None:
    """112 lengths at eight sample rates: kvgate's count from the WAV header's frames and rate is
    vLLM's get_audio_num_frames and _compute_audio_embed_size of the samples vLLM's resampler keeps
    (recorded, the vLLM venv having no scipy; at 16 kHz vLLM does not resample); vLLM's "too
    short" is kvgate's 400."""
    theirs = _vllm(vllm_python, {"audio": [samples for _, _, samples in RESAMPLED], "compression_rate": 8})["audio"]
    rule = audio_tokens(CONFIG)
    assert rule is not None
    ours: list[int | None] = []
    for frames, rate, _ in RESAMPLED:
        try:
            ours.append(rule.features(AudioLength(frames, rate), {}))
        except AudioError:
            ours.append(None)
    assert ours == theirs
    assert None in theirs
    assert theirs.count(None) < len(theirs) // 2


@pytest.fixture(scope="module")
def phi_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_phi4mm(tiny_model_dir, tmp_path_factory.mktemp("tiny-phi4mm"))


def _image(width: int, height: int) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, "PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
    }


def _audio(seconds: float, rate: int = 16000) -> dict:
    return input_audio(silent_wav(seconds, rate))


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


# Chats whose placeholders vLLM puts in front of the text or the text holds itself, images and
# audio mixed, placeholders out of order in the text, placeholders split differently in context.
CHATS: list[list[dict]] = [
    [_text("Describe the picture."), _image(640, 480)],
    [_image(100, 50), _image(3000, 200), _text("Compare them.")],
    [_text("What is said?"), _audio(1.0, 16000)],
    [_image(448, 896), _audio(2.5, 44100), _text("Both, please.")],
    [_text("First <|image_2|> then <|image_1|>, and x<|image_3|>y."), _image(64, 64), _image(900, 900), _image(5, 700)],
    [_text("Listen:<|audio_1|>"), _audio(0.5, 8000), _image(1344, 448)],
    # A space before the placeholder: the byte-level BPE makes " <|" of it, not the "<|" of the
    # placeholder alone, so vLLM (and kvgate) replace it in the text.
    [_text("Look at <|image_1|> now."), _image(640, 480)],
    [_text("Hear <|audio_1|> and see"), _audio(1.5, 22050), _image(200, 3000)],
]


def _counts(rule: HdCrops, parts: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Each image's and each audio's count, by kvgate's rules, in prompt order."""
    from kvgate.media import read_image

    audio = audio_tokens(CONFIG)
    assert audio is not None
    images, sounds = [], []
    for part in parts:
        if part["type"] == "image_url":
            size = read_image(part["image_url"]["url"])
            assert isinstance(size, ImageSize)
            images.append(rule.replacement(size, {}).features)
        elif part["type"] == "input_audio":
            with wave.open(io.BytesIO(base64.b64decode(part["input_audio"]["data"]))) as heard:
                sounds.append(audio.features(AudioLength(heard.getnframes(), heard.getframerate()), {}))
    return images, sounds


@pytest.mark.vllm
def test_phi4mm_prompts_equal_vllms(vllm_python: VllmPython, phi_folder: Path) -> None:
    """kvgate's ids for each chat, its stand-ins read as the feature tokens, are the ids vLLM's
    processor makes of the same chat's tokens; the token plan and the text fallback both run."""
    local = LocalTokenizer(phi_folder)
    rule = image_tokens(CONFIG, {"dynamic_hd": 36})
    audio = audio_tokens(CONFIG)
    assert isinstance(rule, HdCrops)
    assert audio is not None
    counting = MediaCounting(local, rule, None, "phi4mm", audio)
    image_id, audio_id = (local._tok.convert_tokens_to_ids(t) for t in FEATURE_TOKENS)
    prompts, ours = [], []
    for parts in CHATS:
        chat = ChatInput(messages=({"role": "user", "content": parts},))
        heard: list = []
        text_chat, _ = with_placeholders(chat, rule, "phi4mm", False, audio, heard, [])
        raw = list(asyncio.run(local.encode_chat(text_chat)))
        images, sounds = _counts(rule, parts)
        prompts.append(
            {
                "folder": str(phi_folder),
                "ids": raw,
                "images": images,
                "audios": sounds,
                "image_token": image_id,
                "audio_token": audio_id,
            }
        )
        counted = list(asyncio.run(counting.encode_chat(chat)))
        stand_ins = sorted({t for t in counted if t < 0}, key=counted.index)
        assert len(stand_ins) == len(images) + len(sounds)
        ours.append(_as_features(counted, stand_ins, images, sounds, image_id, audio_id))
    theirs = _vllm(vllm_python, {"prompts": prompts})["prompts"]
    assert ours == theirs
    # Both of vLLM's paths ran: some chat's placeholders were found as tokens, some only as text.
    matched = [all(_found(p["ids"], local, n) for n in _numbered(p)) for p in prompts]
    assert any(matched)
    assert not all(matched)


@pytest.mark.vllm
def test_plan_matches_equals_vllms_token_plan(vllm_python: VllmPython) -> None:
    """400 random prompts over a 4-token alphabet, 1 to 5 items with targets of 1 to 3 tokens
    (overlapping, repeated, shared between items, missing): kvgate's plan replaces what vLLM's
    _apply_token_matches_with_placeholders replaces, and finds nothing where it finds nothing."""
    generator = random.Random(23)
    cases = []
    for _ in range(400):
        ids = [generator.randrange(4) for _ in range(generator.randrange(0, 24))]
        targets = [
            [generator.randrange(4) for _ in range(generator.randrange(1, 4))] for _ in range(generator.randrange(1, 6))
        ]
        cases.append({"ids": ids, "targets": targets})
    theirs = _vllm(vllm_python, {"plans": cases})["plans"]
    ours = []
    for case in cases:
        plan = plan_matches(case["ids"], case["targets"])
        if plan is None:
            ours.append(None)
            continue
        out, previous = [], 0
        for start, end, item in plan:
            out += [*case["ids"][previous:start], -(item + 1)]
            previous = end
        ours.append(out + case["ids"][previous:])
    assert ours == theirs
    assert 50 < sum(plan is None for plan in theirs) < 350  # both outcomes well exercised


def _numbered(prompt: dict) -> list[str]:
    return [f"<|image_{i}|>" for i in range(1, len(prompt["images"]) + 1)] + [
        f"<|audio_{i}|>" for i in range(1, len(prompt["audios"]) + 1)
    ]


def _found(ids: list[int], local: LocalTokenizer, text: str) -> bool:
    target = local._tok.encode(text, add_special_tokens=False)
    return any(ids[i : i + len(target)] == target for i in range(len(ids)))


def _as_features(
    counted: list[int], stand_ins: list[int], images: list[int], sounds: list[int], image_id: int, audio_id: int
) -> list[int]:
    """kvgate's ids with each item's stand-in as its feature token: an item is an image or an
    audio by which of the chat's counts its run of stand-ins has (the chats' counts differ)."""
    kind = {}
    for stand_in in stand_ins:
        run = counted.count(stand_in)
        kind[stand_in] = image_id if run in images else audio_id
        assert (run in images) != (run in sounds)
    return [kind.get(t, t) for t in counted]


# (--limit-mm-per-prompt, compression rate): images off, audio off, both, the dummies' options,
# and a compression rate of 1 (1,504 embeddings the dummy audio) that outweighs a small dummy image.
PROFILES = [
    ({"image": 0, "audio": 3}, 8),
    ({"image": 2, "audio": 0}, 8),
    ({"image": 2, "audio": 3}, 8),
    ({"image": 0, "audio": {"count": 2, "length": 50000}}, 8),
    ({"image": {"count": 2, "width": 448, "height": 448}, "audio": 3}, 8),
    ({"image": {"count": 2, "width": 1, "height": 448}, "audio": 3}, 1),
    ({"image": 0, "audio": 3}, 1),
]


@pytest.mark.vllm
def test_phi4mm_profile_credit_is_what_vllms_budget_profiles(vllm_python: VllmPython, tmp_path: Path) -> None:
    """What kvgate credits Phi-4-multimodal's start-up profile with (engine_config.encoder_budget,
    kvgate/profiled_media.py `audio_item`) against vLLM 0.32.0's own `MultiModalBudget` run
    in-process (tests/support/vllm_phi4mm_counts.py `profiled`, its HF processor stood in for by
    vLLM's own counts): the same modality (its dummy audios with images off, its images else,
    unless the audio outweighs a small dummy image), the same dummy item and items, and, where
    vLLM's image M is kvgate's largest image, the same M and budget. Where --limit-mm-per-prompt
    shrinks the dummy image, vLLM's M is the dummy's count (no `get_mm_max_tokens_per_item`):
    kvgate keeps the largest image's M, so its budget is no smaller."""
    asked = [
        {"limits": limits, "dynamic_hd": 36, "compression_rate": rate, "max_model_len": 16384,
         "max_num_batched_tokens": TINY_BATCHED_TOKENS, "max_num_seqs": TINY_SEQUENCES}
        for limits, rate in PROFILES
    ]  # fmt: skip
    theirs = _vllm(vllm_python, {"profiles": asked})
    ours = []
    for n, (limits, rate) in enumerate(PROFILES):
        folder = tmp_path / str(n)
        folder.mkdir()
        config = {**config_json("qwen2.5-7b-instruct"), **CONFIG}
        config["embd_layer"] = {**CONFIG["embd_layer"], "audio_embd_layer": {
            **CONFIG["embd_layer"]["audio_embd_layer"], "compression_rate": rate}}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "preprocessor_config.json").write_text(json.dumps({"dynamic_hd": 36}))
        ours.append(tiny_budget(folder, limits, max_model_len=16384))
    assert [t["modality"] for t in theirs] == ["audio", "image", "image", "audio", "image", "audio", "audio"]
    for limits, budget, their in zip(PROFILES, ours, theirs, strict=True):
        most, compute, items, dummy = profile_of(budget)
        assert (budget.profiled_modality, dummy) == (their["modality"], their["dummy"]), limits
        assert budget.tower_profiled == (their["modality"] == "image"), limits
        if isinstance(limits[0]["image"], dict):
            assert (compute >= their["budget"], items) == (True, their["items"]), limits
        else:
            assert (most, compute, items) == (max(their["per_item"].values()), their["budget"], their["items"]), limits
