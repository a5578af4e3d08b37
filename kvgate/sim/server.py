"""The simulated vLLM's HTTP face: vLLM's OpenAI endpoints and /metrics, plus /sim/* views.

`create_sim_app(config)` starts the engine (raising `StartupError` where vLLM would refuse or
die starting) and returns the ASGI app; the engine loop runs in the app's lifespan.
While the engine is dead (after an OOM, until the restart time has passed) every endpoint
except /sim/* answers 503, standing in for the refused connections of a restarting pod.

A client that hangs up ends its request in the engine, as in vLLM: a streamed answer when the
stream's response stops (Starlette cancels it), a non-streamed one the moment the disconnect
arrives (`with_cancellation`, see `until_disconnect`), so abandoned work gives its KV blocks and
its share of every step back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.sim.api import Parsed, ResponseBuilder, SimApiError, error_body, parse
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import ENGINE_DEAD_MESSAGE, PROCESS, Engine
from kvgate.sim.gpu import Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.request import Request
from kvgate.sim.tokens import TextModel, load_tokenizer
from kvgate.sim.vision import IMAGE_PAD

_UNAVAILABLE = "The simulated vLLM engine is down (restarting after a fatal error)."


def create_sim_app(config: SimConfig) -> FastAPI:
    """Build the simulator: device, engine (started now), tokenizer, routes."""
    model = load_model(config.model, config.dtype)
    name = config.served_model_name or config.model
    tok = load_tokenizer(config.model, model.vocab, {IMAGE_PAD: model.vision.image_token_id} if model.vision else None)
    device = Device(gpu_total_bytes(config.gpu))
    engine = Engine(config, model, device, TextModel(tok, config.seed), name)
    engine.apply_cotenants()
    engine.boot()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = FastAPI(title="kvgate sim (simulated vLLM)", lifespan=lifespan)
    app.state.engine = engine
    app.state.tokenizer = tok

    def down() -> JSONResponse:
        return JSONResponse(error_body(503, _UNAVAILABLE), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200) if engine.ready else down()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": config.vllm_version}

    @app.get("/v1/models")
    async def models() -> Any:
        if not engine.ready:
            return down()
        card = {
            "id": name,
            "object": "model",
            "created": int(engine.boot_wall_time),
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": engine.resolved.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine.ready:
            return down()
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest) -> Any:
        if not engine.ready:
            return down()
        body = await http.json()
        if "messages" in body:
            text = tok.chat_prompt(body["messages"], bool(body.get("add_generation_prompt", True)))
            ids = tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        else:
            ids = tok.encode(str(body.get("prompt", "")), add_special_tokens=bool(body.get("add_special_tokens", True)))
        strs = tok.token_strs(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": engine.resolved.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest) -> Any:
        if not engine.ready:
            return down()
        body = await http.json()
        return {"prompt": tok.decode(list(body.get("tokens") or []))}

    async def generate(http: HttpRequest, chat: bool) -> Response:
        if not engine.ready:
            return down()
        try:
            body = await http.json()
            p = parse(
                body,
                chat=chat,
                tok=tok,
                served=name,
                max_model_len=engine.resolved.max_model_len,
                max_logprobs=config.max_logprobs,
                clamps_max_tokens=engine.resolved.flavor.clamps_max_tokens,
                vision=model.vision,
            )
        except SimApiError as exc:
            return exc.response()
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            return SimApiError(400, f"Invalid request body: {exc}").response()
        if refusal := engine.queue_refusal(p.n):
            return JSONResponse(busy_body(refusal), status_code=503)
        run = RequestRun(engine, p)
        if p.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream")
        return await cancelled_on_disconnect(http, run.complete())

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await generate(http, chat=True)

    @app.get("/server_info")
    async def server_info() -> Any:
        """vLLM's dev-mode view of its config (VLLM_SERVER_DEV_MODE=1), the engine limits part."""
        resolved = getattr(engine, "resolved", None)
        if resolved is None:
            return down()
        return {
            "vllm_config": {
                "scheduler_config": {
                    "max_num_batched_tokens": resolved.max_num_batched_tokens,
                    "max_num_seqs": resolved.max_num_seqs,
                    "long_prefill_token_threshold": config.long_prefill_token_threshold,
                },
                "parallel_config": {"tensor_parallel_size": config.tensor_parallel_size, "pipeline_parallel_size": 1},
            }
        }

    @app.get("/sim/gpu")
    async def sim_gpu() -> dict[str, Any]:
        return gpu_view(engine)

    @app.post("/sim/cotenant")
    async def sim_cotenant(http: HttpRequest) -> Any:
        body = await http.json()
        engine.cotenant_override[str(body["name"])] = int(body["bytes"])
        engine.apply_cotenants()
        return gpu_view(engine)

    @app.get("/sim/state")
    async def sim_state() -> dict[str, Any]:
        rep = getattr(engine, "report", None)
        return {
            "state": engine.state,
            "error": engine.error,
            "restarts": engine.restarts,
            "ooms": engine.ooms,
            "oom_details": engine.oom_details,
            "closest_call_bytes": engine.closest_call(),
            "log": engine.log_lines[-50:],
            "startup": None if rep is None else {k: v for k, v in vars(rep).items() if k != "log"},
        }

    return app


def gpu_view(engine: Engine) -> dict[str, Any]:
    """NVML's view of the simulated GPU (nvmlDeviceGetMemoryInfo + running processes)."""
    dev = engine.device
    procs = [
        {"pid": os.getpid() if n == PROCESS else 100000 + i, "name": n, "used_gpu_memory": b}
        for i, (n, b) in enumerate(sorted(dev.processes.items()))
    ]
    alloc = getattr(engine, "alloc", None)
    torch = (
        None
        if alloc is None or not engine.ready
        else {"allocated": alloc.allocated(), "reserved": alloc.reserved(), "non_torch": alloc.non_torch}
    )
    return {
        "index": dev.index,
        "uuid": f"GPU-5151{dev.index:04d}-0000-0000-0000-000000000000",
        "name": engine.cfg.gpu,
        "total": dev.total,
        "free": dev.free(),
        "used": dev.used(),
        "processes": procs,
        "torch": torch,
        "engine_state": engine.state,
    }


async def until_disconnect(http: HttpRequest) -> None:
    """Return once the client has hung up: vLLM's `listen_for_disconnect`. The body has been
    read, so every message left for this request is the disconnect."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def cancelled_on_disconnect(http: HttpRequest, answer: Coroutine[Any, Any, Response]) -> Response:
    """Run a non-streamed answer until it is ready or the client hangs up, whichever is first;
    a hang-up cancels it (RequestRun.complete then aborts its sequences in the engine).

    vLLM's `with_cancellation` wraps /v1/completions and /v1/chat/completions the same way (read
    in 0.10.1.1: vllm/entrypoints/utils.py, routes in vllm/entrypoints/openai/api_server.py;
    in 0.31.0, 0.32.0 and 0.33.0: vllm/entrypoints/serve/utils/api_utils.py, routes in
    vllm/entrypoints/openai/{completion,chat_completion}/api_router.py): the handler task races
    a task awaiting `http.disconnect`, and AsyncLLM.generate aborts the engine request when its
    task is cancelled (vllm/v1/engine/async_llm.py). A streamed answer returns its
    StreamingResponse at once, so only non-streamed requests are cut by it.
    """
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(until_disconnect(http))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    with contextlib.suppress(asyncio.CancelledError):
        await work  # its abort has run before the response (to nobody) is sent
    return Response()  # vLLM 0.33's answer to a client that is gone (0.32 returns None)


def busy_body(message: str) -> dict[str, Any]:
    """vLLM's body for its queue limits' refusals (GracefulHTTPError: vllm 0.32.0
    entrypoints/serve/exception_handling/error_response.py `create_error_response`)."""
    return {"error": {"message": message, "type": "Service Unavailable", "param": None, "code": 503}}


def engine_requests(p: Parsed, rid: str) -> list[list[Request]]:
    """Per prompt, its n engine requests (choice `prompt_i * n + j`, id `rid-<choice>`), each
    sequence seeded by the request's seed, else its prompt (where a sequence ends depends on it)."""
    out = []
    for i, prompt in enumerate(p.prompts):
        seed = prompt.sampling.seed if prompt.sampling.seed is not None else hash(tuple(prompt.token_ids))
        out.append(
            [
                Request(
                    f"{rid}-{i * p.n + j}",
                    list(prompt.token_ids),
                    prompt.sampling,
                    0.0,  # Engine.add stamps its arrival
                    stream_seed=hash((seed, j)),
                    cache_salt=p.cache_salt,
                    mm_items=prompt.mm_items,
                )
                for j in range(p.n)
            ]
        )
    return out


class RequestRun:
    """One client request: its engine requests (n per prompt), gathered or streamed.

    As vLLM 0.32.0 serves a list of prompts (entrypoints/openai/completion/serving.py
    `_create_completion`): one engine request per prompt (n > 1 fans out in the engine), each
    admitted on its own (v1/engine/async_llm.py `add_request` -> `check_admission`, after the
    request's `_preflight`), scheduled, prefilled and timed (`time_to_first_token_seconds`) on
    its own; their outputs merged as they come (`merge_async_iterators`), a stream's chunk naming
    its choice `prompt_i * n + j`; a non-streamed answer's choices in that order, usage summed.
    A prompt the queue limits refuse after others were added ends the request: those are aborted
    and the client gets the refusal (a stream: as an error event before `[DONE]`).
    """

    def __init__(self, engine: Engine, p: Parsed) -> None:
        self.engine, self.p = engine, p
        self.out = ResponseBuilder(p)
        self.queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        self.reqs: list[Request] = []
        self.refused: str | None = None
        for prompt_reqs in engine_requests(p, self.out.id):
            self.refused = engine.queue_refusal(p.n)
            if self.refused:
                self.abort()
                break
            for req in prompt_reqs:
                req.sink = functools.partial(self._put, len(self.reqs))
                self.reqs.append(req)
                engine.add(req)

    def _put(self, i: int, kind: str, data: Any) -> None:
        """A sequence's event, handed to whoever gathers or streams the answer."""
        self.queue.put_nowait((i, kind, data))

    def abort(self) -> None:
        if self.engine.ready:
            for req in self.reqs:
                self.engine.abort(req)

    def _text(self, i: int) -> str:
        tok = self.engine.sampler.tok  # type: ignore[attr-defined]
        return tok.decode(self.reqs[i].output_token_ids)

    async def complete(self) -> Response:
        """The whole answer once every sequence finished; cancelled, it aborts them."""
        if self.refused:
            return JSONResponse(busy_body(self.refused), status_code=503)
        reasons: list[str | None] = [None] * len(self.reqs)
        try:
            while None in reasons:
                i, kind, data = await self.queue.get()
                if kind == "error":
                    return JSONResponse(error_body(500, data), status_code=500)
                if kind == "finish":
                    reasons[i] = data
        except asyncio.CancelledError:
            self.abort()
            raise
        texts = [self._text(i) for i in range(len(self.reqs))]
        gen = sum(len(r.output_token_ids) for r in self.reqs)
        return JSONResponse(self.out.full(texts, [r or "" for r in reasons], gen))

    async def sse(self) -> AsyncIterator[str]:
        done = 0
        sent = [0] * len(self.reqs)
        # vLLM sends a chat stream's role chunk with the engine's first output, after the prefill
        # (entrypoints/openai/chat_completion/serving.py `chat_completion_stream_generator`:
        # `first_iteration` inside `async for res in result_generator`, 0.32.0), not on arrival.
        started = [not self.p.chat] * len(self.reqs)
        try:
            if self.refused:
                yield _sse(busy_body(self.refused))
            while done < len(self.reqs) and not self.refused:
                i, kind, data = await self.queue.get()
                if kind in ("token", "finish") and not started[i]:
                    started[i] = True
                    yield _sse(self.out.chunk(i, None, None, first=True))
                if kind == "error":
                    yield _sse(error_body(500, data or ENGINE_DEAD_MESSAGE))
                    break
                if kind == "token":
                    text = self._text(i)
                    yield _sse(self.out.chunk(i, text[sent[i] :], None))
                    sent[i] = len(text)
                elif kind == "finish":
                    done += 1
                    yield _sse(self.out.chunk(i, None if self.p.chat else "", data))
            else:
                if self.p.include_usage and not self.refused:
                    gen = sum(len(r.output_token_ids) for r in self.reqs)
                    yield _sse(self.out.usage_chunk(gen))
            yield "data: [DONE]\n\n"
        finally:
            if done < len(self.reqs):
                self.abort()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
