"""Limits on the request head, enforced while it arrives: uvicorn's httptools protocol has none.

Without them a 16 MiB header and 100,000 headers were buffered, parsed and forwarded to vLLM,
a 64 MiB header held the event loop 3 s, and 1,500 connections trickling their heads held
sockets for 90 s. These checks run in the protocol, before any ASGI code sees the request:
- a head (request line and headers) over `max_bytes`, or with more than `max_count` headers:
  431 Request Header Fields Too Large, connection closed;
- a head not complete `timeout_s` after its first byte (or after the connection opened):
  408 Request Timeout, connection closed;
- a request line (method, target, version) that alone passes `max_bytes`: 414 URI Too Long;
- a request httptools cannot parse: 400.
Each refusal is OpenAI's error shape (uvicorn's own 400 is plain text). The connection is then
half-closed and what the client still sends is read and dropped for up to LINGER_S: closing at
once over unread bytes made the kernel reset the connection, and a client still sending its
200 KB target got ECONNRESET instead of the answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
}
_CODES = {
    400: "invalid_http_request",
    408: "request_timeout",
    414: "request_target_too_long",
    431: "request_header_fields_too_large",
}
# How long a refused connection's remaining bytes are read and dropped before it is closed.
LINGER_S = 2.0


class _HeadRefused(Exception):
    """Raised from a parser callback to stop httptools mid-head; uvicorn then answers 400,
    which send_400_response turns into the refusal noted."""


def limited_http_protocol(max_bytes: int, max_count: int, timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these limits on every request head (uvicorn's `http=`)."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._head_count = 0
            self._in_head = True
            self._heads_parsed = 0
            self._refusal: tuple[int, str] | None = None
            self._head_timer: asyncio.TimerHandle | None = None
            self._line_ended = False  # the request line is in: an overflow is the headers'
            self._refused = False  # answered and half-closed: what arrives is dropped

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._arm_head_timer()
                room = max_bytes - self._head_bytes
                in_line = not self._line_ended
                self._line_ended = self._line_ended or b"\n" in data[:room]
                if len(data) > room:  # the head must end within `room`; the rest may be body
                    heads = self._heads_parsed
                    self._head_bytes = max_bytes
                    super().data_received(data[:room])
                    if self._heads_parsed == heads:
                        if not self.transport.is_closing() and not self._refused:
                            if in_line and not self._line_ended:
                                self._refuse(414, f"The request target exceeds kvgate's limit of {max_bytes:,} bytes.")
                            else:
                                self._refuse(431, f"The request head exceeds kvgate's limit of {max_bytes:,} bytes.")
                        return
                    data = data[room:]
                else:
                    self._head_bytes += len(data)
            super().data_received(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_count += 1
            if self._head_count > max_count:
                self._refusal = (431, f"The request has more than kvgate's limit of {max_count} headers.")
                raise _HeadRefused()
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads_parsed += 1
            self._disarm_head_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._head_count = True, 0, 0  # the next request's head
            self._line_ended = False

        def send_400_response(self, msg: str) -> None:
            self._refuse(*(self._refusal or (400, f"{msg.rstrip('.')}: not an HTTP/1.1 request kvgate can read.")))

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                if self._head_bytes:
                    self._refuse(408, f"The request head did not arrive within {timeout_s:g} s.")
                else:
                    self.transport.close()  # an idle connection: nothing to answer

        def _refuse(self, status: int, message: str) -> None:
            """An OpenAI-shaped error, then the connection is half-closed, and closed LINGER_S
            later or when the client closes its side (asyncio closes on EOF): the rest of the
            request is never parsed, so nothing else on this connection can be trusted."""
            self._disarm_head_timer()
            self._refused = True
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": _CODES[status]}
            body = json.dumps({"error": error}).encode()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)) + body
            )
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return LimitedHttpToolsProtocol
