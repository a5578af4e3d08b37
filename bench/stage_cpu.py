"""`python -m bench.stage_cpu`: the CPU of single stages of a chat request, each timed alone in a loop.

bench/request_cpu.py measures whole requests; this one measures the stages a change is made to,
in isolation, on this thread's CPU clock (time.thread_time: what other processes do on a shared
machine costs it little), the least of several passes over the same inputs:
- render: LocalTokenizer.render_chat of the benchmark's chats (bench.overhead.chat_bodies);
- evaluate: RequestPipeline.evaluate (parse, render, tokenize, predict, the never-fits check) of
  `--chats` of them, each new to the segment cache when there are more than it keeps
  (the default, bench.overhead.DISTINCT_CHATS);
- admission: the gate's side of a chat with IN_FLIGHT of the benchmark's chats in flight, as
  `bench.request_cpu --concurrency 32` keeps them: Budget.shortfall of the next chat against the
  ledger, Ledger.reserve, and the oldest in-flight chat's Ledger.release;
- decision: one admission decided by the decision log (DecisionLog), its line written at info to
  a file through kvgate's own log handler, as `kvgate serve` writes its stderr;
- metrics: the Prometheus updates of one admitted chat (GateMetrics' admission and release, and
  the four per-request histograms the pipeline and the HTTP path observe);
- relay: kvgate.http.proxy.Relay relaying a `--stream-events`-event stream that has arrived, one
  ASGI message an event, under a stall deadline (kvgate serve's --stream-stall-timeout), on
  uvloop as `kvgate serve` runs.
Loops keep caches warmer than traffic does: compare arms with each other, not with request_cpu.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvloop

from bench.overhead import DISTINCT_CHATS, chat_bodies, model_folder

# Chats in flight while the admission stage admits one and releases the oldest (request_cpu's c=32).
IN_FLIGHT = 32


def least(passes: int, run: Callable[[], None]) -> float:
    """The least thread CPU seconds of `passes` runs."""
    best = float("inf")
    for _ in range(passes):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=DISTINCT_CHATS, help="distinct chats evaluated")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--admissions", type=int, default=20000, help="chats admitted and released in a pass")
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--updates", type=int, default=20000, help="chats' metric updates in a pass")
    parser.add_argument("--streams", type=int, default=200, help="streams relayed in a pass")
    parser.add_argument("--stream-events", type=int, default=100, help="events in each stream")
    args = parser.parse_args()

    from kvgate.composition import Runtime
    from kvgate.gate.ledger import Reservation
    from kvgate.gate.observer import Decision, Release
    from kvgate.http.decision_log import DecisionLog
    from kvgate.logs import configure_logging, quiet_transformers_advice
    from kvgate.memory.demand import Demand
    from kvgate.metrics import GateMetrics, KvgateMetrics
    from kvgate.openai import parse_request
    from kvgate.settings import Settings
    from kvgate.tokens import LocalTokenizer

    quiet_transformers_advice()
    with tempfile.TemporaryDirectory(prefix="kvgate-stage-cpu-") as tmp:
        folder = model_folder(Path(tmp) / "model")
        bodies = chat_bodies(args.chats)
        tokenizer = LocalTokenizer(folder)
        chats = [parse_request("chat", raw).input for raw in bodies[:2000]]
        render_s = least(args.passes, lambda: [tokenizer.render_chat(chat) for chat in chats])
        print(f"render     {render_s / len(chats) * 1e6:8.1f} us a chat ({len(chats)} chats)", flush=True)

        settings = Settings(
            model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984
        )
        rt = Runtime(settings)
        rt.configure_offline()

        async def evaluate_all() -> None:
            for raw in bodies:
                await rt.pipeline.evaluate("chat", raw)

        evaluate_s = least(args.passes, lambda: asyncio.run(evaluate_all()))
        print(f"evaluate   {evaluate_s / len(bodies) * 1e6:8.1f} us a chat ({len(bodies)} chats)", flush=True)

        async def demands() -> list[Demand]:
            return [(await rt.pipeline.evaluate("chat", raw)).prediction.demand for raw in bodies[:256]]

        admitted = asyncio.run(demands())
        budget, ledger = rt.gate.budget, rt.gate.ledger
        in_flight = deque(ledger.reserve(demand) for demand in admitted[:IN_FLIGHT])

        def admit() -> None:
            for i in range(args.admissions):
                demand = admitted[i % len(admitted)]
                budget.shortfall(demand, ledger)
                in_flight.append(ledger.reserve(demand))
                ledger.release(in_flight.popleft())

        admission_s = least(args.passes + 4, admit)
        print(
            f"admission  {admission_s / args.admissions * 1e6:8.2f} us a chat weighed, reserved, released", flush=True
        )

        out = (Path(tmp) / "decisions.log").open("w")
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(out.fileno(), 2)
        try:
            configure_logging("info")
            logging.getLogger().handlers[0].setStream(sys.stderr)
            demand = Demand(120, 16, tuple(range(8)), 5, transient_prefill_bytes=4096)
            decision = Decision("admit", "fits", "0123456789abcdef0123456789abcdef", demand, queue_wait_s=0.0)
            log = DecisionLog()

            def decide() -> None:
                for _ in range(args.decisions):
                    log.decided(decision)

            decision_s = least(args.passes + 4, decide)
        finally:
            os.dup2(saved, 2)
        print(f"decision   {decision_s / args.decisions * 1e6:8.2f} us an admission logged", flush=True)

        metrics = KvgateMetrics()
        gate_metrics = GateMetrics(metrics)
        release = Release("completed", Reservation(id=1, demand=demand))

        def update() -> None:
            for _ in range(args.updates):
                gate_metrics.decided(decision)
                metrics.tokenization.observe(0.0002)
                metrics.predicted_transient.observe(4096)
                metrics.predicted_kv_blocks.observe(13)
                metrics.added_latency.observe(0.0004)
                gate_metrics.released(release)

        metrics_s = least(args.passes + 4, update)
        print(f"metrics    {metrics_s / args.updates * 1e6:8.2f} us a chat's metric updates", flush=True)

    relay_s = least(args.passes + 4, lambda: uvloop.run(relay_streams(args.streams, args.stream_events)))
    print(f"relay      {relay_s / args.streams * 1e6:8.1f} us a {args.stream_events}-event stream", flush=True)


class _ArrivedStream:
    """What Relay reads of an UpstreamResponse: an event stream whose events each come in a read."""

    status, raw_headers = 200, [(b"content-type", b"text/event-stream")]

    def __init__(self, events: int) -> None:
        self.left = events
        self.complete = False

    def header(self, name: bytes) -> str | None:
        return "text/event-stream" if name == b"content-type" else None

    async def read(self) -> bytes | None:
        if not self.left:
            return None
        self.left -= 1
        self.complete = not self.left
        return b'data: {"choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'

    def release(self) -> None:
        pass


async def relay_streams(streams: int, events: int) -> None:
    from kvgate.http.proxy import Relay

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    for _ in range(streams):
        relay = Relay(_ArrivedStream(events), {}, lambda: None, lambda outcome, tokens: None, stall_timeout_s=60)  # type: ignore[arg-type]
        await relay({"type": "http"}, receive, send)


if __name__ == "__main__":
    main()
