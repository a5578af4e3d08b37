"""The vLLM server behind kvgate: pooled keep-alive connections (kvgate.upstream) for proxied
requests, and httpx clients for the control plane and the /tokenize fallback.

Apart from the relaying (kvgate/http/proxy.py) because the composition root owns one Backend and
sits below the HTTP layer; opening an exchange turns each connection failure into a domain error.
"""

from __future__ import annotations

import httpx

from kvgate.errors import BackendBroke, BackendDown, BackendTimedOut, InvalidField
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
# model folder): enough to keep vLLM's API server busy, few enough to leave it room for the rest.
TOKENIZE_CONNECTIONS = 32


class Backend:
    """The vLLM server behind kvgate: pooled keep-alive connections for proxied requests
    (kvgate.upstream, a few tens of microseconds a round trip), an httpx client for the control
    plane (scrapes, probes: a few requests a second, off the hot path), and one for the /tokenize
    fallback. The last has its own pool, and its requests wait for a connection as long as they
    must: a burst of arrivals tokenized through the backend queues there instead of failing, and
    never starves the scrapes the budget depends on.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        max_connections: int = 1024,
        connect_timeout_s: float = 5.0,
        pool_timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # httpx keeps an idle connection 5 s, as long as vLLM's server does (its uvicorn's
        # timeout_keep_alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a call sent as the server's close
        # arrives is lost (httpx ReadError; S4 of the 2026-11-27 benchmark: 27 x 502
        # backend_error on /tokenize). Not reused past IDLE_REUSE_S, as the proxy's own pool.
        self.client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(10.0), limits=httpx.Limits(keepalive_expiry=IDLE_REUSE_S)
        )
        self.tokenize_client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(30.0, pool=None),
            limits=httpx.Limits(max_connections=TOKENIZE_CONNECTIONS, keepalive_expiry=IDLE_REUSE_S),
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
        be sent, BackendDown when nothing reached the backend (refused, no connection in time),
        BackendTimedOut when it was sent and the backend stayed silent, BackendBroke when it broke
        the exchange."""
        try:
            return await self.pool.request(method, target, headers, body)
        except InvalidRequestHeader as exc:
            raise InvalidField(f"A request header cannot be forwarded: {exc}.", code="invalid_header") from None
        except UpstreamUnavailable as exc:
            raise BackendDown(f"The backend is unavailable: {exc}.") from exc
        except (TimeoutError, UpstreamTimeout) as exc:  # before OSError: TimeoutError is one
            raise BackendTimedOut() from exc
        except OSError as exc:
            raise BackendDown(f"The backend at {self.base_url} is unavailable ({type(exc).__name__}).") from exc
        except UpstreamError as exc:
            raise BackendBroke(str(exc)) from exc
