"""`make demo`: the simulated vLLM dies of CUDA OOM under a short workload; behind kvgate it lives.

For each scenario (a failure mode from docs/sources.md), on 127.0.0.1 and free ports:

1. start the simulator (`kvgate.sim`, a realistic preset) with a configuration that OOMs, replay a
   seeded workload straight at it, and show how it died (the CUDA message, the failed requests);
2. start a fresh simulator, put `kvgate serve` in front of it with the matching flags, replay the
   same workload through kvgate, and show that it survived: how many requests completed, kvgate's
   admit / queue / reject counts from its /metrics and an example of each refusal.

The outcome is a function of the seed alone, never of the wall clock: the simulated engine is
held while the workload is submitted one request at a time (each waits until the simulator or
kvgate has taken the one before), then released; kvgate's queue deadline is longer than the
slowest machine needs, so what completes, fails or is refused is the same on every run.

The simulator is kvgate's adversary, not its accomplice: it plays every allocation on its own
model of PyTorch's caching allocator and never imports kvgate's estimator. Run with `--quick`
for a smaller workload (tests/integration/test_demo.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from demo.processes import stop_process
from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.flavor import Flavor
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes, write_model_folder
from kvgate.sim.runner import SimRunner, free_port
from kvgate.sim.startup import StartupError

# Words of at most six letters: the simulator's stand-in tokenizer makes each one token.
WORDS = [
    "the",
    "cache",
    "block",
    "token",
    "batch",
    "model",
    "server",
    "queue",
    "memory",
    "budget",
    "prompt",
    "graph",
    "tensor",
    "chunk",
    "layer",
    "head",
    "value",
    "key",
    "query",
    "fast",
    "slow",
    "long",
    "short",
    "river",
    "stone",
    "cloud",
    "light",
    "north",
    "south",
    "paper",
    "glass",
    "music",
    "water",
    "field",
    "story",
    "night",
    "green",
    "table",
    "window",
]


@dataclass(frozen=True)
class Call:
    """One request of the workload (workloads list them in the order they are sent)."""

    path: str
    body: dict[str, Any]
    label: str


@dataclass
class Outcome:
    call: Call
    status: int  # 0: no HTTP answer (connection refused, timeout)
    message: str = ""


@dataclass
class Scenario:
    key: str
    title: str
    seed: str
    sim: SimConfig  # the configuration that dies
    kvgate_flags: list[str]
    workload: Callable[[random.Random, bool], list[Call]]
    # The vLLM configuration kvgate is put in front of; None: the same one that died.
    sim_gated: SimConfig | None = None
    note: str = ""


@dataclass
class Result:
    """What happened to one scenario, for the printout and for tests/integration/test_demo.py."""

    scenario: Scenario
    direct: list[Outcome] = field(default_factory=list)
    direct_oom: str | None = None
    direct_startup_failed: bool = False
    gated: list[Outcome] = field(default_factory=list)
    gated_ooms: list[str] = field(default_factory=list)
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    kvgate_command: list[str] = field(default_factory=list)


# ----- workloads --------------------------------------------------------------------------------
def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def chat(rng: random.Random, model: str, i: int, max_tokens: int) -> Call:
    words = rng.randint(150, 1200)
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "messages": [{"role": "user", "content": f"Question {i}: " + text(rng, words)}],
    }
    return Call("/v1/chat/completions", body, "chat")


def document(rng: random.Random, model: str, tokens: int, **extra: Any) -> Call:
    body = {"model": model, "prompt": text(rng, tokens - 1), "max_tokens": 64, **extra}
    return Call("/v1/completions", body, f"document of {tokens // 1000}k tokens")


def long_context_workload(rng: random.Random, quick: bool) -> list[Call]:
    """Chat traffic, and long documents (16k to 120k tokens) for summarisation arriving early."""
    model = "deepseek-v2-lite"
    docs = [16000, 32000, 48000, 64000, 96000, 120000] if not quick else [16000, 64000, 120000]
    calls = [document(rng, model, n) for n in docs]
    chats = 18 if not quick else 6
    calls += [chat(rng, model, i, rng.choice([32, 64, 128])) for i in range(chats)]
    return calls


def eval_workload(rng: random.Random, quick: bool) -> list[Call]:
    """Chat traffic beside an evaluation job scoring prompts (prompt_logprobs, 2k to 8k tokens)."""
    model = "llama-3.1-8b"
    sizes = [2000, 8000, 4000, 8000] if not quick else [4000, 8000]
    scored = [document(rng, model, n, prompt_logprobs=1, max_tokens=1) for n in sizes]
    scored = [replace(c, label=c.label.replace("document", "scored prompt")) for c in scored]
    chats = 12 if not quick else 4
    return [chat(rng, model, i, rng.choice([32, 64])) for i in range(chats)] + scored


def big_batch_workload(rng: random.Random, quick: bool) -> list[Call]:
    """A burst of RAG-style requests (3k to 6k-token prompts), more than the KV cache holds."""
    model = "llama-3.1-8b"
    count = 24 if not quick else 10
    calls = [document(rng, model, rng.choice([3000, 4000, 6000])) for _ in range(count)]
    for c in calls:
        c.body["max_tokens"] = 256
    # One caller asks for 8 samples of a long answer: more KV than the whole cache holds at once, but
    # each sample is its own vLLM request that fits alone, so kvgate queues it for an idle pool.
    greedy = document(rng, model, 3000, n=8, max_tokens=4000)
    return [replace(greedy, label="n=8 x 4000-token answers"), *calls]


def start_on_empty_gpu(cfg: SimConfig) -> startup.StartupReport:
    """The simulated vLLM's start-up with `cfg` on an empty GPU, no server: StartupError with
    vLLM's message where it would not start (the model does not fit, the pool holds no context)."""
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm", cfg.expandable_segments)
    _, report = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    return report


def fully_utilized(cfg: SimConfig) -> SimConfig:
    """`cfg` with the `--kv-cache-memory-bytes` vLLM logs at start-up as the value "to fully
    utilize gpu memory" (the profile's peak and a 150 MiB buffer left over), from the start-up
    numbers of the same engine on an empty GPU."""
    return replace(cfg, kv_cache_memory_bytes=start_on_empty_gpu(cfg).kv_to_fully_utilize())


# Longer than the slowest machine takes to play any scenario: a queued request is refused only
# when the queue is full (decided while the engine is held), never by a wall-clock deadline.
QUEUE_WAIT_S = 300
ANSWER_TIMEOUT_S = QUEUE_WAIT_S + 60
# kvgate's start-up (imports, first scrape of the backend) took over 30 s on this 2-core machine
# at a load average of 12, in the benchmarks' S1 and S9 and in the demo.
KVGATE_READY_S = 90
# The held engine's readings do not change however late a scrape comes on a busy machine: they
# must not count as stale (which halves the budget) while the workload is submitted.
STEADY_FLAGS = ["--max-staleness", "60"]

SCENARIOS: list[Scenario] = [
    Scenario(
        key="long-context",
        title="Chunked prefill over a long computed prefix, MLA's context up-projection (DeepSeek-V2-Lite)",
        seed="docs/sources.md#profile-run-question",
        sim=fully_utilized(
            SimConfig(
                model="deepseek-v2-lite",
                gpu="h100-80gb",
                max_model_len=131072,
                max_num_batched_tokens=2048,
                max_num_seqs=256,
                speedup=25,
                restart_seconds=600,
                vllm_version="0.32.0",
            )
        ),
        # No --model-runner: kvgate applies vLLM's rule to the version the simulator reports.
        kvgate_flags=["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"],
        workload=long_context_workload,
    ),
    Scenario(
        key="prompt-logprobs",
        title="prompt_logprobs over a full 8192-token chunk (an evaluation job), never profiled",
        seed="docs/sources.md#failure-modes, mode 2",
        sim=SimConfig(
            model="llama-3.1-8b",
            gpu="h100-80gb",
            max_model_len=16384,
            max_num_seqs=256,
            gpu_memory_utilization=0.95,
            speedup=25,
            restart_seconds=600,
            vllm_version="0.31.0",
            model_runner="v1",
        ),
        kvgate_flags=["--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--model-runner", "v1"],
        workload=eval_workload,
    ),
    Scenario(
        key="big-batch",
        title="A large --max-num-batched-tokens meant to cap concurrency",
        seed="docs/sources.md#large-max-num-batched-tokens",
        sim=SimConfig(
            model="llama-3.1-8b",
            gpu="l4-24gb",
            max_model_len=8192,
            max_num_batched_tokens=65536,
            max_num_seqs=200,
            speedup=25,
            restart_seconds=600,
            vllm_version="0.31.0",
            model_runner="v1",
        ),
        sim_gated=SimConfig(
            model="llama-3.1-8b",
            gpu="l4-24gb",
            max_model_len=8192,
            max_num_seqs=200,
            speedup=25,
            restart_seconds=600,
            vllm_version="0.31.0",
            model_runner="v1",
        ),
        kvgate_flags=[
            "--max-num-batched-tokens",
            "2048",
            "--max-num-seqs",
            "200",
            "--max-queue",
            "12",
            "--max-queue-wait",
            str(QUEUE_WAIT_S),
            "--model-runner",
            "v1",
        ],
        workload=big_batch_workload,
        note="vLLM dies in its start-up profile; kvgate cannot fix a profile that does not fit, "
        "so vLLM keeps its default batch and kvgate caps the concurrency instead.",
    ),
]


# ----- running ----------------------------------------------------------------------------------
def sim_flags(cfg: SimConfig) -> str:
    parts = [f"--model {cfg.model}", f"--gpu {cfg.gpu}"]
    names = (
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "vllm_version",
        "model_runner",
    )
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value != getattr(SimConfig, name, None):
            parts.append(f"--{name.replace('_', '-')} {value}")
    if cfg.attention_backend != "auto":
        parts.append(f"--attention-backend {cfg.attention_backend}")
    runner = Flavor.of(cfg, load_model(cfg.model, cfg.dtype)).runner.upper()
    return " ".join(parts) + f"  (plays vLLM {cfg.vllm_version} on {runner})"


def client_requests_in(engine: Engine | None) -> int:
    """Client requests the simulated engine holds (its n sequences are ids -0, -1, ...)."""
    if engine is None or not engine.ready:
        return 0
    held = [*engine.scheduler.waiting, *engine.scheduler.running]
    return sum(r.request_id.endswith("-0") for r in held)


async def replay(
    base_url: str,
    calls: list[Call],
    engine: Engine | None,
    queued: Callable[[httpx.AsyncClient], Awaitable[int]] | None = None,
) -> list[Outcome]:
    """Submit every call, one at a time, to a held engine, then release it and collect each
    status and error message.

    A call is sent once the one before it is settled: answered, waiting in kvgate's queue
    (`queued` counts those), or taken in by the engine. So the engine and kvgate see the same
    arrivals in the same order on every run, and the engine starts stepping with all of them.
    """

    async def one(client: httpx.AsyncClient, call: Call) -> Outcome:
        try:
            r = await client.post(call.path, json=call.body)
        except httpx.HTTPError as exc:
            return Outcome(call, 0, type(exc).__name__)
        message = ""
        if r.status_code != 200:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                message = r.json()["error"]["message"]
        return Outcome(call, r.status_code, message)

    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    if engine is not None:
        engine.held = True
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=ANSWER_TIMEOUT_S, limits=limits) as client:
            tasks: list[asyncio.Task[Outcome]] = []
            for sent, call in enumerate(calls, 1):
                tasks.append(asyncio.create_task(one(client, call)))
                deadline = time.monotonic() + ANSWER_TIMEOUT_S
                while True:
                    waiting = await queued(client) if queued is not None else 0
                    answered = sum(t.done() for t in tasks)
                    if answered + waiting + client_requests_in(engine) >= sent:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"request {sent} ({call.label}) was never taken in")
                    await asyncio.sleep(0.005)
            if engine is not None:
                engine.held = False
            return list(await asyncio.gather(*tasks))
    finally:
        if engine is not None:
            engine.held = False


async def queue_depth(client: httpx.AsyncClient) -> int:
    """Requests waiting in kvgate's admission queue, from its /metrics."""
    page = (await client.get("/metrics")).text
    for s in _samples(page):
        if s.name == "kvgate_queue_depth":
            return int(s.value)
    raise ValueError("kvgate's /metrics has no kvgate_queue_depth")


@contextlib.contextmanager
def kvgate(
    backend: str, model_dir: Path, flags: list[str], total_bytes: int, log_path: Path, prefix: Sequence[str] = ()
) -> Iterator[tuple[str, list[str], subprocess.Popen]]:
    """`kvgate serve` as a user runs it, on a free port; yields its URL, command and process
    (the soak reads its RSS and fds) once /readyz says ready and its budget is live (a first
    scrape of the backend has set it), so the first request meets the same budget on every run.
    `prefix` runs it through another command that ends in exec (bench/memory_cgroup.py's)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvgate.cli",
        "serve",
        "--backend",
        backend,
        "--model",
        str(model_dir),
        "--listen",
        f"127.0.0.1:{port}",
        "--gpu-memory-bytes",
        str(total_bytes),
        "--log-level",
        "warning",
        "--metrics-cache-seconds",  # the queue and the decisions are read as they are, not up to 1 s old
        "0",
        *flags,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*prefix, *cmd], stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + KVGATE_READY_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvgate exited ({proc.returncode}):\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/readyz", timeout=2).status_code == 200 and budget_live(url):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvgate not ready after {KVGATE_READY_S} s:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield url, cmd, proc
    finally:
        stop_process(proc)


def _samples(page: str) -> Iterator[Any]:
    for family in text_string_to_metric_families(page):
        yield from family.samples


def budget_live(url: str) -> bool:
    page = httpx.get(url + "/metrics", timeout=5).text
    return any(s.name == "kvgate_budget_mode" and s.labels["mode"] == "live" and s.value == 1 for s in _samples(page))


def decisions(url: str) -> dict[tuple[str, str], int]:
    page = httpx.get(url + "/metrics", timeout=5).text
    return {
        (s.labels["decision"], s.labels["reason"]): int(s.value)
        for s in _samples(page)
        if s.name == "kvgate_decisions_total" and s.value
    }


def run_scenario(s: Scenario, quick: bool = False, seed: int = 7) -> Result:
    res = Result(s)
    calls = s.workload(random.Random(seed), quick)
    # 1. Straight at the simulator.
    try:
        runner = SimRunner(s.sim).start()
    except StartupError as exc:
        res.direct_startup_failed, res.direct_oom = True, str(exc)
        res.direct = asyncio.run(replay(f"http://127.0.0.1:{free_port()}", calls, None))
    else:
        try:
            res.direct = asyncio.run(replay(runner.url, calls, runner.engine))
            ooms = runner.engine.ooms
            res.direct_oom = ooms[0] if ooms else None
        finally:
            runner.stop()
    # 2. A fresh simulator, kvgate in front.
    cfg = s.sim_gated or s.sim
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-demo-") as tmp,
        SimRunner(replace(cfg, cotenants=list(cfg.cotenants))) as sim,
    ):
        model_dir = write_model_folder(cfg.model, Path(tmp) / cfg.model)
        with kvgate(
            sim.url, model_dir, [*STEADY_FLAGS, *s.kvgate_flags], gpu_total_bytes(cfg.gpu), Path(tmp) / "kvgate.log"
        ) as (url, cmd, _):
            res.kvgate_command = cmd
            res.gated = asyncio.run(replay(url, calls, sim.engine, queue_depth))
            res.decisions = decisions(url)
        res.gated_ooms = list(sim.engine.ooms)
    return res


# ----- printing ---------------------------------------------------------------------------------
def _oom_summary(msg: str) -> str:
    head = msg.split(" Including non-PyTorch memory")[0]
    tail = ""
    if "reserved by PyTorch but unallocated" in msg:
        tail = " ... " + msg.split("allocated in private pools (e.g., CUDA Graphs), and ")[-1].split(" If reserved")[0]
    return head.replace("torch.OutOfMemoryError: ", "torch.OutOfMemoryError: ") + tail


def _counts(outcomes: list[Outcome]) -> str:
    c = Counter(o.status for o in outcomes)
    names = {
        200: "completed",
        0: "no answer",
        400: "rejected 400",
        429: "refused 429",
        500: "failed 500",
        503: "failed 503",
    }
    return ", ".join(
        f"{n} {names.get(code, f'HTTP {code}')}" for code, n in sorted(c.items(), key=lambda kv: (kv[0] != 200, kv[0]))
    )


def _clip(text: str, width: int = 150) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def report(res: Result, index: int) -> list[str]:
    s, lines = res.scenario, []
    lines.append(f"[{index}] {s.title}  ({s.seed})")
    lines.append(f"    simulated vLLM: {sim_flags(s.sim)}")
    n = len(res.direct)
    if res.direct_startup_failed:
        lines.append(f"    without kvgate: vLLM died in its start-up profile; {n} requests, {_counts(res.direct)}")
    else:
        lines.append(f"    without kvgate: {n} requests -> {_counts(res.direct)}")
    if res.direct_oom:
        lines.append(f"      {_clip(_oom_summary(res.direct_oom), 400)}")
    if s.note:
        lines.append(f"    {s.note}")
    if s.sim_gated:
        lines.append(f"    simulated vLLM: {sim_flags(s.sim_gated)}")
    flags = " ".join([*STEADY_FLAGS, *s.kvgate_flags])
    lines.append(
        f"    with kvgate (kvgate serve --model <config.json folder> --gpu-memory-bytes "
        f"{gpu_total_bytes((s.sim_gated or s.sim).gpu)} {flags}):"
    )
    survived = "no OOM" if not res.gated_ooms else f"OOM: {_oom_summary(res.gated_ooms[0])}"
    lines.append(f"      {len(res.gated)} requests -> {_counts(res.gated)}; simulator: {survived}")
    d = res.decisions
    parts = [f"{dec} {reason}: {n}" for (dec, reason), n in sorted(d.items())]
    lines.append(f"      kvgate decisions: {', '.join(parts)}")
    shown: set[int] = set()
    for o in res.gated:
        if o.status in (400, 429) and o.status not in shown:
            shown.add(o.status)
            lines.append(f"      {o.status} ({o.call.label}): {_clip(o.message)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller workload")
    p.add_argument("--scenario", choices=[s.key for s in SCENARIOS], action="append")
    args = p.parse_args(argv)
    import logging

    logging.getLogger("kvgate.sim").setLevel(logging.CRITICAL)
    started = time.monotonic()
    failed = False
    chosen = [s for s in SCENARIOS if not args.scenario or s.key in args.scenario]
    print(
        "kvgate demo: a simulated vLLM (GPU memory played allocation by allocation) without and with kvgate in front.\n"
    )
    for i, s in enumerate(chosen, 1):
        res = run_scenario(s, quick=args.quick)
        print("\n".join(report(res, i)) + "\n", flush=True)
        clean = all(o.status in (200, 400, 429) for o in res.gated)
        failed |= bool(res.gated_ooms) or not clean or res.direct_oom is None
    print(
        f"done in {time.monotonic() - started:.1f} s"
        + ("" if not failed else " -- kvgate did NOT protect every scenario (see above)")
    )
    return 1 if failed else 0
