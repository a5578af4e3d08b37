"""Audio counting (kvgate/audio.py) through MediaCounting (kvgate/multimodal.py): a WAV file's
length from its header, Qwen2-Audio's token count against transformers' own WhisperFeatureExtractor
and vLLM's formula, resampling as torchaudio counts it, and the refusals vLLM gives."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import struct
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from kvgate.audio import MAX_WAV_CHUNKS, AudioError, AudioLength, audio_tokens, resampled, resampled_poly, wav_length
from kvgate.chat_template import TokenizationError
from kvgate.multimodal import MediaCounting, MediaOptions
from kvgate.request import ChatInput

# Qwen/Qwen2-Audio-7B-Instruct's config.json (audio_token_index) and preprocessor_config.json.
QWEN2_AUDIO = {"model_type": "qwen2_audio", "audio_token_index": 151646}
QWEN2_AUDIO_PROCESSOR = {"sampling_rate": 16000, "hop_length": 160, "n_samples": 480000, "feature_size": 128}
SPECIAL = {"<|AUDIO|>": 151646, "<|audio_bos|>": 151647, "<|audio_eos|>": 151648}


class WordTokenizer:
    """Qwen2-Audio's special tokens and words; a chat is its parts' texts, placeholders in place."""

    source = "local"

    def _ids(self, text: str) -> list[int]:
        pattern = "|".join(re.escape(s) for s in SPECIAL) + r"|[^\s<]+|<"
        return [SPECIAL.get(piece, 7) for piece in re.findall(pattern, text)]

    async def encode_prompt(self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None):
        return self._ids(prompt)

    async def encode_prompts(self, prompts: list[str], add_special_tokens: bool = True, max_tokens=None):
        return [self._ids(p) for p in prompts]

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        return None

    async def encode_chat(self, chat: ChatInput, max_tokens=None, namespace_aliases=False) -> Sequence[int]:
        text = " ".join(getattr(p, "text", None) or p["text"] for m in chat.messages for p in m["content"])
        return self._ids(text)


def _wav(frames: int, rate: int = 16000, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * frames * channels)
    return buffer.getvalue()


def _float_wav(frames: int, rate: int, extra_chunk: bool = True) -> bytes:
    """A 32-bit float WAV (format 3, as soundfile writes 'FLOAT'), with a LIST chunk before data."""
    fmt = struct.pack("<HHIIHH", 3, 2, rate, rate * 8, 8, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if extra_chunk:
        chunks += b"LIST" + struct.pack("<I", 5) + b"INFOx" + b"\0"  # odd size: padded to even
    chunks += b"data" + struct.pack("<I", frames * 8) + b"\0" * frames * 8
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def _input_audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def _audio_url(data: bytes) -> dict:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(data).decode()}}


TEXT = {"type": "text", "text": "What is said?"}


def _counting(options: MediaOptions | None = None) -> MediaCounting:
    rule = audio_tokens(QWEN2_AUDIO, QWEN2_AUDIO_PROCESSOR)
    return MediaCounting(WordTokenizer(), None, options, "qwen2_audio", rule)


def _count(counting: MediaCounting, *parts: dict, **kwargs: object) -> list[int]:
    chat = ChatInput(messages=({"role": "user", "content": list(parts)},), **kwargs)  # type: ignore[arg-type]
    return list(asyncio.run(counting.encode_chat(chat)))


def _vllm_tokens(mask_frames: int) -> int:
    """qwen2_audio.py _get_feat_extract_output_lengths (vLLM 0.32.0 / 0.33.0)."""
    return (((mask_frames - 1) // 2 + 1) - 2) // 2 + 1


def test_wav_headers_give_frames_and_rate() -> None:
    assert wav_length(_wav(12345, 22050, channels=2)) == AudioLength(12345, 22050)
    assert wav_length(_float_wav(1000, 48000)) == AudioLength(1000, 48000)
    cut = _wav(16000)[:-1000]  # a data chunk cut short: the whole frames present
    assert wav_length(cut) == AudioLength(16000 - 500, 16000)
    lying = bytearray(_wav(16000))
    lying[40:44] = struct.pack("<I", 0xFFFFFFFF)  # the data chunk says 4 GiB: the bytes present count
    assert wav_length(bytes(lying)) == AudioLength(16000, 16000)


def test_a_wav_of_endless_chunks_is_not_read_past_the_limit() -> None:
    header = _wav(10)
    padded = (
        header[:36]
        + b"junk"
        + struct.pack("<I", 0) * 1
        + b"".join(b"pad " + struct.pack("<I", 0) for _ in range(MAX_WAV_CHUNKS))
        + header[36:]
    )
    with pytest.raises(TokenizationError, match=f"within {MAX_WAV_CHUNKS} chunks"):
        _count(_counting(), _input_audio(padded))


@pytest.mark.parametrize("samples", [321, 1600, 16000, 16001, 160 * 1000 + 1, 479999, 480000, 600000])
def test_qwen2_audio_counts_as_the_feature_extractor_masks(samples: int) -> None:
    """The feature extractor's attention mask (transformers' WhisperFeatureExtractor, padding to
    n_samples as Qwen2AudioProcessor asks), halved twice as vLLM does."""
    extractor = WhisperFeatureExtractor(feature_size=128)
    mask = extractor(
        np.zeros(samples, dtype=np.float32),
        sampling_rate=16000,
        padding="max_length",
        truncation=True,
        return_attention_mask=True,
    )["attention_mask"]
    expected = _vllm_tokens(int(np.asarray(mask).sum()))
    rule = audio_tokens(QWEN2_AUDIO, QWEN2_AUDIO_PROCESSOR)
    assert rule is not None
    assert rule.features(AudioLength(samples, 16000), {}) == expected
    ids = _count(_counting(), TEXT, _input_audio(_wav(samples)))
    assert sum(1 for t in ids if t < 0) == expected
    assert ids.count(SPECIAL["<|audio_bos|>"]) == 1  # "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>"


def test_the_longest_audio_and_one_by_url_take_750_tokens() -> None:
    # 30 s at 16 kHz: 3,000 mel frames -> 1,500 -> 750 (get_mm_max_tokens_per_item's own count).
    for where in ("https://example.com/talk.wav", "file:///srv/talk.wav"):
        url = {"type": "audio_url", "audio_url": {"url": where}}
        assert sum(1 for t in _count(_counting(), url) if t < 0) == 750
    with pytest.raises(AudioError, match="scheme must be data, http, https or file"):
        _count(_counting(), {"type": "audio_url", "audio_url": {"url": "ftp://example.com/a.wav"}})
    assert sum(1 for t in _count(_counting(), _input_audio(_wav(16000 * 90))) if t < 0) == 750


def test_other_rates_are_counted_after_torchaudios_resampling() -> None:
    # 44.1 kHz -> 16 kHz: torchaudio keeps ceil(160 n / 441) samples, in float32: 1,000,064
    # samples make 362,835 (torch.ceil(torch.as_tensor(160 * 1000064 / 441)) in torch 2.9), not
    # the exact ceiling 362,836.
    assert resampled(AudioLength(44100, 44100), 16000) == 16000
    assert resampled(AudioLength(1000064, 44100), 16000) == 362835
    assert resampled(AudioLength(33075, 22050), 16000) == 24000
    stereo = _count(_counting(), _audio_url(_wav(44100 * 2, 44100, channels=2)))
    assert sum(1 for t in stereo if t < 0) == _vllm_tokens(-(-32000 // 160))


def test_two_audios_are_numbered_and_get_their_own_stand_ins() -> None:
    ids = _count(_counting(), _input_audio(_wav(16000)), TEXT, _input_audio(_wav(32000)))
    stand_ins = [t for t in ids if t < 0]
    assert len(set(stand_ins)) == 2
    assert len(stand_ins) == _vllm_tokens(100) + _vllm_tokens(200)


def test_limit_mm_per_prompt_for_audio() -> None:
    counting = _counting(MediaOptions(limits={"audio": 1}))
    with pytest.raises(TokenizationError, match="At most 1 audio"):
        _count(counting, _input_audio(_wav(16000)), _input_audio(_wav(16000)))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_wav(100), "too short to be represented"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no data chunk"),
        (_wav(16000 * 601), "maximum allowed duration of 600s"),
        (_float_wav(0, 16000), "No audio found"),
    ],
    ids=["too-short", "no-data", "too-long", "empty"],
)
def test_audio_vllm_refuses_is_a_400(data: bytes, message: str) -> None:
    with pytest.raises(AudioError, match=message):
        _count(_counting(), _input_audio(data))


def test_bad_base64_and_other_containers() -> None:
    bad = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}
    with pytest.raises(AudioError, match="not valid base64"):
        _count(_counting(), bad)
    mp3 = _input_audio(b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\0" * 100)
    with pytest.raises(TokenizationError, match=r"'audio' content part .*qwen2_audio.*WAV files only"):
        _count(_counting(), mp3)


def test_feature_extractor_kwargs_kvgate_does_not_read_are_refused() -> None:
    with pytest.raises(TokenizationError, match="max_length"):
        _count(_counting(), _input_audio(_wav(16000)), mm_processor_kwargs={"audio_kwargs": {"max_length": 1}})


class DroppingTokenizer(WordTokenizer):
    """A template that writes no text for media parts (an "openai"-format one that ignores them)."""

    async def encode_chat(self, chat: ChatInput, max_tokens=None, namespace_aliases=False) -> Sequence[int]:
        texts = [p["text"] for m in chat.messages for p in m["content"] if isinstance(p, dict)]
        return self._ids(" ".join(texts))


def test_a_template_that_drops_the_audio_is_a_400() -> None:
    """vLLM's processor finds no <|AUDIO|> for the audio and refuses; kvgate says so first."""
    counting = MediaCounting(DroppingTokenizer(), None, None, "qwen2_audio", audio_tokens(QWEN2_AUDIO, {}))
    with pytest.raises(TokenizationError, match=r"0 <\|AUDIO\|> placeholders for 1 qwen2_audio media items"):
        _count(counting, TEXT, _input_audio(_wav(16000)))


PHI4MM = {"model_type": "phi4mm", "embd_layer": {"audio_embd_layer": {"compression_rate": 8}}}
# tests/data/phi4mm-resampled-lengths.json: [frames, rate, samples vLLM's scipy resampler keeps].
_RESAMPLED = json.loads((Path(__file__).parents[1] / "data" / "phi4mm-resampled-lengths.json").read_text())["cases"]


def test_phi4mm_resampling_keeps_the_samples_vllms_scipy_resampler_keeps() -> None:
    """112 lengths over 8 rates, recorded from vLLM 0.32.0's AudioResampler("scipy")."""
    assert [resampled_poly(AudioLength(frames, rate), 16000) for frames, rate, _ in _RESAMPLED] == [
        samples for _, _, samples in _RESAMPLED
    ]


def test_phi4mm_audio_counts_frames_over_the_compression_rate() -> None:
    """1 s at 16 kHz: (16,000 - 400) // 160 + 1 = 98 frames, / 8 rounded up: 13; 399 samples
    make no frame (vLLM's "too short"); by URL: 600 s, 60,000 frames, 7,500."""
    rule = audio_tokens(PHI4MM)
    assert rule is not None
    assert rule.indexed
    assert rule.features(AudioLength(16000, 16000), {}) == 13
    assert rule.features(AudioLength(400, 16000), {}) == 1
    with pytest.raises(AudioError, match="too short"):
        rule.features(AudioLength(399, 16000), {})
    assert rule.features(None, {}) == 7500
    assert rule.placeholder_text(3) == "<|audio_3|>"
    assert audio_tokens({"model_type": "phi4mm"}) is None  # no compression rate: not counted
