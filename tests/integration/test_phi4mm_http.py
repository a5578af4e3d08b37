"""Phi-4-multimodal through a running kvgate: the tiny Phi-4-multimodal folder
(tests/support/tiny_phi4mm.py) behind `kvgate serve`, a fake backend behind it (vLLM cannot serve
it here: the checkpoint's remote code is not in this offline machine). What a client sees: an
image's and an audio's tokens in the prompt count in place of their numbered placeholders, by
the tokenizer's ids or, for a placeholder after a space, by re-tokenizing the text as vLLM does;
a body over 64 KiB counted alike in a preparation worker; too many items, too short an audio,
a dynamic_hd kvgate does not count and a prompt it cannot re-tokenize as vLLM does (without a
render endpoint) a 400 that reaches nothing. The counts themselves are
checked against vLLM's own functions in test_phi4mm_counts.py."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import (
    KvgateServer,
    assert_chat_refused_before_backend,
    running_kvgate,
)
from support.tiny_media import input_audio, silent_wav
from support.tiny_phi4mm import tiny_phi4mm


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with running_fake_backend() as fake:
        yield fake


@pytest.fixture(scope="module")
def folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_phi4mm(tiny_model_dir, tmp_path_factory.mktemp("tiny-phi4mm"))


@pytest.fixture(scope="module")
def kvgate(folder: Path, backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    flags = ["--limit-mm-per-prompt", '{"image": 3, "audio": 2}', "--max-process-memory-bytes", "1GiB"]
    with running_kvgate(backend.base_url, folder, tmp_path_factory.mktemp("kvgate"), *flags) as server:
        yield server


def _image(width: int, height: int) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _audio(seconds: float, rate: int = 16000) -> dict:
    return input_audio(silent_wav(seconds, rate))


def _chat(*parts: dict, text: str = "What is this?", **extra: object) -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _prompt_tokens(kvgate: KvgateServer, body: dict) -> int:
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=body, timeout=30)
    assert explained.status_code == 200, explained.text
    assert "prompt_tokens" in explained.json(), explained.text
    return int(explained.json()["prompt_tokens"])


def _tokens(folder: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(folder), local_files_only=True).encode(text, add_special_tokens=False))


def test_an_image_and_an_audio_replace_their_numbered_placeholders(kvgate: KvgateServer, folder: Path) -> None:
    """vLLM puts "<|image_1|>\n" in front of the text (the tiny Llama's template takes strings);
    the placeholder's tokens (several) become the image's: 448 x 448 takes 545, 300 x 30 307,
    100 x 50 409 (test_phi4mm_counts has vLLM's); an audio's: 1 s at 16 kHz 13, 2 s at 44.1 kHz 25 (32,000
    samples at 16 kHz: 198 frames / 8)."""
    question = "What is this?"
    image_1, image_2, audio_1 = (_tokens(folder, t) for t in ("<|image_1|>", "<|image_2|>", "<|audio_1|>"))
    assert image_1 > 1
    one = _prompt_tokens(kvgate, _chat(text=f"<|image_1|>\n{question}"))
    assert _prompt_tokens(kvgate, _chat(_image(448, 448))) == one - image_1 + 545
    two = _prompt_tokens(kvgate, _chat(text=f"<|image_1|>\n<|image_2|>\n{question}"))
    assert _prompt_tokens(kvgate, _chat(_image(300, 30), _image(100, 50))) == two - image_1 - image_2 + 307 + 409
    heard = _prompt_tokens(kvgate, _chat(text=f"<|audio_1|>\n{question}"))
    assert _prompt_tokens(kvgate, _chat(_audio(1))) == heard - audio_1 + 13
    assert _prompt_tokens(kvgate, _chat(_audio(2, 44100))) == heard - audio_1 + 25


def test_a_placeholder_after_a_space_is_counted_from_the_retokenized_text(kvgate: KvgateServer) -> None:
    """The text holds "<|image_1|>" after a space: the tokenizer makes " <" of it there, so vLLM
    (and kvgate) replace it in the text and encode the text again; the image's 545 tokens stand
    where the placeholder's text was, " " now its own token."""
    text = "Look at <|image_1|> now."
    with_image = _prompt_tokens(kvgate, _chat(_image(448, 448), text=text))
    without = _prompt_tokens(kvgate, _chat(text=text.replace(" <|image_1|>", " ")))
    assert with_image == without + 545


def test_a_body_over_64_kib_is_counted_alike_in_a_preparation_worker(kvgate: KvgateServer) -> None:
    """3 s of 16-bit audio is 96 KB of WAV: 298 frames / 8 = 38 tokens where 1 s takes 13."""
    part = _audio(3)
    assert len(part["input_audio"]["data"]) > 64 * 1024
    assert _prompt_tokens(kvgate, _chat(part)) == _prompt_tokens(kvgate, _chat(_audio(1))) - 13 + 38


def test_explain_charges_an_audio_to_the_conformer_and_the_cache(kvgate: KvgateServer) -> None:
    """A 10 s audio (998 mel frames, 125 embeddings, charged as 1,000 frames): its Conformer's
    subsampling (kvgate/memory/encoder.py ConformerTower, measured in bf16 in
    bench/results/fidelity-encoder-phi4mm-audio-cpu.md: 88.38 MiB for 10 s), here in the tiny
    Llama's float32 (4 B a value, the decoder's dtype the tower runs in), apart from the image
    tower's bytes; its embeddings in the encoder cache."""
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=_chat(_audio(10)), timeout=30)
    assert explained.status_code == 200, explained.text
    terms = {t["name"]: t for t in explained.json()["transient"]["terms"]}
    audio = terms["audio_encoder_activations"]
    # 2 x 1,024 x 500 x 40 x 4 + 1,024 x 250 x 20 x 4 + 2 x 1,000 x 80 x 4 + 125^2 + 32 KiB + 1,000 x 80 x 4
    assert audio["bytes"] == 2 * 81_920_000 + 20_480_000 + 640_000 + 15_625 + 32_768 + 320_000
    assert "125 embeddings, at most 1,000 mel frames" in audio["detail"]
    assert audio["profiled"] is False
    assert terms["encoder_activations"]["bytes"] == 0  # no image
    assert "125 embeddings" in terms["encoder_cache"]["detail"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_chat(_audio(0.02)), "Waveform too short"),
        (_chat(_image(64, 64), mm_processor_kwargs={"dynamic_hd": 5000}), "dynamic_hd up to 4096"),
        (_chat(_image(8, 8), _image(8, 8), _image(8, 8), _image(8, 8)), "At most 3 image(s)"),
        # Replaced in the text (a space before it), beside a feature token's text of the prompt's
        # own: kvgate could not tell its image's tokens from the text's; no render endpoint here.
        (_chat(_image(8, 8), text="See <|image_1|> <|endoftext10|>"), "finds only in the prompt's text"),
    ],
    ids=["too-short-audio", "dynamic-hd", "over-the-limit", "feature-text-in-the-prompt"],
)
def test_what_phi4mm_cannot_take_is_a_400_that_reaches_nothing(
    kvgate: KvgateServer, backend: FakeBackend, body: dict, message: str
) -> None:
    assert_chat_refused_before_backend(kvgate, backend.seen, body, message)
