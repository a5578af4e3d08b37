"""Tokens for the simulator: the model folder's own tokenizer when it has one, else a stand-in.

The stand-in is deterministic and needs no files: text is cut into pieces of at most six
letters (with their leading space), runs of up to three digits, or single other characters, so
English prose comes out at roughly 1.3 tokens per word, close to a real BPE's count. A piece's
id is a stable hash into the vocabulary (ids 0-3 are `<unk> <s> </s> <pad>`); `/tokenize` serves
exactly these ids, so kvgate's fallback sees the counts the simulator schedules. The chat
template is `<s>` + `<|role|>\\ncontent\\n` per message + `<|assistant|>\\n`.

Generated text is drawn from a fixed word list by a hash of (seed, prompt, position), and each
sequence stops (finish_reason "stop") after a length drawn the same way, unless max_tokens
comes first.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Protocol

from kvgate.sim.request import Request
from kvgate.sim.vision import PLACEHOLDER as IMAGE_PLACEHOLDER

_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}| ?[^\sA-Za-z\d]|\s")
_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "memory",
    "cache",
    "block",
    "token",
    "batch",
    "model",
    "server",
    "request",
    "queue",
    "budget",
]


def _h(*parts: object) -> int:
    data = "\x1f".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_strs(self, ids: list[int]) -> list[str]: ...
    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str: ...


class StandInTokenizer:
    """Deterministic hash-piece tokenizer (see module docstring)."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self, vocab_size: int, specials: dict[str, int] | None = None) -> None:
        self.vocab_size = vocab_size
        self._pieces: dict[int, str] = dict(enumerate(_SPECIALS))
        self._ids: dict[str, int] = {}  # pieces repeat: hash each once (a busy benchmark's hot path)
        # The model's own special tokens (a vision model's image placeholder), one id each.
        self._specials = {**{s: i for i, s in enumerate(_SPECIALS[1:3], 1)}, **(specials or {})}
        self._pieces.update({i: s for s, i in self._specials.items()})
        self._split = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")

    def _id(self, piece: str) -> int:
        i = self._ids.get(piece)
        if i is None:
            i = self._ids[piece] = len(_SPECIALS) + _h("piece", piece) % (self.vocab_size - len(_SPECIALS))
            self._pieces.setdefault(i, piece)
        return i

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if piece in self._specials:
                ids.append(self._specials[piece])
                continue
            ids.extend(map(self._id, _PIECE.findall(piece)))
        return ids

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self._pieces.get(i, f"<{i}>") for i in ids]

    def decode(self, ids: list[int]) -> str:
        return "".join(
            s for i, s in zip(ids, self.token_strs(ids), strict=True) if i not in (self.bos_token_id, self.eos_token_id)
        )

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = "<s>" + "".join(f"<|{m.get('role', 'user')}|>\n{_content(m)}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class HFTokenizer:
    """A model folder's tokenizer through transformers, chat template included."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id or 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def token_strs(self, ids: list[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(ids))

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return str(self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))


def _content(m: dict[str, Any]) -> str:
    """A message's text; an image part is the Qwen-VL placeholder, as Qwen's template writes it."""
    c = m.get("content") or ""
    if isinstance(c, list):
        return "".join(
            IMAGE_PLACEHOLDER if p.get("type") == "image_url" else p.get("text", "") for p in c if isinstance(p, dict)
        )
    return str(c)


def load_tokenizer(model: str, vocab_size: int, specials: dict[str, int] | None = None) -> Tokenizer:
    """The folder's tokenizer if `model` is a folder with one, else the stand-in (with the
    model's `specials`)."""
    folder = Path(model)
    if folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return HFTokenizer(folder)
    return StandInTokenizer(vocab_size, specials)


class TextModel:
    """Deterministic output tokens: words from a fixed list, a stop point per sequence."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.seed = seed
        self.words = [w for w in (tokenizer.encode(" " + w, False) for w in _WORDS) if len(w) == 1]

    def __call__(self, req: Request) -> tuple[int, bool]:
        key = (self.seed, req.stream_seed, req.num_prompt_tokens)
        pos = len(req.output_token_ids)
        token = self.words[_h(*key, pos) % len(self.words)][0]
        return token, pos + 1 >= 16 + _h(*key, "len") % 240
