"""The vLLM server behind kvgate: pooled keep-alive connections (kvgate.upstream) for proxied
requests, and httpx clients for the control plane and the /tokenize fallback.

Apart from the relaying (kvgate/http/proxy.py) because the composition root owns one Backend and
sits below the HTTP layer; opening an exchange turns each connection failure into a domain error.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import Callable
from contextvars import ContextVar

import httpx

from kvgate.errors import BackendBroke, BackendBusy, BackendDown, BackendTimedOut, InvalidField, TokenizeWaitTimeout
from kvgate.gate.drain import RETRY_AFTER_CAP_S
from kvgate.upstream import (
    IDLE_REUSE_S,
    ConnectionPool,
    InvalidRequestHeader,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
)

# Concurrent /tokenize calls when kvgate tokenizes through the backend (no tokenizer files in the
# model folder; --tokenize-connections). vLLM 0.32.0 answers /tokenize in its API server process,
# never in the engine (vllm/entrypoints/serve/tokenize/serving.py ServingTokenization
# .create_tokenize: the renderer's preprocess_completion/preprocess_chat, which tokenize in the
# renderer's thread pool, --renderer-num-workers threads, 1 by default: vllm/renderers/base.py),
# and its uvicorn sets no concurrency limit and a 2,048-connection accept backlog. So the calls in
# flight cost the engine nothing and vLLM takes hundreds at once; what bounds their rate is its
# event loop and renderer thread, which a few connections cannot keep busy when each round trip
# waits behind hundreds of streams in that loop. S4 on the simulator (1,521 chats in 5 s): with
# 32 connections a queued request had spent a median 27.4 s of its 30 s waiting for one; with 256
# (and the keep-alive retry) no request timed out (bench/results/goodput-session27/s4s13).
DEFAULT_TOKENIZE_CONNECTIONS = 256
# One try at a /tokenize connection; one that times out (the backend's accept queue full under a
# burst) is tried again while the request's deadline lasts.
TOKENIZE_CONNECT_TIMEOUT_S = 5.0
# Weight of the newest call in the mean /tokenize call time that a refusal's Retry-After uses.
_CALL_TIME_WEIGHT = 0.1
# Connections of one httpx pool under TokenizeCalls. httpcore matches the pool's waiting requests
# against every one of its connections whenever a request comes or goes (httpcore 1.0
# `AsyncConnectionPool._assign_requests_to_connections`), so one pool of 256 connections cost
# each call hundreds of steps: 18 % of kvgate's CPU under S4's burst, where kvgate's one core was
# saturated. Pools of 16 cost each call 16.
POOL_CONNECTIONS = 16

# When the request whose work calls the backend must have been admitted (time.monotonic, the
# gate's clock): its /tokenize calls wait for a connection until then.
_deadline: ContextVar[float | None] = ContextVar("kvgate_backend_call_deadline", default=None)


class calls_until:
    """Backend calls made within (the /tokenize fallback) end at `deadline` (time.monotonic):
    tokenizing is part of the request's wait for admission, so it counts against the same
    --max-queue-wait. None: no bound but the calls' own timeouts. A class rather than a
    generator context manager: it is entered once per gated request (as work_budget.charging)."""

    __slots__ = ("_at", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._at = deadline

    def __enter__(self) -> None:
        self._token = _deadline.set(self._at)

    def __exit__(self, *exc_info: object) -> None:
        _deadline.reset(self._token)


class TokenizeCalls(httpx.AsyncBaseTransport):
    """At most `connections` /tokenize calls at the backend at once. A call that finds them all
    busy waits for its turn until the request's deadline (`calls_until`), then is refused as a
    queue timeout with a Retry-After from the line ahead of it (TokenizeWaitTimeout, 429), never
    left hanging; once sent, its answer has the client's own timeouts. A connection the backend
    did not accept in time is tried again within that deadline: under a burst that is its accept
    queue, not its death (a refused connection still fails at once, and the pipeline marks the
    backend down). The answer is read within the turn, so a turn is a connection: the pool below
    never makes a call wait.
    """

    def __init__(
        self,
        connections: int,
        inner: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        pool: Callable[[int], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        """`inner`: one transport for every call; else `pool(n)` makes each pool of n connections."""
        pool = pool or _pool
        self.connections = connections
        # The connections split into pools of POOL_CONNECTIONS; a call goes to the pool with the
        # fewest calls in it, which has a free connection since a call holds a turn.
        self._pools = [inner] if inner is not None else [pool(size) for size in _pool_sizes(connections)]
        self._calls = [0] * len(self._pools)  # calls in each pool now
        self._turns = asyncio.Semaphore(connections)
        self._clock = clock
        self.waiting = 0  # calls waiting for a turn now
        self.connect_timeouts = 0  # connections not accepted in time, tried again
        self._mean_call_s = 0.0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline = _deadline.get()
        started = self._clock()
        await self._take_turn(deadline, started)
        called = self._clock()
        try:
            return await self._call(request, deadline, started)
        finally:
            self._turns.release()
            self._mean_call_s += _CALL_TIME_WEIGHT * (self._clock() - called - self._mean_call_s)

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def _take_turn(self, deadline: float | None, started: float) -> None:
        """A free turn is taken at once, whatever the deadline (a request past it is still served
        when nothing makes it wait); a busy line is waited in until the deadline."""
        if not self._turns.locked():
            await self._turns.acquire()  # returns without yielding
            return
        self.waiting += 1
        try:
            if deadline is None:
                await self._turns.acquire()
            else:
                await asyncio.wait_for(self._turns.acquire(), max(0.0, deadline - self._clock()))
        except TimeoutError:
            raise self._refusal(started, f"all {self.connections} connections to it busy") from None
        finally:
            self.waiting -= 1

    async def _call(self, request: httpx.Request, deadline: float | None, started: float) -> httpx.Response:
        k = min(range(len(self._calls)), key=self._calls.__getitem__)
        self._calls[k] += 1
        try:
            return await self._call_in(self._pools[k], request, deadline, started)
        finally:
            self._calls[k] -= 1

    async def _call_in(
        self, pool: httpx.AsyncBaseTransport, request: httpx.Request, deadline: float | None, started: float
    ) -> httpx.Response:
        while True:
            try:
                response = await pool.handle_async_request(request)
            except httpx.ConnectTimeout:
                if deadline is None:
                    raise
                if self._clock() >= deadline:
                    raise self._refusal(started, "it accepted no connection in time") from None
                self.connect_timeouts += 1  # nothing was sent: tried again while the deadline lasts
                continue
            try:
                await response.aread()  # within the turn: its connection is back in the pool after
            except BaseException:
                await response.aclose()
                raise
            return response

    def _refusal(self, started: float, why: str) -> TokenizeWaitTimeout:
        """Retry-After: the time the calls waiting now take at the recent pace, at least 1 s."""
        line_s = self._mean_call_s * (self.waiting + 1) / self.connections
        retry_after_s = int(min(RETRY_AFTER_CAP_S, max(1, math.ceil(line_s))))
        return TokenizeWaitTimeout(round(self._clock() - started, 3), why, retry_after_s)


def _pool_sizes(connections: int) -> list[int]:
    """`connections` split into pools of at most POOL_CONNECTIONS, as even as can be."""
    pools = max(1, -(-connections // POOL_CONNECTIONS))
    return [connections // pools + (k < connections % pools) for k in range(pools)]


def _pool(connections: int, verify: ssl.SSLContext | bool = True) -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(
        verify=verify,
        limits=httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=IDLE_REUSE_S
        ),
    )


class Backend:
    """The vLLM server behind kvgate: pooled keep-alive connections for proxied requests
    (kvgate.upstream, a few tens of microseconds a round trip), an httpx client for the control
    plane (scrapes, probes: a few requests a second, off the hot path), and one for the /tokenize
    fallback. The last has its own connections (TokenizeCalls): a burst of arrivals tokenized
    through the backend waits there, each until its deadline, and never starves the scrapes the
    budget depends on.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        max_connections: int = 1024,
        connect_timeout_s: float = 5.0,
        pool_timeout_s: float = 30.0,
        tokenize_connections: int = DEFAULT_TOKENIZE_CONNECTIONS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # One TLS context for every httpx pool: each pool made its own by default, loading the CA
        # bundle each time (17 loads: 3-4 s of start-up and ~14 MiB on the loaded 2-core machine;
        # one: 0.25 s, 2 MiB), for a backend that is plain HTTP more often than not.
        tls = httpx.create_ssl_context()
        # httpx keeps an idle connection 5 s, as long as vLLM's server does (its uvicorn's
        # timeout_keep_alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a call sent as the server's close
        # arrives is lost (httpx ReadError; S4 of the 2026-11-27 benchmark: 27 x 502
        # backend_error on /tokenize). Not reused past IDLE_REUSE_S, as the proxy's own pool.
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(10.0),
            limits=httpx.Limits(keepalive_expiry=IDLE_REUSE_S),
            verify=tls,
        )
        self.tokenize_calls = TokenizeCalls(tokenize_connections, pool=lambda n: _pool(n, tls))
        self.tokenize_client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(30.0, connect=TOKENIZE_CONNECT_TIMEOUT_S),
            transport=self.tokenize_calls,
        )
        self.pool = ConnectionPool(
            self.base_url,
            read_timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
        )

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.tokenize_client.aclose()
        self.pool.close()

    async def open(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request (`target`: raw path and query) and return once the response head is
        in, or the domain error that says why it cannot be: InvalidField for a header that cannot
        be sent, BackendDown when nothing reached the backend because it refused the connection,
        BackendBusy when none could be had in time (backpressure: the caller retries it),
        BackendTimedOut when it was sent and the backend stayed silent, BackendBroke when it broke
        the exchange."""
        try:
            return await self.pool.request(method, target, headers, body)
        except InvalidRequestHeader as exc:
            raise InvalidField(f"A request header cannot be forwarded: {exc}.", code="invalid_header") from None
        except UpstreamUnavailable as exc:
            raise BackendBusy(f"The backend is unavailable: {exc}.") from exc
        except (TimeoutError, UpstreamTimeout) as exc:  # before OSError: TimeoutError is one
            raise BackendTimedOut() from exc
        except OSError as exc:
            raise BackendDown(f"The backend at {self.base_url} is unavailable ({type(exc).__name__}).") from exc
        except UpstreamError as exc:
            raise BackendBroke(str(exc)) from exc
