"""Raw ASGI plumbing shared by the gated fast path and the FastAPI routes.

The gated routes run on bare ASGI scopes (no Starlette Request), so the few things they need of
a request (a header, the body under a size limit, noticing the client leave) live here, written
against `scope`, `receive` and `send` only.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvgate.errors import BodyTooLarge, ClientGone, ClientTooSlow, InvalidField, UnsupportedEncoding

# Set in the scope while read_body has refused a body the client is still sending.
_BODY_UNREAD = "kvgate.body_unread"
# nginx's lingering close (ngx_http_core_module: lingering_time 30 s, lingering_timeout 5 s): how
# long, at most, the rest of a refused body is read and thrown away so the client gets the answer.
LINGER_S = 30.0
LINGER_IDLE_S = 5.0


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a header; `name` in lower case, as ASGI servers deliver names."""
    key: bytes
    value: bytes
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def check_head(scope: Scope, *, reads_body: bool) -> None:
    """400 unless an HTTP/1.1 request names exactly one Host (RFC 9112 3.2: a proxy would
    otherwise forward a request whose target it cannot know); 415 for an encoded body kvgate
    must read (`reads_body`): it parses JSON, not gzip."""
    if scope.get("http_version") == "1.1":
        hosts = sum(1 for key, _ in scope["headers"] if key == b"host")
        if hosts != 1:
            raise InvalidField(f"An HTTP/1.1 request needs exactly one Host header, not {hosts}.", code="invalid_host")
    encoding = header(scope, b"content-encoding")
    if reads_body and encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedEncoding(encoding)


async def read_body(
    scope: Scope,
    receive: Receive,
    limit: int,
    idle_timeout_s: float | None = None,
    deadline_s: float | None = None,
    *,
    reads_body: bool = True,
) -> bytes:
    """The whole body, once the head passed check_head; BodyTooLarge as soon as it is known to
    exceed `limit`, ClientTooSlow if the client sends nothing for `idle_timeout_s` or the whole
    body has not arrived `deadline_s` after the head (a byte a second reset the idle timer
    forever: 500 such connections held 500 fds past 90 s), ClientGone if it left. When it refuses
    a body still on its way, body_unread(scope) says so."""
    declared = header(scope, b"content-length")
    scope[_BODY_UNREAD] = declared not in (None, "0") or header(scope, b"transfer-encoding") is not None
    check_head(scope, reads_body=reads_body)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    ends_at = None if deadline_s is None else loop.time() + deadline_s
    while True:
        wait_s = idle_timeout_s
        if ends_at is not None:
            left = ends_at - loop.time()
            wait_s = left if wait_s is None else min(wait_s, left)
        try:
            # A timer, not a task per message; timeout_at, as timeout() looks the running loop up
            # again (a getpid system call on CPython 3.11).
            async with asyncio.timeout_at(None if wait_s is None else loop.time() + wait_s):
                message: Message = await receive()
        except TimeoutError:
            scope[_BODY_UNREAD] = False  # a client that stalled is not waited for again
            if ends_at is not None and loop.time() >= ends_at:
                raise ClientTooSlow(deadline_s or 0, deadline=True) from None
            raise ClientTooSlow(idle_timeout_s or 0) from None
        more = message["type"] != "http.disconnect" and message.get("more_body", False)
        scope[_BODY_UNREAD] = more
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not more:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def answer_refusal(scope: Scope, response: Response) -> Response:
    """`response` (an error), sent so that the client reads it even if read_body refused its
    body while it was still arriving (AnswerThenDiscardBody)."""
    return AnswerThenDiscardBody(response) if scope.get(_BODY_UNREAD, False) else response


class AnswerThenDiscardBody(Response):
    """An error answered while the client is still uploading (413 for a body over the limit):
    the answer goes out at once, then the rest of the body is read and thrown away until it
    ends, the client goes, LINGER_IDLE_S pass without data or LINGER_S in all, and only then is
    the connection closed (`Connection: close`).

    Closing at once, as uvicorn does after the answer when the client asked for
    `Connection: close`, made the kernel reset the connection over the unread upload: the client
    got EPIPE or ECONNRESET while sending and never read the 413. nginx does the same
    (lingering close); uvicorn keeps reading a keep-alive connection's unread body forever, which
    the close after LINGER_S bounds."""

    def __init__(self, answer: Response) -> None:
        super().__init__(answer.body, answer.status_code)
        self.raw_headers = [*answer.raw_headers, (b"connection", b"close")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while True:
                    async with asyncio.timeout(LINGER_IDLE_S):
                        message = await receive()
                    if message["type"] == "http.disconnect" or not message.get("more_body", False):
                        break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def disconnect_future(receive: Receive) -> asyncio.Future[None]:
    """Resolves when the client goes away; call only once the body has been read."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


def request_target(scope: Scope) -> bytes:
    """The path and query as the client sent them (still percent-encoded), to forward as they are."""
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope["query_string"]
    return path + b"?" + query if query else path
