"""The FastAPI app: routes and lifespan wiring, nothing else.

Gated routes read the raw body (kvgate forwards it byte for byte), evaluate it, wait for the gate
and hand the response to a Relay that releases the ticket. Every other path is passed through.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.explain import explain
from app.gate.gate import ClientGone
from app.openai import ApiError, Endpoint, bad_request
from app.proxy import Relay, forward_headers, passthrough
from app.runtime import Runtime
from app.settings import Settings

decision_log = logging.getLogger("kvgate.decision")


def request_id_of(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def tenant_of(request: Request, header: str) -> str:
    """The tenant header if set, else a digest of the API key (never the key itself)."""
    tenant = request.headers.get(header)
    if tenant:
        return tenant
    auth = request.headers.get("authorization", "")
    return hashlib.sha256(auth.encode()).hexdigest()[:12] if auth else "anonymous"


def priority_of(request: Request, body_priority: int) -> int:
    header = request.headers.get("x-kvgate-priority")
    if header is None:
        return body_priority
    try:
        return int(header)
    except ValueError:
        raise bad_request("x-kvgate-priority must be an integer.", "x-kvgate-priority") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed the limit."""
    declared = request.headers.get("content-length")
    too_large = ApiError(
        413, f"The request body exceeds kvgate's limit of {limit:,} bytes.", "request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def disconnect_future(request: Request) -> asyncio.Future:
    """Resolves when the client goes away while its request waits."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return asyncio.ensure_future(watch())


def log_decision(request_id: str, decision: str, reason: str, **fields: object) -> None:
    decision_log.info(json.dumps({"request_id": request_id, "decision": decision, "reason": reason, **fields}))


def create_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    rt = runtime or Runtime(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        yield
        await rt.stop()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = rt

    async def gated(endpoint: Endpoint, request: Request) -> Response:
        started = time.perf_counter()
        request_id = request_id_of(request)
        rid_header = {"x-request-id": request_id}
        try:
            raw = await read_body(request, settings.max_body_bytes)
            evaluation = await rt.evaluate(endpoint, raw)
            demand = evaluation.prediction.demand
            rt.metrics.predicted_transient.observe(evaluation.prediction.transient_peak_bytes)
            rt.metrics.predicted_kv_blocks.observe(demand.kv_blocks)
            priority = priority_of(request, evaluation.spec.priority)
            ticket = await rt.gate.acquire(
                demand, priority, tenant_of(request, settings.tenant_header),
                lambda: disconnect_future(request),
            )
        except ClientGone:
            log_decision(request_id, "abandon", "client_disconnected")
            return Response(status_code=499)
        except ApiError as error:
            if error.status != 429:  # the gate counts its own refusals
                rt.metrics.decisions.labels("reject", error.code).inc()
            log_decision(request_id, "reject", error.code, status=error.status, message=error.message)
            return error.response(rid_header)
        rt.metrics.added_latency.observe(time.perf_counter() - started - ticket.queue_wait_s)
        log_decision(
            request_id, "admit", "fits", prompt_tokens=demand.prompt_tokens,
            max_new_tokens=demand.max_new_tokens, kv_blocks=demand.kv_blocks,
            transient_bytes=demand.transient_bytes, queue_wait_s=round(ticket.queue_wait_s, 4),
        )
        try:
            upstream = await rt.backend.open(
                "POST", request.url.path, request.url.query.encode(),
                forward_headers(request.headers, request_id), raw,
            )
        except ApiError as error:
            ticket.release("upstream_error")
            rt.metrics.upstream_errors.labels(error.code).inc()
            return error.response(rid_header)
        headers = {
            **rid_header,
            "x-kvgate-kv-blocks": str(demand.kv_blocks),
            "x-kvgate-transient-bytes": str(demand.transient_bytes),
            "x-kvgate-queue-wait": f"{ticket.queue_wait_s:.4f}",
        }
        on_first = ticket.end_prefill if evaluation.spec.stream else (lambda: None)
        return Relay(upstream, headers, on_first, ticket.release)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gated("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gated("chat", request)

    @app.post("/kvgate/explain")
    async def explain_route(request: Request) -> Response:
        try:
            raw = await read_body(request, settings.max_body_bytes)
            return JSONResponse(await explain(rt, raw, request.query_params.get("endpoint")))
        except ApiError as error:
            return error.response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        try:
            reachable = (await rt.backend.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            reachable = False
        detail = {
            "backend_reachable": reachable,
            "tokenizer": rt.tokenizer.source if rt.tokenizer else None,
            "budget_known": rt.budget.known,
            "kv_blocks": rt.budget.kv_limit(),
            "transient_bytes": rt.budget.transient_limit(),
            "transient_gated": rt.budget.transient_headroom_bytes is not None,
            "problem": rt.startup_error,
            "telemetry": rt.live.detail() if rt.live else None,
        }
        ok = reachable and rt.ready
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def other(path: str, request: Request) -> Response:
        request_id = request_id_of(request)
        try:
            body = await read_body(request, settings.max_body_bytes)
            return await passthrough(
                rt.backend, request.method, request.url.path, request.url.query.encode(),
                request.headers, body, request_id,
            )
        except ApiError as error:
            return error.response({"x-request-id": request_id})

    return app
