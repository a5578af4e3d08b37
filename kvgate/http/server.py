"""kvgate's ASGI app: the gated routes on a bare fast path, everything else through FastAPI.

POST /v1/completions and /v1/chat/completions go straight to kvgate.http.gated_routes (no routing, no
middleware); every other request, and the lifespan, goes to the FastAPI app built here: explain,
metrics, probes, and the pass-through of any other path to the backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from kvgate.advise import advice_document
from kvgate.advise_live import advise_from, request_json
from kvgate.composition import Runtime
from kvgate.errors import KvgateError, MethodNotAllowed
from kvgate.explain import explain
from kvgate.http.asgi import answer_refusal, read_body, request_target
from kvgate.http.decision_log import DecisionLog
from kvgate.http.errors import error_response
from kvgate.http.gated_routes import GATED_PATHS, GatedRoutes, request_id_of
from kvgate.http.proxy import check_passthrough, passthrough, passthrough_allowed
from kvgate.metrics import MetricsPage
from kvgate.settings import Settings

# vLLM's routes that load and unload LoRA adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING;
# vLLM 0.32.0 vllm/entrypoints/serve/lora/api_router.py, and SageMaker's POST /adapters beside
# them): forwarded when --passthrough-paths names them, and followed (/v1/models re-read) on a 200.
LORA_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters"})


class Kvgate:
    """The front ASGI app: one dictionary lookup decides between the fast path and FastAPI.

    GET /metrics is on the fast path too (with --metrics-page kvgate): a router scrapes it every
    50 ms, and FastAPI's routing cost more than the page itself (bench/results/poll-cost)."""

    def __init__(self, gated: GatedRoutes, rest: FastAPI, page: MetricsPage | None) -> None:
        self.gated = gated
        self.rest = rest
        self.runtime = gated.rt
        self.page = page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            endpoint = GATED_PATHS.get(path)
            if endpoint is not None and scope["method"] == "POST":
                await self.gated(endpoint, scope, receive, send)
                return
            if endpoint is not None:  # OpenAI's error shape, not the backend's {"detail": ...}
                error = MethodNotAllowed(scope["method"], path)
                await error_response(error)(scope, receive, send)
                return
            if path == "/metrics" and self.page is not None and scope["method"] == "GET":
                await Response(self.page.render(), media_type=CONTENT_TYPE_LATEST)(scope, receive, send)
                return
        await self.rest(scope, receive, send)


def create_app(settings: Settings) -> Kvgate:
    rt = Runtime(settings, observers=(DecisionLog(),))  # the decision log: the edge's own observer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        yield
        await rt.stop()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = rt

    @app.post("/kvgate/explain")
    async def explain_route(request: Request) -> Response:
        try:
            raw = await read_body(
                request.scope,
                request.receive,
                settings.max_body_bytes,
                settings.client_body_timeout,
                settings.client_body_deadline,
            )
            return JSONResponse(await explain(rt, raw, request.query_params.get("endpoint")))
        except KvgateError as error:
            return answer_refusal(request.scope, error_response(error))

    # GET /metrics: kvgate's page on the fast path (Kvgate), vLLM's with --metrics-page vllm.
    page = rt.metrics_page if settings.metrics_page == "kvgate" else None

    if page is None:

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            """vLLM's own page, unmodified (--metrics-page vllm)."""
            try:
                return await passthrough(
                    rt.backend,
                    "GET",
                    request_target(request.scope),
                    request.headers.raw,
                    b"",
                    request_id_of(request.scope),
                    request.scope.get("client"),
                    request.scope.get("scheme", "http"),
                )
            except KvgateError as error:
                return answer_refusal(request.scope, error_response(error))

    @app.get("/kvgate/metrics")
    async def kvgate_metrics() -> Response:
        """kvgate's own families alone, rendered now: beside vLLM's page in --metrics-page vllm."""
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/advice")
    async def advice() -> Response:
        """vLLM flags from the traffic kvgate measured (docs/advise.md): predicted off the event
        loop (a few dozen start-up predictions), from a snapshot taken on it."""
        try:
            request, measured, problem = rt.advice_input()
        except KvgateError as error:
            return error_response(error)
        if problem is not None:  # `kvgate advise --from URL --gpu G` can still advise
            deployment = {**request_json(request), "gpu": None}
            return JSONResponse(
                {"deployment": deployment, "measured": measured.to_json(), "advice": None, "problem": problem}
            )
        try:
            advised = await asyncio.to_thread(advise_from, request, measured)
        except (ValueError, KeyError, OSError) as exc:  # the model folder or flags advise cannot read
            return JSONResponse(
                {
                    "deployment": request_json(request),
                    "measured": measured.to_json(),
                    "advice": None,
                    "problem": str(exc),
                }
            )
        return JSONResponse({**advice_document(advised), "problem": None})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        # The budget's own view of the backend, not a probe of /health of its own: /readyz says
        # 503 exactly while the gate holds new arrivals in the queue.
        backend = rt.budget.backend
        detail = {
            "backend_reachable": backend.up,
            "backend": backend.detail(),
            "tokenizer": rt.pipeline.config.tokenizer.source if rt.pipeline.config else None,
            "budget_known": rt.budget.known,
            # The pool's usable blocks (null block excluded) and what kvgate may reserve of it now
            # (pool x calibrated overcommit, at most 1 in conservative mode).
            "kv_pool_blocks": rt.budget.kv_blocks,
            "kv_blocks": rt.budget.kv_limit(),
            "transient_bytes": rt.budget.transient_limit(),
            "transient_gated": rt.budget.transient_headroom_bytes is not None,
            "transient_gate_off": rt.transient_gate_off(),
            "problem": rt.startup_error,
            "vllm": rt.deployment.runtime.labels() if rt.deployment else None,
            "telemetry": rt.live.detail() if rt.live else None,
        }
        ok = backend.up and rt.ready
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    # The gated paths' other methods too: vLLM answers them 405, as a client expects.
    forwarded_paths = passthrough_allowed(settings.passthrough_paths) | GATED_PATHS.keys()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def other(path: str, request: Request) -> Response:
        request_id = request_id_of(request.scope)
        try:
            check_passthrough(request.scope["path"], forwarded_paths)
            body = await read_body(
                request.scope,
                request.receive,
                settings.max_body_bytes,
                settings.client_body_timeout,
                settings.client_body_deadline,
                reads_body=False,
            )
            await rt.pipeline.check_passthrough(
                request.method, request.scope["path"], request.headers.get("content-type"), body
            )
            relay = await passthrough(
                rt.backend,
                request.method,
                request_target(request.scope),
                request.headers.raw,
                body,
                request_id,
                request.scope.get("client"),
                request.scope.get("scheme", "http"),
            )
            if request.scope["path"] in LORA_ADMIN_PATHS and relay.status_code == 200:
                await rt.adapters_changed()  # before the client hears 200: its next request may name it
            return relay
        except KvgateError as error:
            return answer_refusal(request.scope, error_response(error, {"x-request-id": request_id}))

    return Kvgate(GatedRoutes(rt), app, page)
