"""Issue 28, items 1, 3 and 5, through a running `kvgate serve`: the worst bodies sent at once stay
inside kvgate's memory budget and every one is answered (a 4xx in OpenAI's shape or a 200).
/healthz while they are parsed, rendered and tokenized is printed here and measured by
bench/healthz_hostile.py (a latency on a shared machine is no test's to assert).

kvgate's memory is read from /proc as the kernel's cgroup would count it: kvgate's process and its
preparation workers together, sampled every few milliseconds (a worker stopped for passing its
grant takes its peak with it) and, at the end, each live process's own peak (VmHWM).
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.work_cost import hostile_bodies
from kvgate.preparation_workers import DATA_LIMIT_SLACK, _DataLimit
from support.fake_backend import FakeBackend
from support.hostile_templates import STRING_BUILDERS
from support.kvgate_server import KvgateFactory, KvgateServer

MiB = 2**20
PROCESS_MEMORY = 2 * 1024 * MiB  # the manifests' limit (deploy/), given as the flag
PEAK_BOUND = 1536 * MiB  # what kvgate and its workers may reach together: three quarters of the limit
ROUTE_PATH = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, backend: FakeBackend, tiny_model_dir: Path) -> KvgateServer:
    return kvgate_factory(
        backend.base_url,
        tiny_model_dir,
        "--trust-request-chat-template",
        "--max-process-memory-bytes",
        str(PROCESS_MEMORY),
    )


def _status(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (kvgate's preparation workers)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


class MemoryAndLatency:
    """While a block runs: the most kvgate's process tree held (summed VmRSS, every 5 ms) and
    every /healthz latency (one probe at a time, from its own thread)."""

    def __init__(self, kvgate: KvgateServer) -> None:
        self.kvgate = kvgate
        self.peak_tree_rss = 0
        self.healthz: list[float] = []
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            total = sum(_status(pid, "VmRSS") for pid in process_tree(self.kvgate.pid))
            self.peak_tree_rss = max(self.peak_tree_rss, total)
            time.sleep(0.005)  # the sampling period of resident memory

    def run(self, work: Callable[[], list[httpx.Response]]) -> list[httpx.Response]:
        # /healthz from a process of its own: the senders' threads would hold this one's GIL.
        context = multiprocessing.get_context("spawn")
        ready, stop, (receive, send) = context.Event(), context.Event(), context.Pipe(duplex=False)
        poller = context.Process(target=poll_healthz, args=(self.kvgate.base_url, ready, stop, send), daemon=True)
        poller.start()
        assert ready.wait(60), "the /healthz poller did not start"
        sampler = threading.Thread(target=self._sample)
        sampler.start()
        try:
            return work()
        finally:
            self._done.set()
            stop.set()
            sampler.join()
            self.healthz = receive.recv() if receive.poll(30) else []
            poller.join(10)

    @property
    def peak_hwm(self) -> int:
        """Each live process's own peak, summed (an upper bound on their peak together)."""
        return sum(_status(pid, "VmHWM") for pid in process_tree(self.kvgate.pid))

    def healthz_quantile(self, q: float) -> float:
        ordered = sorted(self.healthz)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def poll_healthz(url: str, ready: Any, stop: Any, out: Any) -> None:
    """In a process of its own: the latency of each GET /healthz, every 10 ms, until `stop`."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
            ready.set()
            time.sleep(0.01)  # the probe's period, as the docstring says
    out.send(latencies)


def assert_answered(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["message"], error


def send_all(kvgate: KvgateServer, requests: list[tuple[str, bytes]]) -> list[httpx.Response]:
    def send(request: tuple[str, bytes]) -> httpx.Response:
        path, raw = request
        headers = {"content-type": "application/json"}
        return httpx.post(kvgate.base_url + path, content=raw, headers=headers, timeout=120)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, requests))


def test_the_worst_bodies_at_once_stay_inside_the_memory_budget(kvgate: KvgateServer) -> None:
    """Issue 28: four 28 MiB bodies of 1,024 prompts of 29,000 characters took 6.1 GB and /healthz
    437 ms; one /v1/responses body of function_call items held the loop 7.7 s."""
    bodies = hostile_bodies(model="tiny-llama")
    prompts = bodies["1024 prompts x 29,000 chars"]
    others = [body for name, body in bodies.items() if name != "1024 prompts x 29,000 chars"]
    requests = [(ROUTE_PATH[route], raw) for route, raw in [prompts] * 4 + others]
    watch = MemoryAndLatency(kvgate)
    responses = watch.run(lambda: send_all(kvgate, requests))
    for response in responses:
        assert_answered(response)
    names = ["1024 prompts x 29,000 chars"] * 4 + [name for name in bodies if name != "1024 prompts x 29,000 chars"]
    outcomes = [
        (name, r.status_code, r.json()["error"]["message"][:90] if r.status_code >= 400 else "")
        for name, r in zip(names, responses, strict=True)
    ]
    print(
        f"outcomes {outcomes}; peak RSS of kvgate and its workers {watch.peak_tree_rss / MiB:.0f} MiB sampled, "
        f"{watch.peak_hwm / MiB:.0f} MiB VmHWM summed; /healthz p50 {watch.healthz_quantile(0.5) * 1000:.1f} ms, "
        f"p99 {watch.healthz_quantile(0.99) * 1000:.1f} ms, max {max(watch.healthz) * 1000:.1f} ms "
        f"over {len(watch.healthz)} probes"
    )
    assert max(watch.peak_tree_rss, watch.peak_hwm) < PEAK_BOUND
    assert kvgate.metric("kvgate_in_flight_requests") == 0
    # /healthz's latency is printed, not asserted: on a shared machine it measures the wait for a
    # core as much as kvgate (134 ms p99 at load average 12); bench/healthz_hostile.py measures it.


@pytest.mark.parametrize("template", STRING_BUILDERS.values(), ids=STRING_BUILDERS)
def test_a_trusted_template_is_a_400_and_costs_kvgate_no_memory(kvgate: KvgateServer, template: str) -> None:
    """Issue 28: a join of a range took 12.4 GB and 35 s of the loop; `~` doubling and
    %/center/format built 256-584 MiB and were served 200."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    raw = json.dumps(body).encode()
    watch = MemoryAndLatency(kvgate)
    [response] = watch.run(lambda: send_all(kvgate, [("/v1/chat/completions", raw)]))
    assert response.status_code == 400, response.text
    assert "budget" in response.json()["error"]["message"]
    assert watch.peak_tree_rss < PEAK_BOUND


def test_a_worker_past_its_grant_is_stopped_and_replaced(kvgate: KvgateServer) -> None:
    """A request template that allocates in a way no operator sizes (a list grown by a loop) is
    stopped when its worker passes the memory it was granted: 413, and the next request served."""
    template = (  # each pass adds one item to the list (the + is sized by items), of 100,000 strings
        "{% set ns = namespace(items=[]) %}{% for i in range(99999) %}"
        "{% set ns.items = ns.items + [range(99999)|map('string')|list] %}{% endfor %}{{ ns.items|length }}"
    )
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    watch = MemoryAndLatency(kvgate)
    [response] = watch.run(lambda: send_all(kvgate, [("/v1/chat/completions", json.dumps(body).encode())]))
    assert response.status_code in (400, 413), response.text
    assert_answered(response)
    assert watch.peak_tree_rss < PEAK_BOUND
    ok = httpx.post(kvgate.base_url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x " * 20_000})
    assert ok.status_code in (200, 400), ok.text  # 400: the fake backend's tiny context
    assert_answered(ok)


def allocations_under_a_data_limit(ceiling: int) -> dict[str, str]:
    """In a process of its own (the limit stays with it): a preparation worker's data limit, with
    a job granted 16 MiB, then 64 MiB more, then between jobs; what each allocation came to."""
    limit = _DataLimit(ceiling)

    def allocate(size: int) -> str:
        try:
            bytearray(size)  # zero-filled: resident, as a parse or a render makes it
        except MemoryError:
            return "MemoryError"
        return "allocated"

    past_the_grant = 16 * MiB + DATA_LIMIT_SLACK + 16 * MiB
    outcomes = {}
    limit.hold(16 * MiB)
    outcomes["the grant"] = allocate(16 * MiB)
    outcomes["past the grant"] = allocate(past_the_grant)
    limit.grow(64 * MiB)
    outcomes["past the first grant, within the grown one"] = allocate(past_the_grant)
    limit.release()
    outcomes["between jobs, the whole budget"] = allocate(ceiling)
    outcomes["past the whole budget"] = allocate(ceiling + 2 * DATA_LIMIT_SLACK)
    return outcomes


def test_the_kernel_holds_a_worker_to_its_grant() -> None:
    """Between two readings of a worker's resident memory one operation could allocate gigabytes:
    the kernel refuses at once what passes the job's grant (RLIMIT_DATA), in the worker alone,
    which goes on; between jobs it may hold all of kvgate's request-work budget, never more."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outcomes = pool.apply(allocations_under_a_data_limit, (256 * MiB,))
    assert outcomes == {
        "the grant": "allocated",
        "past the grant": "MemoryError",
        "past the first grant, within the grown one": "allocated",
        "between jobs, the whole budget": "allocated",
        "past the whole budget": "MemoryError",
    }


def test_a_large_passthrough_body_is_checked_off_the_event_loop(kvgate: KvgateServer) -> None:
    """A pass-through body a gated route would prepare in a worker (past 64 KiB or 64 JSON values)
    is checked in one too (its parse held the loop 0.2-0.5 s for 499,998 ids or 160,000 messages):
    the same answers as inline, a 400 naming the field for text that is not Unicode."""
    many = [{"role": "user", "content": "x"}] * 100
    surrogate = b'{"model": "tiny-llama", "messages": ' + json.dumps(many).encode()[:-1] + b', "a\xed\xa0\x80"]}'
    headers = {"content-type": "application/json"}
    refused = httpx.post(kvgate.base_url + "/tokenize", content=surrogate, headers=headers, timeout=120)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages[100]"
    served = httpx.post(kvgate.base_url + "/tokenize", json={"model": "tiny-llama", "messages": many}, timeout=120)
    assert served.status_code == 200, served.text


LARGE_BODIES = """
import sys, threading
from kvgate.work_budget import give_large_blocks_back, libc

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024

if libc() is None:
    print("no-glibc")
    sys.exit()
if sys.argv[1] == "fixed":
    assert give_large_blocks_back()
start = rss_mib()

def body():
    raw = bytes(28 * 2**20)  # a request body, then its joined copy, freed
    joined = raw + b"x"
    del raw, joined

for _ in range(20):
    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    body()
print(rss_mib() - start)
"""


@pytest.mark.parametrize("threshold", ["dynamic", "fixed"])
def test_large_bodies_leave_the_process_once_freed(threshold: str) -> None:
    """glibc's dynamic mmap threshold kept freed 28 MiB bodies resident (130 MiB after 20 rounds);
    kvgate serve fixes it (give_large_blocks_back), and then they are unmapped when freed. (Here a
    body and its copy, on two threads: 56 MiB stay without the fix.)"""
    result = subprocess.run(
        [sys.executable, "-c", LARGE_BODIES, threshold], capture_output=True, text=True, check=True, timeout=120
    )
    if result.stdout.strip() == "no-glibc":
        pytest.skip(
            "the mmap threshold is glibc's (mallopt M_MMAP_THRESHOLD); on another C library kvgate "
            "serve does not set it, so there is nothing to measure"
        )
    growth_mib = int(result.stdout)
    if threshold == "fixed":
        assert growth_mib < 28, growth_mib
    else:  # the behaviour the fix is for: without it, freed bodies stay
        assert growth_mib >= 28, growth_mib
