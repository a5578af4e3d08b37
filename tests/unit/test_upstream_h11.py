"""kvgate.upstream's response parsing against h11's (issue 15, finding 10): the same byte streams,
cut into the same segments, fed to both; each reports the response it saw (status, headers,
body, whether it ended) and whether the connection may carry another exchange.

h11 is a pure-Python HTTP/1.1 implementation written against RFC 9112; where a stream is one
h11 refuses, kvgate must not relay it as a success either.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import h11
import pytest

from kvgate.upstream import Connection, UpstreamError


@dataclass(frozen=True)
class Seen:
    status: int | None
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    complete: bool  # the whole response arrived, to be relayed as such
    reusable: bool  # the connection may carry the next request


class _Transport(asyncio.Transport):
    """Records nothing, closes on demand: all Connection needs of a transport here."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def writelines(self, data: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def by_h11(segments: list[bytes], end: str) -> Seen:
    """`end`: "eof" (a clean close), "reset" (cut: h11 never learns the stream ended), "open"."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "backend"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    status, headers, body, complete = None, (), b"", False
    feeds = [*segments, *([b""] if end == "eof" else [])]
    try:
        for data in feeds:
            conn.receive_data(data)
            while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = tuple((k, v) for k, v in event.headers.raw_items())
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    complete = True
                elif isinstance(event, h11.ConnectionClosed):
                    break
    except h11.RemoteProtocolError:
        return Seen(status, headers, body, False, False)
    # Bytes after the end of the response (h11 holds them back) answer nothing that was asked.
    trailing = bool(conn.trailing_data[0]) or conn.trailing_data[1]
    reusable = complete and not trailing and conn.our_state is h11.DONE and conn.their_state is h11.DONE
    return Seen(status, headers, body, complete, reusable)


async def by_upstream(segments: list[bytes], end: str) -> Seen:
    conn = Connection(read_timeout_s=5)
    transport = _Transport()
    conn.connection_made(transport)
    conn.send(b"", b"", head_only=False)
    for data in segments:
        if conn.closed:
            break
        conn.data_received(data)
    if end == "eof" and not conn.closed:
        conn.connection_lost(None)
    elif end == "reset" and not conn.closed:
        conn.connection_lost(ConnectionResetError())
    body = b""
    try:
        if conn.status:
            while (chunk := await asyncio.wait_for(conn.read(), 0.2)) is not None:
                body += chunk
    except (TimeoutError, UpstreamError):
        pass
    return Seen(
        conn.status or None,
        tuple((k.lower(), v) for k, v in conn.raw_headers),
        body,
        conn.complete,
        conn.reusable and not transport.closed,
    )


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n3\r\nabc\r\n0\r\n\r\n"
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"

STREAMS: dict[str, tuple[list[bytes], str]] = {
    "length": ([OK], "open"),
    "length-byte-by-byte": ([OK[i : i + 1] for i in range(len(OK))], "open"),
    "chunked": ([CHUNKED], "open"),
    "chunked-split": ([CHUNKED[:40], CHUNKED[40:]], "open"),
    "interim-then-final": ([b"HTTP/1.1 100 Continue\r\n\r\n" + OK], "open"),
    "connection-close": ([b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"], "eof"),
    "http-1.0": ([b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"], "eof"),
    "until-close-eof": ([UNTIL_CLOSE], "eof"),
    "until-close-reset": ([UNTIL_CLOSE], "reset"),
    "length-cut": ([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nok"], "eof"),
    "chunked-cut": ([CHUNKED[:-7]], "eof"),
    "two-in-one-segment": ([OK + b"HTTP/1.1 404 Not Found\r\ncontent-length: 6\r\n\r\nokevil"], "open"),
    "two-segments-second-unasked": ([OK, b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"], "open"),
    "not-http": ([b"not http\r\n\r\n"], "open"),
    "bad-length": ([b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\nok"], "open"),
    "two-lengths": ([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nokk"], "open"),
    "space-before-colon": ([b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\nok"], "open"),
    "bad-chunk-size": ([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n"], "open"),
}


@pytest.mark.parametrize("name", list(STREAMS))
async def test_upstream_reports_what_h11_reports(name: str) -> None:
    segments, end = STREAMS[name]
    reference = by_h11(segments, end)
    ours = await by_upstream(segments, end)
    if not reference.complete:
        # h11 refused or saw no end: kvgate must not call it complete nor reuse the connection
        # (what it relayed before noticing may differ; it ends as a broken exchange).
        assert not ours.complete, (reference, ours)
        assert not ours.reusable, (reference, ours)
    else:
        assert ours == reference
