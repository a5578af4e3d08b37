"""`python -m bench.request_cpu`: kvgate's CPU per gated request, measured in one process.

The overhead benchmark (bench/overhead.py) measures kvgate end to end beside nginx and needs a
quiet machine; this one measures what kvgate's own code costs a request, and is usable on a
shared one: it drives kvgate's ASGI app (kvgate.http.server.create_app, the app `kvgate serve`
runs) directly, without uvicorn's socket and HTTP parsing, against the zero-cost backend
(bench/zero_backend.py, another process) over kvgate's real upstream client, and counts this
process's CPU time (time.process_time: every thread) over a fixed number of requests. The
decision log is on (info, every decision logged) and written to a file, as `kvgate serve`
writes it to its stderr.

`--profile FILE` writes a cProfile of the measured requests (pstats format, timed on the thread's
CPU clock) as well, and prints each stage's share of it (SHARES: its entry point's cumulative time;
the profiler's own cost per call inflates the stages that make many small calls).
`--distinct-prompts N` sends N chats with different user messages in turn (1: one chat, which
kvgate's segment cache then reads back whole; the overhead benchmark sends
bench.overhead.DISTINCT_CHATS, more than the cache keeps); `--no-segment-cache` encodes every chat
whole (kvgate/token_segments.py), `--no-pre-token-cache` each new piece whole (its PreTokenCache
off), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import logging
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.overhead import DISTINCT_CHATS, LOAD_CORE, _wait_http, chat_bodies, model_folder, prompt_of, taskset
from demo.processes import stop_process
from kvgate.logs import configure_logging, quiet_transformers_advice
from kvgate.settings import Settings
from kvgate.sim.runner import free_port

# Bodies are sent in turn across calls (bench/overhead.py _closed_loop says why).
_BODY_TURN = itertools.count()


def completions_body(prompt: str) -> bytes:
    return json.dumps({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 16}).encode()


class Exchange:
    """One request's ASGI receive and send: the body in one message, the answer collected."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sent_body = False
        self.status = 0
        self.done = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.done.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.done.set()


def scope_of(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8080"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "state": {},
    }


async def _lifespan(app: Any) -> tuple[asyncio.Task[None], asyncio.Queue[dict[str, Any]]]:
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()
        elif message["type"].endswith("failed"):
            raise RuntimeError(message)

    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send))
    await started.wait()
    return task, inbox


def _system_time() -> float:
    """This process's CPU time in the kernel (system calls: the socket writes and reads, the
    decision log's writes), the part of process_time that Python's own code does not spend."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


async def measure(
    app: Any, path: str, bodies: list[bytes], concurrency: int, requests: int, profiler: cProfile.Profile | None
) -> dict[str, Any]:
    left = [requests]
    bad = [0]

    async def client() -> None:
        while left[0] > 0:
            left[0] -= 1
            body = bodies[next(_BODY_TURN) % len(bodies)]
            exchange = Exchange(body)
            await app(scope_of(path, body), exchange.receive, exchange.send)
            if exchange.status != 200:
                bad[0] += 1

    if profiler is not None:
        profiler.enable()
    cpu0, sys0, wall0 = time.process_time(), _system_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    system = _system_time() - sys0
    if profiler is not None:
        profiler.disable()
    return {
        "concurrency": concurrency,
        "requests": requests,
        "non_200": bad[0],
        "cpu_ms_per_request": round(cpu / requests * 1e3, 4),
        "kernel_ms_per_request": round(system / requests * 1e3, 4),
        "requests_per_s": round(requests / wall, 1),
    }


async def run(args: argparse.Namespace, backend_port: int, folder: Path) -> list[dict[str, Any]]:
    from kvgate.http.server import create_app

    settings = Settings(
        backend=f"http://127.0.0.1:{backend_port}",
        model=str(folder),
        max_num_batched_tokens=8192,
        gpu_memory_bytes=85520809984,
        gpu_probe="none",
    )
    app = create_app(settings)
    task, inbox = await _lifespan(app)
    rt = app.runtime
    for _ in range(600):  # the first sync with the backend: 30 s at most
        if rt.ready:
            break
        await asyncio.sleep(0.05)
    else:
        raise RuntimeError(f"kvgate not ready: {rt.startup_error}")
    path, bodies = (
        ("/v1/chat/completions", chat_bodies(args.distinct_prompts))
        if args.kind == "chat"
        else ("/v1/completions", [completions_body(prompt_of(100))])
    )
    if args.no_segment_cache or args.no_pre_token_cache:
        local = rt.pipeline.config.tokenizer
        while not hasattr(local, "_segments"):
            local = local._inner
        if args.no_segment_cache:
            local._segments = None
        else:
            local._segments.pre_tokens = None
    await measure(app, path, bodies, 8, args.warmup, None)
    if args.canned_evaluation:  # everything but the evaluation: the HTTP path, the gate, the relay
        canned = await rt.pipeline.evaluate("chat" if args.kind == "chat" else "completions", bodies[0])

        async def evaluate(route: Any, raw: bytes, deadline: float | None = None) -> Any:
            return canned

        rt.pipeline.evaluate = evaluate
    # Timed on this thread's CPU clock, not the wall: on a shared core a wall-clock profile charges
    # whatever function was running when the scheduler switched away (the socket write that wakes
    # the backend took 60 % of a wall-clock profile's time) with time this process did not use.
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9) if args.profile else None
    rows = []
    for concurrency in args.concurrency:
        for _ in range(args.repeat):
            rows.append(await measure(app, path, bodies, concurrency, args.requests, profiler))
            print(args.kind, rows[-1], flush=True)
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print_shares(args.profile)
    await inbox.put({"type": "lifespan.shutdown"})
    await task
    return rows


# A request's stages by their entry points ("file:function" under kvgate/), nested ones indented.
SHARES = (
    ("whole request", "http/gated_routes.py:__call__"),
    ("read body", "http/asgi.py:read_body"),
    ("parse", "openai.py:parse_request"),
    ("render chat template", "tokens.py:render_chat"),
    ("tokenize", "tokens.py:_encode"),
    ("predict", "predict.py:predict"),
    ("gate acquire", "gate/gate.py:acquire"),
    ("  observers on admission", "gate/observer.py:decided"),
    ("    decision log", "http/decision_log.py:decided"),
    ("    traffic record", "traffic_record.py:decided"),
    ("    Prometheus", "metrics.py:decided"),
    ("  budget shortfall", "gate/budget.py:shortfall"),
    ("open upstream", "http/gated_routes.py:_forward"),
    ("  socket write", "upstream.py:send"),
    ("relay answer", "http/proxy.py:__call__"),
    ("  release", "http/gated_routes.py:on_end"),
)


def print_shares(profile: str) -> None:
    """Each stage's share of the profiled CPU time (the measured requests' client coroutines)."""
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]

    def cumulative(where: str) -> float:
        return sum(v[3] for (f, _, name), v in stats.items() if f"{f.rpartition('/kvgate/')[2]}:{name}" == where)

    total = sum(v[3] for (f, _, name), v in stats.items() if f.endswith("request_cpu.py") and name == "client")
    print(f"profiled CPU {total:.3f} s")
    for stage, where in SHARES:
        print(f"{stage:<28} {cumulative(where) / total * 100:5.1f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("chat", "completions"), default="chat")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--canned-evaluation",
        action="store_true",
        help="answer every request with one evaluation made in advance: the cost of the rest",
    )
    parser.add_argument("--profile", help="write a cProfile of the measured requests here")
    parser.add_argument("--distinct-prompts", type=int, default=DISTINCT_CHATS, help="chats sent in turn")
    parser.add_argument("--no-segment-cache", action="store_true", help="encode every chat whole")
    parser.add_argument(
        "--no-pre-token-cache", action="store_true", help="encode new pieces with the Rust tokenizer, whole"
    )
    args = parser.parse_args()
    quiet_transformers_advice()
    with tempfile.TemporaryDirectory(prefix="kvgate-request-cpu-") as tmp:
        d = Path(tmp)
        folder = model_folder(d / "model")
        port = free_port()
        log = d / "backend.log"
        with log.open("wb") as out:
            backend = subprocess.Popen(
                [*taskset(LOAD_CORE), sys.executable, "-m", "bench.zero_backend", "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", backend, "backend", log)
            # The decision log as `kvgate serve` writes it: kvgate's format, every decision, to a file.
            decisions = (d / "kvgate.log").open("w")
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(decisions.fileno(), 2)
            try:
                configure_logging("info")
                logging.getLogger().handlers[0].setStream(sys.stderr)
                import uvloop  # what uvicorn runs kvgate serve on when it is installed

                uvloop.run(run(args, port, folder))
            finally:
                os.dup2(saved, 2)
        finally:
            stop_process(backend)


if __name__ == "__main__":
    main()
