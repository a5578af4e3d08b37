"""The safety benchmark's client (bench/safety.py): a call still running at the deadline is a
timeout named after how far it got, so a table's "failed" column says whether requests were still
queued behind a gate, waiting for the engine's first token, or streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from bench.safety import Outcome, outcomes_of, patient_call, stream_call, summarise
from bench.scenarios import SCENARIOS
from bench.workloads import Call

CALL = Call(at=0.0, path="/v1/completions", body={"prompt": "hi", "stream": True}, label="chat")


async def test_a_call_running_past_the_deadline_is_a_timeout_named_by_its_stage() -> None:
    never = asyncio.Event()

    async def hang() -> Outcome:
        await never.wait()
        raise AssertionError("unreachable")

    async def done() -> Outcome:
        return Outcome("chat", 200, "completed", tokens=3)

    tasks = [asyncio.create_task(f()) for f in (hang, hang, hang, done)]
    stages = ["sent", "head", "streaming", "streaming"]
    outs = await outcomes_of(tasks, [CALL] * 4, deadline=-0.95, stages=stages)
    assert [(o.kind, o.reason) for o in outs] == [
        ("failed", "timeout_sent"),
        ("failed", "timeout_head"),
        ("failed", "timeout_streaming"),
        ("completed", ""),
    ]
    await asyncio.wait(tasks)  # the ones still running were cancelled
    assert [t.cancelled() for t in tasks] == [True, True, True, False]


async def test_stream_call_records_the_head_and_the_first_token() -> None:
    seen: list[list[str]] = []
    stages = ["unsent"]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(list(stages))
        body = b'data: {"choices": []}\n\ndata: {"usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, stream=httpx.ByteStream(body), headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://sim") as client:
        out = await stream_call(client, CALL.path, CALL, 0.0, 0.0, stages, 0)
    assert seen == [["sent"]]  # sent before any answer
    assert (out.kind, out.tokens, stages) == ("completed", 2, ["streaming"])


async def test_a_plain_answer_counts_its_usage_tokens_and_has_no_first_token() -> None:
    """An evaluation harness's call (no `stream`): its tokens are the answer's usage, read even
    when prompt logprobs after `usage` make the body far longer than the tail a stream keeps, and
    generated text that looks like a stream's event or a usage field fakes neither."""
    call = Call(at=0.0, path="/v1/completions", body={"prompt": "hi", "prompt_logprobs": 5}, label="eval")
    text = '"text": "data: {\\"completion_tokens\\": 999}"'
    body = ('{"choices": [{' + text + '}], "usage": {"prompt_tokens": 9000, "completion_tokens": 7}, ').encode()
    body += b'"prompt_logprobs": [' + b", ".join([b'{"1": {"logprob": -0.5, "rank": 1}}'] * 3000) + b"]}"
    stages = ["unsent"]

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 1000):  # a usage field may straddle two chunks
            yield body[i : i + 1000]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunks(), headers={"content-type": "application/json"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://sim") as client:
        out = await stream_call(client, call.path, call, 0.0, 0.0, stages, 0)
    assert (out.kind, out.tokens, out.ttft_s, stages) == ("completed", 7, None, ["head"])


def test_an_arm_tells_which_kind_of_request_forms_its_tail_and_was_refused() -> None:
    """The arm's p99 alone does not tell a burst of n=16 jobs held back from chats held back."""
    outs = [Outcome("chat", 200, "completed", ttft_s=0.1, end_s=1.0, tokens=10) for _ in range(20)]
    outs.append(Outcome("n=16 samples", 200, "completed", ttft_s=5.0, end_s=9.0, tokens=10))
    outs += [Outcome("n=16 samples", 429, "rejected", "queue_timeout", end_s=30.0) for _ in range(2)]
    result = summarise(SCENARIOS[0], "kvgate", outs, 10.0, 2.0, [], 0)
    assert result.ttft_p99_by_label == {"chat": 0.2, "n=16 samples": 10.0}  # simulated s: wall x 2
    assert result.rejected_by_label == {"n=16 samples": 2}


def sse_after(delay: float, closed: list[bool]) -> httpx.Response:
    """A streamed answer whose first token comes `delay` seconds after its head; `closed` learns
    whether the client hung up before the end."""

    async def events() -> AsyncIterator[bytes]:
        try:
            await asyncio.sleep(delay)
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            await asyncio.sleep(0.2)  # streaming past the patience is no reason to hang up
            yield b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n\ndata: [DONE]\n\n'
        except BaseException:
            closed.append(True)
            raise

    return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


async def test_a_client_hangs_up_when_its_first_token_is_later_than_its_patience_in_every_arm() -> None:
    """The same client in every arm: a first token later than the patience (counted from sending,
    however long the request waited for the cap's slot) makes it hang up and the call abandoned,
    with no tokens; one in time completes however long the rest streams; a plain answer (no
    first token to see) waits."""
    delays = {"late": 0.3, "soon": 0.0}
    closed: list[bool] = []

    def answer(request: httpx.Request) -> httpx.Response:
        return sse_after(delays[request.url.path.strip("/")], closed)

    late = Call(at=0.0, path="/late", body={"prompt": "hi", "stream": True}, label="late")
    soon = Call(at=0.0, path="/soon", body={"prompt": "hi", "stream": True}, label="soon")
    plain = Call(at=0.0, path="/late", body={"prompt": "hi"}, label="plain")
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://sim") as client:
        for sem in (None, asyncio.Semaphore(4)):  # no cap (none, gates, oracle) and a cap
            stages = ["unsent"] * 3
            outs = await asyncio.gather(
                *(
                    patient_call(client, c.path, c, 0.0, 0.0, stages, k, sem, 0.15)
                    for k, c in enumerate([late, soon, plain])
                )
            )
            assert [(o.kind, o.reason, o.tokens) for o in outs] == [
                ("abandoned", "head", 0),
                ("completed", "", 5),
                ("completed", "", 5),  # waited 0.3 s, past the patience
            ]
        assert closed == [True, True]  # the late stream was closed, once per arm

        full = asyncio.Semaphore(1)  # a cap whose one slot another request holds past the patience
        async with full:
            out = await patient_call(client, soon.path, soon, time.monotonic(), 0.0, ["unsent"], 0, full, 0.1)
        assert (out.kind, out.reason) == ("abandoned", "unsent")


def test_abandoned_calls_are_counted_apart_and_add_no_goodput() -> None:
    outs = [
        Outcome("chat", 200, "completed", ttft_s=0.1, end_s=2.0, tokens=10),
        Outcome("chat", 0, "abandoned", "head", end_s=30.0),
        Outcome("chat", 0, "abandoned", "unsent", end_s=30.0),
        Outcome("chat", 0, "failed", "timeout_streaming", end_s=60.0),
    ]
    r = summarise(SCENARIOS[0], "static-cap", outs, 2.0, 1.0, [], 0)
    assert (r.completed, r.abandoned, r.failed, r.output_tokens, r.goodput_tokens_per_s) == (1, 2, 1, 10, 5.0)
    assert r.abandoned_by_stage == {"head": 1, "unsent": 1}
