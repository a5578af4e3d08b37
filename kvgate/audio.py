"""Audio in chat messages: an audio part's length from its WAV header, and the prompt tokens a
model family's processor makes of it (a rule per family, keyed on config.json's `model_type`).

vLLM 0.32.0 / 0.33.0 read an audio part (`input_audio`'s base64 data, or an `audio_url` data
URL) with vllm/multimodal/media/audio.py `AudioMediaIO.load_base64` (`pybase64.b64decode(data,
validate=True)`) and `load_audio` at the file's own rate, refusing files over
VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25), longer than VLLM_MAX_AUDIO_DECODE_DURATION_S (600 s) or
decoding to more than VLLM_MAX_AUDIO_DECODE_BYTES (256 MiB of float32 samples, all channels);
multimodal/parse.py `MultiModalDataParser._parse_audio_data` then mixes the channels down and
resamples to the feature extractor's rate with `AudioResampler` ("torchaudio" unless the model
asks otherwise: torchaudio.functional.resample keeps ceil(new x n / orig) samples, computed in
float32, after dividing both rates by their gcd).

kvgate reads a WAV file's header only (RIFF `fmt ` and `data` chunks: PCM, IEEE float or
extensible), never its samples: the frames are the data chunk's whole blocks (no more than the
bytes present). Other containers (FLAC, MP3, Ogg, ...) have no sample count kvgate can read
without decoding, and their decoders disagree on padding: they are not counted here (the backend's
render endpoint counts them where it is enabled; kvgate/multimodal.py). Audio by http(s) or file
URL is not fetched and counts as the longest the processor takes.

Rules, read in vLLM 0.32.0 and 0.33.0 (the counting code is the same in both):

- Qwen2-Audio (`qwen2_audio`): transformers' WhisperFeatureExtractor pads or truncates to
  n_samples (30 s at 16 kHz) and masks one frame per hop_length samples, ceil(min(n, n_samples) /
  hop_length) (feature_extraction_whisper.py `__call__`, Qwen2AudioProcessor._process_audio with
  padding "max_length"); the encoder halves that twice (qwen2_audio.py
  `_get_feat_extract_output_lengths`: (L - 1) // 2 + 1, then (L - 2) // 2 + 1) and
  Qwen2AudioMultiModalProcessor._get_prompt_updates repeats <|AUDIO|> that many times, refusing 0
  ("too short to be represented inside the model"). The chat template writes
  "Audio {i}: <|audio_bos|><|AUDIO|><|audio_eos|>" (Qwen2AudioForConditionalGeneration.
  get_placeholder_str) for the i-th audio of the prompt.
- Phi-4-multimodal (`phi4mm`): the audio resampled to the feature extractor's rate by
  scipy.signal.resample_poly (Phi4MMProcessingInfo.get_data_parser asks for "scipy";
  multimodal/audio.py resample_audio_scipy: ceil(n x up / down) samples, the rates' gcd divided
  out), then phi4mm.py Phi4MMProcessingInfo.get_audio_num_frames ((n - 400) // 160 + 1 frames of
  25 ms every 10 ms, after its own 8 kHz / above-16 kHz adjustments, which a 16 kHz extractor never
  takes; fewer than 1 frame: "Waveform too short for given parameters.") and
  _compute_audio_embed_size (frames / config.json's embd_layer.audio_embd_layer.compression_rate,
  rounded up, the qformer rate being 1); Phi4MMMultiModalProcessor._get_prompt_updates repeats
  <|endoftext11|> that many times in place of the numbered text `<|audio_i|>`
  (Phi4MMForCausalLM.get_placeholder_str), which vLLM finds as tokens (`indexed`).
"""

from __future__ import annotations

import binascii
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvgate.chat_template import TokenizationError
from kvgate.image_rules import Expanding, Replacement, _float32, _json_file, mirrored_class

# vllm/envs.py defaults (0.32.0, 0.33.0).
VLLM_MAX_AUDIO_CLIP_FILESIZE_MB = 25
VLLM_MAX_AUDIO_DECODE_DURATION_S = 600
VLLM_MAX_AUDIO_DECODE_BYTES = 268_435_456
_MiB = 1 << 20
# WAVE format tags libsndfile and FFmpeg both read as samples: PCM, IEEE float, extensible.
_WAVE_FORMATS = frozenset({0x0001, 0x0003, 0xFFFE})
# Chunks kvgate reads past before the data chunk (real files have a handful; a 25 MB file of
# empty chunks would be three million Python steps).
MAX_WAV_CHUNKS = 64


class AudioError(TokenizationError):
    """Audio vLLM would not read: a 400 like any request kvgate cannot tokenize."""


class AudioNotCounted(Exception):
    """Audio kvgate cannot count from its header (not a WAV file): the render endpoint's, or a 400."""


@dataclass(frozen=True)
class AudioLength:
    frames: int  # samples per channel at `rate`
    rate: int  # samples per second


@dataclass(frozen=True)
class AudioByUrl:
    """Audio kvgate does not fetch: its length is unknown until vLLM fetches it."""

    url: str


def audio_data(part: dict) -> str | None:
    """An audio part's data URL: `audio_url` ({"url"} or a string), or `input_audio`'s base64
    `data` (vLLM 0.32.0 renderers/chat_utils.py builds "data:audio/{format};base64,{data}" of it);
    None for parts without one (audio_embeds)."""
    kind = part.get("type")
    if kind == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, dict) else None
        return f"data:audio/wav;base64,{data}" if isinstance(data, str) else None
    if kind == "audio_url":
        value = part.get("audio_url")
        value = value.get("url") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None
    return None


def read_audio(url: str) -> AudioLength | AudioByUrl:
    """The audio's length from a data URL's WAV header; AudioByUrl for an http(s) or file URL; AudioError
    for what vLLM would refuse; AudioNotCounted for a container kvgate does not read."""
    scheme = url[:8].lower().partition(":")[0]
    if scheme in ("http", "https", "file"):  # file: vLLM's --allowed-local-media-path
        return AudioByUrl(url)
    if scheme != "data":
        raise AudioError(f"Invalid audio URL {url[:32]!r}: the URL scheme must be data, http, https or file.")
    comma = url.find(",")
    if comma < 0 or url[5:comma].rpartition(";")[2] != "base64":
        raise AudioError("Only base64 data URLs are supported for audio.")
    most_bytes = VLLM_MAX_AUDIO_CLIP_FILESIZE_MB * _MiB
    if len(url) - comma - 1 > 4 * ((most_bytes + 2) // 3):  # AudioMediaIO.load_base64's check
        raise AudioError(
            f"Maximum file size exceeded: audio files are limited to {VLLM_MAX_AUDIO_CLIP_FILESIZE_MB} MB."
        )
    try:
        data = binascii.a2b_base64(memoryview(url.encode("ascii"))[comma + 1 :], strict_mode=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise AudioError(f"The audio's data is not valid base64: {exc}") from None
    return wav_length(data)


def wav_length(data: bytes) -> AudioLength:
    """Frames and rate from a RIFF/WAVE header, reading at most MAX_WAV_CHUNKS chunks."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        if not data:
            raise AudioError("No audio found in the input.")
        raise AudioNotCounted("kvgate counts audio in WAV files only")
    fmt: tuple[int, int, int, int] | None = None
    at = 12
    for _ in range(MAX_WAV_CHUNKS):
        if at + 8 > len(data):
            break
        chunk, size = data[at : at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        if chunk == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise AudioError("Invalid or corrupted audio data: the WAV fmt chunk is cut short.")
            tag, channels, rate, _, block = struct.unpack_from("<HHIIH", data, body)
            fmt = (tag, channels, rate, block)
        elif chunk == b"data":
            if fmt is None:
                raise AudioError("Invalid or corrupted audio data: the WAV data chunk comes before its format.")
            return _length(fmt, min(size, len(data) - body))
        at = body + size + (size & 1)
    else:
        raise AudioNotCounted(f"kvgate reads WAV files whose data comes within {MAX_WAV_CHUNKS} chunks")
    raise AudioError("Invalid or corrupted audio data: the WAV file has no data chunk.")


def _length(fmt: tuple[int, int, int, int], data_bytes: int) -> AudioLength:
    tag, channels, rate, block = fmt
    if tag not in _WAVE_FORMATS:
        raise AudioNotCounted(f"kvgate counts PCM and float WAV audio, not WAVE format 0x{tag:04x}")
    if channels < 1 or rate < 1 or block < 1:
        raise AudioError(f"Invalid or corrupted audio data: {channels} channels, {rate} Hz, {block}-byte frames.")
    frames = data_bytes // block
    if frames == 0:
        raise AudioError("No audio found in the input.")
    if frames / rate > VLLM_MAX_AUDIO_DECODE_DURATION_S:
        raise AudioError(
            f"Audio exceeds maximum allowed duration of {VLLM_MAX_AUDIO_DECODE_DURATION_S}s (file contains "
            f"{frames / rate:.1f}s at {rate}Hz). Set VLLM_MAX_AUDIO_DECODE_DURATION_S to increase this limit."
        )
    if frames * channels * 4 > VLLM_MAX_AUDIO_DECODE_BYTES:
        raise AudioError(
            f"Audio would allocate {frames * channels * 4 / _MiB:.0f} MiB of PCM ({frames} frames x {channels} "
            f"channels x 4B), exceeding the {VLLM_MAX_AUDIO_DECODE_BYTES / _MiB:.0f} MiB limit. Set "
            "VLLM_MAX_AUDIO_DECODE_BYTES to increase this limit."
        )
    return AudioLength(frames, rate)


def resampled(length: AudioLength, rate: int) -> int:
    """Samples after vLLM's default resampler (torchaudio.functional.resample's target_length:
    ceil of new x n / orig in float32, the rates divided by their gcd first)."""
    if length.rate == rate:
        return length.frames
    gcd = math.gcd(length.rate, rate)
    return math.ceil(_float32(rate // gcd * length.frames / (length.rate // gcd)))


class AudioRule(Expanding, Protocol):
    """How one model family's processor expands an audio (WhisperFrames, LogMelFrames)."""

    @property
    def indexed(self) -> bool: ...
    @property
    def most_items(self) -> int | None: ...

    def placeholder_text(self, index: int) -> str: ...
    def features(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> int: ...
    def replacement(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> Replacement: ...


@dataclass(frozen=True)
class WhisperFrames:
    """Qwen2-Audio's audio: mel frames of the first n_samples, halved twice by the encoder."""

    target_token: int  # config.json's audio_token_index (<|AUDIO|>)
    sampling_rate: int = 16000  # preprocessor_config.json (WhisperFeatureExtractor)
    hop_length: int = 160
    n_samples: int = 480000
    family: str = "qwen2_audio"
    merges: tuple[tuple[tuple[str, ...], str], ...] = ()
    indexed: bool = False
    most_items: int | None = None

    @property
    def feature_token(self) -> int:
        return self.target_token

    @property
    def placeholder(self) -> str:  # the token the expansion looks for, for messages
        return "<|AUDIO|>"

    def placeholder_text(self, index: int) -> str:
        """What vLLM puts for the `index`-th (from 1) audio where the template does not."""
        return f"Audio {index}: <|audio_bos|><|AUDIO|><|audio_eos|>"

    def features(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> int:
        """`length` None: audio kvgate cannot hear (the longest, n_samples)."""
        for key in ("max_length", "n_samples", "hop_length", "chunk_length", "sampling_rate", "padding"):
            if key in kwargs:
                raise TokenizationError(f"kvgate does not count Qwen2-Audio audio with mm_processor_kwargs {key!r}")
        samples = self.n_samples if length is None else min(resampled(length, self.sampling_rate), self.n_samples)
        frames = -(-samples // self.hop_length)
        features = ((frames - 1) // 2 + 1 - 2) // 2 + 1
        if features <= 0:
            raise AudioError(f"The audio (len={samples}) is too short to be represented inside the model")
        return features

    def replacement(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> Replacement:
        return Replacement(self.features(length, kwargs))


def _qwen2_audio(config: dict[str, Any], processor: dict[str, Any]) -> WhisperFrames | None:
    """config.json's audio_token_index; preprocessor_config.json's sampling_rate, hop_length and
    n_samples (WhisperFeatureExtractor's defaults 16,000, 160, 480,000)."""
    if "audio_token_index" not in config:
        return None
    return WhisperFrames(
        int(config["audio_token_index"]),
        int(processor.get("sampling_rate") or 16000),
        int(processor.get("hop_length") or 160),
        int(processor.get("n_samples") or 480000),
    )


def resampled_poly(length: AudioLength, rate: int) -> int:
    """Samples after vLLM's "scipy" resampler (multimodal/audio.py resample_audio_scipy:
    scipy.signal.resample_poly(x, up, down) keeps ceil(n x up / down) samples, up / down the rates
    over their gcd), in integers as scipy computes it."""
    if length.rate == rate:
        return length.frames
    gcd = math.gcd(length.rate, rate)
    return -(-length.frames * (rate // gcd) // (length.rate // gcd))


# phi4mm.py _AUDIO_PLACEHOLDER_TOKEN_ID (<|endoftext11|>), and its 100 numbered placeholders.
PHI4MM_AUDIO_TOKEN = 200011
PHI4MM_MOST_AUDIOS = 100


@dataclass(frozen=True)
class LogMelFrames:
    """Phi-4-multimodal's audio: 25 ms log-mel frames every 10 ms at 16 kHz, compressed
    `compression_rate` to one token (vLLM 0.32.0 / 0.33.0 phi4mm.py Phi4MMProcessingInfo.
    get_audio_num_frames and _compute_audio_embed_size)."""

    compression_rate: int  # config.json's embd_layer.audio_embd_layer.compression_rate
    sampling_rate: int = 16000  # the feature extractor's (preprocessor_config.json)
    family: str = "phi4mm"
    target_token: int = -1  # numbered text, encoded per audio (`indexed`)
    feature_token: int = PHI4MM_AUDIO_TOKEN
    placeholder: str = "<|audio_1|>"
    indexed: bool = True
    most_items: int | None = PHI4MM_MOST_AUDIOS
    merges: tuple[tuple[tuple[str, ...], str], ...] = ()

    def placeholder_text(self, index: int) -> str:
        """Phi4MMForCausalLM.get_placeholder_str."""
        return f"<|audio_{index}|>"

    def frames(self, samples: int) -> int:
        """get_audio_num_frames(samples, sr) with sr the feature extractor's rate."""
        sr = self.sampling_rate
        if sr > 16000:
            samples //= int(sr // 16000)
        elif 8000 <= sr < 16000:
            samples *= 2
        elif sr < 8000:
            raise AudioError(f"Unsupported sample rate {sr}")
        frames = (samples - 400) // 160 + 1
        if frames < 1:
            raise AudioError("Waveform too short for given parameters.")
        return frames

    def features(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> int:
        """`length` None: audio kvgate cannot hear (the longest vLLM decodes,
        VLLM_MAX_AUDIO_DECODE_DURATION_S, and a sample for the resampler's rounding)."""
        if "sampling_rate" in kwargs:
            raise TokenizationError(
                "kvgate does not count Phi-4-multimodal audio with mm_processor_kwargs 'sampling_rate'"
            )
        if length is None:
            samples = VLLM_MAX_AUDIO_DECODE_DURATION_S * self.sampling_rate + 1
        else:
            samples = resampled_poly(length, self.sampling_rate)
        return self.embeddings(samples)

    def embeddings(self, samples: int) -> int:
        """The embeddings of `samples` at the feature extractor's rate (_compute_audio_embed_size)."""
        return -(-self.frames(samples) // self.compression_rate)

    def replacement(self, length: AudioLength | None, kwargs: Mapping[str, Any]) -> Replacement:
        return Replacement(self.features(length, kwargs))


def _phi4mm(config: dict[str, Any], processor: dict[str, Any]) -> LogMelFrames | None:
    """config.json's embd_layer.audio_embd_layer.compression_rate (what _compute_audio_embed_size
    reads); the feature extractor's sampling_rate (16,000 unless preprocessor_config.json says)."""
    layer = ((config.get("embd_layer") or {}).get("audio_embd_layer") or {}).get("compression_rate")
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        return None
    return LogMelFrames(layer, int(processor.get("sampling_rate") or 16000))


AUDIO_RULES: dict[str, Callable[[dict[str, Any], dict[str, Any]], AudioRule | None]] = {
    "qwen2_audio": _qwen2_audio,
    "phi4mm": _phi4mm,
}


def audio_tokens(config: dict[str, Any], processor: dict[str, Any] | None = None) -> AudioRule | None:
    """The model's audio rule, or None where kvgate does not count its audio (another family, or a
    class its family's rule was not read from: kvgate/image_rules.py `mirrored_class`)."""
    reader = AUDIO_RULES.get(str(config.get("model_type")))
    return reader(config, processor or {}) if reader is not None and mirrored_class(config) else None


def audio_tokens_of(model_dir: str | Path | None) -> AudioRule | None:
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    folder = Path(model_dir)
    return audio_tokens(_json_file(folder / "config.json"), _json_file(folder / "preprocessor_config.json"))
