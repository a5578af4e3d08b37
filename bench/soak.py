"""`python -m bench --soak`: kvgate under a long, rude load, with the backend killed and hung.

The simulator (`python -m kvgate.sim`, a tiny model that answers fast) and kvgate run as
subprocesses on free 127.0.0.1 ports. A seeded mix of requests is driven at a fixed concurrency:
normal completions and chat (streaming or not), 30 % that disconnect at a random point (before
the response head, mid-stream, or while a non-streaming answer is being generated), and 5 %
hostile ones (malformed or deeply nested JSON, huge numbers, lone surrogates, prompts past the
context, bad fields, a request chat template, gzip, too many or too large headers, a lying
Content-Length, a stalled upload, wrong method or route). When 40 % of the requests have been
sent the backend is SIGKILLed and restarted on the same port; at 70 % it is SIGSTOPped for a few
seconds, then SIGCONTed. Meanwhile a separate process polls /healthz (so the load generator's own
event loop does not inflate the latencies) and kvgate's RSS and open fds are read from /proc.

What counts as a kvgate 5xx: any 5xx kvgate generated itself (no `x-kvgate-kv-blocks` header:
the request was never admitted and relayed) except the honest answers to a backend fault given
while the fault lasted (from the SIGKILL until the simulator answers /health again plus
FAULT_GRACE_S, and from the SIGSTOP until SIGCONT plus FAULT_GRACE_S) with one of the
backend-fault codes in BACKEND_FAULT_CODES. A plain-text 500, a 5xx to a hostile body (but for
a memory-hostile one, admitted and forwarded like a normal request), or a backend-fault code
outside those windows all count. A 5xx relayed from the backend (admitted, so
it carries kvgate's headers) is counted apart as "backend 5xx, relayed".

The other measures: RSS from the end of the warm-up (the first WARMUP_SHARE of the answers) to
the end, once drained; open fds idle before the first request to idle after the drain (under
load they count the clients' connections); /healthz p99 over the polls made while a hostile
request was in flight (and, to compare, over the others); the ledger (kvgate's in-flight,
reserved and queue gauges) once drained. The hang's target is issue 15's: while the backend
does not answer, new arrivals wait in kvgate's queue instead of piling onto it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bench.memory_cgroup import MemoryCgroup, memory_cgroup
from bench.work_cost import hostile_bodies
from demo.processes import stop_process
from demo.replay import WORDS, kvgate
from kvgate.sim.presets import gpu_total_bytes, model_config
from kvgate.sim.runner import free_port

MODEL = "tiny-llama"
GPU = "l4-24gb"
MAX_MODEL_LEN = 1024
# A 256 MiB KV pool: room for every request of the soak at once, and a restart in seconds (the
# simulator builds its block pool in Python: 9 s for the million blocks the L4's memory would give).
KV_CACHE_BYTES = 256 * 2**20
# Simulated seconds per wall second: the tiny model's steps are short already; this keeps a
# request's life in tens of milliseconds so 20,000 of them fit a few minutes on two cores.
SPEEDUP = 100.0
PROCESS_MEMORY = 2 * 2**30  # deploy/ gives kvgate a 2 GiB memory limit
# kvgate's defaults otherwise (client read timeouts included: with shorter ones, a load
# generator starved of CPU on a busy machine saw its kept-alive connections timed out).
KVGATE_FLAGS = [
    "--served-model-name",
    MODEL,
    # The manifests' memory limit (deploy/): issue 28's bodies must stay inside it.
    "--max-process-memory-bytes",
    str(PROCESS_MEMORY),
    # Request templates are rendered (sandboxed, in a worker) rather than refused untrusted.
    "--trust-request-chat-template",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
]
DISCONNECT_SHARE = 0.30
HOSTILE_SHARE = 0.05
# Issue 28's bodies (bench/work_cost.py, each up to 28 MiB) and request templates, on top.
MEMORY_HOSTILE_SHARE = 0.02
KILL_AT, HANG_AT = 0.4, 0.7  # fractions of the requests sent when each fault starts
CLIENT_TIMEOUT_S = 90.0  # a request with no answer by then is "no answer" (a failure)
FAULT_GRACE_S = 2.0
HANG_PROBES = 8  # requests sent once kvgate says the backend hangs
HANG_PROBE_HELD_S = 2.0  # how long they wait at least before the backend answers again
HANG_GIVE_UP_S = 30.0
# Codes of kvgate's own 5xx that are honest while the backend is dead or hung (kvgate/errors.py).
BACKEND_FAULT_CODES = frozenset({"backend_unavailable", "kvgate_not_ready", "backend_error", "backend_timeout"})
WARMUP_SHARE = 0.1
BACKEND_NICENESS = 10  # RSS and fds are compared from the end of the warm-up to the end

TARGETS = {
    "kvgate_5xx": "0",
    "ledger_after": "0",
    "rss_growth": "< 5 %",
    "fd_growth": "< 5 %",
    "hang_queued": "> 0",
    "healthz_p99_hostile_ms": "< 50 ms",
    "peak_rss_tree": f"< {PROCESS_MEMORY // 2**20:,} MiB",
    "kvgate_restarts": "0",
    "no_answer": "0",
}

# Words the simulator's TextModel can emit as one token (kvgate/sim/tokens.py needs some of them).
_SIM_WORDS = ["of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by"]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


# ----- the model folder ------------------------------------------------------------------------
def write_model(dest: Path) -> Path:
    """tiny-llama's config.json plus a word-level tokenizer with a chat template, so kvgate and
    the simulator both tokenize locally: with no tokenizer files kvgate would ask the backend's
    /tokenize, and a hung backend would stall tokenization instead of reaching the gate."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(model_config(MODEL), indent=2) + "\n")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>", *dict.fromkeys(WORDS + _SIM_WORDS)])}
    vocab |= {f"<|{r}|>": len(vocab) + k for k, r in enumerate(("system", "user", "assistant"))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN,
    ).save_pretrained(dest)
    return dest


# ----- the simulator, a process the soak can kill and stop -------------------------------------
class Backend:
    """`python -m kvgate.sim` on a fixed port; start() again after a kill reuses the port."""

    def __init__(self, model_dir: Path, log_path: Path, seed: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "kvgate.sim",
            "--model",
            str(model_dir),
            "--gpu",
            GPU,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--speedup",
            str(SPEEDUP),
            "--served-model-name",
            MODEL,
            "--seed",
            str(seed),
            "--port",
            str(self.port),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> None:
        with self.log_path.open("ab") as log:
            # Below kvgate's priority: on a small shared machine the stand-in for a GPU server
            # should not take kvgate's CPU (vLLM runs on its own cores), or /healthz would
            # measure the simulator's steps.
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(BACKEND_NICENESS)
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited ({self.proc.returncode}):\n{self.log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()  # not left running behind the error
        raise TimeoutError(f"simulator not up after {timeout_s:g} s:\n{self.log_path.read_text()}")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot take SIGTERM
            stop_process(self.proc)


# ----- the traffic -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shot:
    """One request of the soak."""

    index: int
    kind: str  # normal | disconnect | hostile
    variant: str
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    stream: bool = False
    cut_after_s: float | None = None  # disconnect: hang up after this long...
    cut_after_chunks: int | None = None  # ...or after this many streamed chunks
    raw: bytes | None = None  # sent as is on a socket (a lying head or a stalled upload)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _generation(rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.5:
        body: dict[str, Any] = {"model": MODEL, "prompt": _words(rng, rng.randint(4, 60))}
        path = "/v1/completions"
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": _words(rng, rng.randint(4, 60))}]}
        path = "/v1/chat/completions"
    body |= {"max_tokens": max_tokens, "stream": stream}
    return path, body


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _raw_post(path: str, head: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}\r\n".encode() + body


# Each hostile variant: (name, builder(rng) -> Shot fields). Every one must get a 4xx.
def _hostile(rng: random.Random, index: int) -> Shot:
    name = rng.choice(HOSTILE_VARIANTS)
    chat = b'{"model":"tiny-llama","max_tokens":4,"messages":[{"role":"user","content":'
    bodies: dict[str, Callable[[], bytes]] = {
        "malformed_json": lambda: b'{"model":"tiny-llama","prompt":"hi","max_tokens":4',
        "not_an_object": lambda: b"[1, 2, 3]",
        "deep_nesting": lambda: b'{"prompt":' + b"[" * 20000 + b"]" * 20000 + b"}",
        "huge_integer": lambda: b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}",
        "huge_n": lambda: b'{"prompt":"hi","max_tokens":4,"n":1e309}',
        "surrogate_prompt": lambda: b'{"prompt":"a \\ud800 b","max_tokens":4}',
        "surrogate_model": lambda: b'{"model":"\\udfff","prompt":"hi","max_tokens":4}',
        "surrogate_message": lambda: chat + b'"x\\udbff y"}]}',
        "invalid_utf8": lambda: b'{"prompt":"\xff\xfe\xfd","max_tokens":4}',
        "prompt_past_context": lambda: _json({"prompt": _words(rng, 3 * MAX_MODEL_LEN), "max_tokens": 4}),
        "megabyte_prompt": lambda: _json({"prompt": "x" * (1 << 20), "max_tokens": 4}),
        "bad_fields": lambda: _json(rng.choice(BAD_FIELDS)),
        "request_chat_template": lambda: (
            chat + b'"hi"}],"chat_template":"{% for i in range(100) %}{{ \'ab \' * 33333 }}{% endfor %}"}'
        ),
        "gzip": lambda: b"\x1f\x8b\x08\x00" + rng.randbytes(32),
        "too_many_headers": lambda: b'{"prompt":"hi","max_tokens":4}',
        "huge_header": lambda: b'{"prompt":"hi","max_tokens":4}',
        "wrong_method": lambda: b"",
        "trailing_slash": lambda: b'{"prompt":"hi","max_tokens":4}',
    }
    path = "/v1/chat/completions" if name in ("surrogate_message", "request_chat_template") else "/v1/completions"
    headers: tuple[tuple[str, str], ...] = ()
    method = "POST"
    if name == "gzip":
        headers = (("content-encoding", "gzip"),)
    elif name in ("too_many_headers", "huge_header"):  # raw: see exchange_raw
        many = "".join(f"x-filler-{k}: 1\r\n" for k in range(300))
        head = many if name == "too_many_headers" else f"x-filler: {'a' * (256 * 1024)}\r\n"
        body = bodies[name]()
        return Shot(
            index, "hostile", name, path=path, raw=_raw_post(path, f"{head}Content-Length: {len(body)}\r\n", body)
        )
    elif name == "wrong_method":
        method = "GET"
    elif name == "trailing_slash":
        path = "/v1/completions/"
    elif name == "lying_length":  # says 64 MiB, sends a few bytes, waits
        raw = _raw_post(path, f"Content-Length: {64 << 20}\r\n", b'{"prompt": "')
        return Shot(index, "hostile", name, path=path, raw=raw)
    elif name == "stalled_upload":  # a plausible length, half a body, then nothing
        body = b'{"prompt":"hi","max_tokens":4}'
        return Shot(
            index, "hostile", name, path=path, raw=_raw_post(path, f"Content-Length: {len(body)}\r\n", body[:12])
        )
    return Shot(index, "hostile", name, method=method, path=path, body=bodies[name](), headers=headers)


BAD_FIELDS: list[dict[str, Any]] = [
    {"prompt": 5, "max_tokens": "many"},
    {"messages": "hello", "max_tokens": 4},
    {"prompt": "hi", "temperature": "hot"},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "logprobs": 10**6},
]
HOSTILE_VARIANTS = (
    "malformed_json",
    "not_an_object",
    "deep_nesting",
    "huge_integer",
    "huge_n",
    "surrogate_prompt",
    "surrogate_model",
    "surrogate_message",
    "invalid_utf8",
    "prompt_past_context",
    "megabyte_prompt",
    "bad_fields",
    "request_chat_template",
    "gzip",
    "too_many_headers",
    "huge_header",
    "wrong_method",
    "trailing_slash",
    "lying_length",
    "stalled_upload",
)


# Issue 28's memory-hostile bodies, by variant name: the work_cost bodies and request templates
# that built gigabytes (tests/support/hostile_templates.py STRING_BUILDERS has them all).
MEMORY_BODIES = {
    "memory_1024_long_prompts": "1024 prompts x 29,000 chars",
    "memory_function_calls": "110,000 function_call items (Responses)",
    "memory_tool_calls": "120,000 tool_calls in one chat message",
    "memory_tools": "160,000 tools",
    "memory_anthropic_blocks": "200,000 Anthropic text blocks (/v1/messages)",
    "memory_chat_messages": "50,000 chat messages",
    "template_join_range": "{{ range(99999)|join('x' * 99999) }}",
    "template_tilde_doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "template_percent_center_format": "{{ '%536870912s' % 'x' }}{{ 'x'|center(536870912) }}{{ '{:>536870912}'.format('x') }}",
    # Pass-through bodies that cost vLLM's API server seconds (issue 28): a 30 MiB prompt and a
    # chat to /tokenize, half a million ids to /detokenize.
    "passthrough_tokenize_30mib": "30 MiB prompt to /tokenize",
    "passthrough_tokenize_chat": "40,000 chat messages to /tokenize",
    "passthrough_detokenize": "499,998 ids to /detokenize",
}
PASSTHROUGH_BODIES = {
    "30 MiB prompt to /tokenize": ("/tokenize", {"model": MODEL, "prompt": "of " * (10 * 2**20)}),
    "40,000 chat messages to /tokenize": (
        "/tokenize",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 40_000},
    ),
    "499,998 ids to /detokenize": ("/detokenize", {"model": MODEL, "tokens": [5] * 499_998}),
}
ROUTE_PATHS_BY_NAME = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@functools.cache
def _memory_body(name: str) -> tuple[str, bytes]:
    """(path, body): built once, shared by every shot of the variant (a 28 MiB body each)."""
    if name.startswith("template_"):
        chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        return ROUTE_PATHS_BY_NAME["chat"], _json(chat | {"chat_template": MEMORY_BODIES[name]})
    if name.startswith("passthrough_"):
        path, body = PASSTHROUGH_BODIES[MEMORY_BODIES[name]]
        return path, _json(body)
    route, raw = hostile_bodies(MODEL)[MEMORY_BODIES[name]]
    return ROUTE_PATHS_BY_NAME[route], raw


def traffic(n: int, seed: int) -> list[Shot]:
    """The soak's requests, the same for the same (n, seed)."""
    rng = random.Random(seed)
    shots = []
    for i in range(n):
        roll = rng.random()
        if roll < MEMORY_HOSTILE_SHARE:
            name = rng.choice(list(MEMORY_BODIES))
            path, raw = _memory_body(name)
            shots.append(Shot(i, "hostile", name, path=path, body=raw))
            continue
        roll -= MEMORY_HOSTILE_SHARE
        if roll < HOSTILE_SHARE:
            shots.append(_hostile(rng, i))
            continue
        if roll < HOSTILE_SHARE + DISCONNECT_SHARE:
            stage = rng.choice(("before_head", "mid_stream", "waiting"))
            stream = stage == "mid_stream" or (stage == "before_head" and rng.random() < 0.5)
            path, body = _generation(rng, stream, rng.randint(32, 128))
            shot = Shot(
                i,
                "disconnect",
                stage,
                path=path,
                body=_json(body),
                stream=stream,
                cut_after_s=rng.uniform(0.0, 0.01) if stage == "before_head" else rng.uniform(0.02, 0.3),
                cut_after_chunks=rng.randint(1, 6) if stage == "mid_stream" else None,
            )
            shots.append(shot)
            continue
        stream = rng.random() < 0.5
        path, body = _generation(rng, stream, rng.randint(4, 32))
        shots.append(Shot(i, "normal", ("stream" if stream else "plain"), path=path, body=_json(body), stream=stream))
    return shots


# ----- one request -----------------------------------------------------------------------------
@dataclass
class Answer:
    index: int
    kind: str
    variant: str
    outcome: str  # "200", "429", ... | "client disconnect" | "no answer"
    started: float  # time.monotonic(), shared by every process on the machine
    ended: float
    code: str | None = None  # the error body's code
    relayed: bool = False  # kvgate admitted it and relayed the backend's answer
    queue_wait_s: float | None = None
    stream_error: bool = False
    request_id: str = ""  # the x-request-id it was sent with: kvgate's log lines about it name it


def _error_code(raw: bytes) -> str | None:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        code = json.loads(raw)["error"]["code"]
        return str(code) if code is not None else None
    return None


async def _send(client: httpx.AsyncClient, shot: Shot, answer: Answer) -> None:
    """Fills `answer`; a disconnect shot hangs up at its point, raising CancelledError inside."""
    headers = [("content-type", "application/json"), *shot.headers]
    if not any(name.lower() == "x-request-id" for name, _ in headers):
        answer.request_id = f"soak-{shot.index}"
        headers.append(("x-request-id", answer.request_id))
    async with client.stream(shot.method, shot.path, content=shot.body, headers=headers) as r:
        answer.outcome = str(r.status_code)
        answer.relayed = "x-kvgate-kv-blocks" in r.headers
        if "x-kvgate-queue-wait" in r.headers:
            answer.queue_wait_s = float(r.headers["x-kvgate-queue-wait"])
        chunks, tail = 0, b""
        async for chunk in r.aiter_raw():
            chunks += 1
            if shot.cut_after_chunks is not None and chunks >= shot.cut_after_chunks:
                answer.outcome = "client disconnect"
                return  # leaving the block closes the connection mid-stream
            tail = (tail + chunk)[-65536:]
        if r.status_code >= 400:
            answer.code = _error_code(tail)
        elif shot.stream and b'"error"' in tail:
            answer.stream_error = True
            answer.code = next(iter(re.findall(rb'"code":\s*"([a-z_]+)"', tail)), b"").decode() or None


def exchange_raw(url: str, raw: bytes, timeout_s: float) -> bytes:
    """Writes `raw` on a blocking socket and reads until kvgate closes or has answered.

    Blocking, in a thread: when kvgate answers a head it refuses and closes while the client is
    still writing, asyncio's and anyio's streams close themselves on the failed write and never
    read the answer that did arrive (httpx reported a ReadError for a 431 that was there)."""
    host, port = url.removeprefix("http://").split(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if sep and length and len(body) >= int(length.group(1)):
                    break
    return data


# Raw exchanges block a thread each (a stalled upload for kvgate's 30 s body timeout).
_RAW_THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="soak-raw")


async def _send_raw(url: str, shot: Shot, answer: Answer) -> None:
    assert shot.raw is not None
    data = await asyncio.get_running_loop().run_in_executor(_RAW_THREADS, exchange_raw, url, shot.raw, CLIENT_TIMEOUT_S)
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    answer.outcome = m.group(1).decode() if m else "closed without an answer" if not data else "garbled answer"
    answer.code = _error_code(data.partition(b"\r\n\r\n")[2])


def client_for(url: str) -> httpx.AsyncClient:
    """One connection, kept alive between requests."""
    return httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=1))


async def shoot(client: httpx.AsyncClient, url: str, shot: Shot) -> Answer:
    answer = Answer(shot.index, shot.kind, shot.variant, "no answer", time.monotonic(), 0.0)
    try:
        if shot.raw is not None:
            await asyncio.wait_for(_send_raw(url, shot, answer), CLIENT_TIMEOUT_S)
        elif shot.cut_after_s is not None and shot.cut_after_chunks is None:
            # A client of its own that hangs up by closing its connection: a request cancelled
            # inside httpx can leave a pooled connection marked busy, and the next request on
            # that client would wait for it forever (seen as 90 s "no answer" on kvgate's side).
            async with client_for(url) as own:
                try:
                    await asyncio.wait_for(_send(own, shot, answer), shot.cut_after_s)
                except TimeoutError:
                    answer.outcome = "client disconnect"
        else:
            await asyncio.wait_for(_send(client, shot, answer), CLIENT_TIMEOUT_S)
    except TimeoutError:
        answer.outcome = "no answer"
    except (httpx.HTTPError, OSError) as exc:
        # kvgate may answer a hostile head and close while the client still writes.
        if answer.outcome == "no answer":
            answer.outcome = f"connection error ({type(exc).__name__})"
    answer.ended = time.monotonic()
    return answer


# ----- watching kvgate -------------------------------------------------------------------------
def poll_healthz(url: str, stop: Any, out: Any, interval_s: float = 0.02) -> None:
    """Runs in its own process: (time, seconds) of GET /healthz on one kept-alive connection
    (a new one after an error), until `stop` is set."""
    samples: list[tuple[float, float]] = []
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = client.get("/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            samples.append((t0, time.monotonic() - t0 if ok else float("inf")))
            time.sleep(interval_s)
    out.send(samples)


def proc_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of `pid` from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def tree_memory(pid: int, field: str = "VmRSS") -> int:
    """`field` of `pid` and its descendants (kvgate's preparation workers), summed: what the
    container's memory limit counts."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
    return total


def scrape(url: str) -> dict[str, float]:
    """kvgate's /metrics as {name{labels}: value} (the gauges and counters the report reads)."""
    page = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


LEDGER = (
    "kvgate_in_flight_requests",
    "kvgate_reserved_kv_blocks",
    "kvgate_reserved_transient_bytes",
    "kvgate_queue_depth",
)


# ----- the run ---------------------------------------------------------------------------------
@dataclass
class Faults:
    """When each fault happened (time.monotonic())."""

    kill: float | None = None
    back_up: float | None = None
    stop: float | None = None
    cont: float | None = None
    hang_queue_depth_max: float = 0.0
    hang_declared: float | None = None  # when /readyz first said 503 during the hang
    hang_probes: list[Answer] = field(default_factory=list)
    restart_s: float | None = None

    def windows(self) -> list[tuple[float, float]]:
        w = []
        if self.kill is not None and self.back_up is not None:
            w.append((self.kill, self.back_up + FAULT_GRACE_S))
        if self.stop is not None and self.cont is not None:
            w.append((self.stop, self.cont + FAULT_GRACE_S))
        return w


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    seed: int
    hang_s: float
    answers: list[Answer]
    faults: Faults
    healthz: list[tuple[float, float]]
    usage: list[tuple[float, int, int, float]]  # (time, rss, fds, the machine's 1-minute load average)
    tree_rss: list[tuple[float, int]]  # (time, RSS of kvgate and its preparation workers), every 50 ms
    idle_usage: tuple[int, int]  # before the first request
    warm_usage: tuple[int, int]
    end_usage: tuple[int, int]
    ledger_after: dict[str, float]
    metrics_after: dict[str, float]
    load_s: float
    kvgate_command: list[str] = field(default_factory=list)
    sim_command: list[str] = field(default_factory=list)
    kvgate_log_errors: list[str] = field(default_factory=list)
    tree_hwm_end: int = 0  # the live processes' own peaks (VmHWM), summed, at the end
    kvgate_exited: int | None = None  # its exit status if it died during the soak
    workers_replaced: int = 0  # preparation workers stopped past their grant or time
    cgroup: dict[str, Any] | None = None  # kvgate's own memory cgroup (bench/memory_cgroup.py), if it ran in one
    kvgate_log: str = ""  # the whole of it, to quote what it said about a failed request
    wall_minus_monotonic: float = 0.0  # time.time() - time.monotonic(): the log's clock from the answers'


async def _probe(url: str, i: int) -> Answer:
    """One short completion sent while the backend hangs (on a connection of its own)."""
    path, body = _generation(random.Random(i), False, 8)
    async with client_for(url) as own:
        return await shoot(own, url, Shot(-1 - i, "probe", "hang_probe", path=path, body=_json(body)))


async def _drive(
    url: str, backend: Backend, shots: list[Shot], concurrency: int, hang_s: float, pid: int
) -> tuple[list[Answer], Faults, list[tuple[float, int, int, float]], list[tuple[float, int]], tuple[int, int]]:
    answers: list[Answer] = []
    faults = Faults()
    usage: list[tuple[float, int, int, float]] = []
    tree_rss: list[tuple[float, int]] = []
    warm: list[tuple[int, int]] = []
    sent = 0
    kill_now, hang_now, warm_now = asyncio.Event(), asyncio.Event(), asyncio.Event()
    n = len(shots)
    it = iter(shots)

    async def worker() -> None:
        nonlocal sent
        async with client_for(url) as client:
            for shot in it:
                sent += 1
                if sent == int(n * KILL_AT):
                    kill_now.set()
                if sent == int(n * HANG_AT):
                    hang_now.set()
                answers.append(await shoot(client, url, shot))
                if len(answers) == int(n * WARMUP_SHARE):
                    warm_now.set()

    async def faults_task() -> None:
        await kill_now.wait()
        faults.kill = time.monotonic()
        backend.signal(signal.SIGKILL)
        assert backend.proc is not None
        await asyncio.to_thread(backend.proc.wait)
        await asyncio.sleep(1.0)  # dead for a while, as a crashed vLLM is
        await asyncio.to_thread(backend.start)
        faults.back_up = time.monotonic()
        faults.restart_s = round(faults.back_up - faults.kill, 2)
        await hang_now.wait()
        faults.stop = time.monotonic()
        backend.signal(signal.SIGSTOP)
        # The closed-loop clients are all stuck on requests forwarded before kvgate could tell, so
        # once /readyz says the backend is not answering, fresh probe requests arrive: they must
        # wait in kvgate's queue and be served once the backend is back. The hang lasts hang_s, and
        # at least HANG_PROBE_HELD_S past the probes' arrival and until kvgate's queue was seen
        # holding them (never past HANG_GIVE_UP_S): on a loaded machine the probes' requests
        # went out two seconds late and waited 0.3 s, between two of this loop's readings.
        probes: list[asyncio.Task[Answer]] = []
        async with httpx.AsyncClient(base_url=url, timeout=5) as c:
            while True:
                now = time.monotonic()
                if now - faults.stop >= HANG_GIVE_UP_S:
                    break
                if faults.hang_declared is None:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await c.get("/readyz")).status_code == 503:
                            faults.hang_declared = time.monotonic()
                            probes = [asyncio.create_task(_probe(url, i)) for i in range(HANG_PROBES)]
                elif (
                    now - faults.stop >= hang_s
                    and now - faults.hang_declared >= HANG_PROBE_HELD_S
                    and faults.hang_queue_depth_max > 0
                ):
                    break
                with contextlib.suppress(httpx.HTTPError):
                    page = (await c.get("/metrics")).text
                    m = re.search(r"^kvgate_queue_depth ([0-9.eE+-]+)$", page, re.M)
                    if m:
                        faults.hang_queue_depth_max = max(faults.hang_queue_depth_max, float(m.group(1)))
                await asyncio.sleep(0.2)
        backend.signal(signal.SIGCONT)
        faults.cont = time.monotonic()
        faults.hang_probes = list(await asyncio.gather(*probes))

    async def sampler() -> None:
        while True:
            rss, fds = proc_usage(pid)
            usage.append((time.monotonic(), rss, fds, os.getloadavg()[0]))
            if warm_now.is_set() and not warm:
                warm.append((rss, fds))
            await asyncio.sleep(0.5)

    async def tree_sampler() -> None:
        while True:
            tree_rss.append((time.monotonic(), tree_memory(pid)))
            await asyncio.sleep(0.05)

    watch = [asyncio.create_task(faults_task()), asyncio.create_task(sampler()), asyncio.create_task(tree_sampler())]
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await asyncio.wait_for(watch[0], 60)  # a run too short to reach the faults fails here
    watch[1].cancel()
    watch[2].cancel()
    return answers, faults, usage, tree_rss, warm[0] if warm else proc_usage(pid)


def _wait_ledger(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """kvgate's ledger once it reads 0 (or whatever it reads after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        ledger = {k: m.get(k, float("nan")) for k in LEDGER}
        if all(v == 0 for v in ledger.values()) or time.monotonic() > deadline:
            return ledger
        time.sleep(0.25)


def run_soak(
    requests: int,
    concurrency: int,
    seed: int,
    hang_s: float = 5.0,
    logs_dir: Path | None = None,
    cgroup_bytes: int | None = None,
    log_level: str = "warning",
) -> SoakResult:
    """The whole soak; the result holds every answer and reading (see `summary`). The
    simulator's and kvgate's logs are copied into `logs_dir` when given. With `cgroup_bytes`,
    kvgate runs in a memory cgroup of its own with that limit, which it reads itself. At
    `log_level` info kvgate logs every decision with its request's id (a failed request's story)."""
    if cgroup_bytes is None:
        return _run_soak(requests, concurrency, seed, hang_s, logs_dir, None, log_level)
    with memory_cgroup(cgroup_bytes) as group:
        result = _run_soak(requests, concurrency, seed, hang_s, logs_dir, group, log_level)
        result.cgroup = {
            "version": group.version,
            "limit_mib": round(group.limit() / 2**20, 1),
            "peak_mib": round(group.peak() / 2**20, 1),  # page cache included
            "oom_kills": group.oom_kills(),
        }
    return result


def _run_soak(
    requests: int,
    concurrency: int,
    seed: int,
    hang_s: float,
    logs_dir: Path | None,
    group: MemoryCgroup | None,
    log_level: str,
) -> SoakResult:
    shots = traffic(requests, seed)
    flags, prefix = KVGATE_FLAGS, []
    if group is not None:
        at = flags.index("--max-process-memory-bytes")
        flags, prefix = flags[:at] + flags[at + 2 :], group.command_prefix
    flags = [*flags, "--log-level", log_level]  # the last --log-level is the one kvgate uses
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        model_dir = write_model(Path(tmp) / MODEL)
        backend = Backend(model_dir, Path(tmp) / "sim.log", seed)
        try:
            backend.start()
            log_path = Path(tmp) / "kvgate.log"
            with kvgate(backend.url, model_dir, flags, gpu_total_bytes(GPU), log_path, prefix) as (url, cmd, proc):
                stop, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
                poller = ctx.Process(target=poll_healthz, args=(url, stop, tx), daemon=True)
                poller.start()
                idle = proc_usage(proc.pid)
                started = time.monotonic()
                answers, faults, usage, tree_rss, warm = asyncio.run(
                    _drive(url, backend, shots, concurrency, hang_s, proc.pid)
                )
                load_s = time.monotonic() - started
                stop.set()
                healthz = rx.recv() if rx.poll(30) else []
                poller.join(10)
                ledger = _wait_ledger(url)
                time.sleep(1.0)  # kvgate closes what the last clients left
                end = proc_usage(proc.pid)
                tree_hwm_end = tree_memory(proc.pid, "VmHWM")
                metrics = scrape(url)
                kvgate_exited = proc.poll()
                log_text = log_path.read_text(errors="replace")
                workers_replaced = log_text.count("a preparation worker was stopped")
                errors = [ln[:300] for ln in log_text.splitlines() if " ERROR " in ln or "Traceback" in ln][:20]
        finally:
            backend.stop()
            if logs_dir is not None:
                logs_dir.mkdir(parents=True, exist_ok=True)
                for name in ("sim.log", "kvgate.log"):
                    with contextlib.suppress(OSError):
                        shutil.copy(Path(tmp) / name, logs_dir / f"soak-{name}")
    return SoakResult(
        requests,
        concurrency,
        seed,
        hang_s,
        sorted(answers, key=lambda a: a.index),
        faults,
        healthz,
        usage,
        tree_rss,
        idle,
        warm,
        end,
        ledger,
        metrics,
        round(load_s, 1),
        cmd,
        backend.cmd,
        errors,
        tree_hwm_end,
        kvgate_exited,
        workers_replaced,
        kvgate_log=log_text,
        wall_minus_monotonic=time.time() - time.monotonic(),
    )


# ----- the report ------------------------------------------------------------------------------
def _in(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def is_kvgate_5xx(a: Answer, fault_windows: list[tuple[float, float]]) -> bool:
    """A 5xx kvgate made (not relayed), unless it is the honest answer to a backend fault given
    while the fault lasted; see the module docstring."""
    if not a.outcome.isdigit() or int(a.outcome) < 500 or a.relayed:
        return False
    # A memory-hostile body is a valid request that may be admitted (vLLM would serve it): once
    # forwarded it meets the backend's faults as a normal request does.
    honest = a.code in BACKEND_FAULT_CODES and (a.kind != "hostile" or a.variant in MEMORY_BODIES)
    return not (honest and (_in(a.started, fault_windows) or _in(a.ended, fault_windows)))


# A log record's first line: kvgate's format (kvgate/logs.py), "2026-11-28 06:18:25,503 LEVEL name ...".
_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ", re.M)


def log_records(text: str) -> list[tuple[float, str, str]]:
    """(wall time, level, the record with its traceback) for each record of a kvgate log."""
    starts = list(_RECORD.finditer(text))
    return [
        (
            dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(),
            m.group(2),
            text[m.start() : starts[i + 1].start() if i + 1 < len(starts) else len(text)].rstrip("\n"),
        )
        for i, m in enumerate(starts)
    ]


def log_around(
    log_text: str, wall_minus_monotonic: float, answers: list[Answer], margin_s: float = 1.0, max_chars: int = 20_000
) -> list[str]:
    """What kvgate logged about `answers`: the records naming their request ids, and every
    warning or error (tracebacks whole) from `margin_s` before each was sent to `margin_s` after
    it ended. Uvicorn's traceback of an exception that became a plain 500 names no request."""
    ids = {a.request_id for a in answers if a.request_id}
    spans = [(a.started + wall_minus_monotonic - margin_s, a.ended + wall_minus_monotonic + margin_s) for a in answers]
    named = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, ids)) + r")(?![\w-])") if ids else None
    kept, size = [], 0
    for t, level, record in log_records(log_text):
        if (named is not None and named.search(record)) or (
            level in ("WARNING", "ERROR", "CRITICAL") and _in(t, spans)
        ):
            kept.append(record)
            size += len(record)
            if size > max_chars:
                kept.append("... (cut)")
                break
    return kept


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _growth(before: int, after: int) -> float:
    return round(100.0 * (after - before) / before, 2) if before else 0.0


def summary(r: SoakResult) -> dict[str, Any]:
    windows = r.faults.windows()
    t0 = min((a.started for a in r.answers), default=0.0)

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    def example(a: Answer) -> dict[str, Any]:
        return asdict(a) | {"started": since(a.started), "ended": since(a.ended)}

    by_outcome = Counter(a.outcome for a in r.answers)
    by_kind = {
        k: dict(Counter(a.outcome for a in r.answers if a.kind == k)) for k in ("normal", "disconnect", "hostile")
    }
    kvgate_5xx = [a for a in r.answers if is_kvgate_5xx(a, windows)]
    honest_5xx = Counter(
        f"{a.outcome} {a.code}"
        for a in r.answers
        if a.outcome.isdigit() and int(a.outcome) >= 500 and not a.relayed and not is_kvgate_5xx(a, windows)
    )
    relayed_5xx = sum(a.relayed and a.outcome.isdigit() and int(a.outcome) >= 500 for a in r.answers)
    hostile = [(a.started, a.ended) for a in r.answers if a.kind == "hostile"]
    lat = [s for t, s in r.healthz]
    lat_hostile = [s for t, s in r.healthz if _in(t, hostile)]
    lat_calm = [s for t, s in r.healthz if not _in(t, hostile)]
    hang_arrivals = [
        a
        for a in r.answers
        if r.faults.stop is not None and r.faults.cont is not None and r.faults.stop <= a.started < r.faults.cont
    ]
    hang_waits = [a.queue_wait_s for a in hang_arrivals if a.queue_wait_s is not None]
    ms = lambda s: None if s is None else (round(s * 1000, 1) if s != float("inf") else "no answer")  # noqa: E731
    admitted = sum(v for k, v in r.metrics_after.items() if k.startswith("kvgate_decisions_total{decision=admit"))
    released = sum(v for k, v in r.metrics_after.items() if k.startswith("kvgate_reservations_released_total"))
    out = {
        "requests": r.requests,
        "concurrency": r.concurrency,
        "seed": r.seed,
        "load_s": r.load_s,
        "requests_per_s": round(r.requests / r.load_s, 1) if r.load_s else None,
        "by_outcome": dict(sorted(by_outcome.items())),
        "by_kind": by_kind,
        "hostile_by_variant": {
            v: dict(Counter(a.outcome for a in r.answers if a.variant == v))
            for v in (*HOSTILE_VARIANTS, *MEMORY_BODIES)
        },
        "disconnects_by_stage": {
            v: dict(Counter(a.outcome for a in r.answers if a.kind == "disconnect" and a.variant == v))
            for v in ("before_head", "mid_stream", "waiting")
        },
        "stream_errors": dict(Counter(a.code for a in r.answers if a.stream_error)),
        "kvgate_5xx": len(kvgate_5xx),
        "kvgate_5xx_examples": [example(a) for a in kvgate_5xx[:10]],
        "kvgate_5xx_log": log_around(r.kvgate_log, r.wall_minus_monotonic, kvgate_5xx[:10]),
        "no_answer_examples": [example(a) for a in r.answers if a.outcome == "no answer"][:10],
        "honest_backend_fault_5xx": dict(honest_5xx),
        "relayed_backend_5xx": relayed_5xx,
        "no_answer": by_outcome.get("no answer", 0),
        "ledger_after": r.ledger_after,
        "admitted": admitted,
        "released": released,
        "releases_by_outcome": {
            k.split("outcome=")[1].rstrip("}"): v
            for k, v in r.metrics_after.items()
            if k.startswith("kvgate_reservations_released_total{")
        },
        "client_disconnects_seen_by_kvgate": {
            k.split("stage=")[1].rstrip("}"): v
            for k, v in r.metrics_after.items()
            if k.startswith("kvgate_client_disconnects_total{")
        },
        "rss_mib": {
            "after_warmup": round(r.warm_usage[0] / 2**20, 1),
            "end": round(r.end_usage[0] / 2**20, 1),
            "peak": round(max((u[1] for u in r.usage), default=0) / 2**20, 1),
        },
        "rss_growth_pct": _growth(r.warm_usage[0], r.end_usage[0]),
        # kvgate and its preparation workers together, against the manifests' limit
        "peak_rss_tree_mib": round(max((v for _, v in r.tree_rss), default=0) / 2**20, 1),
        "tree_hwm_end_mib": round(r.tree_hwm_end / 2**20, 1),
        "process_memory_limit_mib": PROCESS_MEMORY // 2**20,
        "kvgate_restarts": 0 if r.kvgate_exited is None else 1,
        "memory_cgroup": r.cgroup,
        "preparation_workers_replaced": r.workers_replaced,
        "fds": {
            "idle_before": r.idle_usage[1],
            "after_warmup": r.warm_usage[1],
            "end": r.end_usage[1],
            "peak": max((u[2] for u in r.usage), default=0),
        },
        "fd_growth_pct": _growth(r.idle_usage[1], r.end_usage[1]),
        "healthz_polls": len(lat),
        "healthz_p50_ms": ms(percentile(lat, 0.5)),
        "healthz_p99_ms": ms(percentile(lat, 0.99)),
        "healthz_polls_hostile": len(lat_hostile),
        "healthz_p99_hostile_ms": ms(percentile(lat_hostile, 0.99)),
        "healthz_p99_no_hostile_ms": ms(percentile(lat_calm, 0.99)),
        "load_average_mean": round(sum(u[3] for u in r.usage) / len(r.usage), 2) if r.usage else None,
        "healthz_max_ms": ms(max(lat, default=None)),
        "kill": {
            "restart_s": r.faults.restart_s,
            "at_s": since(r.faults.kill),
            "back_up_at_s": since(r.faults.back_up),
        },
        "hang": {
            "seconds": r.hang_s,
            "at_s": since(r.faults.stop),
            "arrivals": len(hang_arrivals),
            "outcomes": dict(Counter(a.outcome for a in hang_arrivals)),
            "admitted_queue_wait_p50_s": percentile(hang_waits, 0.5),
            "max_queue_depth": r.faults.hang_queue_depth_max,
            "declared_after_s": None
            if r.faults.hang_declared is None or r.faults.stop is None
            else round(r.faults.hang_declared - r.faults.stop, 2),
            "probes": dict(Counter(a.outcome for a in r.faults.hang_probes)),
            "probe_queue_wait_p50_s": percentile(
                [a.queue_wait_s for a in r.faults.hang_probes if a.queue_wait_s is not None], 0.5
            ),
            "kvgate_5xx": sum(is_kvgate_5xx(a, windows) for a in hang_arrivals),
        },
        "kvgate_log_errors": r.kvgate_log_errors,
        "kvgate_command": " ".join(r.kvgate_command[3:]),
        "sim_command": " ".join(r.sim_command[3:]),
    }
    out["targets"] = targets(out)
    return out


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    hz = s["healthz_p99_hostile_ms"]
    rows = [
        ("kvgate 5xx", s["kvgate_5xx"], s["kvgate_5xx"] == 0, TARGETS["kvgate_5xx"]),
        (
            "ledger after (in flight, KV blocks, transient bytes, queue)",
            ", ".join(f"{v:g}" for v in s["ledger_after"].values()),
            all(v == 0 for v in s["ledger_after"].values()),
            TARGETS["ledger_after"],
        ),
        ("RSS growth, warm-up to end", f"{s['rss_growth_pct']} %", s["rss_growth_pct"] < 5, TARGETS["rss_growth"]),
        (
            "open fds growth, idle before the load to idle after",
            f"{s['fd_growth_pct']} %",
            s["fd_growth_pct"] < 5,
            TARGETS["fd_growth"],
        ),
        (
            "/healthz p99 while hostile bodies were in flight",
            f"{hz} ms",
            isinstance(hz, float) and hz < 50,
            TARGETS["healthz_p99_hostile_ms"],
        ),
        ("requests with no answer", s["no_answer"], s["no_answer"] == 0, TARGETS["no_answer"]),
        (
            "peak RSS of kvgate and its preparation workers (sampled every 50 ms; VmHWM summed at the end)",
            f"{s['peak_rss_tree_mib']} MiB ({s['tree_hwm_end_mib']} MiB)",
            max(s["peak_rss_tree_mib"], s["tree_hwm_end_mib"]) < s["process_memory_limit_mib"],
            TARGETS["peak_rss_tree"],
        ),
        *(
            [
                (
                    "OOM kills in kvgate's memory cgroup (limit; peak charge, page cache included)",
                    f"{s['memory_cgroup']['oom_kills']} ({s['memory_cgroup']['limit_mib']:g} MiB; "
                    f"{s['memory_cgroup']['peak_mib']:g} MiB)",
                    s["memory_cgroup"]["oom_kills"] == 0,
                    "0",
                )
            ]
            if s.get("memory_cgroup")
            else []
        ),
        (
            "kvgate restarts (its process exited)",
            s["kvgate_restarts"],
            s["kvgate_restarts"] == 0,
            TARGETS["kvgate_restarts"],
        ),
        (
            "backend hung: requests sent once it is detected wait in kvgate's queue (its depth at "
            "most; their answers once it is back)",
            f"{s['hang']['max_queue_depth']:g}; " + ", ".join(f"{k}: {v}" for k, v in s["hang"]["probes"].items()),
            s["hang"]["max_queue_depth"] > 0
            and s["hang"]["kvgate_5xx"] == 0
            and s["hang"]["probes"] == {"200": HANG_PROBES},
            TARGETS["hang_queued"],
        ),
    ]
    return [{"check": c, "value": v, "target": t, "met": bool(m)} for c, v, m, t in rows]


def markdown(s: dict[str, Any], command: str, machine: dict[str, Any]) -> str:
    lines = [
        f"Soak: `{command}`",
        "",
        f"{s['requests']} requests at concurrency {s['concurrency']} (seed {s['seed']}) in {s['load_s']} s "
        f"({s['requests_per_s']} requests/s); {machine['cpu_model']}, {machine['cpus']} cores, Python {machine['python']}.",
        f"Backend SIGKILLed at {int(KILL_AT * 100)} % of the requests and back after {s['kill']['restart_s']} s; "
        f"SIGSTOPped at {int(HANG_AT * 100)} % for {s['hang']['seconds']:g} s.",
        "",
        "| target | value | goal | met |",
        "|---|---|---|---|",
        *(f"| {t['check']} | {t['value']} | {t['target']} | {'yes' if t['met'] else '**no**'} |" for t in s["targets"]),
        "",
        "| requests by outcome | normal | disconnect | hostile | all |",
        "|---|---|---|---|---|",
    ]
    for outcome, total in s["by_outcome"].items():
        cells = [str(s["by_kind"][k].get(outcome, 0)) for k in ("normal", "disconnect", "hostile")]
        lines.append(f"| {outcome} | {' | '.join(cells)} | {total} |")
    hang = s["hang"]
    lines += [
        "",
        f"- kvgate's own 5xx answering a backend fault while it lasted (not counted above): "
        f"{', '.join(f'{k}: {v}' for k, v in s['honest_backend_fault_5xx'].items()) or 'none'}; "
        f"backend 5xx relayed: {s['relayed_backend_5xx']}; streams ended by an error event: "
        f"{', '.join(f'{k}: {v}' for k, v in s['stream_errors'].items()) or 'none'}.",
        f"- Admitted {s['admitted']:g}, released {s['released']:g} "
        f"({', '.join(f'{k} {v:g}' for k, v in s['releases_by_outcome'].items())}); "
        f"disconnects kvgate saw: {', '.join(f'{k} {v:g}' for k, v in s['client_disconnects_seen_by_kvgate'].items())}.",
        f"- RSS MiB after warm-up / end / peak: {s['rss_mib']['after_warmup']} / {s['rss_mib']['end']} / "
        f"{s['rss_mib']['peak']}; open fds idle before / after warm-up / idle after / peak: {s['fds']['idle_before']} / "
        f"{s['fds']['after_warmup']} / {s['fds']['end']} / {s['fds']['peak']}.",
        f"- /healthz: {s['healthz_polls']} polls, p50 {s['healthz_p50_ms']} ms, p99 {s['healthz_p99_ms']} ms, "
        f"max {s['healthz_max_ms']} ms; {s['healthz_polls_hostile']} while a hostile body was in flight; p99 of the "
        f"others {s['healthz_p99_no_hostile_ms']} ms. The machine's 1-minute load average over the run: "
        f"{s['load_average_mean']} (other work shares it).",
        f"- Hang: {hang['arrivals']} arrivals while the backend was stopped "
        f"({', '.join(f'{k}: {v}' for k, v in hang['outcomes'].items())}); kvgate's queue held up to "
        f"{hang['max_queue_depth']:g}; median queue wait of those admitted: {hang['admitted_queue_wait_p50_s']} s. "
        f"kvgate declared the hang {hang['declared_after_s']} s after the SIGSTOP; the {HANG_PROBES} requests sent "
        f"then: {', '.join(f'{k}: {v}' for k, v in hang['probes'].items())}, median queue wait "
        f"{hang['probe_queue_wait_p50_s']} s.",
        "",
        "| hostile variant | outcomes |",
        "|---|---|",
        *(
            f"| {v} | {', '.join(f'{k}: {n}' for k, n in o.items()) or '-'} |"
            for v, o in s["hostile_by_variant"].items()
        ),
        "",
        f"kvgate: `kvgate {s['kvgate_command']}`; simulator: `python -m kvgate.sim {s['sim_command']}`.",
    ]
    return "\n".join(lines) + "\n"


def main(
    requests: int,
    concurrency: int,
    seed: int,
    hang_s: float,
    out_dir: Path,
    command: str,
    machine: dict[str, Any],
    cgroup_bytes: int | None = None,
) -> dict[str, Any]:
    """Runs the soak, writes soak.json and soak.md into `out_dir`, prints the tables."""
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    s = summary(run_soak(requests, concurrency, seed, hang_s, out_dir / "tmp", cgroup_bytes))
    s |= {"command": command, "machine": machine, "started_at": started}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
    text = markdown(s, command, machine)
    (out_dir / "soak.md").write_text(text)
    print(text)
    return s
