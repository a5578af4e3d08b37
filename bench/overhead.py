"""Part 2: what kvgate adds in front of a zero-cost backend, beside nginx.

Processes and cores (2-core machine): the proxy under test (kvgate, or nginx with one worker)
is pinned to core 0 with `taskset -c 0`; the zero-cost backend (bench/zero_backend.py, raw
asyncio + uvloop) and this load generator are pinned to core 1 (taskset / sched_setaffinity).
The load generator is a raw asyncio HTTP/1.1 client over keep-alive connections (tens of
microseconds a request, so it is not what limits the request rate). Arms are interleaved: every
repetition runs direct, kvgate and nginx in turn, for each measurement.

kvgate runs at its default log level (info): every decision is logged, as in production. The
proxy's CPU time (utime + stime of the whole process, /proc/PID/stat; nginx: its worker) is read
before and after each fixed-count phase, so CPU per request is counted over a known number of
requests and does not depend on how busy the other core was. Chat requests (one system prompt
and a different user message each, DISTINCT_CHATS bodies in turn, rendered by the model folder's
chat template) are the measure of issue 22's targets; completions rows are kept beside them for comparison with earlier runs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from bench.percentile import percentile
from demo.processes import stop_process
from kvgate.preparation_workers import status_bytes
from kvgate.sim.runner import free_port
from kvgate.token_segments import CACHE_ENTRIES

PROXY_CORE, LOAD_CORE = "0", "1"
# The tiny offline tokenizer the test suite builds (tests/support/tiny_model.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


# ----- a minimal HTTP/1.1 client ------------------------------------------------------------------
class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.r, self.w = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.w:
            self.w.close()

    async def post(self, path: str, body: bytes) -> tuple[int, float, float]:
        """(status, seconds to the first body byte, seconds to the end of the response)."""
        assert self.r
        assert self.w
        t0 = time.perf_counter()
        self.w.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        head = await self.r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        low = head.lower()
        if b"transfer-encoding: chunked" in low:
            first = None
            while True:
                size = int((await self.r.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                if first is None:
                    first = time.perf_counter() - t0
                if size == 0:
                    await self.r.readuntil(b"\r\n")
                    break
                await self.r.readexactly(size + 2)
            return status, first, time.perf_counter() - t0
        i = low.find(b"content-length:")
        n = int(low[i + 15 : low.index(b"\r\n", i)]) if i >= 0 else 0
        if n:
            await self.r.readexactly(1)
            first = time.perf_counter() - t0
            await self.r.readexactly(n - 1)
        else:
            first = time.perf_counter() - t0
        return status, first, time.perf_counter() - t0


_BODY_TURN = itertools.count()


async def _closed_loop(
    port: int,
    body: bytes | list[bytes],
    conc: int,
    total: int | None = None,
    seconds: float | None = None,
    path: str = "/v1/completions",
) -> tuple[list[tuple[float, float]], int, float]:
    """`conc` connections in a closed loop; latencies (ttfb, total), non-200 count, wall time.
    A list of bodies is sent in turn, the turn carried on from one call to the next (a phase
    starting over would resend the bodies the last one ended with, still in kvgate's cache)."""
    bodies = [body] if isinstance(body, bytes) else body
    conns = [Conn("127.0.0.1", port) for _ in range(conc)]
    await asyncio.gather(*(c.open() for c in conns))
    lat: list[tuple[float, float]] = []
    bad = 0
    left = [total or 10**9]
    start = time.perf_counter()
    stop_at = start + (seconds or 1e9)

    async def worker(c: Conn) -> None:
        nonlocal bad
        while left[0] > 0 and time.perf_counter() < stop_at:
            left[0] -= 1
            status, ttfb, t = await c.post(path, bodies[next(_BODY_TURN) % len(bodies)])
            if status != 200:
                bad += 1
            lat.append((ttfb, t))

    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - start
    for c in conns:
        c.close()
    return lat, bad, wall


# ----- processes ------------------------------------------------------------------------------------
def _wait_http(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        with suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready: {log.read_text()[-2000:]}")
        time.sleep(0.1)


@contextmanager
def _proc(cmd: list[str], log: Path, ready_url: str, what: str) -> Iterator[subprocess.Popen]:
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    try:
        _wait_http(ready_url, proc, what, log)
        yield proc
    finally:
        stop_process(proc)


def taskset(core: str) -> list[str]:
    return ["taskset", "-c", core] if shutil.which("taskset") else []


def model_folder(dest: Path) -> Path:
    """Llama-3.1-8B's config.json with the test suite's tiny offline BPE tokenizer (2048 ids,
    Llama-3-style chat template): kvgate tokenizes locally, as with a real model folder."""
    from kvgate.sim.presets import write_model_folder
    from support.tiny_model import build_tiny_model

    build_tiny_model(dest)
    (dest / "model.safetensors").unlink(missing_ok=True)
    cfg = json.loads((write_model_folder("llama-3.1-8b", dest.parent / "preset") / "config.json").read_text())
    tok_cfg = json.loads((dest / "config.json").read_text())
    cfg.update({k: tok_cfg[k] for k in ("bos_token_id", "eos_token_id") if k in tok_cfg})
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


NGINX_CONF = """
worker_processes 1;
worker_cpu_affinity 01;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream backend {{ server 127.0.0.1:{backend}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def nginx_binary() -> str | None:
    """nginx on PATH (Debian installs it in an sbin directory: add that to PATH), else None."""
    return shutil.which("nginx")


# ----- measurements -----------------------------------------------------------------------------------
def _pcts(xs: list[float]) -> dict[str, float]:
    """p50 and p99 by the benchmarks' one definition; NaN without samples."""
    return {name: _p(xs, q) for name, q in (("p50", 0.5), ("p99", 0.99))}


def _p(xs: list[float], q: float) -> float:
    value = percentile(xs, q)
    return float("nan") if value is None else value


def _latency_row(arm: str, scenario: str, samples: list[float], direct: dict[str, float]) -> dict[str, Any]:
    """One latency result, with what it adds over the direct arm's percentiles."""
    p = _pcts(samples)
    return {
        "arm": arm,
        "scenario": scenario,
        "added_p50_ms": round((p["p50"] - direct["p50"]) * 1e3, 3),
        "added_p99_ms": round((p["p99"] - direct["p99"]) * 1e3, 3),
        "latency_p50_ms": round(p["p50"] * 1e3, 3),
        "latency_p99_ms": round(p["p99"] * 1e3, 3),
        "requests_per_s": None,
        "samples": len(samples),
    }


def _cpu_seconds(pid: int) -> float:
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of a process and its children (kvgate's preparation workers, nginx's worker);
    0 for an arm without a proxy."""
    if pid is None:
        return 0.0
    children = Path(f"/proc/{pid}/task/{pid}/children")
    total = _cpu_seconds(pid)
    for kid in children.read_text().split() if children.exists() else []:
        with suppress(FileNotFoundError, ProcessLookupError):  # a child that just exited
            total += _cpu_seconds(int(kid))
    return total


def wait_until_idle(
    pid: int, timeout_s: float = 120.0, window_s: float = 0.5, busy_share: float = 0.05, windows: int = 3
) -> float:
    """Wait until a process and its children have used under `busy_share` of a core in each of
    `windows` windows of `window_s` in a row (at most `timeout_s`); the seconds waited.
    `kvgate serve` says ready before its preparation workers (kvgate/preparation_workers.py) have
    loaded transformers and the tokenizer: a few CPU seconds on the proxy's core, which counted as
    CPU per request in the first phases when the measurement started at once. Several quiet
    windows, not one: on a busy machine the workers (niced) can be starved for a moment."""
    started = time.monotonic()
    quiet = 0
    while quiet < windows and time.monotonic() - started < timeout_s:
        before = _tree_cpu_seconds(pid)
        time.sleep(window_s)
        quiet = quiet + 1 if _tree_cpu_seconds(pid) - before < busy_share * window_s else 0
    return time.monotonic() - started


def _rss_bytes(pid: int) -> int:
    return status_bytes(pid, b"VmRSS:") or 0


def chat_body(prompt: str) -> bytes:
    """A non-streaming chat request: a system prompt and `prompt` as the user's message."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}]
    return json.dumps({"model": "llama-3.1-8b", "messages": messages, "max_tokens": 16}).encode()


def chat_bodies(count: int) -> list[bytes]:
    """`count` chat requests with one system prompt and a different ~100-token user message each,
    as traffic is: kvgate's segment cache (kvgate/token_segments.py) reads the system prompt and
    the template's headers back and encodes each user message. Sent in turn, more of them than the
    cache keeps entries (`2 * CACHE_ENTRIES`) never find their user message cached."""
    from support.tiny_model import english_text

    return [chat_body(prompt_of(100))] + [chat_body(english_text(91, seed=1000 + i)) for i in range(count - 1)]


# The chat bodies the benchmark sends in turn (chat_bodies): twice the segment cache's entries.
DISTINCT_CHATS = 2 * CACHE_ENTRIES


def scenario_name(kind: str, concurrency: int) -> str:
    """A fixed-count phase's row name; completions keep the names earlier runs used."""
    return f"{'chat, ' if kind == 'chat' else ''}non-streaming, concurrency {concurrency}"


def prompt_of(tokens: int) -> str:
    """English-like prose in the tiny tokenizer's vocabulary, about `tokens` tokens long."""
    from support.tiny_model import english_text

    return english_text(max(1, int(tokens / 1.1)), seed=tokens)


def estimate_cost(folder: Path, sizes: tuple[int, ...] = (100, 1000, 8000), reps: int = 30) -> list[dict[str, Any]]:
    """Tokenization + memory estimate, in process, as kvgate runs them per request
    (RequestPipeline.predict: parse, local tokenizer, Predictor.predict)."""
    from kvgate.composition import Runtime
    from kvgate.settings import Settings

    rt = Runtime(
        Settings(model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984)
    )
    rt.configure_offline()
    out = []

    async def run() -> None:
        for n in sizes:
            # words of <= 6 letters: about one token each in the tiny BPE; measure the real count
            text = prompt_of(n)
            raw = json.dumps({"model": "llama-3.1-8b", "prompt": text, "max_tokens": 16}).encode()
            ev = await rt.pipeline.predict("completions", raw)
            tok_s, tot_s = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                ev = await rt.pipeline.predict("completions", raw)
                tot_s.append(time.perf_counter() - t0)
                tok_s.append(ev.tokenize_s)
            out.append(
                {
                    "target_tokens": n,
                    "prompt_tokens": ev.prediction.prompt_tokens,
                    "tokenize_ms_p50": round(_p(tok_s, 0.5) * 1e3, 3),
                    "tokenize_plus_estimate_ms_p50": round(_p(tot_s, 0.5) * 1e3, 3),
                    "estimate_ms_p50": round((_p(tot_s, 0.5) - _p(tok_s, 0.5)) * 1e3, 3),
                }
            )

    asyncio.run(run())
    return out


def chat_evaluation_cost(folder: Path, reps: int = 300) -> dict[str, Any]:
    """CPU of evaluating the benchmark's chat request in process, on the proxy's core, as kvgate
    does it per request (RequestPipeline.evaluate: parse, render, tokenize, predict, the
    never-fits check): the part of kvgate's CPU per request that is neither HTTP, the gate nor
    the relay."""
    from kvgate.composition import Runtime
    from kvgate.settings import Settings

    rt = Runtime(
        Settings(model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984)
    )
    rt.configure_offline()
    bodies = chat_bodies(reps + max(3, reps // 10))  # each user message new, as in the load phases
    cpu_s: list[float] = []
    tokenize_s: list[float] = []

    async def run() -> None:
        for raw in bodies[reps:]:  # warm-up
            await rt.pipeline.evaluate("chat", raw)
        for raw in bodies[:reps]:
            t0 = time.process_time()
            ev = await rt.pipeline.evaluate("chat", raw)
            cpu_s.append(time.process_time() - t0)
            tokenize_s.append(ev.tokenize_s)

    old_aff = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(PROXY_CORE)})
    try:
        asyncio.run(run())
    finally:
        os.sched_setaffinity(0, old_aff)
    return {
        "requests": reps,
        "evaluate_cpu_ms_mean": round(sum(cpu_s) / len(cpu_s) * 1e3, 4),
        "render_and_tokenize_ms_p50": round(_p(tokenize_s, 0.5) * 1e3, 4),
    }


def run_overhead(
    results_dir: Path,
    quick: bool = False,
    profile: bool = True,
    progress: Any = None,
    log: Any = print,
    tiny: bool = False,
) -> dict[str, Any]:
    reps = 2 if quick else 3
    n1, n32, nstream = (100, 400, 60) if quick else (500, 3000, 400)
    rps_s = 0.7 if quick else 3.0
    if tiny:  # the smoke test
        reps, n1, n32, nstream, rps_s = 1, 40, 200, 30, 0.5
    old_aff = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="kvgate-overhead-") as tmp:
        d = Path(tmp)
        folder = model_folder(d / "model")
        os.sched_setaffinity(0, {int(LOAD_CORE)})
        bport, kport, nport = free_port(), free_port(), free_port()
        backend_cmd = [*taskset(LOAD_CORE), sys.executable, "-m", "bench.zero_backend", "--port", str(bport)]
        kvgate_cmd = [
            *taskset(PROXY_CORE),
            sys.executable,
            "-m",
            "kvgate.cli",
            "serve",
            "--backend",
            f"http://127.0.0.1:{bport}",
            "--model",
            str(folder),
            "--listen",
            f"127.0.0.1:{kport}",
            "--max-num-batched-tokens",
            "8192",
            "--gpu-memory-bytes",
            "85520809984",
            "--gpu-probe",
            "none",
        ]
        arms = ["direct", "kvgate"]
        nginx = nginx_binary()
        result: dict[str, Any] = {
            "pinning": {
                "proxy_under_test": f"core {PROXY_CORE} (taskset -c {PROXY_CORE}; nginx: 1 worker, "
                "worker_cpu_affinity)",
                "backend_and_load_generator": f"core {LOAD_CORE}",
            },
            "kvgate_command": " ".join(kvgate_cmd[3:] if kvgate_cmd[0] == "taskset" else kvgate_cmd),
        }
        with (
            _proc(backend_cmd, d / "backend.log", f"http://127.0.0.1:{bport}/health", "backend"),
            _proc(kvgate_cmd, d / "kvgate.log", f"http://127.0.0.1:{kport}/readyz", "kvgate") as kproc,
        ):
            ports = {"direct": bport, "kvgate": kport}
            nginx_proc = None
            if nginx:
                for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
                    (d / sub).mkdir()
                (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, backend=bport, port=nport))
                nginx_cm = _proc(
                    [*taskset(PROXY_CORE), nginx, "-c", str(d / "nginx.conf"), "-p", str(d)],
                    d / "nginx.log",
                    f"http://127.0.0.1:{nport}/health",
                    "nginx",
                )
                nginx_proc = nginx_cm.__enter__()
                ports["nginx"] = nport
                arms.append("nginx")
                result["nginx_version"] = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
            else:
                result["nginx_version"] = "not installed (apt-get install -y nginx)"
            try:
                prompt = prompt_of(100)
                body = json.dumps({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 16}).encode()
                sbody = json.dumps(
                    {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 16, "stream": True}
                ).encode()
                kinds: dict[str, tuple[bytes | list[bytes], str]] = {
                    "completions": (body, "/v1/completions"),
                    "chat": (chat_bodies(DISTINCT_CHATS), "/v1/chat/completions"),
                }
                pids = {"direct": None, "kvgate": kproc.pid, "nginx": nginx_proc.pid if nginx_proc else None}
                lat: dict[tuple[str, str, int], list[float]] = {}
                fixed_rps: dict[tuple[str, str, int], list[float]] = {}
                cpu: dict[tuple[str, str, int], list[float]] = {}  # [cpu seconds, requests]
                ttfb: dict[str, list[float]] = {a: [] for a in arms}
                stotal: dict[str, list[float]] = {a: [] for a in arms}
                rps: dict[str, list[float]] = {a: [] for a in arms}
                errors: dict[str, int] = {a: 0 for a in arms}
                result["kvgate_start_up_settled_s"] = round(wait_until_idle(kproc.pid), 1)
                # warm-up
                for a in arms:
                    for kbody, path in kinds.values():
                        asyncio.run(_closed_loop(ports[a], kbody, 8, total=400, path=path))
                for rep in range(reps):
                    order = arms if rep % 2 == 0 else arms[::-1]
                    for a in order:
                        for conc, n in ((1, n1), (32, n32)):
                            for kind, (kbody, path) in kinds.items():
                                cpu0 = _tree_cpu_seconds(pids[a])
                                ls, bad, wall = asyncio.run(_closed_loop(ports[a], kbody, conc, total=n, path=path))
                                spent = cpu.setdefault((a, kind, conc), [0.0, 0])
                                spent[0] += _tree_cpu_seconds(pids[a]) - cpu0
                                spent[1] += len(ls)
                                lat.setdefault((a, kind, conc), []).extend(t for _, t in ls)
                                fixed_rps.setdefault((a, kind, conc), []).append(len(ls) / wall)
                                errors[a] += bad
                        ls, bad, _ = asyncio.run(_closed_loop(ports[a], sbody, 1, total=nstream))
                        ttfb[a].extend(f for f, _ in ls)
                        stotal[a].extend(t for _, t in ls)
                        errors[a] += bad
                        ls, bad, wall = asyncio.run(_closed_loop(ports[a], body, 64, seconds=rps_s))
                        rps[a].append(len(ls) / wall)
                        errors[a] += bad
                        if progress is not None:
                            progress.update(1)
                rss = _rss_bytes(kproc.pid)
                rows = []
                base = {(k, c): _pcts(lat[("direct", k, c)]) for k in kinds for c in (1, 32)}
                sbase_f, sbase_t = _pcts(ttfb["direct"]), _pcts(stotal["direct"])
                for a in arms:
                    for kind in kinds:
                        for c in (1, 32):
                            row = _latency_row(a, scenario_name(kind, c), lat[(a, kind, c)], base[(kind, c)])
                            spent_s, count = cpu[(a, kind, c)]
                            row["closed_loop_requests_per_s"] = round(_p(fixed_rps[(a, kind, c)], 0.5), 1)
                            row["proxy_cpu_ms_per_request"] = (
                                None if pids[a] is None else round(spent_s / count * 1e3, 4)
                            )
                            rows.append(row)
                    rows.append(_latency_row(a, "streaming 16 tokens, concurrency 1, TTFB", ttfb[a], sbase_f))
                    rows.append(_latency_row(a, "streaming 16 tokens, concurrency 1, total", stotal[a], sbase_t))
                    rows.append(
                        {
                            "arm": a,
                            "scenario": "max throughput, concurrency 64",
                            "added_p50_ms": None,
                            "added_p99_ms": None,
                            "requests_per_s": round(_p(rps[a], 0.5), 1),
                            "requests_per_s_each_rep": [round(x, 1) for x in rps[a]],
                        }
                    )
                chat_cpu_s, chat_count = cpu[("kvgate", "chat", 32)]
                result.update(
                    {
                        "rows": rows,
                        "errors": errors,
                        "repetitions": reps,
                        "kvgate_log_level": "info (kvgate's default: every decision logged)",
                        "kvgate_cpu_ms_per_request": round(chat_cpu_s / chat_count * 1e3, 4),
                        "kvgate_cpu_measured_over": f"{chat_count} chat requests at concurrency 32",
                        "kvgate_rss_bytes": rss,
                        "requests": {
                            "concurrency_1": n1,
                            "concurrency_32": n32,
                            "stream": nstream,
                            "throughput_seconds": rps_s,
                        },
                    }
                )
                if profile:
                    result["profile"] = profile_kvgate(
                        kproc.pid, ports["kvgate"], kinds["chat"][0], results_dir, 2.0 if quick else 8.0, log
                    )
            finally:
                if nginx_proc is not None:
                    nginx_cm.__exit__(None, None, None)
        os.sched_setaffinity(0, old_aff)
        result["estimate_cost"] = estimate_cost(folder, reps=2 if tiny else 5 if quick else 30)
        result["chat_evaluation_cost"] = chat_evaluation_cost(folder, reps=5 if tiny else 50 if quick else 300)
    return result


# ----- py-spy -------------------------------------------------------------------------------------------
def _pyspy() -> str | None:
    return shutil.which("py-spy") or next(
        (p for p in (str(Path(sys.executable).parent / "py-spy"),) if Path(p).exists()), None
    )


def profile_kvgate(
    pid: int, port: int, body: bytes | list[bytes], results_dir: Path, seconds: float, log: Any = print
) -> dict[str, Any]:
    """py-spy record (raw collapsed stacks) of kvgate under concurrency-64 chat load; top frames."""
    spy = _pyspy()
    if spy is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    raw = results_dir / "pyspy-kvgate.txt"
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)
    cpu0 = _cpu_seconds(pid)
    ls, _, _wall = asyncio.run(_closed_loop(port, body, 64, seconds=seconds, path="/v1/chat/completions"))
    cpu_ms = (_cpu_seconds(pid) - cpu0) / max(1, len(ls)) * 1e3
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed: {err.decode()[-500:]}"}
    out = summarise_profile(raw, requests=len(ls), cpu_ms_per_request=cpu_ms)
    out["cpu_ms_per_request_while_sampled"] = round(cpu_ms, 4)
    out["rate_hz"] = 250
    return out


# Components, matched from the leaf of each sampled stack upwards: a sample counts for the
# first (deepest) frame that belongs to one of them.
COMPONENTS = (
    (
        "tokenization (transformers/tokenizers, kvgate/tokens.py)",
        ("tokenization_utils", "tokenizers", "kvgate/tokens.py", "kvgate/chat_template.py"),
    ),
    ("memory estimate (kvgate/predict.py, kvgate/memory/)", ("kvgate/predict.py", "kvgate/memory/")),
    ("admission gate (kvgate/gate/)", ("kvgate/gate/",)),
    ("request parsing (kvgate/openai.py, kvgate/request.py)", ("kvgate/openai.py", "kvgate/request.py")),
    (
        "kvgate proxy/server code (kvgate/backend.py, kvgate/http/, kvgate/composition.py, kvgate/pipeline.py)",
        ("kvgate/backend.py", "kvgate/http/", "kvgate/composition.py", "kvgate/pipeline.py"),
    ),
    ("upstream HTTP client (kvgate/upstream.py, httpx)", ("kvgate/upstream.py", "httpx/", "httpcore/")),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("telemetry loop (kvgate/telemetry/)", ("kvgate/telemetry/",)),
    ("JSON (json/)", ("json/",)),
    ("HTTP server (uvicorn, starlette, fastapi)", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools")),
    ("asyncio event loop", ("asyncio/", "uvloop")),
)


def summarise_profile(
    raw: Path, requests: int, top: int = 25, cpu_ms_per_request: float | None = None
) -> dict[str, Any]:
    self_s: dict[str, int] = {}
    incl: dict[str, int] = {}
    comp: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        frames = stack.split(";")
        total += count
        leaf = frames[-1]
        self_s[leaf] = self_s.get(leaf, 0) + count
        for f in set(frames):
            incl[f] = incl.get(f, 0) + count
        name = "other"
        for f in reversed(frames):
            hit = next((c for c, keys in COMPONENTS if any(k in f for k in keys)), None)
            if hit:
                name = hit
                break
        comp[name] = comp.get(name, 0) + count

    def tbl(d: dict[str, int], n: int = top) -> list[dict[str, Any]]:
        return [
            {"frame": f, "share": round(c / total, 4), "samples": c}
            for f, c in sorted(d.items(), key=lambda kv: -kv[1])[:n]
        ]

    kv_incl = {f: c for f, c in incl.items() if "(kvgate/" in f}
    components = [
        {
            "component": c,
            "share": round(v / total, 4),
            "ms_per_request": None if cpu_ms_per_request is None else round(v / total * cpu_ms_per_request, 4),
        }
        for c, v in sorted(comp.items(), key=lambda kv: -kv[1])
    ]
    return {
        "samples": total,
        "requests": requests,
        "file": str(raw.name),
        "components": components,
        "top_self": tbl(self_s),
        "top_inclusive_kvgate": tbl(kv_incl, 20),
        "top_inclusive": tbl(incl),
    }
