"""Raw ASGI plumbing shared by the gated fast path and the FastAPI routes.

The gated routes run on bare ASGI scopes (no Starlette Request), so the few things they need of
a request (a header, the body under a size limit, noticing the client leave) live here, written
against `scope`, `receive` and `send` only.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope

from app.errors import BodyTooLarge, ClientGone


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a header; `name` in lower case, as ASGI servers deliver names."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body; BodyTooLarge as soon as it is known to exceed `limit`, ClientGone if the
    client left."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
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
