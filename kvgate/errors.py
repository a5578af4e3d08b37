"""Why kvgate will not forward a request: domain errors that carry their numbers.

The parser, the predictor and the gate raise these and know nothing of HTTP; the HTTP edge
(kvgate.http.errors) maps each one, once, to a status, OpenAI's error body and its headers. The
same split as TGI's router (`ValidationError` variants mapped to a status in
router/src/server.rs) and the Inference Gateway's flow control (sentinel errors such as
`ErrQueueAtCapacity`, mapped at the edge).

`code` is the machine-readable reason clients and the `kvgate_decisions` metric see; `message`
is built here from the numbers so that every edge (HTTP, `kvgate explain`) says the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.units import MiB


class KvgateError(Exception):
    """A request kvgate refuses or cannot serve; `param` names the request field at fault."""

    code: str = "kvgate_error"
    param: str | None = None
    retry_after_s: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidField(KvgateError):
    """A malformed body or request field (`param` names it; None for the body as a whole)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class InvalidText(InvalidField):
    """A string or key of the body is not Unicode text (bytes that are not UTF-8, a lone
    surrogate): `param` names the first such field (kvgate/json_text.py)."""

    def __init__(self, field: str | None) -> None:
        where = f"'{field}'" if field else "the body"
        super().__init__(
            f"The body is not valid JSON: {where} holds text that is not valid UTF-8 "
            "(invalid bytes, or an unpaired UTF-16 surrogate).",
            field,
            "invalid_json",
        )


class BodyTooLarge(KvgateError):
    code = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"The request body exceeds kvgate's limit of {limit_bytes:,} bytes.")
        self.limit_bytes = limit_bytes


class MethodNotAllowed(KvgateError):
    """A gated path asked with another method than POST (OpenAI's shape, not Starlette's)."""

    code = "method_not_allowed"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"Method {method} is not allowed on {path}: send a POST.")
        self.method = method


class UnsupportedEncoding(KvgateError):
    """A body kvgate must read arrived compressed: it parses JSON, not gzip."""

    code = "unsupported_content_encoding"

    def __init__(self, encoding: str) -> None:
        super().__init__(
            f"kvgate reads request bodies as plain JSON; Content-Encoding {encoding[:40]!r} is not supported."
        )


class ClientTooSlow(KvgateError):
    """The client stopped sending its body: the connection is not worth holding."""

    code = "request_timeout"

    def __init__(self, seconds: float, *, deadline: bool = False) -> None:
        """`seconds`: the idle timeout that ran out, or with `deadline` the whole body's deadline."""
        super().__init__(
            f"The request body did not arrive within kvgate's {seconds:g} s deadline."
            if deadline
            else f"The request body stalled: nothing arrived for {seconds:g} s."
        )


class RouteNotForwarded(KvgateError):
    """A path kvgate neither gates nor was told to pass through (--passthrough-paths)."""

    code = "route_not_forwarded"

    def __init__(self, path: str) -> None:
        super().__init__(
            f"kvgate does not forward {path[:200]!r}: only the gated generation routes (completions, "
            "chat, /invocations, /v1/responses, /v1/messages, /inference/v1/generate, pooling) and "
            "--passthrough-paths reach the backend."
        )


class TooManyJsonValues(BodyTooLarge):
    """A body with more JSON values than kvgate parses: the parse alone would hold the loop."""

    def __init__(self, values: int, limit: int) -> None:
        KvgateError.__init__(
            self, f"The body holds about {values:,} JSON values; kvgate parses at most {limit:,} in one request."
        )
        self.values, self.limit = values, limit


class RequestTooCostly(BodyTooLarge):
    """Preparing the body (parse, render, tokenize) would take more of kvgate's memory than all of
    what it has for request work (kvgate/work_budget.py), or took more than it was given."""

    code = "request_too_costly"

    def __init__(self, cost_bytes: int, capacity_bytes: int, what: str = "would take") -> None:
        KvgateError.__init__(
            self,
            f"Parsing and tokenizing this request {what} about {cost_bytes / MiB:,.0f} MiB of kvgate's memory; "
            f"it has {capacity_bytes / MiB:,.0f} MiB for request work (--max-process-memory-bytes). "
            "Send fewer or shorter prompts or messages.",
        )
        self.cost_bytes, self.capacity_bytes = cost_bytes, capacity_bytes


class VllmRefusal(KvgateError):
    """A request vLLM itself refuses, worded as vLLM words it: its `VLLMValidationError`
    (vllm/exceptions.py, vLLM 0.31.0 and 0.32.0) appends " (parameter=p, value=v)" to the
    message, and its server answers `{"message", "type": "BadRequestError"|"NotFoundError",
    "param", "code": <status>}` (entrypoints/serve/exception_handling/error_response.py). The HTTP edge gives
    these vLLM's body, so a client sees the same error with or without kvgate; `code` stays
    kvgate's reason for its metrics and logs."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, value: object = None) -> None:
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message)
        self.param = param


class ModelNotFound(VllmRefusal):
    """vLLM 0.32.0 entrypoints/serve/engine/serving.py `_check_model`: "The model `m` does not
    exist. Valid aliases: a, b." (the served base names in --served-model-name order); 0.31.0
    says the first sentence alone (`aliases` None)."""

    code = "model_not_found"

    def __init__(self, model: str, aliases: Sequence[str] | None = None) -> None:
        message = f"The model `{model}` does not exist."
        if aliases is not None:
            message += f" Valid aliases: {', '.join(aliases)}."
        KvgateError.__init__(self, message)
        self.param = "model"
        self.model = model


class ContextTooLong(VllmRefusal):
    """A prompt or max_tokens past max_model_len, in the words of the backend's release
    (vllm/renderers/params.py TokenizeParams, read in 0.31.0 and 0.32.0); built by the
    classmethods below. `limit` is max_model_len, `requested` the tokens asked for."""

    code = "context_length_exceeded"

    def __init__(self, message: str, limit: int, requested: int, param: str, value: int) -> None:
        super().__init__(message, param, value)
        self.limit, self.requested = limit, requested

    @classmethod
    def prompt(cls, limit: int, prompt_tokens: int, at_least: bool, output_tokens: int | None) -> ContextTooLong:
        """`_token_len_check`: the prompt alone is past the input limit. A text prompt is encoded
        with truncation at limit + 1 tokens, so vLLM counts "at least" limit + 1 of it
        (`get_encode_kwargs`). 0.32.0: the input limit is max_model_len (`output_tokens` None);
        0.21.0 - 0.31.0: max_model_len - the request's max_tokens (0 when absent, 16 by default
        for completions), named in the message."""
        counted = limit - (output_tokens or 0) + 1 if at_least else prompt_tokens
        qualifier = "at least " if at_least else ""
        if output_tokens is None:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{qualifier}{counted} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt."
            )
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{output_tokens} output tokens and your prompt contains {qualifier}{counted} input tokens, "
                f"for a total of {qualifier}{counted + output_tokens} tokens. Please reduce the length of "
                "the input prompt or the number of requested output tokens."
            )
        return cls(message, limit, counted + (output_tokens or 0), "input_tokens", counted)

    @classmethod
    def output(cls, limit: int, max_tokens: int, param: str) -> ContextTooLong:
        """`TokenizeParams.__post_init__`: max_tokens (or max_completion_tokens) past max_model_len,
        refused before the prompt is read (every release since 0.21.0)."""
        message = (
            f"{param}={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output tokens."
        )
        return cls(message, limit, max_tokens, param, max_tokens)

    @classmethod
    def no_room(cls, limit: int) -> ContextTooLong:
        """0.32.0: a generation prompt of exactly max_model_len tokens passes the input check,
        then `get_max_tokens` clamps max_tokens to the 0 left and `SamplingParams._verify_args`
        refuses that ("max_tokens must be at least 1, got 0.")."""
        return cls("max_tokens must be at least 1, got 0.", limit, limit + 1, "max_tokens", 0)


class PromptExceedsContext(ContextTooLong):
    """A text known to pass max_model_len before it is all tokenized (a bound on characters per
    token, kvgate.tokens): vLLM, which encodes text truncated at its input limit + 1, counts "at
    least" limit + 1 of it (vLLM 0.32.0's wording; the preparation that raises it runs without the
    backend's release)."""

    def __init__(self, limit: int) -> None:
        vllm = ContextTooLong.prompt(limit, limit + 1, True, None)
        KvgateError.__init__(self, vllm.message)
        self.param, self.limit, self.requested = vllm.param, vllm.limit, vllm.requested


class NeverFits(KvgateError):
    """No amount of waiting would let this request in: it exceeds what an idle server holds."""

    def __init__(self, message: str, needed: int, limit: int) -> None:
        super().__init__(message)
        self.needed, self.limit = needed, limit


class KvNeverFits(NeverFits):
    """One request vLLM would create (one prompt, one of its n samples) needs more KV blocks than
    vLLM's whole pool: vLLM could never schedule it to the end."""

    code = "kv_cache_never_fits"

    def __init__(
        self,
        needed_blocks: int,
        pool_blocks: int,
        block_size: int,
        prompt_tokens: int,
        max_new_tokens: int,
        which: str,
    ) -> None:
        super().__init__(
            f"{which} needs {needed_blocks:,} KV blocks of {block_size} tokens ({prompt_tokens:,} prompt "
            f"tokens + up to {max_new_tokens:,} new tokens), but vLLM's whole KV cache holds "
            f"{pool_blocks:,} blocks: lower max_tokens or shorten that prompt.",
            needed_blocks,
            pool_blocks,
        )


def in_mib(needed: int, limit: int) -> tuple[str, str]:
    """Two byte counts in MiB with as many decimals as it takes for them to read differently."""
    for decimals in (1, 2, 3):
        pair = (f"{needed / MiB:,.{decimals}f} MiB", f"{limit / MiB:,.{decimals}f} MiB")
        if pair[0] != pair[1]:
            return pair
    return f"{needed:,} bytes", f"{limit:,} bytes"


class TransientNeverFits(NeverFits):
    code = "transient_memory_never_fits"

    def __init__(self, needed_bytes: int, limit_bytes: int, what: str, advice: str) -> None:
        needed, limit = in_mib(needed_bytes, limit_bytes)
        super().__init__(
            f"{what} needs {needed} of transient GPU memory in its worst step, but at most {limit} is "
            f"available even on an idle server: {advice}.",
            needed_bytes,
            limit_bytes,
        )


class TokenizationFailed(KvgateError):
    code = "tokenization_failed"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Could not tokenize the request: {detail}")


class TokenizerUnavailable(KvgateError):
    """No local tokenizer and the backend's /tokenize failed: a deployment problem, not load."""

    code = "tokenizer_unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"kvgate has no local tokenizer and the backend's /tokenize failed: {detail}. "
            "Give kvgate the model folder with its tokenizer files (--model)."
        )


class CacheOutgrown(KvgateError):
    """A prompt that runs alone only from some of the caches the engine's caching allocator can hold
    now, which keeps its free segments until the engine restarts: kvgate sees their total, not
    how they are cut, so no wait on this engine lets it in (kvgate/gate/budget.py `Budget.outgrown`)."""

    code = "allocator_cache_outgrown"

    def __init__(self, prompt_tokens: int, headroom_bytes: int, cached_bytes: int) -> None:
        super().__init__(
            f"This request's prefill ({prompt_tokens:,} prompt tokens) can run out of CUDA memory in the "
            f"engine's {headroom_bytes / MiB:,.0f} MiB of transient headroom, depending on how the "
            f"{cached_bytes / MiB:,.0f} MiB of free segments vLLM's caching allocator has kept since the engine "
            "started are cut, and the allocator keeps them until the engine restarts: kvgate will not admit it "
            "on this engine. vLLM with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (and kvgate with "
            "--expandable-segments), or a replica started since, can serve it."
        )
        self.prompt_tokens, self.headroom_bytes, self.cached_bytes = prompt_tokens, headroom_bytes, cached_bytes


class NotReady(KvgateError):
    """kvgate has not learned the backend's configuration yet."""

    code = "kvgate_not_ready"
    retry_after_s = 2

    def __init__(self, problem: str | None) -> None:
        super().__init__(f"kvgate is starting and does not know the backend yet ({problem}).")


class Refused(KvgateError):
    """Turned away for load, not for what the request is: retrying later can succeed."""

    retry_after_s: int


class QueueFull(Refused):
    code = "queue_full"

    def __init__(self, max_size: int, retry_after_s: int) -> None:
        super().__init__(
            f"kvgate's admission queue is full ({max_size} requests waiting). Retry after {retry_after_s} s."
        )
        self.max_size, self.retry_after_s = max_size, retry_after_s


class QueueTimeout(Refused):
    code = "queue_timeout"

    def __init__(self, waited_s: float, reason: str, retry_after_s: int) -> None:
        super().__init__(
            f"Waited {waited_s:g} s for GPU memory ({reason}) without admission. Retry after {retry_after_s} s."
        )
        self.waited_s, self.reason, self.retry_after_s = waited_s, reason, retry_after_s


class TokenizeWaitTimeout(QueueTimeout):
    """The request's deadline (--max-queue-wait from its arrival) passed while it waited for the
    backend's /tokenize (kvgate counts tokens there when the model folder has no tokenizer
    files): refused as a queue timeout, since that wait is part of the same deadline."""

    def __init__(self, waited_s: float, reason: str, retry_after_s: int) -> None:
        Refused.__init__(
            self,
            f"Waited {waited_s:g} s for the backend's /tokenize ({reason}) without admission. "
            f"Retry after {retry_after_s} s.",
        )
        self.waited_s, self.reason, self.retry_after_s = waited_s, reason, retry_after_s


class WorkMemoryBusy(Refused):
    """kvgate's memory for request work is taken by requests in flight: this one waited and
    would still not fit (kvgate/work_budget.py)."""

    code = "work_memory_busy"
    retry_after_s = 1

    def __init__(self, cost_bytes: int, capacity_bytes: int, in_use_bytes: int, waited_s: float) -> None:
        super().__init__(
            f"kvgate is preparing other large requests: this one needs about {cost_bytes / MiB:,.0f} MiB of "
            f"its {capacity_bytes / MiB:,.0f} MiB for request work, {in_use_bytes / MiB:,.0f} MiB are in use "
            f"(waited {waited_s:.1f} s). Retry after {self.retry_after_s} s."
        )
        self.cost_bytes, self.capacity_bytes = cost_bytes, capacity_bytes


class BackendDown(Refused):
    """The backend is unreachable (or held down by telemetry); `message` says where it showed,
    `retry_after_s` when it is likely back (kvgate/gate/backend_state.py `retry_after_s`)."""

    code = "backend_unavailable"

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendBusy(BackendDown):
    """No connection to the backend in time: it did not accept one within
    --upstream-connect-timeout (its accept queue full under a burst) or every pooled connection
    stayed busy. Nothing was sent, so the request goes back to the queue; but this is
    backpressure, not an outage: whether the backend is alive is for its /metrics and /health to
    say (kvgate/telemetry/live.py), and a refused connection still marks it down at once."""


class BackendTimedOut(KvgateError):
    code = "backend_timeout"

    def __init__(self) -> None:
        super().__init__("The backend did not answer in time.")


class BackendBroke(KvgateError):
    """The backend took the request but broke the exchange (a malformed or cut response)."""

    code = "backend_error"

    def __init__(self, detail: str) -> None:
        super().__init__(f"The backend broke the exchange ({detail}).")


class ClientGone(KvgateError):
    """The client disconnected before kvgate could answer (while sending or queued)."""

    code = "client_disconnected"

    def __init__(self) -> None:
        super().__init__("The client disconnected.")
