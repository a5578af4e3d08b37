"""The HTTP edge's one mapping from domain errors to what a client sees."""

from __future__ import annotations

import json

from app import errors
from app.http.errors import _STATUS as STATUS
from app.http.errors import error_response, status_of


def all_subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(all_subclasses(sub) for sub in found))


def test_every_domain_error_has_a_status_of_its_own() -> None:
    """A new error left out of the mapping would reach clients as a 500. (Refused is only the
    common base of the refusals for load.)"""
    unmapped = [
        cls.__name__
        for cls in all_subclasses(errors.KvgateError)
        if cls is not errors.Refused and not any(c in STATUS for c in cls.__mro__)
    ]
    assert unmapped == []


def test_a_refusal_for_load_is_openai_shaped_with_retry_after() -> None:
    response = error_response(errors.QueueFull(max_size=7, retry_after_s=3), {"x-request-id": "r"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3" and response.headers["x-request-id"] == "r"
    assert json.loads(response.body) == {
        "error": {
            "message": "kvgate's admission queue is full (7 requests waiting). Retry after 3 s.",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
    }


def test_a_context_error_names_the_field_and_the_numbers() -> None:
    error = errors.ContextTooLong(
        limit=1024, prompt_tokens=1000, max_new_tokens=100, where="prompt", param="max_tokens"
    )
    body = json.loads(error_response(error).body)["error"]
    assert status_of(error) == 400 and (body["param"], body["code"]) == ("max_tokens", "context_length_exceeded")
    assert "maximum context length is 1024 tokens" in body["message"] and "1100 tokens" in body["message"]
    assert (error.limit, error.requested) == (1024, 1100)


def test_a_client_that_left_gets_499_and_no_body() -> None:
    response = error_response(errors.ClientGone(), {"x-request-id": "r"})
    assert response.status_code == 499 and response.body == b""


def test_every_502_and_503_carries_retry_after() -> None:
    """Issue 28: a 502 after a backend kill carried none. Every error mapped to 502 or 503."""
    samples = [
        errors.BackendBroke("the backend closed the connection (EOF)"),
        errors.BackendDown("refused"),
        errors.NotReady("starting"),
    ]
    assert {type(e) for e in samples} == {cls for cls, status in STATUS.items() if status in (502, 503)}
    for error in samples:
        assert int(error_response(error).headers["retry-after"]) >= 1, type(error).__name__


def test_a_408_closes_the_connection() -> None:
    response = error_response(errors.ClientTooSlow(60, deadline=True))
    assert response.status_code == 408 and response.headers["connection"] == "close"
    assert "60 s deadline" in json.loads(response.body)["error"]["message"]
