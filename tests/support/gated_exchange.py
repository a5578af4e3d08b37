"""Requests through kvgate's gated routes in-process (kvgate/http/gated_routes.py), against a scripted
backend: what a client sees (status, headers, body, stream events) with no server and no socket,
so that the order of events around a backend fault is the test's to choose.

The backend is `Backend.open` replaced (`ScriptedBackend.install`): each call takes the next
entry of its script, an exception to raise (BackendDown for a refused connection, ...) or a
`ScriptedUpstream`, the answer whose body the Relay reads, chunk by chunk, as it would read
kvgate.upstream's `UpstreamResponse`. A client (`Client`) is uvicorn's side of one request: its
`receive` hands over the body, then waits until the response is complete or the client leaves,
as uvicorn's does; `send` records what the client got.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.request_cpu import scope_of
from kvgate.composition import Runtime
from kvgate.http.gated_routes import GatedRoutes
from kvgate.upstream import UpstreamError
from kvgate.vllm_routes import Route

SSE = b"text/event-stream"
# One completion event and the end of the stream, as vLLM sends them.
EVENT = b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n'
DONE = b"data: [DONE]\n\n"
ANSWER = b'{"choices": [{"index": 0, "text": " x"}], "usage": {"completion_tokens": 1}}'

# A step of a scripted body: bytes to hand over, an exception to raise (the connection cut), or
# an event to wait for first (the test decides when the next chunk comes).
Step = bytes | BaseException | asyncio.Event


class ScriptedUpstream:
    """The backend's answer, as the Relay reads kvgate.upstream's UpstreamResponse: status and
    headers now, then `steps`. Closing it (the client left, the relay gave up) ends a wait for an
    event with the UpstreamError a closed connection raises."""

    def __init__(self, steps: list[Step], status: int = 200, content_type: bytes = SSE) -> None:
        self.status = status
        self.raw_headers = [(b"content-type", content_type)]
        self._steps = list(steps)
        self._closed = asyncio.get_running_loop().create_future()
        self.complete = not any(isinstance(s, bytes | BaseException) for s in self._steps)
        self.released = self.closed = 0

    def header(self, name: bytes) -> str | None:
        return next((v.decode("latin-1") for k, v in self.raw_headers if k.lower() == name), None)

    async def read(self) -> bytes | None:
        while self._steps:
            step = self._steps.pop(0)
            if isinstance(step, asyncio.Event):
                waiting = asyncio.ensure_future(step.wait())
                await asyncio.wait({waiting, self._closed}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if self._closed.done():
                    raise UpstreamError("the connection to the backend was closed")
                continue
            if isinstance(step, BaseException):
                raise step
            self.complete = not any(isinstance(s, bytes | BaseException) for s in self._steps)
            return step
        self.complete = True
        return None

    def release(self) -> None:
        self.released += 1

    def close(self) -> None:
        self.closed += 1
        if not self._closed.done():
            self._closed.set_result(None)


def stream(*steps: Step) -> Callable[[], ScriptedUpstream]:
    """A streamed answer: `steps`, by default one event and the end of the stream."""
    return lambda: ScriptedUpstream(list(steps) or [EVENT, DONE])


def answer(body: bytes = ANSWER, status: int = 200) -> Callable[[], ScriptedUpstream]:
    """A non-streamed answer, whole."""
    return lambda: ScriptedUpstream([body], status, b"application/json")


# What a call to the backend does: raise, or answer (made when called: it needs the running loop).
Entry = BaseException | Callable[[], ScriptedUpstream] | Callable[[], Awaitable[ScriptedUpstream]]


@dataclass
class ScriptedBackend:
    """`Backend.open` taking its answers from `script`, in order; once that is spent, `then`
    answers every call (by default a short answer of the request's kind)."""

    script: list[Entry] = field(default_factory=list)
    then: Entry | None = None
    calls: int = 0
    opened: list[ScriptedUpstream] = field(default_factory=list)

    def install(self, rt: Runtime) -> None:
        rt.backend.open = self.open  # type: ignore[method-assign]

    async def open(self, method: str, target: bytes, headers: object, body: bytes) -> ScriptedUpstream:
        self.calls += 1
        entry = self.script.pop(0) if self.script else self.then
        if entry is None:
            entry = stream() if json.loads(body).get("stream") else answer()
        if isinstance(entry, BaseException):
            raise entry
        made = entry()
        upstream = await made if isinstance(made, Awaitable) else made
        self.opened.append(upstream)
        return upstream


class Client:
    """uvicorn's side of one request: the body at once, then `receive` waits until the response
    is complete or the client leaves (`leave()`); `send` records what arrives."""

    def __init__(self, body: dict[str, Any], path: str = "/v1/completions", request_id: str = "") -> None:
        self.raw = json.dumps(body).encode()
        self.scope: dict[str, Any] = scope_of(path, self.raw)
        if request_id:
            self.scope["headers"].append((b"x-request-id", request_id.encode()))
        self.messages: list[dict[str, Any]] = []
        self._body_sent = False
        self._over = asyncio.Event()  # the response is complete or the client left
        self.left = False
        self.raised: BaseException | None = None

    def leave(self) -> None:
        self.left = True
        self._over.set()

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.raw, "more_body": False}
        await self._over.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.left:  # uvicorn drops what is sent to a client that left
            return
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._over.set()

    @property
    def status(self) -> int | None:
        """The status the client got; None if no response began."""
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def headers(self) -> dict[str, str]:
        start = next((m for m in self.messages if m["type"] == "http.response.start"), None)
        return {} if start is None else {k.decode().lower(): v.decode() for k, v in start["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        return self._over.is_set() and not self.left

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of an error answer."""
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return error


async def exchange(routes: GatedRoutes, client: Client, route: Route = "completions") -> Client:
    """Run one request to its end. What the handler raises is kept in `client.raised`: before the
    response began, uvicorn would have answered it with a plain-text 500."""
    try:
        await routes(route, client.scope, client.receive, client.send)
    except BaseException as exc:  # noqa: BLE001 - the tests assert there is none
        client.raised = exc
    return client
