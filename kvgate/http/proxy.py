"""Relaying the backend's answers: bytes passed on as they arrive (the connections: kvgate.backend).

Responses are never buffered: each chunk vLLM sends is passed on at once, so time to first byte
is vLLM's plus a few hundred microseconds. A relay owns its ticket from the moment the upstream
answers and releases it exactly once however the exchange ends: completion, upstream failure,
or the client going away (which closes the upstream connection, and vLLM aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvgate.backend import Backend
from kvgate.errors import RouteNotForwarded
from kvgate.gate.backend_state import UNKNOWN_OUTAGE_RETRY_S
from kvgate.http.choice_watch import ChoiceWatch
from kvgate.http.output_tokens import OutputTokenCounter
from kvgate.logs import ending_response_unfinished
from kvgate.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("kvgate.proxy")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
# Set by kvgate from what it saw of the connection, never taken from the client as sent: a client
# could otherwise tell the backend (whose uvicorn trusts forwarding headers from 127.0.0.1) any
# scheme or host it likes. X-Forwarded-For and Forwarded are chains: kvgate appends its hop.
_REWRITTEN = frozenset({b"x-request-id", b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"forwarded"})
_NOT_FORWARDED = HOP_BY_HOP | _REWRITTEN


async def open_while_client_waits(
    backend: Backend,
    receive: Receive,
    method: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> UpstreamResponse | None:
    """Backend.open, or None if the client leaves first: the half-open exchange is then
    cancelled, which closes its connection, and vLLM aborts the request.

    vLLM sends a non-streaming answer's head only when the answer is complete, so a client that
    hangs up meanwhile would otherwise keep its reservation, and vLLM its generation, to the end.
    """
    # The exchange runs in the caller's task and one watcher task cancels it if the client leaves
    # (a task for each and asyncio.wait over both cost three times as much per request).
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def cancel_when_client_leaves() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    # The task's own loop: asyncio.ensure_future would look the running loop up again, a getpid
    # system call on CPython 3.11 (Modules/_asynciomodule.c get_running_loop).
    watcher = task.get_loop().create_task(cancel_when_client_leaves())
    try:
        return await backend.open(method, target, headers, body)
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # the watcher's cancel, no one else's: the exchange is closed
            return None
        raise
    finally:
        watcher.cancel()


def forward_headers(
    raw: Iterable[tuple[bytes, bytes]],
    request_id: str,
    client: tuple[str, int] | None = None,
    scheme: str = "http",
) -> list[tuple[bytes, bytes]]:
    """The client's headers (ASGI's lower-case byte pairs) as a reverse proxy forwards them
    (RFC 9110 7.6.1): hop-by-hop ones, every Proxy-* one and those its Connection header names
    dropped; Host is the backend's (kvgate.upstream writes it); X-Forwarded-Host and
    X-Forwarded-Proto say what kvgate was asked (the client's Host, the scheme it spoke),
    replacing any the client sent; the client's address appended to X-Forwarded-For and, as an
    RFC 7239 element with host and proto, to Forwarded (without a peer address, on a Unix socket,
    both chains go on as they came); x-request-id is the one kvgate uses."""
    # One pass (this runs for every request): what is kept, and what kvgate rewrites.
    out: list[tuple[bytes, bytes]] = []
    host: bytes | None = None
    for_chain: list[bytes] = []
    forwarded: list[bytes] = []
    named: set[bytes] = set()
    for key, value in raw:
        if key not in _NOT_FORWARDED and not key.startswith(b"proxy-"):
            out.append((key, value))
        elif key == b"host":
            host = value if host is None else host
        elif key == b"x-forwarded-for":
            for_chain.append(value)
        elif key == b"forwarded":
            forwarded.append(value)
        elif key == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    if named:
        out = [(k, v) for k, v in out if k not in named]
    proto = scheme.encode("latin-1")
    if client is not None:
        address = client[0].encode("latin-1")
        for_chain.append(address)
        node = b'"[' + address + b']"' if b":" in address else address  # RFC 7239 6: IPv6 quoted, bracketed
        element = b"for=" + node + b";proto=" + proto
        if host is not None and b'"' not in host and b"\\" not in host:
            element += b';host="' + host + b'"'
        forwarded.append(element)
    if for_chain:
        out.append((b"x-forwarded-for", b", ".join(for_chain)))
    if forwarded:
        out.append((b"forwarded", b", ".join(forwarded)))
    if host is not None:
        out.append((b"x-forwarded-host", host))
    out.append((b"x-forwarded-proto", proto))
    out.append((b"x-request-id", request_id.encode("latin-1")))
    return out


def response_headers(upstream: UpstreamResponse, extra: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The backend's headers less the hop-by-hop ones (its Content-Length kept unless the body is
    encoded), then `extra`; one pass over the backend's (this runs for every answer)."""
    kept = []
    length: bytes | None = None
    encoded = retry_after = False
    for key, value in upstream.raw_headers:
        name = key.lower()
        if name not in HOP_BY_HOP:
            kept.append((key, value))
            encoded = encoded or name == b"content-encoding"
            retry_after = retry_after or name == b"retry-after"
        elif name == b"content-length" and length is None:
            length = value
    if length is not None and not encoded:
        kept.append((b"content-length", length))
    kept.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
    if upstream.status in (502, 503) and not retry_after:
        # Every 502 and 503 a client gets carries Retry-After, the backend's own ones too.
        kept.append((b"retry-after", str(UNKNOWN_OUTAGE_RETRY_S).encode()))
    return kept


# The last event of an OpenAI stream: once it is sent whole, the client has its whole answer.
SSE_DONE = b"data: [DONE]\n\n"


def sse_error_event(message: str, code: str) -> bytes:
    """An error event in vLLM's streaming shape, then the end of the stream."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Relay(Response):
    """An ASGI response that relays the upstream body and always runs `on_end(outcome, tokens)`
    once; `tokens` is the output token count read off the body when `count_output` is set.

    It overrides Response's ASGI call rather than using StreamingResponse so that the release
    happens even when the client has gone before the first byte could be sent. It is a Response
    so that the FastAPI routes (the pass-through) can return it as they return any other.

    A client that stops reading is throttled, then cut. Throttled: while its socket buffer is
    full, uvicorn's send waits (its flow control drains) and the relay reads nothing more from
    vLLM, so vLLM's own writer blocks the same way. vLLM 0.32.0 gives a blocked writer no
    deadline: its StreamingResponse waits in uvicorn's send for as long as the connection stays
    open, while the engine goes on generating into the request's RequestOutputCollector
    (vllm/v1/engine/output_processor.py, which merges the deltas no one reads) and holds its KV
    until max_tokens. Cut: once one send has waited `stall_timeout_s`, the relay closes the
    upstream connection (vLLM aborts the request and frees its blocks), releases the
    reservation as "stalled" and ends without completing the response, which makes uvicorn
    close the client's connection (ASGI has no other way to drop it; kvgate's own warning says
    so, and uvicorn's "ASGI callable returned without completing response." is filtered out
    for these requests alone, kvgate.logs.ending_response_unfinished).
    """

    def __init__(
        self,
        upstream: UpstreamResponse,
        headers: Mapping[str, str],
        on_first_chunk: Callable[[], None],
        on_end: Callable[[str, int | None], None],
        count_output: bool = False,
        stall_timeout_s: float | None = None,
        choices: ChoiceWatch | None = None,
    ) -> None:
        # Response's own __init__ is not called: it renders a body and builds headers that the
        # upstream's replace (what the pass-through routes' FastAPI reads is set here).
        self.status_code = upstream.status
        self.background = None
        self.body = b""
        self.raw_headers = response_headers(upstream, headers)  # the upstream's, not Response's
        self.upstream = upstream
        self._on_first_chunk = on_first_chunk
        self._on_end = on_end
        self._choices = choices  # a stream of several engine requests: when all its choices started
        self._is_sse = (upstream.header(b"content-type") or "").startswith("text/event-stream")
        self._counter = OutputTokenCounter(self._is_sse) if count_output else None
        self._client_gone = False
        self._sent_tail = b""  # the end of what the client was sent, to see SSE_DONE go out
        self._stall_timeout_s = stall_timeout_s
        # The stall deadline: one timer for the whole relay, armed by its first send (a timeout
        # around every send cost a timer handle and a context manager a message).
        self._stall_timer: asyncio.TimerHandle | None = None
        self._sending_since: float | None = None  # when the send under way began (the loop's clock)
        self._stalled = False
        self._task: asyncio.Task[Any] | None = None  # the task relaying, which a stall cancels
        self._request_id = headers.get("x-request-id", "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "disconnected"
        # A body that has already arrived whole (vLLM's non-streaming answers come at once) is
        # relayed without waiting on the backend: no client to watch for, no task to start.
        watcher = None
        if not self.upstream.complete:  # on the relay's task's loop: one look-up, which _send reuses
            self._task = asyncio.current_task()
            assert self._task is not None
            watcher = self._task.get_loop().create_task(self._watch_disconnect(receive))
        try:
            outcome = await self._relay(send)
        except ClientStalled:
            outcome = "stalled"
            ending_response_unfinished()  # uvicorn closes the connection; its ERROR line would be noise
            log.warning(
                "request %s: the client read nothing for %g s with its socket buffer full: stream cut, "
                "backend request aborted, reservation released",
                self._request_id,
                self._stall_timeout_s,
            )
        except UpstreamError:  # cut mid-body: the client's connection is dropped (uvicorn) too
            outcome = "upstream_error"
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            self._on_end(outcome, self._counter.tokens() if self._counter else None)
            if outcome in ("completed", "refused_by_backend", "backend_error"):
                self.upstream.release()  # read to the end: the connection goes back to the pool
            else:
                self.upstream.close()  # abandoned mid-body: closing it makes vLLM abort

    async def _watch_disconnect(self, receive: Receive) -> None:
        """The client left: closing the upstream connection makes vLLM abort the request."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        self.upstream.close()

    def _outcome_once_client_left(self) -> str:
        """A stream whose `data: [DONE]` went out whole was answered in full: a client that hangs
        up right after it (most do) completed, though vLLM's end of the chunked body may still have
        been on its way and kvgate saw the hang-up first. Anything else was cut short."""
        return "completed" if self._sent_tail == SSE_DONE else "disconnected"

    async def _relay(self, send: Send) -> str:
        await self._send(send, {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        started = ended = False
        try:
            while not ended and (chunk := await self.upstream.read()) is not None:
                if not started:
                    started = True
                    self._on_first_chunk()
                if self._counter is not None:
                    self._counter.feed(chunk)
                if self._choices is not None:
                    self._choices.feed(chunk)
                # read() handed over all that had arrived: if the response is complete this is
                # its last chunk, and the end of the body goes out with it (one write, not two).
                ended = self.upstream.complete
                if self._is_sse and not self._client_gone:
                    self._sent_tail = (self._sent_tail + chunk)[-len(SSE_DONE) :]
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": not ended})
        except UpstreamError as exc:
            if self._client_gone:
                return self._outcome_once_client_left()
            log.warning("backend stream broke: %s", type(exc).__name__)
            if self._is_sse:
                event = sse_error_event(f"The backend stream broke ({type(exc).__name__}).", "backend_stream_broken")
                await self._send(send, {"type": "http.response.body", "body": event, "more_body": False})
                return "upstream_error"
            raise
        if self._client_gone:
            return self._outcome_once_client_left()
        if not ended:
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        if self.status_code >= 500:
            return "backend_error"  # the backend answered, with an error (vLLM: its engine died)
        return "refused_by_backend" if self.status_code >= 400 else "completed"

    async def _send(self, send: Send, message: Message) -> None:
        """`send`, or ClientStalled once it has waited `stall_timeout_s` for a client that reads
        nothing (uvicorn's send waits only while the connection's write buffer is full)."""
        if self._stall_timeout_s is None:
            await send(message)
            return
        task = self._task
        if task is None:  # the relay's task, looked up once (a getpid system call each, on 3.11)
            task = self._task = asyncio.current_task()
            assert task is not None
        loop = task.get_loop()
        self._sending_since = now = loop.time()
        if self._stall_timer is None:
            self._stall_timer = loop.call_at(now + self._stall_timeout_s, self._check_stall, task)
        try:
            await send(message)
        except asyncio.CancelledError:
            if self._stalled and task.uncancel() == 0:  # our cancel, no one else's
                raise ClientStalled() from None
            raise
        finally:
            self._sending_since = None

    def _check_stall(self, task: asyncio.Task[Any]) -> None:
        """The stall timer is due: cut the relay if the send under way has waited the whole
        `stall_timeout_s`, else wait for what is left of the send under way; with none under
        way, the next send arms it again."""
        self._stall_timer = None
        since = self._sending_since
        if since is None or self._stall_timeout_s is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - since >= self._stall_timeout_s:
            self._stalled = True
            task.cancel()
        else:
            self._stall_timer = loop.call_at(since + self._stall_timeout_s, self._check_stall, task)


class ClientStalled(Exception):
    """The client left a full socket buffer unread past the stall deadline."""


def passthrough_allowed(setting: str) -> frozenset[str]:
    """--passthrough-paths as the set of paths it names."""
    return frozenset(path.strip() for path in setting.split(",") if path.strip())


def check_passthrough(path: str, allowed: frozenset[str]) -> None:
    """404 for a path kvgate neither gates nor was told to forward. Forwarding everything let
    vLLM's other generation routes (/invocations, /v1/responses, ...) and its admin routes
    bypass the gate, and `/v1/completions/` came back as a redirect to vLLM's own address."""
    if path not in allowed:
        raise RouteNotForwarded(path)


async def passthrough(
    backend: Backend,
    method: str,
    target: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    request_id: str,
    client: tuple[str, int] | None = None,
    scheme: str = "http",
) -> Relay:
    """Any path kvgate does not gate: forwarded with the headers a reverse proxy sends
    (forward_headers), relayed as it comes."""
    upstream = await backend.open(method, target, forward_headers(headers, request_id, client, scheme), body)
    return Relay(upstream, {"x-request-id": request_id}, lambda: None, lambda outcome, tokens: None)
