"""Arm (e): an admission oracle that knows the simulator's exact memory.

It runs *inside* the simulator process, on the simulator's own event loop, as extra routes
`/oracle/v1/completions` and `/oracle/v1/chat/completions` added to the simulator's FastAPI app
before it starts. For each request, first come first served, it parses the body with the
simulator's own parser (exact token ids, sampling, n) and asks: if this request joined the
engine now, would any step until it has produced its first tokens hit CUDA OOM? It answers by a
dry run: a deep copy of the live engine state, advanced past the step in flight (scheduler queues, PyTorch caching allocator with its real fragmentation, the device with its co-tenants at their size
`LOOKAHEAD_S` simulated seconds ahead), the candidate added, then the engine's own step code
(scheduler.schedule, Engine.shape, StepMemory.plan, run_tape on the copied allocator, the same
deterministic sampler) for up to `MAX_STEPS` steps, until the candidate has sampled `DECODE_STEPS` tokens. Steps
that carry no candidate are scheduled but not played on the allocator (they run whether or
not it is admitted), and sequences in the dry run do not stop early (a conservative
simplification: the sampler's stop point is not consulted). No OOM: it forwards the request to the simulator's own
handler in the same loop turn (nothing runs in between, so the check and the admission are
atomic). OOM: if it would OOM an idle engine too (a second dry run without the other requests) it is
refused 400 `oracle_never_fits`; else it waits and the check is repeated when a request leaves
the engine (or every `RECHECK_S`); one that waited
`max_wait_s` wall seconds gets 429 `oracle_queue_timeout`.

The copy leaves out the KV block pool (copying it per check is too slow): in the dry run
every KV allocation succeeds, so it batches at least as much as the real scheduler (the safe
side). It does not plan KV capacity (a full pool means preemption, not OOM: the scheduler copes) and it
cannot see steps beyond its horizon, so it is a ceiling for memory knowledge, not for
scheduling.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from app.sim.api import SimApiError, parse
from app.sim.engine import Engine
from app.sim.gpu import CudaOutOfMemory
from app.sim.request import Request, Status
from app.sim.step_memory import run_tape

MAX_STEPS = 400
DECODE_STEPS = 2  # the candidate's prefill, first decode step
LOOKAHEAD_S = 30.0
RECHECK_S = 0.25


class _Null:
    """Stands in for the copied engine's metrics and callbacks."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self

    def __getitem__(self, k: Any) -> Any:
        return self


class _UnboundedKV:
    """The dry run's KV manager: every allocation succeeds, no prefix hits. Copying the real
    block pool (tens of thousands of blocks) per check is too slow; without it the dry run
    batches at least as many tokens per step as the real scheduler would (conservative)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def allocate_slots(self, *a: Any, **k: Any) -> bool:
        return True

    def get_computed_blocks(self, *a: Any, **k: Any) -> list:
        return []

    def free(self, req_id: str) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


def would_oom(engine: Engine, candidates: list[Request], in_flight: Any = None,
              idle: bool = False) -> str | None:
    """Dry-run the engine with `candidates` added; the OOM message, or None if it survives.

    `in_flight`: the scheduler output of the step the engine is running now (its tape has run,
    its tokens are not yet counted): the copy counts them first, so the dry run starts at the
    engine's next step. `idle`: dry-run the candidates on an engine with no other request.
    """
    memo: dict[int, Any] = {}
    null = _Null()
    reqs = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    memo[id(engine.scheduler.kv)] = _UnboundedKV(engine.scheduler.kv.block_size)
    for r in reqs:
        memo[id(r.sink)] = null
        memo[id(r.prompt_token_ids)] = r.prompt_token_ids  # never mutated: share, don't copy
    sched, alloc, carry = copy.deepcopy((engine.scheduler, engine.alloc, engine.carry), memo)
    sched.__dict__.pop("schedule", None)  # the live scheduler's tracking wrapper: not for the copy
    if in_flight is not None:
        for sr in in_flight.scheduled:
            req = memo.get(id(sr.request))
            if req is None or req.status != Status.RUNNING:
                continue
            req.num_computed_tokens += sr.num_new_tokens
            if req.num_computed_tokens >= req.num_tokens:
                req.output_token_ids.append(0)
                if len(req.output_token_ids) >= req.sampling.max_tokens:
                    _finish(sched, req)
    if idle:
        sched.running.clear()
        sched.waiting.clear()
    device = alloc.device
    t_ahead = engine.sim_time() + LOOKAHEAD_S
    for c in engine.cfg.cotenants:
        if c.start_s <= t_ahead and (c.end_s is None or c.end_s > engine.sim_time()):
            held = device.processes.get(c.name, 0)
            if c.bytes > held and c.bytes - held <= device.free():
                device.set_usage(c.name, c.bytes)
    watch = [r for r in sched.running] + list(sched.waiting)
    for c in candidates:
        c2 = copy.copy(c)
        c2.output_token_ids = []
        c2.sink = null
        sched.add(c2)
        watch.append(c2)
    mine = {id(c) for c in watch[len(watch) - len(candidates):]}
    for _ in range(MAX_STEPS):
        if all(r.status == Status.FINISHED or len(r.output_token_ids) >= DECODE_STEPS
               for r in watch if id(r) in mine):
            return None
        out = sched.schedule()
        if not out.scheduled:
            return None
        # Only steps that carry a candidate are played on the allocator copy (the others would
        # run whether or not it is admitted; playing every step is too slow for a live gate).
        if any(id(s.request) in mine for s in out.scheduled):
            try:
                carry.start_step([s.request for s in out.scheduled])
                carry.keep_outputs(run_tape(alloc, engine.steps.plan(Engine.shape(out))))
            except CudaOutOfMemory as exc:
                return str(exc)
        for s in out.scheduled:
            req = s.request
            if req.status != Status.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.output_token_ids.append(0)
            sp = req.sampling
            if (len(req.output_token_ids) >= sp.max_tokens
                    or req.num_tokens >= engine.resolved.max_model_len):
                _finish(sched, req)
    return None


def _finish(sched: Any, req: Request) -> None:
    if any(r is req for r in sched.running):
        sched.finish(req)
    req.status = Status.FINISHED


def _membership(engine: Engine) -> tuple[str, ...]:
    return tuple(r.request_id for r in engine.scheduler.running) + (
        str(len(engine.scheduler.waiting)),)


def install(app: FastAPI, max_wait_s: float) -> dict[str, int]:
    """Add the oracle routes to a simulator app (before it starts); returns its counters."""
    engine: Engine = app.state.engine
    endpoints = {r.path: r.endpoint for r in app.routes if hasattr(r, "endpoint")}
    lock = asyncio.Lock()
    stats = {"checks": 0, "held": 0, "never_fits": 0, "timeouts": 0}
    flight: dict[str, Any] = {"out": None}
    schedule, update = engine.scheduler.schedule, engine._update

    def track_schedule() -> Any:  # the step in flight: scheduled, tokens not yet counted
        flight["out"] = schedule()
        return flight["out"]

    def track_update(out: Any, start: float) -> None:
        flight["out"] = None
        update(out, start)

    def rebind() -> None:  # after a restart the engine has a new scheduler
        if getattr(engine.scheduler.schedule, "__name__", "") != "track_schedule":
            nonlocal schedule
            schedule = engine.scheduler.schedule
            engine.scheduler.schedule = track_schedule  # type: ignore[method-assign]
            flight["out"] = None

    engine._update = track_update  # type: ignore[method-assign]
    rebind()

    async def gated(http: HttpRequest, path: str) -> Response:
        chat = path.endswith("chat/completions")
        body = await http.json()  # cached on the request: the real handler re-reads it
        start = time.monotonic()
        async with lock:
            held = False
            while True:
                if not engine.ready:
                    break  # the simulator answers 503 itself
                try:
                    p = parse(body, chat=chat, tok=app.state.tokenizer, served=engine.model_name,
                              max_model_len=engine.resolved.max_model_len)
                except SimApiError:
                    break  # the simulator answers the 400 itself
                cands = [Request(f"oracle-{i}", list(p.prompt_token_ids), p.sampling, 0.0,
                                 stream_seed=i) for i in range(p.n)]
                stats["checks"] += 1
                rebind()
                t0 = time.perf_counter()
                oom = would_oom(engine, cands, flight["out"])
                if oom is not None and would_oom(engine, cands, idle=True) is not None:
                    stats["never_fits"] += 1
                    return JSONResponse({"error": {
                        "message": f"oracle: would OOM even on an idle engine: {oom[:200]}",
                        "type": "BadRequestError", "param": None,
                        "code": "oracle_never_fits"}}, status_code=400)
                took = time.perf_counter() - t0
                stats["check_ms_total"] = stats.get("check_ms_total", 0) + int(took * 1000)
                stats["check_ms_max"] = max(stats.get("check_ms_max", 0), int(took * 1000))
                if oom is None:
                    break
                if not engine.scheduler.has_work():
                    stats["never_fits"] += 1
                    return JSONResponse({"error": {
                        "message": f"oracle: would OOM even on an idle engine: {oom[:200]}",
                        "type": "BadRequestError", "param": None,
                        "code": "oracle_never_fits"}}, status_code=400)
                if time.monotonic() - start > max_wait_s:
                    stats["timeouts"] += 1
                    return JSONResponse({"error": {
                        "message": "oracle: waited too long", "type": "RateLimitError",
                        "param": None, "code": "oracle_queue_timeout"}}, status_code=429)
                held = held or not stats.__setitem__("held", stats["held"] + 1)
                # Re-check when a request leaves the engine (memory can only come back then),
                # or every RECHECK_S: a dry run per engine step would stall the engine.
                key = _membership(engine)
                since = time.monotonic()
                while (_membership(engine) == key and engine.ready
                       and time.monotonic() - since < RECHECK_S):
                    await asyncio.sleep(0.002)
            return await endpoints[path](http)

    async def completions(http: HttpRequest) -> Response:
        return await gated(http, "/v1/completions")

    async def chat_completions(http: HttpRequest) -> Response:
        return await gated(http, "/v1/chat/completions")

    app.add_api_route("/oracle/v1/completions", completions, methods=["POST"])
    app.add_api_route("/oracle/v1/chat/completions", chat_completions, methods=["POST"])
    return stats
