"""What every tiny multimodal folder starts from (tests/support/tiny_*.py, each run as a script in
the vLLM venv, so this module is imported by its bare name): the tiny Llama's tokenizer with the
family's media tokens and chat template, saved as the family's, and a one-layer vision tower. The
tests that serve such a folder to kvgate alone (a fake backend, no weights) start from
`folder_with_media_tokens`."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path
from typing import Any


def media_tokenizer(llama: Path, tokens: list[str], template: str | None = None) -> Any:
    """The tiny Llama's tokenizer with `tokens` added as special tokens and `template` (if any) as
    its chat template (a family may add more before saving it with save_tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    if template is not None:
        tok.chat_template = template
    return tok


def folder_with_media_tokens(llama: Path, out: Path, tokens: list[str]) -> tuple[Any, dict[str, Any]]:
    """`out` holding the tiny Llama's tokenizer with `tokens` added; that tokenizer and a copy of
    the tiny Llama's config.json, for the caller to make its family's and write."""
    tok = media_tokenizer(llama, tokens)
    tok.save_pretrained(str(out))
    return tok, json.loads((llama / "config.json").read_text())


def save_tokenizer(tok: Any, out: Path, template: str) -> None:
    """The tokenizer in `out`, with the chat template also as chat_template.jinja (vLLM reads it)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(template)


def tiny_tower(image_size: int, patch_size: int) -> dict[str, int]:
    """A vision tower of one layer, width 32, two heads: the smallest vLLM serves."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }


def silent_wav(seconds: float, rate: int = 16000) -> str:
    """A mono 16-bit WAV of `seconds` of silence at `rate` Hz, base64 (an input_audio's data)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * int(seconds * rate))
    return base64.b64encode(buffer.getvalue()).decode()


def input_audio(data: str) -> dict[str, Any]:
    """A chat content part carrying base64 WAV `data`."""
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
