"""`python -m bench.healthz_hostile [--rounds N] [--niceness N] [--out DIR]`: /healthz while issue
28's worst bodies are in flight, beside /healthz with nothing in flight, on the same kvgate.

kvgate runs as the soak runs it (bench/soak.py: the simulator behind it, the manifests' 2 GiB as
--max-process-memory-bytes, request templates trusted). Phase "idle" probes /healthz alone; phase
"hostile" probes it while each round sends, at once, bench/work_cost.py's bodies (four 28 MiB
bodies of 1,024 long prompts, 110,000 Responses items, 120,000 tool calls, 160,000 tools,
200,000 Anthropic blocks, 50,000 messages, 490,000 token ids) and three pass-through bodies a
gated route would prepare in a worker (499,998 ids to /detokenize, 490,000 values and 160,000
chat messages to /tokenize). `--cgroup-memory-bytes` runs kvgate under a real memory limit, a
cgroup of its own (bench/memory_cgroup.py), and reports its peak and OOM kills.

On a machine other work shares, a probe's latency is mostly the wait for a core: the load
average is recorded beside each phase, and `--niceness` runs kvgate's process and the prober at
another priority (negative needs root) to tell kvgate's own stalls from that wait. The
preparation workers keep their own +10 (kvgate/preparation_workers.py), relative to kvgate's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.memory_cgroup import MemoryCgroup, memory_cgroup
from bench.soak import GPU, KVGATE_FLAGS, MODEL, Backend, tree_memory, write_model
from bench.work_cost import hostile_bodies
from demo.replay import kvgate
from kvgate.sim.presets import gpu_total_bytes

ROUTE_PATH = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
IDLE_S = 10.0
MiB = 2**20


def passthrough_bodies() -> dict[str, tuple[str, bytes]]:
    return {
        "499,998 ids to /detokenize": ("/detokenize", json.dumps({"model": MODEL, "tokens": [5] * 499_998}).encode()),
        "490,000 values to /tokenize": (
            "/tokenize",
            json.dumps({"model": MODEL, "prompt": "of", "x": [[]] * 490_000}).encode(),
        ),
        "160,000 messages to /tokenize": (
            "/tokenize",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 160_000}).encode(),
        ),
    }


def requests() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of one round."""
    memory = hostile_bodies(model=MODEL)
    out = [(name, ROUTE_PATH[route], raw) for name, (route, raw) in memory.items()]
    prompts = next(r for r in out if r[0].startswith("1024 prompts"))
    out += [prompts] * 3  # four of them at once, as issue 28 sent them
    out += [(name, path, raw) for name, (path, raw) in passthrough_bodies().items()]
    return out


def poll_healthz(url: str, ready: Any, stop: Any, out: Any) -> None:
    """In a process of its own: the latency of each GET /healthz, every 10 ms, until `stop`;
    `ready` once the first answer came (the phase starts then)."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            latencies.append(time.perf_counter() - started)
            ready.set()
            time.sleep(0.01)  # the probe's period
    out.send(latencies)


def _send(url: str, request: tuple[str, str, bytes]) -> tuple[str, str]:
    """The request's name and its outcome: the status, with the error code of a 4xx or 5xx."""
    name, path, raw = request
    try:
        response = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=180)
    except httpx.HTTPError as exc:
        return name, type(exc).__name__
    if response.status_code < 400:
        return name, str(response.status_code)
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return name, f"{response.status_code} {code}"


def _quantiles(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    if not ordered:
        return {"probes": 0}

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 1)

    return {"probes": len(ordered), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(ordered[-1] * 1000, 1)}


def _renice(pid: int, niceness: int | None) -> None:
    if niceness is not None:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)


def run(
    rounds: int, niceness: int | None, cgroup_bytes: int | None = None, stalls: Path | None = None
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(memory_cgroup(cgroup_bytes)) if cgroup_bytes is not None else None
        result = _run(rounds, niceness, group, stalls)
        if group is not None:
            result["cgroup"] = {
                "version": group.version,
                "limit_mib": round(group.limit() / MiB, 1),
                "peak_mib": round(group.peak() / MiB, 1),  # page cache included
                "oom_kills": group.oom_kills(),
            }
    return result


def _run(rounds: int, niceness: int | None, group: MemoryCgroup | None, stalls: Path | None) -> dict[str, Any]:
    """kvgate under `group`'s limit (read by kvgate itself) when given, else told the manifests'
    limit with --max-process-memory-bytes; through bench/loop_stalls.py when `stalls` names its
    output."""
    ctx = mp.get_context("spawn")
    flags, prefix = KVGATE_FLAGS, []
    if group is not None:
        at = flags.index("--max-process-memory-bytes")
        flags, prefix = flags[:at] + flags[at + 2 :], group.command_prefix
    if stalls is not None:
        prefix = [*prefix, sys.executable, "-m", "bench.loop_stalls", "--out", str(stalls.resolve()), "--"]
    with tempfile.TemporaryDirectory(prefix="kvgate-healthz-") as tmp:
        model_dir = write_model(Path(tmp) / MODEL)
        backend = Backend(model_dir, Path(tmp) / "sim.log", seed=28)
        backend.start()
        try:
            log_path = Path(tmp) / "kvgate.log"
            with kvgate(backend.url, model_dir, flags, gpu_total_bytes(GPU), log_path, prefix) as (url, cmd, proc):
                _renice(proc.pid, niceness)
                time.sleep(10.0)  # the preparation workers load transformers and the tokenizer first

                def probe(work: Any) -> tuple[list[float], Any, tuple[float, float]]:
                    ready, stop, (rx, tx) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
                    prober = ctx.Process(target=poll_healthz, args=(url, ready, stop, tx), daemon=True)
                    prober.start()
                    assert prober.pid is not None
                    _renice(prober.pid, niceness)
                    if not ready.wait(120):
                        raise RuntimeError("the /healthz prober did not start")
                    load_before = os.getloadavg()[0]
                    result = work()
                    load_after = os.getloadavg()[0]
                    stop.set()
                    samples = rx.recv() if rx.poll(60) else []
                    prober.join(10)
                    return samples, result, (load_before, load_after)

                idle, _, idle_load = probe(lambda: time.sleep(IDLE_S))
                peak = [0]
                done = threading.Event()

                def sample() -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], tree_memory(proc.pid))
                        time.sleep(0.005)  # the sampling period of resident memory

                def hostile() -> list[tuple[str, str]]:
                    sampler = threading.Thread(target=sample)
                    sampler.start()
                    outcomes: list[tuple[str, str]] = []
                    try:
                        for _ in range(rounds):
                            batch = requests()
                            with ThreadPoolExecutor(len(batch)) as pool:
                                outcomes += pool.map(lambda r: _send(url, r), batch)
                    finally:
                        done.set()
                        sampler.join()
                    return outcomes

                busy, outcomes, busy_load = probe(hostile)
                alive = proc.poll() is None
                hwm = tree_memory(proc.pid, "VmHWM")
                replaced = log_path.read_text(errors="replace").count("a preparation worker was stopped")
        finally:
            backend.stop()
    return {
        # without this machine's paths: the interpreter and the temporary model folder
        "command": [("python" if c == sys.executable else c.replace(tmp, "<tmp>")) for c in cmd],
        "rounds": rounds,
        "niceness": niceness,
        "idle": {**_quantiles(idle), "load_average_before_after": idle_load},
        "hostile": {**_quantiles(busy), "load_average_before_after": busy_load},
        "outcomes": {f"{name}: {status}": n for (name, status), n in sorted(Counter(outcomes).items())},
        "peak_tree_rss_mib": round(peak[0] / MiB, 1),
        "tree_vmhwm_summed_mib": round(hwm / MiB, 1),
        "kvgate_alive": alive,
        "workers_replaced": replaced,
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--niceness", type=int, default=None, help="kvgate's and the prober's (negative: root)")
    parser.add_argument("--out", type=Path, default=None, help="append the result as a JSON line to DIR/runs.jsonl")
    parser.add_argument(
        "--cgroup-memory-bytes",
        type=int,
        default=None,
        help="run kvgate in a memory cgroup of its own with this limit (bench/memory_cgroup.py; root)",
    )
    parser.add_argument(
        "--stalls", type=Path, default=None, help="record the event loop's stalls here (bench/loop_stalls.py)"
    )
    args = parser.parse_args()
    result = run(args.rounds, args.niceness, args.cgroup_memory_bytes, args.stalls)
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "runs.jsonl").open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
