"""Arm (e): an admission oracle that knows the simulator's exact memory.

It runs *inside* the simulator process, on the simulator's own event loop, as extra routes
`/oracle/v1/completions` and `/oracle/v1/chat/completions` added to the simulator's FastAPI app
before it starts. Each request is parsed with the simulator's own parser (exact token ids,
sampling, n) and joins one FIFO queue. One admitter task checks the *whole queue at once* and
admits its longest prefix that a dry run shows cannot OOM:

- The question for a prefix of k requests: if they joined the engine now, in order, would any
  step until each of them has produced its first `DECODE_STEPS` tokens hit CUDA OOM? A dry run
  answers it on a private copy of the live engine, advanced past the step in flight (scheduler
  queues, PyTorch caching allocator with its real fragmentation, the device with its co-tenants
  at their size `LOOKAHEAD_S` simulated seconds ahead), with the k requests added, by the
  engine's own step code (scheduler.schedule, Engine.shape, StepMemory.plan, run_tape on the
  copied allocator, and the simulator's deterministic sampler for where each sequence stops)
  for up to `MAX_STEPS` steps. Every step is played on the allocator, those that carry none of
  the k too: they move blocks (the penalties' prompt ids follow the batch) under the steps
  that follow. (Playing only the candidates' steps, and letting every sequence run to
  max_tokens, let S4's fragmentation through: the real next step, with fewer rows and a moved
  tensor, OOMed where the dry run had passed.)
- The search: the scheduler admits FIFO, so the dry run of k requests is step for step the dry
  run of any longer prefix until the longer one first schedules a request past k. An OOM at a
  step therefore condemns every prefix that has scheduled the same requests by then and is not
  yet done: the failing dry run returns that bound, and the next probe starts under it. Probes:
  the whole window first (after a check that admitted nothing: the head alone), then one below
  the bound, then bisection. Only a k whose own dry run survived is ever admitted, so the
  search needs no monotonicity: fragmentation may make k + 1 fail where k + 2 would not, and
  then the oracle admits k. A check costs one to a few dry runs, where S4's spike of 1,500
  arrivals cost one deep copy and dry run each, and starved the engine.
- The window: the oracle keeps about `WINDOW_STEPS` engine steps of work queued inside the
  engine (tokens still to compute of its running and waiting requests, prefix-cache hits
  excepted) and holds the rest in its own FIFO queue, re-checked after every engine step. That
  changes no batch, because the scheduler could not start them sooner, and it bounds a dry run
  to a few steps and a few dozen candidates, instead of a backlog of hundreds behind which the
  last candidate gets its first token.
- Atomic: the k requests enter the engine (the simulator's own request objects, `RequestRun`, the
  same that its handler makes) in the same event-loop turn as the dry run that passed them;
  nothing runs in between. Their clients' coroutines only stream what the engine produces.
- When the queue's head does not fit: if it would OOM an idle engine too (a dry run without
  the other requests) it is refused 400 `oracle_never_fits`; else the whole queue waits (FIFO,
  no overtaking) and is checked again when the engine's membership changes (a request started
  or left: memory can only come back then) or every `RECHECK_S`. A request still queued after
  `max_wait_s` wall seconds gets 429 `oracle_queue_timeout`.

The copy is made per dry run, by hand and only of what a dry run mutates: each queued or running
request is a shallow copy with its own output list (prompt token ids shared), the scheduler a
shallow copy with its own queues, the allocator its segments and blocks (a few hundred small
objects; the carried-over tensors mapped onto the copies). `copy.deepcopy` of a thousand running
requests per arrival was what made the arm unmeasurable under S4's spike.

The copy leaves out the KV block pool (copying it per check is too slow): in the dry run every
KV allocation succeeds, so it batches at least as many requests as the real scheduler (the safe
side); prefix-cache hits are taken from the live pool's cached hashes and the blocks the dry run
itself allocates (see _DryKV: without them, n > 1 siblings recomputed their prompt and the dry
run sampled fewer rows per step than the engine). It does not plan KV capacity (a full pool
means preemption, not OOM: the scheduler copes) and it cannot see steps beyond its horizon (a step after the
candidates' first tokens is checked only as part of later checks' dry runs, while requests
wait), so it is a ceiling for memory knowledge, not for scheduling: it admits whatever memory
allows, however many sequences that makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.sim.api import Parsed, SimApiError, parse
from kvgate.sim.blocks import KVCacheManager, chained_hashes
from kvgate.sim.carryover import CrossStepTensors
from kvgate.sim.engine import Engine, play_encoder
from kvgate.sim.gpu import Block, CachingAllocator, CudaOutOfMemory, Segment
from kvgate.sim.request import Request, Status
from kvgate.sim.scheduler import PrefixStats, Scheduler
from kvgate.sim.server import RequestRun, cancelled_on_disconnect, engine_requests
from kvgate.sim.step_memory import run_tape

MAX_STEPS = 400
DECODE_STEPS = 2  # the candidate's prefill, first decode step
LOOKAHEAD_S = 30.0
RECHECK_S = 0.25
WINDOW_STEPS = 2  # engine steps of work the oracle keeps queued inside the engine


class _Null:
    """Stands in for the copied requests' sinks."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self

    def __getitem__(self, k: Any) -> Any:
        return self


_NULL = _Null()


class _DryKV:
    """The dry run's KV manager: every allocation succeeds (copying the real block pool, tens of
    thousands of blocks, per check is too slow; without its limit the dry run batches at least
    as many requests per step as the real scheduler would), but prefix-cache hits are taken as
    the real one takes them: a prompt block hits if the live pool has its hash cached or an
    earlier request of the dry run has allocated it (vLLM caches a block when it allocates it,
    so the n sequences of one request, or requests sharing a prompt, hit in the very step the
    first of them computes it). Without hits, the n = 16 sequences of S8's requests each
    recomputed their prompt in the dry run, a step held a few of them, and the real engine, whose
    siblings hit, sampled several times as many rows at once: the oracle admitted, the engine
    OOMed."""

    def __init__(self, live: KVCacheManager, hashes: dict[str, list[int]]) -> None:
        self.block_size = live.block_size
        self.caching = live.caching
        self.live_cached = live.pool.cached
        self.live_hashes = live.hashes
        self.hashes = hashes  # request id -> its prompt's chained block hashes
        self.added: set[int] = set()

    def register(self, req: Request) -> None:
        """Know `req`'s prompt hashes (a dry request's token ids are not built): the live
        manager's if it has hashed them, else computed once and kept in the memo."""
        rid = req.request_id
        if self.caching and rid not in self.hashes:
            known = self.live_hashes.get(rid)
            self.hashes[rid] = (
                known
                if known is not None
                else chained_hashes(req.prompt_token_ids, self.block_size, 0, 0, req.cache_salt)
            )

    def get_computed_blocks(self, req_id: str, token_ids: Any, cache_salt: str | None = None) -> list[None]:
        if not self.caching:
            return []
        hit = 0
        for h in self.hashes.get(req_id, ())[: (len(token_ids) - 1) // self.block_size]:
            if h not in self.live_cached and h not in self.added:
                break
            hit += 1
        return [None] * hit  # the scheduler takes only their number

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Any,
        num_computed: int,
        num_new: int,
        new_computed: Any = (),
        cache_salt: str | None = None,
    ) -> bool:
        if self.caching:
            full = (num_computed + len(new_computed) * self.block_size + num_new) // self.block_size
            self.added.update(self.hashes.get(req_id, ())[:full])
        return True

    def free(self, req_id: str) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


# ----- the copy a dry run works on ---------------------------------------------------------------
class _DryRequest(Request):
    """A request in a dry run. Its KV manager (_DryKV) hashes prompts itself, and the
    scheduler only takes the number of token ids, so `all_token_ids` need not build prompt +
    output."""

    @property
    def all_token_ids(self) -> range:  # type: ignore[override]
        return range(self.num_tokens)


def _fork_request(req: Request) -> Request:
    """What a dry run mutates of a request: progress, output list, status (prompt shared)."""
    c = object.__new__(_DryRequest)
    c.__dict__.update(req.__dict__)
    c.output_token_ids = list(req.output_token_ids)
    c.sink = _NULL
    return c


def _fork_memory(alloc: CachingAllocator, carry: CrossStepTensors) -> tuple[CachingAllocator, CrossStepTensors]:
    """The allocator (device, segments, blocks) and the tensors carried across steps, copied."""
    device = copy.copy(alloc.device)
    device.processes = dict(alloc.device.processes)
    a = copy.copy(alloc)
    a.device, a.segments = device, []
    twin: dict[int, Block] = {}
    for seg in alloc.segments:
        s = Segment(seg.size, seg.pool)
        for b in seg.blocks:
            twin[id(b)] = nb = Block(s, b.offset, b.size, b.allocated, b.requested)
            s.blocks.append(nb)
        a.segments.append(s)
    c = copy.copy(carry)
    c.alloc = a
    c.outputs = [twin[id(b)] for b in carry.outputs]
    if carry.penalty_prompt_ids is not None:
        c.penalty_prompt_ids = twin[id(carry.penalty_prompt_ids)]
    c.held = {key: [twin[id(b)] for b in blocks] for key, blocks in carry.held.items()}
    return a, c


def _fork(
    engine: Engine, in_flight: Any, idle: bool, memo: Memo
) -> tuple[Scheduler, CachingAllocator, CrossStepTensors]:
    """A private copy of the engine at its next step: the step in flight counted, co-tenants at
    their size LOOKAHEAD_S ahead; `idle`: without its requests."""
    live = engine.scheduler
    sched = copy.copy(live)
    sched.__dict__.pop("schedule", None)  # the live scheduler's tracking wrapper: not for the copy
    sched.kv = kv = _DryKV(live.kv, memo.hashes)
    if live.encoder is not None:  # images: the copy's own encoder budget and cache (kvgate/sim/vision.py)
        sched.encoder = live.encoder.fork(live.encoder.cache.alloc)
    sched.prefix = PrefixStats()
    if idle:
        sched.running, sched.waiting = [], deque()
    else:
        twins = {id(r): _fork_request(r) for r in (*live.running, *live.waiting)}
        sched.running = [twins[id(r)] for r in live.running]
        sched.waiting = deque(twins[id(r)] for r in live.waiting)
        for twin in twins.values():
            kv.register(twin)
        for sr in in_flight.scheduled if in_flight is not None else ():
            req = twins.get(id(sr.request))
            if req is None or req.status != Status.RUNNING:
                continue
            req.num_computed_tokens += sr.num_new_tokens
            _release_encoded(sched, req)
            if req.num_computed_tokens >= req.num_tokens and _sample(engine, req, memo):
                _finish(sched, req)
    alloc, carry = _fork_memory(engine.alloc, engine.carry)
    if sched.encoder is not None:
        sched.encoder.cache.alloc = alloc  # what the dry run encodes lives (and is evicted) there
    device, t = alloc.device, engine.sim_time()
    for c in engine.cfg.cotenants:
        if c.start_s <= t + LOOKAHEAD_S and (c.end_s is None or c.end_s > t):
            held = device.processes.get(c.name, 0)
            if c.bytes > held and c.bytes - held <= device.free():
                device.set_usage(c.name, c.bytes)
    return sched, alloc, carry


@dataclass
class Memo:
    """What dry runs learn that holds from one check to the next. `stops`: per sequence, the
    positions already asked of the sampler (none of them an end) or its first end, so that a
    check asks about a position or two per sequence, not every position of its horizon.
    `hashes`: per request id, its prompt's chained block hashes (the prefix-cache lookup)."""

    stops: dict[tuple[str, int], tuple[int, int | None]] = field(default_factory=dict)
    hashes: dict[str, list[int]] = field(default_factory=dict)


def _eos(engine: Engine, req: Request, memo: Memo) -> bool:
    """Whether the simulator's sampler (deterministic in the request's state) ends the sequence
    at its next token (asked once per position, see Memo)."""
    pos = len(req.output_token_ids)
    key = (req.request_id, req.stream_seed)
    asked, first = memo.stops.get(key, (0, None))
    if first is not None:
        return pos >= first
    if pos < asked:
        return False
    eos = engine.sampler(req)[1]
    if pos == asked:
        memo.stops[key] = (pos, pos) if eos else (pos + 1, None)
    return eos


def _sample(engine: Engine, req: Request, memo: Memo) -> bool:
    """Engine._update for a sequence that computed all its tokens: one more output token; True
    if the sequence ends there (max_tokens, max_model_len, or its end of sequence)."""
    eos = _eos(engine, req, memo)
    req.output_token_ids.append(0)
    sp = req.sampling
    return (
        len(req.output_token_ids) >= sp.max_tokens
        or req.num_tokens >= engine.resolved.max_model_len
        or (eos and not sp.ignore_eos)
    )


def _release_encoded(sched: Scheduler, req: Request) -> None:
    """Engine._update's `_free_encoder_inputs`: an image its prompt has read leaves the encoder
    cache's needed entries (freeable, evicted for the next image). Without it the dry run saw the
    cache full, deferred the next images' encoding and passed steps the engine then ran with
    their encoder activations (S14's oracle OOM, session 26)."""
    if sched.encoder is None:
        return
    for i, item in enumerate(req.mm_items):
        if item.start + item.length <= req.num_computed_tokens:
            sched.encoder.cache.release((req.request_id, i))


def _finish(sched: Scheduler, req: Request) -> None:
    if any(r is req for r in sched.running):
        sched.finish(req)
    req.status = Status.FINISHED


# ----- the dry run and the search ----------------------------------------------------------------
def dry_run(
    engine: Engine, groups: list[list[Request]], in_flight: Any = None, idle: bool = False, memo: Memo | None = None
) -> tuple[str | None, int]:
    """Dry-run the engine with `groups` (one per client request: its n sequences) added in
    order: `(None, len(groups))` if it survives, else `(OOM message, bound)`, where every prefix
    of at least `bound` groups would hit the very same OOM.

    `in_flight`: the scheduler output of the step the engine is running now (its tape has run,
    its tokens are not yet counted): the copy counts them first, so the dry run starts at the
    engine's next step. `idle`: dry-run the groups on an engine with no other request.
    `memo`: what earlier dry runs learnt (see Memo); a fresh one if None.
    """
    memo = memo if memo is not None else Memo()
    sched, alloc, carry = _fork(engine, in_flight, idle, memo)
    kv = cast(_DryKV, sched.kv)
    n = len(groups)
    group_of: dict[int, int] = {}
    left = []  # per group: its sequences still short of DECODE_STEPS tokens
    for g, cands in enumerate(groups):
        left.append(len(cands))
        for c in cands:
            c2 = _fork_request(c)
            c2.output_token_ids = []
            kv.register(c2)
            sched.add(c2)
            group_of[id(c2)] = g
    done = 0  # leading groups whose every sequence has its first tokens
    seen = -1  # the last group scheduled so far (FIFO: every earlier one was too)
    for _ in range(MAX_STEPS):
        while done < n and not left[done]:
            done += 1
        if done == n:
            return None, n
        out = sched.schedule()
        if not out.scheduled:
            return None, n
        for s in out.scheduled:
            g = group_of.get(id(s.request))
            if g is not None and g > seen:
                seen = g
        # Every step is played, those without a probed request too: they move the allocator's
        # blocks (the penalties' prompt ids follow the batch) under the steps that follow.
        try:
            carry.start_step([s.request for s in out.scheduled])
            if sched.encoder is not None and engine.model.vision is not None:
                play_encoder(engine.model.vision, sched.encoder, alloc, out)
            carry.keep_outputs(run_tape(alloc, engine.steps.plan(Engine.shape(out)), carry.held))
        except CudaOutOfMemory as exc:
            # A prefix of k groups plays these very steps while it has scheduled the same
            # groups (k > seen) and is not done yet (k > done).
            return str(exc), max(seen, done) + 1
        finished = False
        for s in out.scheduled:
            req = s.request
            if req.status != Status.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            _release_encoded(sched, req)
            if req.num_computed_tokens < req.num_tokens:
                continue
            ends = _sample(engine, req, memo)
            if ends:
                req.status = Status.FINISHED
                if sched.encoder is not None and req.mm_items:  # Scheduler.finish's _release_images
                    sched.encoder.cache.release_request(req.request_id)
                finished = True
            g = group_of.get(id(req))
            if g is not None and (ends or len(req.output_token_ids) == DECODE_STEPS):
                left[g] -= 1
        if finished:  # Scheduler.finish one by one is a list.remove with dataclass __eq__
            sched.running = [r for r in sched.running if r.status != Status.FINISHED]
    return None, n


def _to_compute(engine: Engine, token_ids: list[int], sampling: Any, hashes: list[int] | None = None) -> int:
    """The tokens the scheduler would compute to start this prompt now: those of its prefix
    already in the KV cache are not (a read-only lookup of the chained block hashes that
    KVCacheManager.get_computed_blocks walks; `hashes`: the prompt's, if known)."""
    kv = engine.scheduler.kv
    if sampling.prompt_logprobs is not None or not kv.pool.enable_caching:
        return len(token_ids)
    if hashes is None:
        hashes = chained_hashes(token_ids, kv.block_size, 0, 0)
    hit = 0
    for h in hashes[: (len(token_ids) - 1) // kv.block_size]:
        if h not in kv.pool.cached:
            break
        hit += 1
    return len(token_ids) - hit * kv.block_size


def window(engine: Engine, entries: Any, in_flight: Any = None) -> int:
    """How many leading `entries` (objects with `.parsed`, maybe `.hashes`) fit in the engine's
    next WINDOW_STEPS steps: the work it already has (tokens not yet computed, of the running
    and waiting requests, after the step in flight) plus theirs (prefix-cache hits excepted), at
    most WINDOW_STEPS x max_num_batched_tokens. The first entry is in as soon as there is room."""
    s = engine.scheduler
    room = WINDOW_STEPS * s.max_num_batched_tokens + (in_flight.num_tokens if in_flight else 0)
    for r in s.running:
        room -= r.num_tokens - r.num_computed_tokens
    for r in s.waiting:
        room -= _to_compute(engine, r.all_token_ids, r.sampling)
    k = 0
    for e in entries:
        if room <= 0:
            break
        p = e.parsed
        hashes = getattr(e, "hashes", None) or [None] * len(p.prompts)
        room -= (
            sum(_to_compute(engine, q.token_ids, q.sampling, h) for q, h in zip(p.prompts, hashes, strict=True)) * p.n
        )
        k += 1
    return k


def would_oom(engine: Engine, candidates: list[Request], in_flight: Any = None, idle: bool = False) -> str | None:
    """The OOM message if `candidates` (one request's sequences) joined the engine now."""
    return dry_run(engine, [candidates], in_flight, idle)[0]


def longest_prefix(
    engine: Engine,
    groups: list[list[Request]],
    in_flight: Any = None,
    first: int | None = None,
    memo: Memo | None = None,
) -> tuple[int, str | None, int]:
    """The most leading groups whose own dry run survives: `(k, OOM message that stopped the
    search or None, dry runs)`. Probes `first` (default: all), then one under the bound the
    failing dry run gives (or all, after a first probe that passed), then bisects."""
    lo, hi = 0, len(groups) + 1  # lo: passed (0 trivially); every k >= hi fails
    probe = len(groups) if first is None else first
    oom, runs = None, 0
    while hi - lo > 1:
        runs += 1
        msg, bound = dry_run(engine, groups[:probe], in_flight, memo=memo)
        if msg is None:
            lo = probe
        else:
            hi, oom = bound, msg
        probe = hi - 1 if runs == 1 else (lo + hi) // 2
    return lo, oom, runs


# ----- the routes --------------------------------------------------------------------------------
@dataclass(eq=False)
class _Entry:
    path: str
    parsed: Parsed
    cands: list[Request]
    start: float
    verdict: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    held: bool = False
    hashes: list[list[int]] | None = None  # per prompt, its chained block hashes (prefix-cache lookup)


def _sequences(p: Parsed, rid: str) -> list[Request]:
    """The request's engine requests (n per prompt), built and seeded as the simulator's
    RequestRun builds them (the sampler's end of sequence depends on the seed)."""
    return [req for prompt_reqs in engine_requests(p, rid) for req in prompt_reqs]


def _refusal(status: int, kind: str, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def install(app: FastAPI, max_wait_s: float) -> dict[str, int]:
    """Add the oracle routes to a simulator app (before it starts); returns its counters."""
    engine: Engine = app.state.engine
    endpoints = {r.path: r.endpoint for r in app.routes if hasattr(r, "endpoint")}
    stats = {
        "checks": 0,
        "held": 0,
        "never_fits": 0,
        "timeouts": 0,
        "check_ms_total": 0,
        "check_ms_max": 0,
        "dry_runs": 0,
        "admitted": 0,
        "batches": 0,
        "batch_max": 0,
        "queue_max": 0,
    }
    queue: deque[_Entry] = deque()
    memo = Memo()
    # hold: why the queue's head waits: "window" (the engine has enough work queued), "oom"
    # (the head would OOM now), None (the queue is empty)
    state: dict[str, Any] = {"out": None, "task": None, "hold": None, "seen": None, "n": 0}
    arrived, changed = asyncio.Event(), asyncio.Event()
    schedule, update = engine.scheduler.schedule, engine._update

    def membership() -> tuple[int, int]:
        return len(engine.scheduler.running), len(engine.scheduler.waiting)

    def track_schedule() -> Any:  # the step in flight: scheduled, tokens not yet counted
        state["out"] = schedule()
        return state["out"]

    def track_update(out: Any, start: float) -> None:
        state["out"] = None
        update(out, start)
        if state["hold"] == "window" or (state["hold"] == "oom" and membership() != state["seen"]):
            changed.set()

    def rebind() -> None:  # after a restart the engine has a new scheduler
        if getattr(engine.scheduler.schedule, "__name__", "") != "track_schedule":
            nonlocal schedule
            schedule = engine.scheduler.schedule
            engine.scheduler.schedule = track_schedule  # type: ignore[method-assign]
            state["out"] = None

    engine._update = track_update  # type: ignore[method-assign]
    rebind()

    def settle(entry: _Entry, verdict: Any) -> None:
        if not entry.verdict.done():
            entry.verdict.set_result(verdict)

    def check() -> None:
        """One admission decision over the whole queue, in one event-loop turn."""
        rebind()
        stats["checks"] += 1
        stats["queue_max"] = max(stats["queue_max"], len(queue))
        t0 = time.perf_counter()
        admitted, hold = 0, None
        while queue and engine.ready:
            take = window(engine, queue, state["out"])
            if not take:
                hold = "window"
                break
            groups = [e.cands for e in itertools.islice(queue, take)]
            k, oom, runs = longest_prefix(engine, groups, state["out"], 1 if state["hold"] == "oom" else None, memo)
            stats["dry_runs"] += runs
            if k == 0:
                head = queue[0]
                if engine.scheduler.has_work():  # else that dry run was on an idle engine
                    stats["dry_runs"] += 1
                    if would_oom(engine, head.cands, idle=True) is None:
                        hold = "oom"
                        break  # it fits once memory comes back: the queue waits
                queue.popleft()
                stats["never_fits"] += 1
                why = (oom or "")[:200]
                settle(
                    head,
                    _refusal(
                        400, "BadRequestError", "oracle_never_fits", f"oracle: would OOM even on an idle engine: {why}"
                    ),
                )
                continue
            for _ in range(k):  # into the engine now, before anything else runs
                e = queue.popleft()
                settle(e, RequestRun(engine, e.parsed))
            admitted, hold = k, "oom" if k < take else "window"
            break
        if not engine.ready:  # the simulator answers (503) itself
            while queue:
                settle(queue.popleft(), None)
        now = time.monotonic()
        while queue and now - queue[0].start > max_wait_s:
            stats["timeouts"] += 1
            settle(queue.popleft(), _refusal(429, "RateLimitError", "oracle_queue_timeout", "oracle: waited too long"))
        for e in queue:
            if not e.held:
                e.held = True
                stats["held"] += 1
        if admitted:
            stats["admitted"] += admitted
            stats["batches"] += 1
            stats["batch_max"] = max(stats["batch_max"], admitted)
        state["hold"] = hold if queue else None
        state["seen"] = membership()
        took = int((time.perf_counter() - t0) * 1000)
        stats["check_ms_total"] += took
        stats["check_ms_max"] = max(stats["check_ms_max"], took)

    async def admitter() -> None:
        while True:
            if not queue:
                arrived.clear()
                await arrived.wait()
                continue
            check()
            if queue:  # held: re-check after the next engine step (window) or when a request
                # starts or leaves (oom: memory can only come back then), or every RECHECK_S
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECHECK_S)
            else:
                await asyncio.sleep(0)

    async def gated(http: HttpRequest, path: str) -> Response:
        chat = path.endswith("chat/completions")
        body = await http.json()  # cached on the request: the real handler re-reads it
        try:
            p = (
                parse(
                    body,
                    chat=chat,
                    tok=app.state.tokenizer,
                    served=engine.model_name,
                    max_model_len=engine.resolved.max_model_len,
                    max_logprobs=engine.cfg.max_logprobs,
                    clamps_max_tokens=engine.resolved.flavor.clamps_max_tokens,
                    vision=engine.model.vision,
                )
                if engine.ready
                else None
            )
        except SimApiError:
            p = None  # the simulator answers the 400 itself
        if p is None:
            return await endpoints[path](http)
        state["n"] += 1
        entry = _Entry(
            path,
            p,
            _sequences(p, f"oracle-{state['n']}"),
            time.monotonic(),
            hashes=[chained_hashes(q.token_ids, engine.scheduler.kv.block_size, 0, 0) for q in p.prompts],
        )
        per_sequence = (h for h in entry.hashes or [] for _ in range(p.n))  # cands: n per prompt, in order
        memo.hashes.update((c.request_id, h) for c, h in zip(entry.cands, per_sequence, strict=True))
        queue.append(entry)
        arrived.set()
        if state["task"] is None or state["task"].done():
            state["task"] = asyncio.create_task(admitter())
        try:
            verdict = await entry.verdict
        except asyncio.CancelledError:  # the client went away
            if entry in queue:
                queue.remove(entry)
            elif (
                entry.verdict.done()
                and not entry.verdict.cancelled()
                and isinstance(entry.verdict.result(), RequestRun)
            ):
                entry.verdict.result().abort()
            raise
        if verdict is None:
            return await endpoints[path](http)
        if isinstance(verdict, Response):
            return verdict
        if p.stream:  # as the simulator's handler does with its RequestRun
            return StreamingResponse(verdict.sse(), media_type="text/event-stream")
        return await cancelled_on_disconnect(http, verdict.complete())

    async def completions(http: HttpRequest) -> Response:
        return await gated(http, "/v1/completions")

    async def chat_completions(http: HttpRequest) -> Response:
        return await gated(http, "/v1/chat/completions")

    app.add_api_route("/oracle/v1/completions", completions, methods=["POST"])
    app.add_api_route("/oracle/v1/chat/completions", chat_completions, methods=["POST"])
    return stats
