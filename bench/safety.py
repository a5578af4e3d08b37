"""Part 1: safety and goodput on the simulator, six arms on identical traffic.

Arms (all drive the same seeded `Call` list, streaming, from one asyncio load generator; the
simulator runs in this process on its own thread and event loop (SimRunner), kvgate in a
subprocess):

- `none`: straight at the simulator.
- `cap-N`: a static concurrency cap, an asyncio.Semaphore(N) in the load generator held from
  send until the response ends (no proxy hop: the cap costs nothing). N is swept per scenario;
  the arm reported as `static-cap` is the best-goodput N that had no OOM.
- `saturation`: the Inference Gateway's rule, in the load generator: a task scrapes the
  simulator's /metrics every 50 ms; a request is refused 429 when kv usage >= 0.8, or waiting >=
  5, or the last good scrape is older than 200 ms (wall).
- `vllm-queue`: vLLM's own API-server admission, played by the simulator as vLLM 0.32.0 does it
  (kvgate/sim/engine.py `Engine.queue_refusal`: 503 "Service Unavailable" past
  `--max-num-queued-reqs` unfinished sequences or `--max-num-queued-tokens` prompt tokens still
  prefilling). One setting, not swept: `--max-num-queued-reqs` at the best surviving static cap
  (the operator's known-safe concurrency, now counted by vLLM per sequence) and
  `--max-num-queued-tokens` at 4 x the engine's max-num-batched-tokens (about four prefill steps
  of backlog: vLLM's `target_TTFT x prefill_throughput` rule, vllm/config/scheduler.py). A 503
  carrying vLLM's admission message counts as a refusal, not a failure.
- `kvgate`: `kvgate serve` (subprocess, demo.replay.kvgate) with the flags that match the
  simulator, GPU probe auto (= sim), everything else at its defaults.
- `oracle`: bench/oracle.py, inside the simulator.

Times: the simulator runs `speedup` times faster than the wall clock; every latency and
goodput is reported in simulated seconds (wall x speedup), so overheads outside the simulator
(the load generator, kvgate's hop) are magnified by the speed-up, against the gated arms.

Clients: the same in every arm. A streaming client waits `patience_s` (run_arm: the gate arms'
queue wait, min(30, 60 / speed-up) wall seconds) from sending a request for its first
token, whether the request waits for a cap's slot, in a gate's queue or in the engine's; then it
hangs up (closes the connection: the engine aborts the request, as vLLM does) and the request is
`abandoned`, its tokens out of goodput. A non-streaming client sees no first token and keeps
waiting until the run's end (docs/benchmarks.md, "The clients' patience").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench import oracle as oracle_mod
from bench.percentile import percentile
from bench.scenarios import Scenario
from bench.workloads import Call
from demo.replay import decisions, kvgate
from kvgate.errors import CacheOutgrown
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import QUEUE_OVERFLOW_MESSAGE, QUEUED_TOKENS_MESSAGE
from kvgate.sim.presets import gpu_total_bytes, write_model_folder
from kvgate.sim.runner import SimRunner
from kvgate.units import MiB

ARMS = ("none", "static-cap", "saturation", "vllm-queue", "kvgate", "oracle")
# vLLM 0.32.0's admission messages (kvgate/sim/engine.py, from vllm/exceptions.py): a 503 with one
# of them is a refusal, like a gate's 429, not the engine failing.
VLLM_ADMISSION = {
    QUEUE_OVERFLOW_MESSAGE: "vllm_max_num_queued_reqs",
    QUEUED_TOKENS_MESSAGE: "vllm_max_num_queued_tokens",
}
# kvgate's own 503 refusals: a request this engine will not run before it restarts, refused for
# memory (kvgate/errors.py), unlike a 503 for a backend that went down.
KVGATE_503_REFUSALS = frozenset({CacheOutgrown.code})
# --max-num-queued-tokens of the vllm-queue arm, in the engine's max-num-batched-tokens.
QUEUED_TOKENS_PER_BATCH = 4
DRAIN_S = 60.0  # simulated seconds after the last arrival before outstanding requests time out
# Calls sharing one HTTP client, each with a connection of its own: httpcore's pool matches every
# queued request against every connection whenever one changes, quadratic in one big pool (a
# burst of 1,500 streams spent its whole drain window there).
CALLS_PER_CLIENT = 64


@dataclass
class Outcome:
    label: str
    status: int  # 0: no HTTP answer / timeout
    kind: str  # completed | failed | rejected | abandoned
    reason: str = ""
    ttft_s: float | None = None  # wall
    end_s: float = 0.0  # wall, since the run's start
    tokens: int = 0


@dataclass
class ArmResult:
    scenario: str
    arm: str
    oom_crashes: int
    failed: int
    completed: int
    abandoned: int
    goodput_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    rejected: dict[str, int]
    preemptions: int
    requests: int = 0
    cap: int | None = None
    span_s: float = 0.0
    output_tokens: int = 0
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    abandoned_by_stage: dict[str, int] = field(default_factory=dict)  # where the client gave up
    completed_by_label: dict[str, int] = field(default_factory=dict)
    # who forms the TTFT tail and who is refused: a kind of request the line holds back shows here
    ttft_p99_by_label: dict[str, float | None] = field(default_factory=dict)
    rejected_by_label: dict[str, int] = field(default_factory=dict)
    oom_messages: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return asdict(self)


# ----- the simulator ---------------------------------------------------------------------------
@contextlib.contextmanager
def simulator(cfg: SimConfig, with_oracle: bool = False, oracle_wait_s: float = 30.0):
    runner = SimRunner(cfg)
    eng = runner.engine
    counts = {"preemptions": 0}
    original = eng._count_preemptions

    def count(out: Any) -> None:  # preemptions across engine lives (counters reset at restart)
        counts["preemptions"] += len(out.preempted)
        original(out)

    eng._count_preemptions = count  # type: ignore[method-assign]
    stats = oracle_mod.install(runner.app, oracle_wait_s) if with_oracle else None
    runner.start()
    try:
        yield runner, counts, stats
    finally:
        runner.stop()


# ----- the load generator ---------------------------------------------------------------------
class SaturationGate:
    """Inference Gateway's saturation rule on the backend's /metrics."""

    _KV = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)", re.M)
    _WAIT = re.compile(r"^vllm:num_requests_waiting\{[^}]*\} ([0-9.eE+-]+)", re.M)

    def __init__(self, url: str, interval: float = 0.05, max_age: float = 0.2) -> None:
        self.url, self.interval, self.max_age = url, interval, max_age
        self.kv, self.waiting, self.at = 1.0, 0.0, -1e9

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = await client.get(self.url + "/metrics", timeout=1.0)
                if r.status_code == 200:
                    kv, w = self._KV.search(r.text), self._WAIT.search(r.text)
                    self.kv = float(kv.group(1)) if kv else 1.0
                    self.waiting = float(w.group(1)) if w else 0.0
                    self.at = time.monotonic()
            await asyncio.sleep(self.interval)

    def refuse(self) -> str | None:
        if time.monotonic() - self.at > self.max_age:
            return "saturated_stale_metrics"
        if self.kv >= 0.8:
            return "saturated_kv"
        if self.waiting >= 5:
            return "saturated_waiting"
        return None


async def replay(
    url: str,
    calls: list[Call],
    speedup: float,
    *,
    cap: int | None = None,
    gate: SaturationGate | None = None,
    prefix: str = "",
    drain_s: float = DRAIN_S,
    patience_s: float | None = None,
    progress: Any = None,
) -> tuple[list[Outcome], float]:
    """Send every call at at/speedup wall seconds; returns outcomes and the wall span. A
    streaming call whose first token has not come `patience_s` simulated seconds after it was
    sent is abandoned (`patient_call`)."""
    sem = asyncio.Semaphore(cap) if cap else None
    patience_wall = None if patience_s is None else patience_s / speedup
    start = time.monotonic()
    last_at = max(c.at for c in calls) / speedup
    deadline = last_at + drain_s / speedup

    stages = ["unsent"] * len(calls)  # how far each call got: a timeout says where it stood

    async def one(client: httpx.AsyncClient, k: int, call: Call) -> Outcome:
        await asyncio.sleep(max(0.0, call.at / speedup - (time.monotonic() - start)))
        sent = time.monotonic()
        if gate is not None and (why := gate.refuse()):
            return Outcome(call.label, 429, "rejected", why, end_s=sent - start)
        return await patient_call(client, prefix + call.path, call, sent, start, stages, k, sem, patience_wall)

    limits = httpx.Limits(max_connections=CALLS_PER_CLIENT, max_keepalive_connections=CALLS_PER_CLIENT)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(drain_s / speedup + 60), limits=limits)
            )
            for _ in range(-(-len(calls) // CALLS_PER_CLIENT))
        ]
        scraper = asyncio.create_task(gate.run(clients[0])) if gate else None
        if gate:
            await asyncio.sleep(0.1)
            start = time.monotonic()
        tasks = [asyncio.create_task(one(clients[k % len(clients)], k, c)) for k, c in enumerate(calls)]
        if progress is not None:
            for t in tasks:
                t.add_done_callback(lambda _: progress.update(1))
        outs = await outcomes_of(tasks, calls, deadline, stages)
        if scraper:
            scraper.cancel()
    span = max([last_at] + [o.end_s for o in outs if o.kind == "completed"])
    return outs, span


async def outcomes_of(
    tasks: list[asyncio.Task[Outcome]], calls: list[Call], deadline: float, stages: list[str] | None = None
) -> list[Outcome]:
    """Each call's outcome, in order; a call still running a second past `deadline` is cancelled
    and counts as a timeout, named after how far it got (`stages`, stream_call's): "timeout_sent"
    had no response head (behind a gate: still queued), "timeout_head" a head and no token yet
    (the engine had not started it), "timeout_streaming" had tokens and no end."""
    done, pending = await asyncio.wait(tasks, timeout=deadline + 1)
    for t in pending:
        t.cancel()
    return [
        t.result()
        if t in done and not t.cancelled() and t.exception() is None
        else Outcome(c.label, 0, "failed", f"timeout_{stages[k]}" if stages else "timeout", end_s=deadline)
        for k, (t, c) in enumerate(zip(tasks, calls, strict=True))
    ]


async def patient_call(
    client: httpx.AsyncClient,
    url: str,
    call: Call,
    sent: float,
    start: float,
    stages: list[str],
    k: int,
    sem: asyncio.Semaphore | None,
    patience: float | None,
) -> Outcome:
    """One client, alike in every arm: it takes the cap's slot if there is one, then `stream_call`.
    A streaming client whose first token has not come `patience` wall seconds after `sent` hangs
    up (the cancellation closes its connection, which makes the engine abort the request, or a
    gate drop it from its queue) and the call is "abandoned", named after how far it got (see
    `outcomes_of`; "unsent": still waiting for the cap's slot). A non-streaming client sees no
    first token and is not timed here."""
    streamed = bool(call.body.get("stream"))
    try:
        async with asyncio.timeout(patience if streamed else None) as wait:
            async with sem if sem is not None else contextlib.nullcontext():
                return await stream_call(
                    client, url, call, sent, start, stages, k, first_token=lambda: wait.reschedule(None)
                )
    except TimeoutError:
        return Outcome(call.label, 0, "abandoned", stages[k], end_s=time.monotonic() - start)


async def stream_call(
    client: httpx.AsyncClient,
    url: str,
    call: Call,
    sent: float,
    start: float,
    stages: list[str] | None = None,
    k: int = 0,
    first_token: Callable[[], None] = lambda: None,
) -> Outcome:
    """POST one call and read the answer to its end: what the client saw (times are wall seconds;
    `start` is the run's start). `stages[k]`, if given, follows how far it got: sent, head (the
    response's status and headers), streaming (a first token). A call without `stream` (an
    evaluation harness's, lm-eval's local-completions) has no first token to time: its TTFT is
    None and its tokens are the answer's `usage.completion_tokens`. `first_token` is called when
    a streamed call's first token arrives."""
    ttft = None
    tokens = 0
    streamed = bool(call.body.get("stream"))
    stage = stages.__setitem__ if stages is not None else (lambda _k, _v: None)
    stage(k, "sent")
    try:
        async with client.stream("POST", url, json=call.body) as r:
            stage(k, "head")
            if r.status_code != 200:
                raw = await r.aread()
                code: Any = None
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    error = json.loads(raw)["error"]
                    code = error["code"]
                    if r.status_code == 503 and code not in KVGATE_503_REFUSALS:
                        code = VLLM_ADMISSION.get(error["message"])
                now = time.monotonic() - start
                if isinstance(code, str) or r.status_code in (400, 413, 429):
                    reason = code if isinstance(code, str) else f"http_{r.status_code}"
                    return Outcome(call.label, r.status_code, "rejected", reason, end_s=now)
                return Outcome(call.label, r.status_code, "failed", f"http_{r.status_code}", end_s=now)
            # Raw chunks, not lines: with a thousand streams in flight, httpx's line
            # splitting was a quarter of this process's CPU, shared with the simulator.
            tail = b""
            async for chunk in r.aiter_raw():
                if streamed and ttft is None and b"data: " in chunk:
                    ttft = time.monotonic() - sent
                    stage(k, "streaming")
                    first_token()
                window = tail[-64:] + chunk  # a marker may straddle two chunks
                if streamed and b'"error"' in window:
                    return Outcome(call.label, 200, "failed", "stream_error", ttft, time.monotonic() - start)
                if not streamed:
                    tokens = _completion_tokens(window, tokens)
                tail = (tail + chunk)[-4096:]
            if streamed:
                tokens = _usage_tokens(tail)
        return Outcome(call.label, 200, "completed", "", ttft, time.monotonic() - start, tokens)
    except (TimeoutError, httpx.HTTPError) as exc:
        return Outcome(call.label, 0, "failed", type(exc).__name__, ttft, time.monotonic() - start)


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def _completion_tokens(window: bytes, found: int) -> int:
    """`usage.completion_tokens` of a plain JSON answer, read as its bytes pass (prompt logprobs
    after `usage` can make the answer far longer than any tail kept); `found` if not in `window`.
    Generated text cannot fake it: its quotes are escaped."""
    matches = _COMPLETION_TOKENS.findall(window)
    return int(matches[-1]) if matches else found


def _usage_tokens(tail: bytes) -> int:
    """completion_tokens of the stream's usage event (the last data event before [DONE])."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: ") and b'"usage"' in line and b'"completion_tokens"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return int(json.loads(line[6:])["usage"]["completion_tokens"] or 0)
    return 0


def summarise(
    scn: Scenario, arm: str, outs: list[Outcome], span_wall: float, speedup: float, ooms: list[str], preemptions: int
) -> ArmResult:
    done = [o for o in outs if o.kind == "completed"]
    ttfts = [o.ttft_s * speedup for o in done if o.ttft_s is not None]
    tokens = sum(o.tokens for o in done)
    span = span_wall * speedup
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return ArmResult(
        scenario=scn.key,
        arm=arm,
        oom_crashes=len(ooms),
        failed=sum(o.kind == "failed" for o in outs),
        completed=len(done),
        abandoned=sum(o.kind == "abandoned" for o in outs),
        goodput_tokens_per_s=round(tokens / span, 1) if span else 0.0,
        ttft_p50_s=rnd(percentile(ttfts, 0.5)),
        ttft_p99_s=rnd(percentile(ttfts, 0.99)),
        rejected=dict(Counter(o.reason for o in outs if o.kind == "rejected")),
        preemptions=preemptions,
        requests=len(outs),
        span_s=round(span, 2),
        output_tokens=tokens,
        failed_by_reason=dict(Counter(o.reason for o in outs if o.kind == "failed")),
        abandoned_by_stage=dict(Counter(o.reason for o in outs if o.kind == "abandoned")),
        completed_by_label=dict(Counter(o.label for o in done)),
        ttft_p99_by_label={
            label: rnd(
                percentile([o.ttft_s * speedup for o in done if o.label == label and o.ttft_s is not None], 0.99)
            )
            for label in sorted({o.label for o in done})
        },
        rejected_by_label=dict(Counter(o.label for o in outs if o.kind == "rejected")),
        oom_messages=[m[:600] for m in ooms[:3]],
    )


def scaled_config(scn: Scenario, scale: float) -> SimConfig:
    cfg = replace(scn.sim, speedup=scn.speedup)
    cfg.cotenants = [
        replace(c, start_s=c.start_s * scale, end_s=None if c.end_s is None else c.end_s * scale)
        for c in scn.sim.cotenants
    ]
    return cfg


def run_arm(
    scn: Scenario,
    arm: str,
    calls: list[Call],
    scale: float,
    workdir: Path,
    cap: int | None = None,
    progress: Any = None,
) -> ArmResult:
    cfg = scaled_config(scn, scale)
    sp = scn.speedup
    notes: dict[str, Any] = {}
    # kvgate and the oracle hold a request at most 30 s wall, and no longer than the run drains:
    # a deadline in wall seconds would otherwise outlast the drain at speed-ups above 2. Every
    # arm's streaming clients wait as long for their first token (`patient_call`): queue_wait_s x
    # speed-up simulated seconds, 30 at speed-up 1 and the drain's 60 at 2 and above.
    queue_wait_s = min(30.0, DRAIN_S / sp)
    patient = functools.partial(replay, speedup=sp, patience_s=queue_wait_s * sp, progress=progress)
    with simulator(cfg, with_oracle=(arm == "oracle"), oracle_wait_s=queue_wait_s) as (sim, counts, ostats):
        if arm == "vllm-queue":
            sim.engine.cfg.max_num_queued_reqs = cap
            sim.engine.cfg.max_num_queued_tokens = QUEUED_TOKENS_PER_BATCH * sim.engine.resolved.max_num_batched_tokens
            notes["vllm_flags"] = (
                f"--max-num-queued-reqs {cap} --max-num-queued-tokens {sim.engine.cfg.max_num_queued_tokens}"
            )
            outs, span = asyncio.run(patient(sim.url, calls))
        elif arm in ("none", "cap", "saturation"):
            gate = SaturationGate(sim.url) if arm == "saturation" else None
            outs, span = asyncio.run(patient(sim.url, calls, cap=cap, gate=gate))
        elif arm == "oracle":
            outs, span = asyncio.run(patient(sim.url, calls, prefix="/oracle"))
            notes["oracle"] = dict(ostats or {})
        elif arm == "kvgate":
            model_dir = write_model_folder(cfg.model, workdir / cfg.model)
            flags = [*scn.kvgate_flags, "--max-queue-wait", f"{queue_wait_s:g}"]
            if level := os.environ.get("KVGATE_BENCH_LOG_LEVEL"):  # diagnostics: every decision at info
                flags += ["--log-level", level]
            with kvgate(sim.url, model_dir, flags, gpu_total_bytes(cfg.gpu), workdir / f"kvgate-{scn.key}.log") as (
                url,
                cmd,
                _,
            ):
                outs, span = asyncio.run(patient(url, calls))
                with contextlib.suppress(httpx.HTTPError):
                    notes["kvgate_decisions"] = {f"{d}/{r}": n for (d, r), n in decisions(url).items()}
                    text = httpx.get(url + "/metrics", timeout=5).text
                    notes["kvgate_gauges"] = {
                        m.group(1): float(m.group(2))
                        for m in re.finditer(
                            r"^(kvgate_(?:kv_overcommit_factor|transient_safety_margin|"
                            r"transient_headroom_bytes|backend_restarts_total|"
                            r"transient_prediction_error_bytes))(?:\{\})? ([0-9.eE+-]+)$",
                            text,
                            re.M,
                        )
                    }
                log_text = (workdir / f"kvgate-{scn.key}.log").read_text(errors="replace")
                notes["kvgate_warnings"] = [
                    ln[24:300] for ln in log_text.splitlines() if " WARNING " in ln or " ERROR " in ln
                ][:12]
                notes["kvgate_command"] = " ".join(cmd[3:])
        else:
            raise ValueError(arm)
        ooms = list(sim.engine.ooms)
        if sim.engine.oom_details:  # the first crash's step, tensor and allocator
            notes["oom_details"] = sim.engine.oom_details[:1]
        if (closest := sim.engine.closest_call()) is not None:  # the run's margin from an OOM
            notes["closest_call_mib"] = round(closest / MiB, 1)
        notes["engine_busy_sim_s"] = round(sim.engine.sim_clock, 1)
        notes["engine_restarts"] = sim.engine.restarts
        res = summarise(scn, "static-cap" if arm == "cap" else arm, outs, span, sp, ooms, counts["preemptions"])
    res.cap = cap if arm == "cap" else None
    res.notes = notes
    return res


def pick_cap(results: list[ArmResult]) -> ArmResult | None:
    ok = [r for r in results if r.oom_crashes == 0]
    return max(ok, key=lambda r: (r.goodput_tokens_per_s, -r.cap)) if ok else None


def confirmed_cap(
    results: list[ArmResult], oom_seed: Callable[[int], int | None]
) -> tuple[ArmResult | None, dict[int, int]]:
    """The best cap of a sweep (as `pick_cap`) that also survives more traffic: `oom_seed(cap)`
    runs it on further traffic seeds and gives the first one it ran out of memory on, or None.
    An operator picks a cap after more than one day of traffic: one run that survives does not
    make a cap safe (S13's cap 288 survived session 39's committed run and ran out of memory on
    1 of 6 other seeds, bench/results/caps-session40). Also the caps dropped, with that seed."""
    dropped: dict[int, int] = {}
    for r in sorted((r for r in results if r.oom_crashes == 0), key=lambda r: (-r.goodput_tokens_per_s, r.cap)):
        seed = oom_seed(r.cap)
        if seed is None:
            return r, dropped
        dropped[r.cap] = seed
    return None, dropped


def quiet() -> None:
    logging.getLogger("kvgate.sim").setLevel(logging.CRITICAL)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def tmpdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="kvgate-bench-")
