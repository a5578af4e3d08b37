"""Raw ASGI plumbing shared by the gated fast path and the FastAPI routes.

The gated routes run on bare ASGI scopes (no Starlette Request), so the few things they need of
a request (a header, the body under a size limit, noticing the client leave) live here, written
against `scope`, `receive` and `send` only.
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope

from app.errors import BodyTooLarge, ClientGone, ClientTooSlow, InvalidField, UnsupportedEncoding


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a header; `name` in lower case, as ASGI servers deliver names."""
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
    *,
    reads_body: bool = True,
) -> bytes:
    """The whole body, once the head passed check_head; BodyTooLarge as soon as it is known to
    exceed `limit`, ClientTooSlow if the client sends nothing for `idle_timeout_s`, ClientGone if
    it left."""
    check_head(scope, reads_body=reads_body)
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):  # a timer, not a task per message
                message: Message = await receive()
        except TimeoutError:
            raise ClientTooSlow(idle_timeout_s or 0) from None
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def disconnect_future(receive: Receive) -> asyncio.Future:
    """Resolves when the client goes away; call only once the body has been read."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


def request_target(scope: Scope) -> bytes:
    """The path and query as the client sent them (still percent-encoded), to forward as they are."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope["query_string"]
    return path + b"?" + query if query else path
