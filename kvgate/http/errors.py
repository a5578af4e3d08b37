"""The one place a domain error (kvgate.errors) becomes an HTTP status, OpenAI's error body and headers.

OpenAI's shape is {"error": {message, type, param, code}}; `type` follows from the status as in
OpenAI's API (429 rate_limit_error, 5xx server_error, 404 not_found_error, else
invalid_request_error). What vLLM itself would refuse (errors.VllmRefusal) gets vLLM's own body
instead: `type` vLLM's exception name, `code` the status number. A refusal for load carries Retry-After. A client that went away gets 499
(nginx's "client closed request") with no body: nobody is left to read one.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from kvgate import errors
from kvgate.gate.backend_state import UNKNOWN_OUTAGE_RETRY_S

_STATUS: dict[type[errors.KvgateError], int] = {
    errors.InvalidField: 400,
    errors.VllmRefusal: 400,
    errors.NeverFits: 400,
    errors.TokenizationFailed: 400,
    errors.ModelNotFound: 404,
    errors.RouteNotForwarded: 404,
    errors.MethodNotAllowed: 405,
    errors.ClientTooSlow: 408,
    errors.UnsupportedEncoding: 415,
    errors.BodyTooLarge: 413,
    errors.TokenizerUnavailable: 424,
    errors.QueueFull: 429,
    errors.QueueTimeout: 429,
    errors.WorkMemoryBusy: 429,
    errors.ClientGone: 499,
    errors.BackendBroke: 502,
    errors.NotReady: 503,
    errors.CacheOutgrown: 503,
    errors.BackendDown: 503,
    errors.BackendTimedOut: 504,
}


def status_of(error: errors.KvgateError) -> int:
    """The HTTP status of `error` (its nearest mapped class; 500 for one nobody mapped)."""
    for cls in type(error).__mro__:
        status = _STATUS.get(cls)
        if status is not None:
            return status
    return 500


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error"


# vLLM 0.32.0 entrypoints/serve/exception_handling/error_response.py create_error_response: the
# error types of its client errors.
_VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


def error_body(error: errors.KvgateError) -> dict[str, Any]:
    """OpenAI's error object for `error`, in vLLM's shape where vLLM would have refused it too."""
    status = status_of(error)
    if isinstance(error, errors.VllmRefusal):
        return {"error": {"message": error.message, "type": _VLLM_TYPES[status], "param": error.param, "code": status}}
    return {
        "error": {
            "message": error.message,
            "type": _error_type(status),
            "param": error.param,
            "code": error.code,
        }
    }


# Why a request was dropped before it reached vLLM, in the words of llm-d's endpoint picker
# (llm-d/llm-d-router pkg/common/error/error.go RequestDroppedReason; pkg/epp/requestcontrol/
# admission.go translateFlowControlOutcome answers its own flow control's drops with them: 429
# rejected-saturated for a full queue, 429 rejected-ttl-expired for a queue wait that ran out while
# the pool has endpoints, 503 rejected-no-endpoints when no serving capacity exists). A router or
# client in front of kvgate reads kvgate's drops as it reads the picker's.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
_DROPPED_REASONS: dict[type[errors.KvgateError], str] = {
    errors.QueueFull: "rejected-saturated",
    errors.WorkMemoryBusy: "rejected-saturated",
    errors.QueueTimeout: "rejected-ttl-expired",
    errors.BackendDown: "rejected-no-endpoints",
    errors.NotReady: "rejected-no-endpoints",
}


def error_headers(error: errors.KvgateError) -> dict[str, str]:
    """Allow for a 405; Retry-After for a refusal for load and for every 502 and 503 (a broken
    exchange gets the backend state's default, UNKNOWN_OUTAGE_RETRY_S), and the endpoint picker's
    drop reason for a request kvgate never sent (saturated, queue wait expired, backend down);
    `Connection: close` with a 408, as RFC 9110 15.5.9 asks: the client's body was not read to its end."""
    if isinstance(error, errors.MethodNotAllowed):
        return {"Allow": "POST"}
    if isinstance(error, errors.ClientTooSlow):
        return {"Connection": "close"}
    headers: dict[str, str] = {}
    retry_after_s = error.retry_after_s
    if retry_after_s is None and status_of(error) in (502, 503):
        retry_after_s = UNKNOWN_OUTAGE_RETRY_S
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    reason = next((r for cls in type(error).__mro__ if (r := _DROPPED_REASONS.get(cls))), None)
    if reason is not None:
        headers[DROPPED_REASON_HEADER] = reason
    return headers


def error_response(error: errors.KvgateError, extra_headers: dict[str, str] | None = None) -> Response:
    """The response a client sees for `error`, with `extra_headers` (the request id) added."""
    if isinstance(error, errors.ClientGone):
        return Response(status_code=status_of(error))
    headers = {**error_headers(error), **(extra_headers or {})}
    return JSONResponse(error_body(error), status_code=status_of(error), headers=headers)
