"""Reservations follow what vLLM will really hold (issue 28, item 6), seen by a client of kvgate in
front of the simulator: a cache_salt shares no prefix, ignore_eos and min_tokens reserve the
output they force, and a client that stops reading is cut and released after the deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty
from support.sim_model import ENGINE_FLAGS, MODEL
from support.waiting import wait_for, wait_for_async

STALL_S = 3  # --stream-stall-timeout for these tests (default 60)
PROMPT = [1000 + i for i in range(2000)]  # token ids: 125 full blocks of 16


@pytest.fixture(scope="module")
def sim(sim_model_dir: Path) -> Iterator[SimRunner]:
    config = SimConfig(
        model=str(sim_model_dir), served_model_name=MODEL, gpu="h100-80gb", max_model_len=8192, speedup=50
    )
    with SimRunner(config) as runner:
        yield runner


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, sim: SimRunner, sim_model_dir: Path) -> KvgateServer:
    return kvgate_factory(sim.url, sim_model_dir, *ENGINE_FLAGS, "--stream-stall-timeout", str(STALL_S))


@pytest.fixture(scope="module")
def slow_kvgate(kvgate_factory: KvgateFactory, sim_model_dir: Path) -> Iterator[KvgateServer]:
    """kvgate in front of a simulator at speed-up 5, where a 6,000-token answer takes about 12 s:
    long enough for eight to be seen in flight together (at 50 they end within a second or two)."""
    config = SimConfig(
        model=str(sim_model_dir), served_model_name=MODEL, gpu="h100-80gb", max_model_len=8192, speedup=5
    )
    with SimRunner(config) as runner:
        yield kvgate_factory(runner.url, sim_model_dir, *ENGINE_FLAGS)


def engine_holds(sim: SimRunner) -> int:
    """Requests the simulated engine still has, waiting or running."""
    return len(sim.engine.scheduler.waiting) + len(sim.engine.scheduler.running)


def assert_idle(kvgate: KvgateServer, sim: SimRunner, timeout_s: float = 30) -> None:
    """Nothing reserved, in flight or queued in kvgate, nothing in the engine."""
    assert_ledger_empty(kvgate, timeout_s)
    wait_for(
        lambda: engine_holds(sim) == 0,
        timeout_s=timeout_s,
        what=lambda: f"the engine to empty ({engine_holds(sim)} held)",
    )


def explain(kvgate: KvgateServer, **body: object) -> dict:
    response = httpx.post(
        kvgate.base_url + "/kvgate/explain", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()


async def reserved_while_in_flight(kvgate: KvgateServer, prompts: list[list[int]], salts: list[str | None]) -> int:
    """kvgate's reserved KV blocks once all these requests are in flight together (long ignore_eos
    answers, hung up on once measured)."""
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60) as client:

        async def one(ids: list[int], salt: str | None) -> httpx.Response:
            body = {"model": MODEL, "prompt": ids, "max_tokens": 6000, "ignore_eos": True}
            return await client.post("/v1/completions", json=body | ({} if salt is None else {"cache_salt": salt}))

        tasks = [asyncio.create_task(one(ids, salt)) for ids, salt in zip(prompts, salts, strict=True)]
        seen: dict[str, float] = {}

        def all_in_flight() -> bool:
            # One scrape for both numbers: at the simulator's speed-up an answer may end between two.
            seen.update(kvgate.metrics("kvgate_in_flight_requests", "kvgate_reserved_kv_blocks"))
            return seen["kvgate_in_flight_requests"] == len(prompts) or any(t.done() for t in tasks)

        try:
            await wait_for_async(all_in_flight, timeout_s=30, what="every request in flight")
            ended = [t.result() for t in tasks if t.done() and not t.exception()]
            assert not any(t.done() for t in tasks), (
                f"ended before all were in flight: {[(r.status_code, r.text[:300]) for r in ended]}"
            )
            return int(seen["kvgate_reserved_kv_blocks"])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_cache_salts_share_no_prefix(slow_kvgate: KvgateServer) -> None:
    """Eight copies of one prompt under eight cache_salt values are reserved what eight distinct
    prompts are (vLLM hashes the salt into the first block); under one salt they share it."""
    alone = explain(slow_kvgate, max_tokens=6000, ignore_eos=True)["kv"]["blocks"]
    distinct = await reserved_while_in_flight(slow_kvgate, [[7 + i, *PROMPT] for i in range(8)], [None] * 8)
    assert_ledger_empty(slow_kvgate, timeout_s=30)
    salted = await reserved_while_in_flight(slow_kvgate, [PROMPT] * 8, [f"salt-{i}" for i in range(8)])
    assert_ledger_empty(slow_kvgate, timeout_s=30)
    shared = await reserved_while_in_flight(slow_kvgate, [PROMPT] * 8, ["one-salt"] * 8)
    assert_ledger_empty(slow_kvgate, timeout_s=30)
    assert salted == 8 * alone == distinct - 8  # a distinct prompt is one token longer: same blocks
    assert shared == alone + 7 * (alone - len(PROMPT) // 16)


async def send_all(kvgate: KvgateServer, body: dict, count: int) -> None:
    """`count` copies of a completions request at once, each answered 200."""
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=120) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(count)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]


async def test_forced_outputs_reserve_their_length_and_teach_nothing(kvgate: KvgateServer, sim: SimRunner) -> None:
    """After 64 short answers taught kvgate short outputs, an ignore_eos request still reserves
    its max_tokens and a min_tokens one at least its minimum; 20 ignore_eos answers that filled
    their max_tokens do not teach the plain requests long outputs (learned, they would count as
    needing all of any max_tokens)."""
    plain = {"model": MODEL, "prompt": "Say something short.", "max_tokens": 4000}
    await send_all(kvgate, plain, 64)
    # Output lengths are learned as reservations are released, which may follow the last answer
    # the client read: every one released, every one learned.
    assert_ledger_empty(kvgate, timeout_s=30)
    learned = explain(kvgate, max_tokens=4000)
    assert learned["reserved_new_tokens"] < 300  # the simulator's answers stop after 16-255 tokens
    forced = explain(kvgate, max_tokens=4000, ignore_eos=True)
    assert forced["reserved_new_tokens"] == 4000
    assert forced["kv"]["blocks"] == forced["kv"]["blocks_at_max_tokens"] == -(-(len(PROMPT) + 4000) // 16)
    assert explain(kvgate, max_tokens=4000, min_tokens=1500)["reserved_new_tokens"] == 1500
    await send_all(kvgate, plain | {"max_tokens": 64, "ignore_eos": True}, 20)
    assert_ledger_empty(kvgate, timeout_s=30)
    assert explain(kvgate, max_tokens=4000)["reserved_new_tokens"] == learned["reserved_new_tokens"]
    assert_idle(kvgate, sim)


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def backend_streams_open(sim: SimRunner) -> int:
    """Connections to the simulator's HTTP server with a generation under way: kvgate's own
    scrapes of /metrics, /health and /v1/models are short answers, not streams, and not counted."""
    connections = sim._server.server_state.connections
    return sum(
        1
        for c in connections
        if (cycle := getattr(c, "cycle", None)) is not None
        and not cycle.response_complete
        and cycle.scope["path"] in GENERATION_PATHS
    )


def stalled_client(kvgate: KvgateServer, body: dict) -> socket.socket:
    """A client that sends a streaming request and never reads: a small receive buffer, so that
    the answer fills it and kvgate's socket buffer behind it at once."""
    host, port = kvgate.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, int(port)))
    raw = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything left to read, once kvgate has closed the connection (AssertionError if it stays open)."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"kvgate kept the connection open {timeout_s} s") from None
    return got


def test_a_client_that_stops_reading_is_cut_and_released(kvgate: KvgateServer, sim: SimRunner) -> None:
    """A stream whose client reads nothing holds its reservation only until the stall deadline:
    then kvgate aborts the backend request, releases the reservation ("stalled"), counts and logs
    it and closes the client's connection. Meanwhile another client is served."""
    assert_idle(kvgate, sim)  # a quiet start: the earlier tests' hung-up streams gone too
    wait_for(lambda: backend_streams_open(sim) == 0, timeout_s=30, what="earlier backend streams to close")
    before = kvgate.metric("kvgate_reservations_released_total", outcome="stalled")
    # 8 x 6000 events of ~180 bytes: more than kvgate's socket buffer grows to on loopback (4 MiB).
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6000, "n": 8, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    sock = stalled_client(kvgate, body)
    try:
        wait_for(lambda: kvgate.metric("kvgate_in_flight_requests") == 1, timeout_s=30, what="the stream to start")
        assert backend_streams_open(sim) == 1
        honest = httpx.post(
            kvgate.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8}, timeout=30
        )
        assert honest.status_code == 200, honest.text
        assert kvgate.metric("kvgate_in_flight_requests") == 1  # throttled, still held
        wait_for(
            lambda: kvgate.metric("kvgate_reservations_released_total", outcome="stalled") == before + 1,
            timeout_s=60,
            what="the stalled stream's release",
        )
        cut_after = time.monotonic() - started
        assert kvgate.metric("kvgate_reserved_kv_blocks") == 0
        assert kvgate.metric("kvgate_in_flight_requests") == 0
        read = read_until_closed(sock, 10)
    finally:
        sock.close()
    assert read.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in read
    assert STALL_S <= cut_after < 60, cut_after
    # kvgate closed the stream's connection to the backend: the simulator's server saw it go (on
    # it vLLM's API server aborts the request).
    wait_for(lambda: backend_streams_open(sim) == 0, timeout_s=10, what="the backend connection to close")
    log = kvgate.log()
    assert "read nothing for 3 s" in log
    assert "returned without completing response" not in log  # uvicorn's line, noise for a cut kvgate logs


def test_a_stream_of_several_choices_ends_its_prefill_once_every_choice_showed_a_token(
    slow_kvgate: KvgateServer,
) -> None:
    """An n = 4 stream is four engine requests; its first event is one of theirs. Once each of the
    four choices has streamed text, all four have prefilled: kvgate holds its prefill terms no
    more (`kvgate_plain_prefills{state="open"}` back to 0) while the answer is still streaming,
    without waiting for vLLM's count of first tokens to say so (kvgate/http/choice_watch.py)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6000, "n": 4, "ignore_eos": True, "stream": True}
    seen: set[int] = set()
    with httpx.stream("POST", slow_kvgate.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"] if c.get("text")}
            if len(seen) == 4:
                break
        assert slow_kvgate.metric("kvgate_in_flight_requests") == 1  # still streaming
        wait_for(
            lambda: slow_kvgate.metric("kvgate_plain_prefills", state="open") == 0,
            timeout_s=5,
            what="the stream's prefill terms to be let go",
        )
        assert slow_kvgate.metric("kvgate_in_flight_requests") == 1
