"""kvgate/http/proxy.py response_headers: what a client gets of the backend's headers."""

from __future__ import annotations

from kvgate.gate.backend_state import UNKNOWN_OUTAGE_RETRY_S
from kvgate.http.proxy import response_headers
from kvgate.upstream import UpstreamResponse


class _Answer:
    """What response_headers reads of an UpstreamResponse."""

    header = UpstreamResponse.header

    def __init__(self, status: int, raw: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.raw_headers = raw


def _headers(status: int, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return response_headers(_Answer(status, raw), {"x-request-id": "r1"})  # type: ignore[arg-type]


def test_hop_by_hop_headers_go_and_the_length_is_kept_once() -> None:
    raw = [
        (b"Content-Type", b"application/json"),
        (b"Connection", b"keep-alive"),
        (b"Content-Length", b"42"),
        (b"content-length", b"43"),
        (b"Transfer-Encoding", b"chunked"),
        (b"X-Backend", b"a"),
    ]
    assert _headers(200, raw) == [
        (b"Content-Type", b"application/json"),
        (b"X-Backend", b"a"),
        (b"content-length", b"42"),
        (b"x-request-id", b"r1"),
    ]


def test_an_encoded_body_keeps_no_length() -> None:
    raw = [(b"Content-Length", b"42"), (b"Content-Encoding", b"gzip")]
    assert _headers(200, raw) == [(b"Content-Encoding", b"gzip"), (b"x-request-id", b"r1")]


def test_a_502_or_503_carries_retry_after_once() -> None:
    retry = (b"retry-after", str(UNKNOWN_OUTAGE_RETRY_S).encode())
    assert _headers(503, [])[-1] == retry
    assert _headers(502, [(b"Content-Length", b"0")])[-1] == retry
    assert _headers(500, []) == [(b"x-request-id", b"r1")]
    own = _headers(503, [(b"Retry-After", b"7")])
    assert own == [(b"Retry-After", b"7"), (b"x-request-id", b"r1")]
