"""Token ids exactly as the vLLM backend will see them: the model's own tokenizer, or vLLM's /tokenize.

Chat requests are rendered by kvgate.chat_template (vLLM's preprocessing) and then encoded here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvgate.audio import audio_tokens_of
from kvgate.chat_template import (
    ChatRenderer,
    TemplateBudget,
    TokenizationError,
    render_within_budget,
)
from kvgate.harmony import HarmonyChats, renders_with_harmony
from kvgate.image_rules import image_tokens_of, model_type_of
from kvgate.multimodal import MediaCounting, MediaOptions
from kvgate.request import ChatInput
from kvgate.token_segments import TOKEN_ARRAY, SegmentCache
from kvgate.units import MiB
from kvgate.work_budget import TOKENIZE_BYTES_PER_TEXT_BYTE, charge

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

log = logging.getLogger("kvgate.tokens")


class BackendTokenizeError(RuntimeError):
    """The backend's /tokenize failed for reasons other than a bad request. `cause`: "unreachable"
    (no connection could be made: nothing reached the backend, it is down), "timeout" (it took the
    call and stayed silent) and "broke" (it cut the exchange): a backend in trouble, as a forwarded
    request would have found it; "missing": it answered, without tokens (no tokenizer there, a
    release without /tokenize: a deployment problem)."""

    def __init__(self, message: str, cause: str = "missing") -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def unreachable(self) -> bool:
        return self.cause == "unreachable"


class PromptTooLong(TokenizationError):
    """The text has more tokens than `max_tokens` for certain, known without tokenizing it all."""

    def __init__(self, tokens_at_least: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_tokens} tokens. However, the prompt "
            f"has at least {tokens_at_least:,} tokens. Please reduce the length of the prompt."
        )
        self.tokens_at_least, self.max_tokens = tokens_at_least, max_tokens


class Tokenizer(Protocol):
    source: str  # "local" | "backend"

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[int]: ...

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[Sequence[int]]: ...

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        """`namespace_aliases`: the backend release's rule for the template's content format
        (kvgate/chat_template.py render_chat)."""

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        """PromptTooLong if `text` has more than `max_tokens` tokens for certain, known without
        tokenizing it; nothing when it may fit or no bound is known."""


# How many characters of input one character of a normalizer's output can stand for, at most.
# Prepend, Lowercase, single-character Replace and the decompositions never shorten a text; the
# compositions (NFC, NFKC) join at most 4 code points into one (the longest canonical
# decomposition, e.g. U+1FAF). Others (accent or whitespace stripping, regex Replace) can drop
# any amount, and a tokenizer with them gets no character bound.
_NORMALIZER_SHRINK = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Replace": 1}
# Output budget of a request template when the tokenizer gives no character bound.
DEFAULT_TEMPLATE_CHARS = 4 * MiB
# Text encoded in one call to the Rust tokenizer: it takes up to 160 bytes per byte of text
# (kvgate/work_budget.py TOKENIZE_BYTES_PER_TEXT_BYTE), so a request's prompts are encoded a run at
# a time and each encoding is kept only as an array of its ids.
ENCODE_CHUNK_BYTES = 256 * 1024
TOKEN_BYTES = 8  # an id in its array (TOKEN_ARRAY)


def max_chars_per_token(rust: Any) -> int | None:
    """Most characters of input text one token can stand for, or None when the normalizer may
    drop text (then no count of characters says anything certain about the count of tokens).

    Byte-level vocabularies spell each byte as one character, so an entry's length is its bytes,
    never fewer than the characters it decodes to; SentencePiece-style entries spell characters
    one for one ("\u2581" for a space); byte-fallback entries (<0x0A>) are longer than the byte.
    """
    normalizer = json.loads(rust.to_str()).get("normalizer")
    shrink = 1
    for part in [] if normalizer is None else normalizer.get("normalizers", [normalizer]):
        kind = part.get("type")
        if kind not in _NORMALIZER_SHRINK:
            return None
        if kind == "Replace" and (not part.get("content") or len(part.get("pattern", {}).get("String") or "xx") != 1):
            return None  # only single characters replaced by something
        shrink *= _NORMALIZER_SHRINK[kind]
    return shrink * max(len(entry) for entry in rust.get_vocab(with_added_tokens=True))


class LocalTokenizer:
    """vLLM's tokenizer and chat template, loaded once from the served model folder.

    Concurrent encodes are safe: truncation and padding are never changed, so the
    Rust tokenizer is only ever borrowed shared.
    """

    source = "local"

    def __init__(
        self,
        model_dir: str | Path,
        offload_threshold_chars: int = 4000,
        template_seconds: float = 1.0,
        segment_cache: bool = True,
    ) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._rust = rust_backend(self._tok)
        # What the template's chats share, worked out once: this tokenizer's template never changes
        # (a backend sync that loads another tokenizer makes another renderer).
        self._renderer = ChatRenderer(self._tok)
        # tokenizers >= 0.21 has the offset-free batch call; with an older one, plain `encode`.
        self._batch_fast = getattr(self._rust, "encode_batch_fast", None)
        # A chat's template text repeats (system prompt, earlier turns, headers): its pieces between
        # added tokens are encoded once (kvgate/token_segments.py says when that is exact).
        self._segments = SegmentCache.of(self._rust) if segment_cache and self._batch_fast is not None else None
        self._threshold = offload_threshold_chars
        self._template_seconds = template_seconds
        self.max_chars_per_token = max_chars_per_token(self._rust) if self._rust is not None else None

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[int]:
        return (await self.encode_prompts([prompt], add_special_tokens, max_tokens))[0]

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[array]:
        """All of a request's text prompts in one batch: 1,024 prompts encoded one by one on the
        event loop held it for seconds."""
        for prompt in prompts:
            if not isinstance(prompt, str):
                raise TokenizationError("prompt must be a string")
            self.refuse_certainly_too_long(prompt, max_tokens)
        return await self._encode(prompts, add_special_tokens)

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        """A request's own template renders in a thread under a time and output budget; the
        model's template (the operator's) renders inline: kvgate prepares a body large enough to
        take more than a few milliseconds in a worker process (kvgate/preparation_workers.py)."""
        if chat.carries_template:
            rendered = await render_within_budget(
                lambda: self.render_chat(chat, namespace_aliases), self.template_budget(max_tokens)
            )
        else:
            rendered = self.render_chat(chat, namespace_aliases)
        if isinstance(rendered, list):  # chat_template_kwargs asked the template to tokenize
            return rendered
        self.refuse_certainly_too_long(rendered, max_tokens)
        return (await self._encode([rendered], chat.add_special_tokens))[0]

    def template_budget(self, max_tokens: int | None) -> TemplateBudget:
        """What a request's own template may spend rendering a prompt of at most `max_tokens`."""
        return TemplateBudget(self._template_seconds, self._char_bound(max_tokens) or DEFAULT_TEMPLATE_CHARS)

    def _char_bound(self, max_tokens: int | None) -> int | None:
        """Characters beyond which a text has more than `max_tokens` tokens for certain."""
        if max_tokens is None or self.max_chars_per_token is None:
            return None
        return max_tokens * self.max_chars_per_token

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        """Refuse before tokenizing a text that cannot fit: a 30 MiB prompt took 22 s and 6 GiB
        to tokenize only to be refused for its length."""
        bound = self._char_bound(max_tokens)
        if bound is not None and max_tokens is not None and len(text) > bound:
            raise PromptTooLong(math.ceil(len(text) / self.max_chars_per_token), max_tokens)  # type: ignore[operator]

    async def _encode(self, texts: list[str], add_special_tokens: bool) -> list[array]:
        """Long texts go to a worker thread (the Rust tokenizer lets go of the GIL): BPE on 100k
        characters takes tens of ms. Their memory is charged to the request first: the largest
        run of texts encoded at once, and the arrays that keep every id."""
        if len(texts) == 1:  # a chat or a single prompt, most requests: one run, sized once
            largest = total = _text_bytes(texts[0])
            chars = len(texts[0])
        else:
            largest = max(sum(map(_text_bytes, run)) for run in _chunks(texts, ENCODE_CHUNK_BYTES)) if texts else 0
            total = sum(map(_text_bytes, texts))
            chars = sum(len(text) for text in texts)
        await charge(TOKENIZE_BYTES_PER_TEXT_BYTE * largest + TOKEN_BYTES * total)
        if chars > self._threshold:
            return await asyncio.to_thread(self._encode_now, texts, add_special_tokens)
        return self._encode_now(texts, add_special_tokens)

    def _encode_now(self, texts: list[str], add_special_tokens: bool) -> list[array]:
        # tokenizer.encode is the call vLLM itself makes: transformers runs it as the Rust
        # `encode_batch([text])`. `encode_batch_fast` is the same pipeline (added tokens,
        # normalizer, pre-tokenizer, model, post-processor) without the character offsets nobody
        # reads here: same ids, a quarter less time on a short prompt (the offsets cost a
        # byte-to-char map of the whole text), and none of transformers' per-call bookkeeping.
        # Ids are kept as arrays, a chunk of texts at a time (ENCODE_CHUNK_CHARS).
        rust = self._rust
        out: list[array] = []
        for chunk in [texts] if len(texts) == 1 else _chunks(texts, ENCODE_CHUNK_BYTES):
            if rust is not None and _in_encode_state(rust, self._tok):
                if self._segments is not None and not add_special_tokens and not rust.encode_special_tokens:
                    out += [self._segments.encode(text) for text in chunk]
                    continue
                if self._batch_fast is not None:
                    encodings = self._batch_fast(chunk, add_special_tokens=add_special_tokens)
                else:
                    encodings = [rust.encode(text, add_special_tokens=add_special_tokens) for text in chunk]
                out += [array(TOKEN_ARRAY, e.ids) for e in encodings]
                del encodings
            else:
                out += [array(TOKEN_ARRAY, self._tok.encode(t, add_special_tokens=add_special_tokens)) for t in chunk]
        return out

    def render_chat(self, chat: ChatInput, namespace_aliases: bool = False) -> str | list[int]:
        """The prompt text vLLM renders for `chat` (token ids if kwargs say tokenize=True)."""
        return self._renderer.render(chat, namespace_aliases)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` as vLLM decodes a prompt (transformers' decode, special tokens kept:
        vllm/tokenizers/hf.py, called by the multimodal processor's text fallback)."""
        return str(self._tok.decode(list(ids)))


def _text_bytes(text: str) -> int:
    """The UTF-8 size of `text`, or a bound on it (isascii is a flag read, encode a copy)."""
    return len(text) if text.isascii() else 4 * len(text)


def _chunks(texts: list[str], limit_bytes: int) -> Iterator[list[str]]:
    """`texts` in runs of at most `limit_bytes` of text (a longer text is a run of its own)."""
    run: list[str] = []
    size = 0
    for text in texts:
        if run and size + _text_bytes(text) > limit_bytes:
            yield run
            run, size = [], 0
        run.append(text)
        size += _text_bytes(text)
    if run:
        yield run


# What transformers' fast tokenizers run between `encode` and the Rust tokenizer: a subclass
# overriding any of them may add to the Rust result, so kvgate then calls `encode` itself.
_ENCODE_PATH = ("encode", "encode_plus", "_encode_plus", "_batch_encode_plus", "set_truncation_and_padding")


def rust_backend(tok: Any) -> Any | None:
    """The `tokenizers.Tokenizer` under `tok` when `tok.encode` is exactly a call to it, else None."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tok, PreTrainedTokenizerFast):
        return None
    cls = type(tok)
    if any(getattr(cls, name, None) is not getattr(PreTrainedTokenizerFast, name, None) for name in _ENCODE_PATH):
        return None
    tok.encode("")  # lets transformers put the Rust tokenizer in its encode state (no truncation, padding)
    return tok._tokenizer


def _in_encode_state(rust: Any, tok: Any) -> bool:
    """The Rust tokenizer is as `tok.encode` would leave it (a template call may have changed it)."""
    return (
        rust.truncation is None
        and rust.padding is None
        and rust.encode_special_tokens == getattr(tok, "split_special_tokens", False)
    )


class BackendTokenizer:
    """Asks the backend's POST /tokenize; `client` must have the backend as base_url."""

    source = "backend"

    def __init__(self, client: httpx.AsyncClient, model_name: str) -> None:
        self._client = client
        self._model = model_name

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        """Without the tokenizer files kvgate knows no bound on characters per token."""

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """`max_tokens` is vLLM's to enforce here: without the tokenizer files kvgate has no
        bound on characters per token."""
        return await self._tokenize({"model": self._model, "prompt": prompt, "add_special_tokens": add_special_tokens})

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[list[int]]:
        """One /tokenize call a prompt (it takes one prompt), one after the other: a batch never
        takes more than its share of the backend's tokenizer connections."""
        return [await self.encode_prompt(prompt, add_special_tokens, max_tokens) for prompt in prompts]

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> list[int]:
        """vLLM renders it (with its own release's rule for the content format)."""
        body = {"model": self._model, **chat.backend_fields()}
        return await self._tokenize({k: v for k, v in body.items() if v is not None})

    async def _tokenize(self, body: dict) -> list[int]:
        try:
            try:
                response = await self._client.post("/tokenize", json=body)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                # A kept-alive connection the server closed as the call went out (its keep-alive
                # timer; kvgate/backend.py reuses none near it): /tokenize changes nothing on the
                # server, so it is sent once more (httpx has dropped the broken connection).
                response = await self._client.post("/tokenize", json=body)
        except httpx.HTTPError as e:
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                cause = "unreachable"
            else:
                cause = "timeout" if isinstance(e, httpx.TimeoutException) else "broke"
            raise BackendTokenizeError(f"backend /tokenize failed: {e!r}", cause) from e
        if response.status_code in (400, 422):
            raise TokenizationError(_error_message(response))
        if response.status_code != 200:
            raise BackendTokenizeError(f"backend /tokenize answered {response.status_code}: {response.text[:200]}")
        try:
            return response.json()["tokens"]
        except (ValueError, KeyError, TypeError) as e:
            raise BackendTokenizeError("backend /tokenize answered without tokens") from e


def _error_message(response: httpx.Response) -> str:
    """vLLM >= 0.11 nests {"error": {"message"}}; 0.10 sent a flat {"message"}."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return response.text


def local_tokenizer(
    model_dir: str | Path,
    template_seconds: float = 1.0,
    media: MediaOptions | None = None,
    segment_cache: bool = True,
) -> Tokenizer:
    """The model folder's own tokenizer, images counted (or refused) by kvgate.multimodal.
    `segment_cache`: keep a chat's repeated pieces (kvgate/token_segments.py)."""
    local = LocalTokenizer(model_dir, template_seconds=template_seconds, segment_cache=segment_cache)
    inner = _chats_as_vllm_renders(local, model_dir)
    return MediaCounting(inner, image_tokens_of(model_dir), media, model_type_of(model_dir), audio_tokens_of(model_dir))


def _chats_as_vllm_renders(tokenizer: Any, model_dir: str | Path | None) -> Any:
    """GPT-OSS chats rendered with Harmony (kvgate/harmony.py), as vLLM's chat route renders them."""
    return HarmonyChats(tokenizer) if renders_with_harmony(model_dir) else tokenizer


def load_tokenizer(
    model_dir: str | Path | None,
    client: httpx.AsyncClient,
    model_name: str,
    template_seconds: float = 1.0,
    media: MediaOptions | None = None,
) -> Tokenizer:
    """Local when the model folder holds a tokenizer (no network per request), else the backend;
    either way images are counted (or refused) by kvgate.multimodal, never passed through uncounted."""
    if has_local_tokenizer(model_dir):
        assert model_dir is not None
        return local_tokenizer(model_dir, template_seconds, media)
    log.warning(
        "the model folder %s has no tokenizer files (%s): kvgate counts tokens through the "
        "backend's /tokenize, one round trip per request",
        model_dir,
        ", ".join(_TOKENIZER_FILES),
    )
    return MediaCounting(
        _chats_as_vllm_renders(BackendTokenizer(client, model_name), model_dir),
        image_tokens_of(model_dir),
        media,
        model_type_of(model_dir),
        audio_tokens_of(model_dir),
    )


def has_local_tokenizer(model_dir: str | Path | None) -> bool:
    return model_dir is not None and any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES)
