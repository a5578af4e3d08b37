"""kvgate/token_segments.py: ids read piece by piece from the segment cache are the ids the Rust
tokenizer (and transformers' `encode`, which vLLM calls) gives for the whole text, on generated
texts full of added tokens, their fragments, whitespace and non-ASCII text; tokenizers whose pieces
do not encode independently get no cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

from kvgate import token_segments
from kvgate.token_segments import SegmentCache
from kvgate.tokens import LocalTokenizer

HEADERS = ["<|start_header_id|>", "<|end_header_id|>"]
NORMALIZED_TOKEN = "<tool>"  # an added token matched after normalization
PIECES = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    *HEADERS,
    NORMALIZED_TOKEN,
    "<",
    "s>",
    "</",
    "<|",
    "|>",
    "<|start_header",
    "_id|>",
    "<tool",
    "\n\n",
    " ",
    "  ",
    "\t",
    "system",
    "user",
    "assistant",
    "You are a helpful assistant.",
    " the model",
    "Hello,",
    "12345",
    "don't",
    "\u00e9t\u00e9",
    "\u65e5\u672c\u8a9e",
    "\U0001f600",
    "\u2581",
    "caf\u0065\u0301",
]
texts = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(st.characters(codec="utf-8"), max_size=12)), max_size=24
).map("".join)


def _tiny(tiny_model_dir: Path) -> Tokenizer:
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(h, normalized=False, special=True) for h in HEADERS])
    rust.add_tokens([AddedToken(NORMALIZED_TOKEN, normalized=True)])
    return rust


def _full(rust: Tokenizer, text: str) -> list[int]:
    return rust.encode_batch_fast([text], add_special_tokens=False)[0].ids


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tokenizer:
    return _tiny(tiny_model_dir)


@pytest.fixture(scope="module")
def prepending(tiny_model_dir: Path) -> Tokenizer:
    """Llama 2's normalizer (a "\u2581" prepended to each piece, spaces replaced) and Metaspace
    that always prepends, over the tiny vocabulary."""
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rust.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="always"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    rust.add_special_tokens([AddedToken(h, normalized=False, special=True) for h in HEADERS])
    return rust


@pytest.fixture(scope="module")
def splitting(tiny_model_dir: Path) -> Tokenizer:
    """Llama 3's shape: NFKC, its split regex, then byte-level without a regex of its own."""
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.normalizer = normalizers.NFKC()
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    rust.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    rust.add_special_tokens([AddedToken(h, normalized=False, special=True) for h in HEADERS])
    return rust


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_cached_pieces_give_the_ids_of_the_whole_text(
    tiny: Tokenizer, prepending: Tokenizer, splitting: Tokenizer, text: str
) -> None:
    for rust in (tiny, prepending, splitting):
        cache = SegmentCache.of(rust)
        assert cache is not None
        expected = _full(rust, text)
        assert list(cache.encode(text)) == expected  # pieces encoded
        assert list(cache.encode(text)) == expected  # pieces read back


def test_a_shared_cache_stays_exact_and_bounded(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces met in earlier texts are read back inside new ones; the cache never holds more
    entries than its bound, evicting the least recently used."""
    monkeypatch.setattr(token_segments, "CACHE_ENTRIES", 8)
    cache = SegmentCache.of(tiny)
    assert cache is not None
    system = "<s><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.</s>"
    for i in range(40):
        text = f"{system}<|start_header_id|>user<|end_header_id|>\n\nQuestion {i}: why?</s>"
        assert list(cache.encode(text)) == _full(tiny, text)
        assert len(cache._entries) <= 8
    assert cache.hits >= 39  # the system piece, from the second text on
    assert cache.misses >= 40


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda r: setattr(r, "pre_tokenizer", pre_tokenizers.Metaspace(prepend_scheme="first")),
            id="metaspace-first",
        ),
        pytest.param(lambda r: r.add_special_tokens([AddedToken("<x>", lstrip=True)]), id="lstrip"),
        pytest.param(lambda r: r.add_special_tokens([AddedToken("<y>", rstrip=True)]), id="rstrip"),
        pytest.param(lambda r: r.add_tokens([AddedToken("word", single_word=True)]), id="single-word"),
        pytest.param(
            lambda r: (
                setattr(r, "normalizer", normalizers.Lowercase()),
                r.add_tokens([AddedToken("<n>", normalized=True)]),
            ),
            id="normalized-token-under-a-normalizer",
        ),
        pytest.param(lambda r: setattr(r, "normalizer", normalizers.BertNormalizer()), id="unlisted-normalizer"),
    ],
)
def test_tokenizers_whose_pieces_depend_on_their_neighbours_get_no_cache(tiny_model_dir: Path, change: object) -> None:
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert SegmentCache.of(rust) is not None
    change(rust)  # type: ignore[operator]
    assert SegmentCache.of(rust) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_kvgate_encodes_as_transformers_does(tiny_model_dir: Path, text: str) -> None:
    """The local tokenizer, through its segment cache, against transformers' `encode` (vLLM's call)."""
    tokenizer = _local(tiny_model_dir)
    assert tokenizer._segments is not None
    for _ in range(2):
        (ids,) = tokenizer._encode_now([text], add_special_tokens=False)
        assert list(ids) == tokenizer._tok.encode(text, add_special_tokens=False)


_LOCAL: dict[Path, LocalTokenizer] = {}


def _local(folder: Path) -> LocalTokenizer:
    if folder not in _LOCAL:
        _LOCAL[folder] = LocalTokenizer(folder)
    return _LOCAL[folder]


# ASCII texts for the pre-token cache: every ASCII character (Python's \s takes \x1c-\x1f, which
# Oniguruma's does not), contractions in both cases, runs of digits, spaces and line ends.
ASCII_PIECES = ["'s", "'S", "'ll", "'LL", "'re", "don't", "  ", "\r\n", "\n\n", " \n", "\t", "123", "4567", "a1b2"]
ascii_texts = st.lists(
    st.one_of(
        st.sampled_from(ASCII_PIECES + HEADERS),
        st.text(st.characters(max_codepoint=127), max_size=12),
        st.text(st.sampled_from(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1fAz09'.,!"), max_size=8),
    ),
    max_size=24,
).map("".join)


@pytest.fixture(scope="module")
def qwen_splitting(tiny_model_dir: Path) -> Tokenizer:
    """Qwen2's shape: NFC, its split regex (digits one at a time), byte-level without a regex."""
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.normalizer = normalizers.NFC()
    rust.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(token_segments._QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    rust.add_special_tokens([AddedToken(h, normalized=False, special=True) for h in HEADERS])
    return rust


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ascii_texts)
def test_pre_tokens_give_the_ids_of_the_whole_text(
    tiny: Tokenizer, splitting: Tokenizer, qwen_splitting: Tokenizer, text: str
) -> None:
    """New ASCII pieces are encoded pre-token by pre-token (GPT-2's byte-level regex, Llama 3's and
    Qwen2's splits): the same ids as the Rust tokenizer's for the whole text, encoded afresh and
    read back."""
    for rust in (tiny, splitting, qwen_splitting):
        cache = SegmentCache.of(rust)
        assert cache is not None
        assert cache.pre_tokens is not None
        expected = _full(rust, text)
        assert list(cache.encode(text)) == expected
        fresh = SegmentCache.of(rust)  # an empty segment cache over the pre-tokens seen above
        assert fresh is not None
        fresh.pre_tokens = cache.pre_tokens
        assert list(fresh.encode(text)) == expected


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ascii_texts)
def test_the_python_split_is_the_rust_pre_tokenizers(
    tiny: Tokenizer, splitting: Tokenizer, qwen_splitting: Tokenizer, text: str
) -> None:
    """The cuts themselves, not only the ids (a small vocabulary can give the same ids for two
    different cuts): Python's rewritten regex cuts an ASCII text where the Rust pre-tokenizer does."""
    for rust, regex in (
        (tiny, token_segments._GPT2_SPLIT),
        (splitting, token_segments._LLAMA3_SPLIT),
        (qwen_splitting, token_segments._QWEN2_SPLIT),
    ):
        expected = [span for _, span in rust.pre_tokenizer.pre_tokenize_str(text)]
        assert [m.span() for m in token_segments.ascii_pattern(regex).finditer(text)] == expected


def test_the_pre_token_cache_reads_words_back_and_stays_bounded(
    tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-tokens met before are read back in new pieces; past its bound the cache is emptied and
    filled again, the ids unchanged; a pre-token longer than the longest kept is encoded, not kept."""
    monkeypatch.setattr(token_segments, "PRE_TOKEN_ENTRIES", 16)
    cache = SegmentCache.of(tiny)
    assert cache is not None
    assert cache.pre_tokens is not None
    words = cache.pre_tokens
    for i in range(60):
        text = f"Question {i} about the model{'s' * (i % 7)} and the server: why not {i * 7919}?"
        assert list(cache.encode(text)) == _full(tiny, text)
        assert len(words._ids) <= 16
    assert words.hits > 0
    assert words.misses > 0
    long_word = "x" * (token_segments.MAX_PRE_TOKEN_CHARS + 1)
    assert list(cache.encode(f"a {long_word} b")) == _full(tiny, f"a {long_word} b")
    assert f" {long_word}" not in words._ids


def test_non_ascii_pieces_go_to_the_rust_tokenizer(tiny: Tokenizer) -> None:
    cache = SegmentCache.of(tiny)
    assert cache is not None
    assert cache.pre_tokens is not None
    assert cache.pre_tokens.encode("caf\u00e9 au lait") is None
    assert list(cache.encode("caf\u00e9 au lait")) == _full(tiny, "caf\u00e9 au lait")


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        pytest.param(pre_tokenizers.ByteLevel(add_prefix_space=True), id="byte-level-prefix-space"),
        pytest.param(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(r"\s+|\w+"), behavior="isolated"),
                    pre_tokenizers.ByteLevel(use_regex=False),
                ]
            ),
            id="unlisted-split-regex",
        ),
        pytest.param(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(token_segments._LLAMA3_SPLIT), behavior="removed"),
                    pre_tokenizers.ByteLevel(use_regex=False),
                ]
            ),
            id="split-removing-matches",
        ),
        pytest.param(pre_tokenizers.Whitespace(), id="not-byte-level"),
    ],
)
def test_other_pre_tokenizers_get_no_pre_token_cache(tiny_model_dir: Path, pre_tokenizer: object) -> None:
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.pre_tokenizer = pre_tokenizer
    cache = SegmentCache.of(rust)
    assert cache is not None
    assert cache.pre_tokens is None


def test_a_lowercasing_normalizer_gets_no_pre_token_cache(tiny_model_dir: Path) -> None:
    rust = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    rust.normalizer = normalizers.Lowercase()
    cache = SegmentCache.of(rust)
    assert cache is not None
    assert cache.pre_tokens is None
