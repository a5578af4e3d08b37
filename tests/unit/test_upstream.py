"""kvgate.upstream, kvgate's HTTP/1.1 client to the backend, against scripted raw-socket servers."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from kvgate import upstream
from kvgate.backend import Backend
from kvgate.errors import BackendBroke, BackendBusy, BackendDown, BackendTimedOut, InvalidField
from kvgate.http.errors import error_headers, status_of
from kvgate.http.proxy import forward_headers, open_while_client_waits, response_headers
from kvgate.upstream import ConnectionPool, UpstreamError, UpstreamTimeout
from support.waiting import wait_for_async

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port running `handler` per connection; yields its URL and a list that
    grows by one per connection accepted."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def answering(*responses: bytes, then_hang: bool = False, then_close: bool = False) -> Handler:
    """Answer each request with the next of `responses`, then hang, close, or answer OK forever."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await read_request(reader)
            writer.write(response)
            await writer.drain()
        if then_hang:
            await asyncio.sleep(3600)
        elif not then_close:
            while True:
                await read_request(reader)
                writer.write(OK)

    return handle


async def body_of(response: upstream.UpstreamResponse) -> bytes:
    chunks = []
    while (chunk := await response.read()) is not None:
        chunks.append(chunk)
    return b"".join(chunks)


async def test_request_head_and_keep_alive_reuse() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async with server(handle) as (url, connections):
        pool = ConnectionPool(url.replace("://", "://user:secret@") + "/prefix/", read_timeout_s=5)
        for _ in range(3):
            response = await pool.request("POST", b"/v1/completions?a=%20b", [(b"x-one", b"1")], b'{"p": 1}')
            assert response.complete  # the body came with the head
            assert (response.status, await body_of(response)) == (200, b"{}")
            assert response.header(b"content-type") == "application/json"
            response.release()
        pool.close()
    assert len(connections) == 1
    head, body = seen[0]
    assert head.startswith(b"POST /prefix/v1/completions?a=%20b HTTP/1.1\r\n")
    assert f"host: {url.removeprefix('http://')}\r\n".encode() in head
    assert b"secret" not in head
    assert b"x-one: 1\r\n" in head
    assert b"content-length: 8\r\n" in head
    assert body == b'{"p": 1}'


async def test_chunks_are_handed_over_as_they_arrive() -> None:
    more = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await more.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await asyncio.sleep(3600)

    async with server(handle) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [], b"{}")
        assert await response.read() == b"first"
        assert not response.complete
        more.set()
        assert await body_of(response) == b"second"
        response.release()
        pool.close()


async def test_chunks_that_arrived_together_are_read_together() -> None:
    events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"))
    stream = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    async with server(answering(stream + events + b"0\r\n\r\n", then_hang=True)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [], b"{}")
        await wait_for_async(lambda: response.complete, timeout_s=5, what="the whole stream to arrive")
        assert await response.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert response.complete
        assert await response.read() is None
        response.release()
        pool.close()


class ScriptedStream:
    """What Relay uses of an UpstreamResponse: an event stream read in the given chunks."""

    status, raw_headers = 200, [(b"content-type", b"text/event-stream")]
    complete, released = False, False

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    def header(self, name: bytes) -> str | None:
        return dict(self.raw_headers).get(name, b"").decode() or None

    async def read(self) -> bytes | None:
        if not self.reads:
            return None
        self.complete = len(self.reads) == 1  # the last read takes what is left
        return self.reads.pop(0)

    def release(self) -> None:
        self.released = True


async def test_a_relay_ends_the_body_with_its_last_chunk() -> None:
    """One body message per read, the last one closing the body: a stream that arrived whole
    leaves in one write, a non-streaming answer without a separate empty end."""
    from kvgate.http.proxy import Relay

    async def relayed(reads: list[bytes]) -> tuple[list[tuple[bytes, bool]], list[object]]:
        sent: list[dict] = []
        ends: list[object] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {}

        source = ScriptedStream(reads)
        await Relay(
            source, {}, lambda: None, lambda outcome, tokens: ends.append((outcome, tokens)), count_output=True
        )({"type": "http"}, receive, send)
        assert source.released
        return [(m["body"], m["more_body"]) for m in sent[1:]], ends

    body, ends = await relayed([b"data: {}\n\ndata: {}\n\n"])
    assert body == [(b"data: {}\n\ndata: {}\n\n", False)]
    assert ends == [("completed", 2)]
    body, ends = await relayed([b"data: {}\n\n", b"data: {}\n\n"])
    assert body == [(b"data: {}\n\n", True), (b"data: {}\n\n", False)]
    assert ends == [("completed", 2)]
    body, ends = await relayed([])
    assert body == [(b"", False)]
    assert ends == [("completed", 0)]


async def test_body_until_close_and_head_requests_are_complete() -> None:
    async with server(answering(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it", then_close=True)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("GET", b"/", [], b"")
        assert await body_of(response) == b"all of it"
        response.release()
    async with server(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n")) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        for _ in range(2):
            response = await pool.request("HEAD", b"/", [], b"")
            assert response.status == 200
            assert await response.read() is None
            response.release()
        assert len(connections) == 2  # a HEAD's connection is not reused
        pool.close()


async def test_interim_responses_are_skipped() -> None:
    async with server(answering(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [(b"expect", b"100-continue")], b"{}")
        assert (response.status, await body_of(response)) == (200, b"{}")
        response.release()
        pool.close()


async def test_broken_and_silent_backends() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart"
    async with server(answering(cut, then_close=True)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [], b"{}")
        assert await response.read() == b"part"
        with pytest.raises(UpstreamError):
            await response.read()
        response.close()
    async with server(answering(then_hang=True)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=0.2)
        with pytest.raises(UpstreamTimeout):
            await pool.request("POST", b"/", [], b"{}")
    async with server(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", then_hang=True)) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [], b"{}")
        reading = asyncio.ensure_future(response.read())
        await wait_for_async(lambda: response._conn._waiter is not None, timeout_s=5, what="the reader to wait")
        response.close()  # the client left: the reader wakes at once
        with pytest.raises(UpstreamError):
            await reading
    async with server(answering(b"not http\r\n\r\n")) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.request("POST", b"/", [], b"{}")


async def test_backend_maps_failures_to_api_errors() -> None:
    async with server(answering()) as (url, _):
        pass  # closed: nothing listens on that port any more
    backend = Backend(url, timeout_s=5)
    with pytest.raises(BackendDown) as refused:
        await backend.open("POST", b"/v1/completions", [], b"{}")
    assert refused.value.code == "backend_unavailable"
    assert refused.value.retry_after_s == 5
    async with server(answering(then_hang=True)) as (url, _):
        backend = Backend(url, timeout_s=0.2)
        with pytest.raises(BackendTimedOut) as silent:
            await backend.open("POST", b"/v1/completions", [], b"{}")
        assert silent.value.code == "backend_timeout"
        await backend.aclose()


async def test_a_reused_connection_does_not_look_up_the_running_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio.get_running_loop() is a getpid system call on CPython 3.11: not one per request."""
    async with server(answering()) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("GET", b"/", [], b"")
        await body_of(response)
        response.release()
        lookups: list[int] = []
        real = asyncio.get_running_loop
        monkeypatch.setattr(asyncio, "get_running_loop", lambda: lookups.append(1) or real())
        for _ in range(3):
            response = await pool.request("GET", b"/", [], b"")
            await body_of(response)
            response.release()
        monkeypatch.undo()
        pool.close()
    assert lookups == []
    assert len(connections) == 1


async def test_an_exchange_and_its_relay_look_their_task_up_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPython 3.11 each look-up of the running loop (asyncio.get_running_loop, current_task,
    ensure_future, timeout) is a getpid system call: a reused connection's exchange and the relay
    of its answer under a stall deadline take one current_task each, a stream's relay one in all."""
    from kvgate.http.proxy import Relay

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {}

    async with server(answering()) as (url, _):
        backend = Backend(url, timeout_s=5)
        (await backend.open("GET", b"/", [], b"")).release()
        lookups: list[str] = []
        for name in ("get_running_loop", "current_task", "ensure_future", "get_event_loop"):
            real = getattr(asyncio, name)
            monkeypatch.setattr(asyncio, name, lambda *a, _n=name, _r=real: lookups.append(_n) or _r(*a))
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        response = await open_while_client_waits(backend, receive, "GET", b"/", [], b"")
        assert response is not None
        ends: list[str] = []
        await Relay(response, {}, lambda: None, lambda outcome, _: ends.append(outcome), stall_timeout_s=5)(
            {"type": "http"}, receive, send
        )
        monkeypatch.undo()
        await backend.aclose()
    assert lookups == ["current_task", "current_task"]
    assert ends == ["completed"]
    assert [m.get("body") for m in sent] == [None, b"{}"]

    # A stream relayed in 20 messages: one look-up for the whole relay, not one per message.
    lookups.clear()
    sent.clear()
    for name in ("get_running_loop", "current_task", "ensure_future", "get_event_loop"):
        real = getattr(asyncio, name)
        monkeypatch.setattr(asyncio, name, lambda *a, _n=name, _r=real: lookups.append(_n) or _r(*a))
    stream = ScriptedStream([b"data: {}\n\n"] * 20)
    await Relay(stream, {}, lambda: None, lambda outcome, _: ends.append(outcome), stall_timeout_s=5)(
        {"type": "http"}, receive, send
    )
    monkeypatch.undo()
    assert lookups == ["current_task"]
    assert ends == ["completed", "completed"]
    assert len(sent) == 21
    assert stream.released


async def test_stale_idle_connections_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "IDLE_REUSE_S", 0.0)
    async with server(answering()) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        for _ in range(2):
            response = await pool.request("GET", b"/", [], b"")
            await body_of(response)
            response.release()
        pool.close()
    assert len(connections) == 2


def closing_the_reused_connection(answer_then: bytes = b"") -> Handler:
    """The first connection answers one request, then closes on the next one's arrival (after
    `answer_then`, if any): a keep-alive timer that ran out as the request went out. Every later
    connection answers OK."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if handle.first:  # type: ignore[attr-defined]
            handle.first = False  # type: ignore[attr-defined]
            await read_request(reader)
            writer.write(OK)
            await read_request(reader)
            writer.write(answer_then)
            await writer.drain()
            return  # the server closes the connection
        while True:
            await read_request(reader)
            writer.write(OK)

    handle.first = True  # type: ignore[attr-defined]
    return handle


async def test_a_reused_connection_closed_unanswered_is_sent_again_on_a_new_one() -> None:
    """The backend closed an idle connection as kvgate reused it: it never read the request."""
    async with server(closing_the_reused_connection()) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        for _ in range(2):
            response = await pool.request("POST", b"/", [], b"{}")
            assert (response.status, await body_of(response)) == (200, b"{}")
            response.release()
        pool.close()
    assert len(connections) == 2


async def test_a_connection_closed_after_an_answer_began_or_when_new_is_not_sent_again() -> None:
    """Once the backend answered a byte it read the request; a new connection closed unanswered
    is the backend failing, not a stale keep-alive: both are errors, sent once."""
    async with server(closing_the_reused_connection(answer_then=b"HTTP/1.1 20")) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("POST", b"/", [], b"{}")
        await body_of(response)
        response.release()
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.request("POST", b"/", [], b"{}")
        pool.close()
    assert len(connections) == 1
    async with server(answering(then_close=True)) as (url, connections):
        pool = ConnectionPool(url, read_timeout_s=5)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.request("POST", b"/", [], b"{}")
    assert len(connections) == 1


async def test_a_new_connection_lost_before_the_request_is_sent_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend killed as it accepted: the connection is gone before the request is written. The
    request fails then (a 502 at the edge), not after the read timeout with nothing to wait for."""
    new_connection = ConnectionPool._new_connection

    async def lost_at_once(self: ConnectionPool) -> upstream.Connection:
        conn = await new_connection(self)
        await wait_for_async(lambda: conn.closed, timeout_s=5, what="the backend to close the connection")
        return conn

    monkeypatch.setattr(ConnectionPool, "_new_connection", lost_at_once)

    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass  # the server closes the connection as soon as the handler returns

    async with server(close_at_once) as (url, _):
        backend = Backend(url, timeout_s=3)
        started = asyncio.get_running_loop().time()
        with pytest.raises(BackendBroke):
            await backend.open("POST", b"/v1/completions", [], b"{}")
        assert asyncio.get_running_loop().time() - started < 2
        await backend.aclose()


async def test_reading_pauses_above_the_high_water_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "HIGH_WATER_BYTES", 1000)
    sent = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 200000\r\n\r\n")
        for _ in range(100):
            writer.write(b"x" * 2000)
            await writer.drain()
        sent.set()

    async with server(handle) as (url, _):
        pool = ConnectionPool(url, read_timeout_s=5)
        response = await pool.request("GET", b"/", [], b"")
        await wait_for_async(lambda: response._conn._paused, timeout_s=5, what="reading to pause")
        assert len(await body_of(response)) == 200000
        await asyncio.wait_for(sent.wait(), 5)
        response.release()
        pool.close()


async def test_unsendable_headers_are_refused_before_anything_is_sent() -> None:
    """Issue 15, finding 10: a header value with CR/LF would split the request kvgate writes."""
    async with server(answering()) as (url, connections):
        backend = Backend(url, timeout_s=5)
        for header in [
            (b"x-a", b"1\r\nx-evil: 1"),
            (b"x-a", b"1\n"),
            (b"x-a", b"\0"),
            (b"bad name", b"1"),
            (b"", b"1"),
        ]:
            with pytest.raises(InvalidField) as refused:
                await backend.open("POST", b"/v1/completions", [header], b"{}")
            assert (status_of(refused.value), refused.value.code) == (400, "invalid_header")
        assert connections == []
        response = await backend.open("POST", b"/v1/completions", [(b"x-fine", b"a\tb c")], b"{}")
        assert response.status == 200
        response.release()
        await backend.aclose()


def test_a_header_name_is_refused_unless_every_byte_is_an_http_token_character() -> None:
    """RFC 9110 5.1 and 5.6.2: a field name is a token; each of the 256 bytes alone and inside a
    name, against the RFC's tchar list written out as a regex."""
    tchar = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
    for byte in range(256):
        for name in (bytes([byte]), b"x-" + bytes([byte]) + b"-y"):
            if tchar.fullmatch(name):
                upstream.check_header(name, b"1")
            else:
                with pytest.raises(upstream.InvalidRequestHeader):
                    upstream.check_header(name, b"1")


async def test_connect_timeout_is_configurable_and_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reached the backend: 503 with Retry-After (it was a 504 after a fixed 5 s). It is
    BackendBusy, backpressure: the caller sends it again without marking the backend down."""

    async def never_connects(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(asyncio.get_running_loop(), "create_connection", never_connects)
    backend = Backend("http://127.0.0.1:9", timeout_s=5, connect_timeout_s=0.1)
    started = asyncio.get_running_loop().time()
    with pytest.raises(BackendBusy) as refused:
        await backend.open("POST", b"/v1/completions", [], b"{}")
    assert asyncio.get_running_loop().time() - started < 1
    assert (status_of(refused.value), refused.value.code) == (503, "backend_unavailable")
    assert "0.1 s" in refused.value.message
    assert error_headers(refused.value)["Retry-After"]
    await backend.aclose()


async def test_waiting_for_a_pooled_connection_times_out_as_a_503() -> None:
    async with server(answering(then_hang=True)) as (url, _):
        backend = Backend(url, timeout_s=5, max_connections=1, pool_timeout_s=0.1)
        hanging = asyncio.ensure_future(backend.open("POST", b"/v1/completions", [], b"{}"))
        await wait_for_async(lambda: backend.pool._slots.locked(), timeout_s=5, what="the one connection to be taken")
        with pytest.raises(BackendBusy) as refused:
            await backend.open("POST", b"/v1/completions", [], b"{}")
        assert (status_of(refused.value), refused.value.code) == (503, "backend_unavailable")
        assert "1 connections" in refused.value.message
        hanging.cancel()
        await backend.aclose()


async def test_a_client_leaving_before_the_head_closes_the_backend_connection() -> None:
    """vLLM aborts a request whose connection closes: that is how it learns the client left."""
    closed = asyncio.Event()

    async def generate_slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if await reader.read() == b"":  # EOF: kvgate closed the connection
            closed.set()

    async def client_leaves_after_a_while() -> dict:
        await asyncio.sleep(0.1)  # the client under test: it leaves while the backend generates
        return {"type": "http.disconnect"}

    async with server(generate_slowly) as (url, _):
        backend = Backend(url, timeout_s=30)
        opened = await open_while_client_waits(backend, client_leaves_after_a_while, "POST", b"/", [], b"{}")
        assert opened is None
        await asyncio.wait_for(closed.wait(), 2)
        await backend.aclose()


def test_connection_named_headers_dropped_and_forwarded_for_appended() -> None:
    raw = [
        (b"connection", b"close, X-Hop"),
        (b"x-hop", b"1"),
        (b"x-forwarded-for", b"203.0.113.7"),
        (b"x-kept", b"1"),
        (b"host", b"kvgate"),
        (b"keep-alive", b"5"),
    ]
    out = forward_headers(raw, "rid", ("10.0.0.2", 5555))
    assert out == [
        (b"x-kept", b"1"),
        (b"x-forwarded-for", b"203.0.113.7, 10.0.0.2"),
        (b"forwarded", b'for=10.0.0.2;proto=http;host="kvgate"'),
        (b"x-forwarded-host", b"kvgate"),
        (b"x-forwarded-proto", b"http"),
        (b"x-request-id", b"rid"),
    ]
    assert (b"x-forwarded-for", b"203.0.113.7") in forward_headers(raw, "rid", None)


def test_an_ipv6_peer_is_a_quoted_forwarded_node_and_a_quoted_host_is_left_out() -> None:
    out = dict(forward_headers([(b"host", b'a"b')], "rid", ("::1", 5555), "https"))
    assert out[b"forwarded"] == b'for="[::1]";proto=https'
    assert out[b"x-forwarded-proto"] == b"https"


class _Answer:
    """What response_headers reads of an upstream response."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.raw_headers = status, headers

    def header(self, name: bytes) -> str | None:
        return next((v.decode() for k, v in self.raw_headers if k.lower() == name), None)


@pytest.mark.parametrize("status", [502, 503])
def test_a_relayed_backend_502_or_503_gets_retry_after(status: int) -> None:
    """Every 502 and 503 a client sees carries Retry-After, the backend's own ones too (issue 28)."""
    added = dict(response_headers(_Answer(status, []), {}))  # type: ignore[arg-type]
    assert added[b"retry-after"] == b"5"
    kept = response_headers(_Answer(status, [(b"Retry-After", b"30")]), {})  # type: ignore[arg-type]
    assert [v for k, v in kept if k.lower() == b"retry-after"] == [b"30"]
    assert b"retry-after" not in dict(response_headers(_Answer(500, []), {}))  # type: ignore[arg-type]


async def test_the_backend_loads_the_ca_bundle_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One TLS context for all of the backend's httpx pools: each made its own, loading the CA
    bundle 17 times (3-4 s of kvgate's start-up on the loaded 2-core machine, ~14 MiB)."""
    loads = []
    load = ssl.SSLContext.load_verify_locations

    def counted(context: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args or kwargs)
        load(context, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    backend = Backend("http://127.0.0.1:9", timeout_s=1.0)
    assert len(loads) == 1
    await backend.aclose()
