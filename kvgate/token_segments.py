"""The ids of a text as the Rust tokenizer encodes it, with repeated segments (a system prompt, a
chat's earlier turns, the template's headers) read from a cache instead of encoded again.

Why it is exact. A Hugging Face `tokenizers.Tokenizer` encodes a text in this order
(tokenizers/src/tokenizer/mod.rs `encode_single_sequence`, added_vocabulary.rs
`extract_and_normalize`, tokenizers 0.20-0.23): it first cuts the added tokens out of the raw
text (one Aho-Corasick automaton, leftmost-longest, over the tokens with `normalized` false),
normalizes each remaining piece on its own, cuts the `normalized` added tokens out of each
normalized piece, then pre-tokenizes and runs the model on each piece on its own; without special
tokens asked for, the post-processor adds nothing. So the ids of a text are the ids of its pieces
between added tokens, concatenated with the added tokens' ids, provided each step sees a piece
alone, whatever stands before it. That holds for the normalizers and pre-tokenizers allowed here
(functions of the piece's text) and not for others: Metaspace with `prepend_scheme` "first" reads
the piece's offset in the whole text, an added token with `lstrip`, `rstrip` or `single_word`
looks at its neighbours, BPE dropout is random, and a normalizer would change what the
`normalized` tokens match. A tokenizer outside these rules gets no SegmentCache (`of` returns
None) and is encoded whole, as before. tests/unit/test_token_segments.py compares the two on
generated texts.

The cache is bounded (entries and bytes), keyed by the piece's text; a piece longer than
MAX_CACHED_CHARS is encoded and not kept.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# Token ids are int64 (vLLM's tensors; kvgate's image and history stand-ins are negative 63-bit).
TOKEN_ARRAY = "q"
# Normalizers and pre-tokenizers whose output for a piece depends on the piece's text alone.
_PURE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Strip", "Sequence"})
_PURE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"})
# Bounds: a system prompt or a long earlier turn is worth keeping; a book is not.
MAX_CACHED_CHARS = 64 * 1024
CACHE_BYTES = 32 * 1024 * 1024
CACHE_ENTRIES = 4096
_ENTRY_OVERHEAD = 200  # an entry's dictionary slot, key and array headers, roughly


def _pure_normalizer(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") not in _PURE_NORMALIZERS:
        return False
    return all(_pure_normalizer(part) for part in spec.get("normalizers", []))


def _pure_pre_tokenizer(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pure_pre_tokenizer(part) for part in spec.get("pretokenizers", []))
    if kind == "Metaspace":  # "first" prepends only at offset 0 of the whole text
        return spec.get("prepend_scheme") in ("always", "never")
    return kind in _PURE_PRE_TOKENIZERS


def _splitter(contents: list[str]) -> re.Pattern[str] | None:
    """Leftmost-longest over literal strings: at the leftmost position any matches, the longest
    alternative (Python tries alternatives in order, so longest first)."""
    if not contents:
        return None
    return re.compile("|".join(re.escape(content) for content in sorted(contents, key=len, reverse=True)))


class SegmentCache:
    """`encode(text)`: the ids `encode_batch_fast([text], add_special_tokens=False)` gives, with the
    pieces between added tokens kept in a bounded LRU. Safe from several threads (long texts are
    encoded in a worker thread)."""

    def __init__(self, encode_batch: Callable[[list[str]], list[Any]], added: dict[str, tuple[int, bool]]) -> None:
        """`added`: each added token's content -> (id, matched after normalization)."""
        self._encode_batch = encode_batch
        self._ids = {content: token_id for content, (token_id, _) in added.items()}
        self._raw_split = _splitter([c for c, (_, normalized) in added.items() if not normalized])
        self._normalized_split = _splitter([c for c, (_, normalized) in added.items() if normalized])
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # pieces read from the cache, pieces encoded

    @classmethod
    def of(cls, rust: Any) -> SegmentCache | None:
        """A cache for the `tokenizers.Tokenizer` `rust` if its pieces encode independently (see the
        module's docstring), else None."""
        spec = json.loads(rust.to_str())
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return None
        if not _pure_normalizer(spec.get("normalizer")) or not _pure_pre_tokenizer(spec.get("pre_tokenizer")):
            return None
        added: dict[str, tuple[int, bool]] = {}
        for token in spec.get("added_tokens") or []:
            if token["single_word"] or token["lstrip"] or token["rstrip"] or not token["content"]:
                return None
            if token["normalized"] and spec.get("normalizer") is not None:
                return None  # matched in normalized text: the split would need the normalizer
            added[token["content"]] = (token["id"], bool(token["normalized"]))
        return cls(lambda texts: rust.encode_batch_fast(texts, add_special_tokens=False), added)

    def pieces(self, text: str) -> list[str]:
        """`text` cut where the Rust tokenizer cuts it: non-normalized added tokens first, then the
        normalized ones in each remaining piece; added tokens are pieces of their own."""
        pieces = _cut(text, self._raw_split)
        if self._normalized_split is None:
            return pieces
        split = self._normalized_split
        return [part for piece in pieces for part in ([piece] if piece in self._ids else _cut(piece, split))]

    def encode(self, text: str) -> array:
        pieces = self.pieces(text)
        ids = self._ids
        found: dict[str, array] = {}
        with self._lock:
            entries = self._entries
            for piece in pieces:
                if piece not in ids and piece not in found:
                    cached = entries.get(piece)
                    if cached is not None:
                        entries.move_to_end(piece)
                        found[piece] = cached
            self.hits += len(found)
        missing = [piece for piece in dict.fromkeys(pieces) if piece not in ids and piece not in found]
        if missing:
            for piece, encoding in zip(missing, self._encode_batch(missing), strict=True):
                found[piece] = array(TOKEN_ARRAY, encoding.ids)
            self._keep({piece: found[piece] for piece in missing})
        out = array(TOKEN_ARRAY)
        for piece in pieces:
            token_id = ids.get(piece)
            if token_id is None:
                out.extend(found[piece])
            else:
                out.append(token_id)
        return out

    def _keep(self, new: dict[str, array]) -> None:
        with self._lock:
            self.misses += len(new)
            entries = self._entries
            for piece, piece_ids in new.items():
                if piece in entries or len(piece) > MAX_CACHED_CHARS:
                    continue
                entries[piece] = piece_ids
                self._bytes += _entry_bytes(piece, piece_ids)
            while entries and (self._bytes > CACHE_BYTES or len(entries) > CACHE_ENTRIES):
                piece, piece_ids = entries.popitem(last=False)
                self._bytes -= _entry_bytes(piece, piece_ids)


def _entry_bytes(piece: str, piece_ids: array) -> int:
    return _ENTRY_OVERHEAD + 4 * len(piece) + piece_ids.itemsize * len(piece_ids)


def _cut(text: str, split: re.Pattern[str] | None) -> list[str]:
    """`text` cut around each match of `split`, the matches kept as pieces of their own; no empty
    piece between two matches; an empty text is one empty piece (it encodes to no ids)."""
    if split is None:
        return [text]
    pieces: list[str] = []
    start = 0
    for match in split.finditer(text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        pieces.append(match.group())
        start = match.end()
    if start < len(text) or not pieces:
        pieces.append(text[start:])
    return pieces
