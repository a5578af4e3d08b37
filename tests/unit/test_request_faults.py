"""Backend faults in the middle of other requests' lives, in an order each test chooses: every
request ends with an answer a client can read (a 200, a stream ended by an error event, or an
OpenAI-shaped 502/503/504), never an exception out of the handler (uvicorn's plain-text 500 before
the response begins), and every reservation is released exactly once.

The soak (tests/integration/test_soak.py) meets these faults by chance: a SIGKILLed backend
refusing connections while others wait, a stream cut mid-body, the backend back as a deadline
fires. Here the backend is scripted (tests/support/gated_exchange.py) and the requests run through
kvgate's gated routes in-process, so each interleaving happens every time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from kvgate.composition import Runtime
from kvgate.errors import BackendBroke, BackendDown, BackendTimedOut
from kvgate.gate.observer import Decision, Release
from kvgate.http.gated_routes import GatedRoutes
from kvgate.settings import Settings
from kvgate.upstream import UpstreamClosed
from support.gated_exchange import (
    ANSWER,
    DONE,
    EVENT,
    Client,
    ScriptedBackend,
    ScriptedUpstream,
    exchange,
    stream,
)
from support.waiting import wait_for_async

REFUSED = "The backend at http://127.0.0.1:8000 is unavailable (ConnectionRefusedError)."
# 900 output tokens take 57 of the pool's 100 blocks: two cannot run at once; 4 take 1.
LARGE, SMALL = 900, 4


class Tally:
    """Every admission and release the gate reports, by reservation."""

    def __init__(self) -> None:
        self.admitted: list[object] = []
        self.releases: Counter[int] = Counter()
        self.outcomes: Counter[str] = Counter()

    def decided(self, decision: Decision) -> None:
        if decision.kind == "admit":
            self.admitted.append(decision.reservation)

    def released(self, release: Release) -> None:
        self.releases[id(release.reservation)] += 1
        self.outcomes[release.outcome] += 1


Make = Callable[..., tuple[Runtime, Tally, GatedRoutes]]


@pytest.fixture
def make(tiny_model_dir: Path) -> Iterator[Make]:
    runtimes: list[Runtime] = []

    def make_(max_queue_wait: float = 30.0) -> tuple[Runtime, Tally, GatedRoutes]:
        tally = Tally()
        rt = Runtime(
            Settings(
                model=str(tiny_model_dir),
                block_size=16,
                max_model_len=2048,
                num_gpu_blocks=100,
                max_queue_wait=max_queue_wait,
            ),
            observers=(tally,),
        )
        rt.configure_offline()
        runtimes.append(rt)
        return rt, tally, GatedRoutes(rt)

    yield make_
    for rt in runtimes:
        rt.backend.pool.close()


def assert_settled(rt: Runtime, tally: Tally) -> None:
    """Nothing reserved or queued; each admission released exactly once."""
    ledger = rt.gate.ledger
    assert (ledger.in_flight, ledger.kv_blocks, ledger.transient_bytes, rt.gate.waiting) == (0, 0, 0, 0)
    assert tally.admitted
    assert [tally.releases[id(r)] for r in tally.admitted] == [1] * len(tally.admitted)


def assert_refused(client: Client, status: int, code: str) -> None:
    """An answer kvgate made: the status, OpenAI's error shape, Retry-After on a 502/503."""
    assert client.raised is None, client.raised
    assert client.status == status, client.body
    assert client.error()["code"] == code
    assert client.headers["x-request-id"]
    if status in (502, 503):
        assert int(client.headers["retry-after"]) >= 1


def assert_served(client: Client) -> None:
    assert client.raised is None, client.raised
    assert client.status == 200, client.body
    assert "x-kvgate-kv-blocks" in client.headers
    assert client.complete
    assert (
        client.body.endswith(DONE) if client.headers["content-type"] == "text/event-stream" else client.body == ANSWER
    )


def chat(max_tokens: int, streamed: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": streamed}


def completion(max_tokens: int, streamed: bool = True) -> dict:
    return {"prompt": "hi", "max_tokens": max_tokens, "stream": streamed}


async def test_a_refused_connection_and_a_cut_stream_while_another_request_waits(make: Make) -> None:
    """`a` streams; `b` waits for memory behind it; `c` fits beside it and is admitted, and its
    connection is refused: the backend is marked down from c's own task, which re-checks the
    queue there. Then a's stream is cut. Nobody is admitted while the backend is down; once it
    is back, b and c are served."""
    rt, tally, routes = make()
    cut = asyncio.Event()
    backend = ScriptedBackend([stream(EVENT, cut, UpstreamClosed("EOF")), BackendDown(REFUSED)])
    backend.install(rt)
    a = Client(completion(LARGE), request_id="a")
    b = Client(chat(LARGE), "/v1/chat/completions", "b")  # no room beside a
    c = Client(completion(SMALL), request_id="c")  # room beside a, and b fits beside it
    task_a = asyncio.create_task(exchange(routes, a))
    await wait_for_async(lambda: EVENT in a.body, timeout_s=5, what="a's first event")
    task_b = asyncio.create_task(exchange(routes, b, "chat"))
    await wait_for_async(lambda: rt.gate.waiting == 1, timeout_s=5, what="b in the queue")
    task_c = asyncio.create_task(exchange(routes, c))
    await wait_for_async(
        lambda: rt.budget.hold is not None and rt.gate.waiting == 2, timeout_s=5, what="c back in the queue, down"
    )
    assert backend.calls == 2  # c was admitted beside a, and sent

    cut.set()
    await task_a
    assert a.raised is None
    assert a.status == 200
    assert b"backend_stream_broken" in a.body
    assert a.body.endswith(DONE)
    assert backend.opened[0].closed == 1  # the cut connection is not put back in the pool
    await asyncio.sleep(0)  # the queue's re-check after a's release: the backend is still down
    assert (b.status, c.status, rt.gate.waiting) == (None, None, 2)

    rt.budget.set_backend("up")  # the telemetry loop sees the backend again
    await asyncio.gather(task_b, task_c)
    assert_served(b)
    assert_served(c)
    assert backend.calls == 4
    assert tally.outcomes == {"upstream_error": 1, "requeued": 1, "completed": 2}
    assert_settled(rt, tally)


async def test_two_refused_at_once_as_the_backend_hangs_get_503_at_their_deadline(make: Make) -> None:
    """Two requests find the backend gone in the same turn of the loop while the telemetry loop
    marks it hung: both wait, are never sent again while it is out, and get 503 at their
    deadline, a streamed and a non-streamed one alike."""
    rt, tally, routes = make(max_queue_wait=0.3)
    both_sent = asyncio.Barrier(2)

    async def refused(hang: bool) -> ScriptedUpstream:
        await both_sent.wait()  # both admitted and sent before either is refused
        if hang:
            rt.budget.set_backend("hung", "scrape of /metrics timed out")
        raise BackendDown(REFUSED)

    backend = ScriptedBackend([lambda: refused(hang=True), lambda: refused(hang=False)])
    backend.install(rt)
    clients = [Client(completion(SMALL, streamed=True)), Client(chat(SMALL, streamed=False), "/v1/chat/completions")]
    await asyncio.gather(exchange(routes, clients[0]), exchange(routes, clients[1], "chat"))
    for client in clients:
        assert_refused(client, 503, "backend_unavailable")
        assert client.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    assert backend.calls == 2
    assert tally.outcomes == {"requeued": 2}
    assert_settled(rt, tally)


@pytest.mark.parametrize("offset_ms", [-3, -1, 0, 1, 3])
async def test_the_backend_back_as_the_deadline_fires(make: Make, offset_ms: int) -> None:
    """The backend comes back at (about) the instant a waiting request's deadline fires, before
    or after it: the request is served or refused 503, and nothing stays reserved."""
    wait_s = 0.1
    rt, tally, routes = make(max_queue_wait=wait_s)
    backend = ScriptedBackend([BackendDown(REFUSED)])
    backend.install(rt)
    loop = asyncio.get_running_loop()
    loop.call_at(loop.time() + wait_s + offset_ms / 1000, rt.budget.set_backend, "up")
    client = await exchange(routes, Client(completion(SMALL)))
    if client.status == 200:
        assert_served(client)
    else:
        assert_refused(client, 503, "backend_unavailable")
    assert_settled(rt, tally)


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "plain"])
async def test_the_client_leaves_as_the_backend_refuses_it(make: Make, streamed: bool) -> None:
    """Its reservation goes back when the connection is refused, and it leaves the queue it went
    back to: nothing is sent to a client that is gone, nothing stays reserved or queued."""
    rt, tally, routes = make()
    client = Client(completion(SMALL, streamed))

    def leave_and_refuse() -> NoReturn:
        client.leave()
        raise BackendDown(REFUSED)

    ScriptedBackend([leave_and_refuse]).install(rt)
    await exchange(routes, client)
    assert client.raised is None
    assert client.messages == []
    assert tally.outcomes == {"requeued": 1}
    assert_settled(rt, tally)


async def test_refused_again_right_after_the_backend_is_back(make: Make) -> None:
    """The backend's return admits two waiters in one re-check; the one sent first is refused
    again (a second outage begins from its task, right after the first ended) while the other,
    admitted in the same re-check, is sent: it is served, and the refused one waits for the next
    return."""
    rt, tally, routes = make()
    rt.budget.set_backend("down", "killed")
    backend = ScriptedBackend([BackendDown(REFUSED)])  # then answers of each request's kind
    backend.install(rt)
    clients = [Client(completion(SMALL), request_id="streamed"), Client(completion(SMALL, False), request_id="plain")]
    tasks = [asyncio.create_task(exchange(routes, client)) for client in clients]
    await wait_for_async(lambda: rt.gate.waiting == 2, timeout_s=5, what="both in the queue")
    rt.budget.set_backend("up")
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    served = next(c for c, t in zip(clients, tasks, strict=True) if t in done)
    refused = next(c for c in clients if c is not served)
    assert_served(served)
    assert backend.calls == 2
    assert rt.budget.hold is not None  # down again, from the refused request's task
    assert refused.status is None
    assert rt.gate.waiting == 1
    rt.budget.set_backend("up")
    await asyncio.gather(*tasks)
    assert_served(refused)
    assert backend.calls == 3
    assert tally.outcomes == {"requeued": 1, "completed": 2}
    assert_settled(rt, tally)


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (BackendBroke("the backend closed the connection (ConnectionResetError)"), 502, "backend_error"),
        (BackendTimedOut(), 504, "backend_timeout"),
    ],
    ids=["reset-before-head", "silent"],
)
@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "plain"])
async def test_a_request_sent_and_then_lost_is_answered_not_retried(
    make: Make, error: Exception, status: int, code: str, streamed: bool
) -> None:
    """Sent, then the backend broke the exchange or stayed silent before the head: kvgate's own
    answer, once (vLLM may have seen it), and the backend is not marked down for it."""
    rt, tally, routes = make()
    backend = ScriptedBackend([error])
    backend.install(rt)
    client = await exchange(routes, Client(completion(SMALL, streamed)))
    assert_refused(client, status, code)
    assert backend.calls == 1
    assert rt.budget.hold is None
    assert_settled(rt, tally)


async def test_a_plain_answer_cut_after_its_head_closes_the_connection(make: Make) -> None:
    """A non-streamed answer cut between its head and its end: the status went out, so the only
    honest end is a dropped connection (uvicorn closes it on the exception, after the start):
    never a 500, and the reservation is back."""
    rt, tally, routes = make()
    backend = ScriptedBackend([lambda: ScriptedUpstream([UpstreamClosed("EOF")], 200, b"application/json")])
    backend.install(rt)
    client = await exchange(routes, Client(completion(SMALL, streamed=False)))
    assert client.status == 200
    assert isinstance(client.raised, UpstreamClosed)
    assert backend.opened[0].closed == 1
    assert tally.outcomes == {"upstream_error": 1}
    assert_settled(rt, tally)
