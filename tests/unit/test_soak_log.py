"""bench/soak.py's quote of kvgate's log for a failed request: what a soak failure shows."""

from __future__ import annotations

import datetime as dt

from bench.soak import Answer, is_kvgate_5xx, log_around

# Three seconds of a kvgate log at info level: soak-12 is the failed request.
LOG = """\
2026-11-28 06:18:20,000 INFO kvgate.decisions {"request_id": "soak-12", "decision": "admit", "reason": "fits"}
2026-11-28 06:18:20,100 INFO kvgate.decisions {"request_id": "soak-120", "decision": "admit", "reason": "fits"}
2026-11-28 06:18:20,200 INFO kvgate.decisions {"request_id": "soak-7", "decision": "admit", "reason": "fits"}
2026-11-28 06:18:21,000 ERROR uvicorn.error Exception in ASGI application
Traceback (most recent call last):
  File "kvgate/http/gated_routes.py", line 163, in __call__
RuntimeError: boom
2026-11-28 06:18:21,500 WARNING kvgate.proxy backend stream broke: UpstreamClosed
2026-11-28 06:18:29,000 WARNING kvgate.telemetry long after the request
"""


def at(clock: str) -> float:
    return dt.datetime.strptime(f"2026-11-28 {clock}", "%Y-%m-%d %H:%M:%S").timestamp()


def test_the_failed_requests_records_and_the_warnings_and_tracebacks_while_it_lasted() -> None:
    # The answers' clock is time.monotonic(); here it runs 1,000 s behind the wall clock.
    failed = Answer(12, "normal", "stream", "500", at("06:18:20") - 1000, at("06:18:21") - 1000, request_id="soak-12")
    quoted = log_around(LOG, 1000.0, [failed], margin_s=1.0)
    assert quoted == [
        '2026-11-28 06:18:20,000 INFO kvgate.decisions {"request_id": "soak-12", "decision": "admit", "reason": "fits"}',
        "2026-11-28 06:18:21,000 ERROR uvicorn.error Exception in ASGI application\n"
        "Traceback (most recent call last):\n"
        '  File "kvgate/http/gated_routes.py", line 163, in __call__\n'
        "RuntimeError: boom",
        "2026-11-28 06:18:21,500 WARNING kvgate.proxy backend stream broke: UpstreamClosed",
    ]


def test_nothing_is_quoted_without_a_failed_request_and_a_long_quote_is_cut() -> None:
    assert log_around(LOG, 0.0, []) == []
    failed = Answer(12, "normal", "stream", "500", at("06:18:20"), at("06:18:30"), request_id="soak-12")
    quoted = log_around(LOG, 0.0, [failed], max_chars=150)
    assert len(quoted) == 3  # the decision, the traceback that passed the limit, the cut
    assert quoted[-1] == "... (cut)"


def test_a_memory_hostile_body_forwarded_into_a_backend_fault_may_get_its_honest_5xx() -> None:
    """A memory-hostile body is valid and may be admitted: killed under it, the backend's fault
    answer is honest while the fault lasts, as for a normal request; a malformed body never is."""
    fault = [(10.0, 20.0)]
    memory = Answer(50, "hostile", "memory_tools", "502", 3.0, 14.0, code="backend_error")
    assert not is_kvgate_5xx(memory, fault)
    assert is_kvgate_5xx(Answer(50, "hostile", "memory_tools", "502", 3.0, 8.0, code="backend_error"), fault)
    assert is_kvgate_5xx(Answer(51, "hostile", "deep_nesting", "502", 3.0, 14.0, code="backend_error"), fault)
    assert is_kvgate_5xx(Answer(52, "normal", "stream", "500", 11.0, 12.0), fault)
