"""The fleet benchmark (issue 25 item 4): N simulated vLLM engines behind an EPP-like router.

    python -m bench.fleet [--engines 3] [--scenarios S10 S12] [--scale 1] [--speedup 2] [--out DIR]

Each engine is one scenario's simulated vLLM (bench/scenarios.py); the traffic is that scenario's,
N times over (N seeded draws merged), so each engine meets about the load the scenario puts on
one. Arms, on identical traffic:

- `router`: the router (bench/fleet_router.py: llm-d's EPP scoring) straight at the engines, on
  vLLM's own gauges;
- `router+flow-control`: the same with the EPP's flow control (queue, utilization detector, TTL);
- `router+kvgate`: a kvgate in front of each engine, the router on the gauges kvgate exports on
  its port (the pool's target port). A kvgate's 429 reaches the client: the EPP does not retry
  another endpoint (llm-d-router#2210).

Reported per arm: engine OOM crashes, goodput (completion tokens of completed requests per
simulated second), 429s and every other error that reached a client, TTFT p50/p99 (simulated
seconds, from the client's send: the EPP's queue counts). Writes fleet.json and fleet.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.fleet_router import (
    NO_ENDPOINTS,
    REQUEST_TTL_S,
    Router,
    readiness,
)
from bench.percentile import percentile
from bench.safety import CALLS_PER_CLIENT, Outcome, outcomes_of, quiet, scaled_config, simulator, stream_call, tmpdir
from bench.scenarios import SCENARIOS, Scenario
from bench.workloads import Call
from demo.replay import decisions, kvgate
from kvgate.sim.presets import gpu_total_bytes, write_model_folder

RESULTS = Path(__file__).resolve().parent / "results" / "fleet"
ARMS: dict[str, tuple[bool, bool]] = {  # name: (flow control, kvgate)
    "router": (False, False),
    "router+flow-control": (True, False),
    "router+kvgate": (False, True),
    "router+flow-control+kvgate": (True, True),
}
DEFAULT_ARMS = ("router", "router+flow-control", "router+kvgate")
DRAIN_S = 90.0  # simulated seconds after the last arrival: the EPP's 60 s TTL, then 30 s to answer


@dataclass
class FleetResult:
    scenario: str
    arm: str
    engines: int
    requests: int
    completed: int
    oom_crashes: int
    goodput_tokens_per_s: float
    client_429: int
    client_errors: int  # every request that did not complete, 429s included
    errors_by_reason: dict[str, int]
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    span_s: float
    output_tokens: int
    dispatched_by_endpoint: list[int]
    router_queue_max: int
    engine_restarts: int
    gauge_source: str  # whose /metrics the router scored on: vLLM's or kvgate's (its vllm: gauges)
    notes: dict[str, Any] = field(default_factory=dict)


def fleet_traffic(scn: Scenario, engines: int, seed: int, scale: float) -> list[Call]:
    """The scenario's traffic drawn `engines` times from seeded generators, merged in time."""
    calls: list[Call] = []
    for k in range(engines):
        calls += scn.traffic(random.Random(seed * 1000 + k), scale)
    return sorted(calls, key=lambda c: c.at)


async def drive(router: Router, calls: list[Call], speedup: float, drain_s: float) -> tuple[list[Outcome], float]:
    """Sends every call at at/speedup wall seconds through the router; outcomes and wall span."""
    last_at = max(c.at for c in calls) / speedup
    deadline = last_at + drain_s / speedup
    limits = httpx.Limits(max_connections=CALLS_PER_CLIENT, max_keepalive_connections=CALLS_PER_CLIENT)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(deadline + 60), limits=limits))
            for _ in range(-(-len(calls) // CALLS_PER_CLIENT))
        ]
        await stack.enter_async_context(router.running())
        await router.pool_full()
        start = time.monotonic()

        async def one(client: httpx.AsyncClient, call: Call) -> Outcome:
            await asyncio.sleep(max(0.0, call.at / speedup - (time.monotonic() - start)))
            sent = time.monotonic()
            chosen = await router.admit()
            if isinstance(chosen, str):
                status = 503 if chosen == NO_ENDPOINTS else 429
                return Outcome(call.label, status, "rejected", chosen, end_s=time.monotonic() - start)
            return await stream_call(client, chosen.url + call.path, call, sent, start)

        tasks = [asyncio.create_task(one(clients[k % len(clients)], c)) for k, c in enumerate(calls)]
        outs = await outcomes_of(tasks, calls, deadline)
    span = max([last_at] + [o.end_s for o in outs if o.kind == "completed"])
    return outs, span


def run_arm(
    scn: Scenario, arm: str, calls: list[Call], engines: int, scale: float, speedup: float, workdir: Path, seed: int
) -> FleetResult:
    flow_control, with_kvgate = ARMS[arm]
    cfg = replace(scaled_config(scn, scale), speedup=speedup)
    notes: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(simulator(cfg))[0] for _ in range(engines)]
        if with_kvgate:
            model_dir = write_model_folder(cfg.model, workdir / cfg.model)
            # kvgate holds a request as long as the EPP's flow control would: its TTL.
            flags = [*scn.kvgate_flags, "--max-queue-wait", f"{REQUEST_TTL_S / speedup:g}"]
            gates = [
                stack.enter_context(
                    kvgate(s.url, model_dir, flags, gpu_total_bytes(cfg.gpu), workdir / f"kvgate-{arm}-{k}.log")
                )
                for k, s in enumerate(sims)
            ]
            notes["kvgate_command"] = shlex.join(gates[0][1][3:])
            ready = readiness("/readyz")
            router = Router([url for url, _, _ in gates], speedup, flow_control=flow_control, seed=seed, ready=ready)
        else:
            ready = readiness("/health")
            router = Router([s.url for s in sims], speedup, flow_control=flow_control, seed=seed, ready=ready)
        outs, span_wall = asyncio.run(drive(router, calls, speedup, DRAIN_S))
        ooms = [m for s in sims for m in s.engine.ooms]
        restarts = sum(s.engine.restarts for s in sims)
        notes["scrapes"] = sum(e.scrapes for e in router.endpoints)
        notes["failed_scrapes"] = sum(e.failed_scrapes for e in router.endpoints)
        notes["oom_messages"] = [m[:300] for m in ooms[:3]]
        # What the engines did: their simulated busy time, and what the kvgates decided.
        notes["engine_busy_sim_s"] = [round(s.engine.sim_clock, 1) for s in sims]
        if with_kvgate:
            counted: Counter[str] = Counter()
            for url, _, _ in gates:
                counted.update({f"{d}/{r}": n for (d, r), n in decisions(url).items()})
            notes["kvgate_decisions"] = dict(sorted(counted.items()))
    done = [o for o in outs if o.kind == "completed"]
    ttfts = [o.ttft_s * speedup for o in done if o.ttft_s is not None]
    tokens = sum(o.tokens for o in done)
    span = span_wall * speedup
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return FleetResult(
        scenario=scn.key,
        arm=arm,
        engines=engines,
        requests=len(outs),
        completed=len(done),
        oom_crashes=len(ooms),
        goodput_tokens_per_s=round(tokens / span, 1) if span else 0.0,
        client_429=sum(o.status == 429 for o in outs),
        client_errors=len(outs) - len(done),
        errors_by_reason=dict(Counter(f"{o.status} {o.reason}" for o in outs if o.kind != "completed")),
        ttft_p50_s=rnd(percentile(ttfts, 0.5)),
        ttft_p99_s=rnd(percentile(ttfts, 0.99)),
        span_s=round(span, 2),
        output_tokens=tokens,
        dispatched_by_endpoint=router.dispatched_by_endpoint,
        router_queue_max=router.max_queue,
        engine_restarts=restarts,
        gauge_source="kvgate" if with_kvgate else "vllm",
        notes=notes,
    )


def table(results: list[FleetResult]) -> str:
    head = (
        "| scenario | arm | engines | OOM crashes | goodput tok/s | completed | 429s to clients | "
        "all client errors | TTFT p50 s | TTFT p99 s | errors by reason |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {r.scenario} | {r.arm} | {r.engines} | {r.oom_crashes} | {r.goodput_tokens_per_s} | "
        f"{r.completed}/{r.requests} | {r.client_429} | {r.client_errors} | {r.ttft_p50_s} | {r.ttft_p99_s} | "
        + (", ".join(f"{k}: {v}" for k, v in sorted(r.errors_by_reason.items())) or "-")
        + " |"
        for r in results
    ]
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--scenarios", nargs="+", default=["S10", "S12"])
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    ap.add_argument("--scale", type=float, default=1.0, help="shrinks each scenario's window (traffic mix kept)")
    ap.add_argument("--speedup", type=float, default=1.0, help="simulated seconds per wall second")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    quiet()
    by_key = {s.key: s for s in SCENARIOS}
    started = time.monotonic()
    load_before = os.getloadavg()
    results: list[FleetResult] = []
    with tmpdir() as tmp:
        for scn in (by_key[k] for k in args.scenarios):
            calls = fleet_traffic(scn, args.engines, args.seed, args.scale)
            for arm in args.arms:
                print(f"[fleet] {scn.key} {arm}: {len(calls)} requests", file=sys.stderr, flush=True)
                r = run_arm(scn, arm, calls, args.engines, args.scale, args.speedup, Path(tmp), args.seed)
                print(f"[fleet] {json.dumps(asdict(r))}", file=sys.stderr, flush=True)
                results.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.fleet " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {
        "command": command.strip(),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - started, 1),
        # The machine's 1/5/15-minute load averages (2 cores): the simulated engines slow down with it.
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "scenarios": {k: (by_key[k].title, by_key[k].engine) for k in args.scenarios},
    }
    (args.out / "fleet.json").write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    (args.out / "fleet.md").write_text(
        f"# Fleet benchmark\n\n`{meta['command']}`, {meta['finished']}, {meta['wall_s']} s wall, load average "
        f"{meta['load_average_before'][0]} before and {meta['load_average_after'][0]} after (2 cores).\n\n"
        + table(results)
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
