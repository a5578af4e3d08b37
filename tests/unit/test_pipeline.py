"""The request pipeline driven directly, no HTTP server: a body goes in, the validated request and
its prediction (or the refusal a client would get) come out.

The pipeline runs as `kvgate serve` runs it: the tiny model's own tokenizer, a predictor built
from the deployment kvgate resolves for it, and one PipelineConfig swapped in whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from kvgate.backend import POOL_CONNECTIONS, TokenizeCalls
from kvgate.cli import build_parser
from kvgate.composition import engine_flags, pipeline_config
from kvgate.engine_config import build_predictor, resolve
from kvgate.errors import (
    BackendDown,
    ContextTooLong,
    InvalidField,
    KvgateError,
    KvNeverFits,
    ModelNotFound,
    NotReady,
    TokenizeWaitTimeout,
    VllmRefusal,
)
from kvgate.gate.budget import Budget
from kvgate.http.errors import error_body, error_headers, status_of
from kvgate.model_folder import load_geometry
from kvgate.pipeline import PipelineConfig, RequestPipeline
from kvgate.request import ChatInput, ValidRequest
from kvgate.served_names import Served, ServedNames
from kvgate.settings import settings_from_args
from kvgate.tokens import BackendTokenizer, Tokenizer, local_tokenizer
from support.waiting import wait_for_async

MODEL = "tiny-llama"


class CountingTokenizer:
    """The real tokenizer, counting what it is asked to encode; `gate`, when set, holds every
    encode until it opens (to swap the configuration while a request is being tokenized)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.source = inner.source
        self.calls = 0
        self.called = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def _counted(self) -> None:
        self.calls += 1
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[int]:
        await self._counted()
        return await self.inner.encode_prompt(prompt, add_special_tokens, max_tokens)

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[Sequence[int]]:
        await self._counted()
        return await self.inner.encode_prompts(prompts, add_special_tokens, max_tokens)

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        await self._counted()
        return await self.inner.encode_chat(chat, max_tokens, namespace_aliases)

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        self.inner.refuse_certainly_too_long(text, max_tokens)


@pytest.fixture(scope="module")
def real_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return local_tokenizer(tiny_model_dir)


def config_for(model_dir: Path, tokenizer: Tokenizer, *flags: str) -> PipelineConfig:
    """What a backend sync configures for the tiny model served with these vLLM flags."""
    settings = settings_from_args(build_parser().parse_args(["serve", "--model", str(model_dir), *flags]))
    geometry = load_geometry(model_dir)
    deployment = resolve(engine_flags(settings), geometry, None, None)
    return pipeline_config(deployment, build_predictor(deployment, geometry), tokenizer)


def new_pipeline(budget: Budget | None = None) -> RequestPipeline:
    names = ServedNames()
    names.replace([Served(MODEL), Served("lora-a", MODEL, "/adapters/a")])
    return RequestPipeline(budget or Budget(kv_blocks=10_000), names, lambda: "no backend yet", lambda _s: None)


@pytest.fixture
def tokenizer(real_tokenizer: Tokenizer) -> CountingTokenizer:
    return CountingTokenizer(real_tokenizer)


@pytest.fixture
def pipeline(tiny_model_dir: Path, tokenizer: CountingTokenizer) -> RequestPipeline:
    configured = new_pipeline()
    configured.configure(config_for(tiny_model_dir, tokenizer, "--max-model-len", "1024", "--max-logprobs", "5"))
    return configured


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


async def test_a_chat_request_comes_out_validated_tokenized_and_predicted(
    pipeline: RequestPipeline, real_tokenizer: Tokenizer
) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello there"}]
    raw = body(messages=messages, max_completion_tokens=7, n=2, stream=True, priority=3, temperature=0)
    evaluation = await pipeline.evaluate("chat", raw)

    request = evaluation.request
    assert isinstance(request, ValidRequest)
    assert (request.model, request.stream, request.priority) == (MODEL, True, 3)
    assert (request.sampling.max_tokens, request.sampling.n, request.sampling.greedy) == (7, 2, True)
    assert request.max_tokens_param == "max_completion_tokens"
    assert request.prompts_from_text == (True,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.priority = 9  # type: ignore[misc]

    rendered = await real_tokenizer.encode_chat(ChatInput(messages=tuple(messages)))
    prediction = evaluation.prediction
    assert prediction.prompt_tokens == len(rendered)
    assert prediction.max_new_tokens == 7
    assert prediction.demand.sequences == 2
    assert evaluation.predictor is pipeline.config.predictor  # type: ignore[union-attr]


async def test_a_batch_of_prompts_is_one_prompt_each_with_exact_token_counts(pipeline: RequestPipeline) -> None:
    evaluation = await pipeline.evaluate("completions", body(prompt=[[5, 6, 7], [8] * 40], max_tokens=3))
    assert evaluation.request.prompts_from_text == (False, False)
    assert [fp.prompt_tokens for fp in evaluation.prediction.footprints] == [3, 40]


async def test_a_malformed_body_is_refused_by_the_parser_before_anything_is_tokenized(
    pipeline: RequestPipeline, tokenizer: CountingTokenizer
) -> None:
    with pytest.raises(InvalidField) as refused:
        await pipeline.evaluate("chat", body(messages=[{"content": "no role"}]))
    assert status_of(refused.value) == 400
    assert error_body(refused.value)["error"] == {
        "message": "messages[0] must be an object with a string 'role'.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "invalid_request",
    }
    assert tokenizer.calls == 0


@pytest.mark.parametrize(
    ("fields", "error", "param", "message"),
    [
        (
            {"prompt": "hi", "logprobs": 6},
            VllmRefusal,
            "logprobs",
            "Requested sample logprobs of 6, which is greater than max allowed: 5 (parameter=logprobs, value=6)",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000},
            ContextTooLong,
            "max_tokens",
            "max_tokens=2000 cannot be greater than max_model_len=1024. Please request fewer output tokens. "
            "(parameter=max_tokens, value=2000)",
        ),
        (
            {"prompt": "hi", "n": 16_385},
            VllmRefusal,
            None,
            "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable.",
        ),
    ],
    ids=["logprobs", "max_tokens", "n_past_vllm_max_n_sequences"],
)
async def test_what_vllm_refuses_before_reading_a_prompt_is_refused_before_tokenizing(
    pipeline: RequestPipeline, tokenizer: CountingTokenizer, fields: dict, error: type, param: str, message: str
) -> None:
    route = "chat" if "messages" in fields else "completions"
    with pytest.raises(error) as refused:
        await pipeline.evaluate(route, body(**fields))
    assert error_body(refused.value)["error"] == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }
    assert tokenizer.calls == 0


async def test_an_unknown_model_is_a_404_naming_the_served_base_models(pipeline: RequestPipeline) -> None:
    with pytest.raises(ModelNotFound) as refused:
        await pipeline.evaluate("completions", json.dumps({"model": "nope", "prompt": "hi"}).encode())
    assert status_of(refused.value) == 404
    assert MODEL in refused.value.message
    assert "lora-a" not in refused.value.message


async def test_a_request_larger_than_the_pool_never_fits_but_is_still_predicted(
    tiny_model_dir: Path, tokenizer: CountingTokenizer
) -> None:
    small = new_pipeline(Budget(kv_blocks=4))
    small.configure(config_for(tiny_model_dir, tokenizer, "--max-model-len", "1024"))
    raw = body(prompt=[7] * 200, max_tokens=10)
    evaluation = await small.predict("completions", raw)  # predicted without judging
    assert evaluation.prediction.max_kv_blocks > 4
    with pytest.raises(KvNeverFits) as refused:
        await small.evaluate("completions", raw)
    assert status_of(refused.value) == 400


async def test_before_the_first_sync_a_valid_body_is_503_and_a_malformed_one_400() -> None:
    unconfigured = new_pipeline()
    assert unconfigured.config is None
    with pytest.raises(NotReady) as waiting:
        await unconfigured.evaluate("completions", body(prompt="hi"))
    assert status_of(waiting.value) == 503
    assert "no backend yet" in waiting.value.message
    with pytest.raises(InvalidField):
        await unconfigured.evaluate("completions", body(prompt=7))


async def test_a_new_configuration_takes_effect_whole_and_a_request_on_its_way_keeps_its_own(
    tiny_model_dir: Path, tokenizer: CountingTokenizer
) -> None:
    """A backend restarted with a shorter context: requests after the sync are judged by it; the
    one being tokenized meanwhile finishes against the configuration it started with."""
    pipeline = new_pipeline()
    long_context = config_for(tiny_model_dir, tokenizer, "--max-model-len", "1024")
    short_context = config_for(tiny_model_dir, tokenizer, "--max-model-len", "256")
    pipeline.configure(long_context)
    raw = body(prompt="hello there " * 40, max_tokens=4)  # 281 tokens

    tokenizer.gate = asyncio.Event()
    on_its_way = asyncio.create_task(pipeline.evaluate("completions", raw))
    await asyncio.wait_for(tokenizer.called.wait(), timeout=10)
    pipeline.configure(short_context)
    tokenizer.gate.set()
    evaluation = await on_its_way
    assert evaluation.predictor is long_context.predictor
    assert 256 < evaluation.prediction.prompt_tokens < 1024

    with pytest.raises(ContextTooLong) as refused:
        await pipeline.evaluate("completions", raw)
    # a text prompt, counted as vLLM counts it (encoded up to the limit + 1): "at least 257"
    assert "maximum context length is 256 tokens. However, your prompt contains at least 257 input tokens" in (
        refused.value.message
    )


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (httpx.ReadTimeout("silent"), 504, "backend_timeout"),
        (httpx.ReadError("connection reset"), 502, "backend_error"),
        (httpx.Response(404, json={"detail": "Not Found"}), 424, "tokenizer_unavailable"),
    ],
)
async def test_a_backend_tokenize_failure_says_whose_it_is(
    tiny_model_dir: Path, failure: Exception | httpx.Response, status: int, code: str
) -> None:
    """Tokenizing through vLLM's /tokenize: a call it took and then left silent or cut is the
    backend in trouble (504 or 502, as a forwarded request would have found it), not a
    deployment problem; only an answer without tokens is one (424, naming --model)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(failure, httpx.Response):
            return failure
        raise failure

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm") as client:
        configured = new_pipeline()
        configured.configure(config_for(tiny_model_dir, BackendTokenizer(client, MODEL)))
        with pytest.raises(KvgateError) as refused:
            await configured.evaluate("completions", body(prompt="hello", max_tokens=4))
    assert status_of(refused.value) == status
    assert error_body(refused.value)["error"]["code"] == code


async def test_a_tokenize_call_cut_by_the_servers_keep_alive_close_is_sent_again(tiny_model_dir: Path) -> None:
    """vLLM's server closes an idle connection after 5 s; a /tokenize sent on it as the close
    arrives is cut (httpx ReadError) though the server never saw it: kvgate sends it once more
    (tokenizing changes nothing) instead of answering 502."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["prompt"])
        if len(calls) == 1:
            raise httpx.ReadError("")
        return httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3, "max_model_len": 256})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm") as client:
        configured = new_pipeline()
        configured.configure(config_for(tiny_model_dir, BackendTokenizer(client, MODEL)))
        evaluation = await configured.evaluate("completions", body(prompt="hello", max_tokens=4))
    assert calls == ["hello", "hello"]
    assert evaluation.prediction.demand.prompt_tokens == 3


class HeldTokenize(httpx.AsyncBaseTransport):
    """A backend's /tokenize that answers only when the test lets it (`answer.set()`), after
    `connect_timeouts` connections it did not accept in time; counts the calls it holds."""

    def __init__(self, connect_timeouts: int = 0) -> None:
        self.answer = asyncio.Event()
        self.held = 0
        self.most_held = 0
        self.connect_timeouts = connect_timeouts

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.connect_timeouts:
            self.connect_timeouts -= 1
            raise httpx.ConnectTimeout("the accept queue is full")
        self.held += 1
        self.most_held = max(self.most_held, self.held)
        try:
            await self.answer.wait()
        finally:
            self.held -= 1
        return httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3, "max_model_len": 256})


async def test_the_tokenize_connections_are_split_into_small_pools() -> None:
    """httpcore weighs each call against every connection of its pool: 40 connections are three
    pools (14, 13, 13), each call goes to the least busy, so 40 calls run at once and none waits."""
    pools: list[tuple[int, HeldTokenize]] = []

    def pool(size: int) -> HeldTokenize:
        pools.append((size, HeldTokenize()))
        return pools[-1][1]

    calls = TokenizeCalls(40, pool=pool)
    assert [size for size, _ in pools] == [14, 13, 13]
    async with httpx.AsyncClient(transport=calls, base_url="http://vllm") as client:
        sent = [asyncio.create_task(client.post("/tokenize", json={"prompt": "hi"})) for _ in range(40)]
        await wait_for_async(lambda: sum(held.held for _, held in pools) == 40, timeout_s=5, what="40 calls held")
        assert all(held.most_held <= size <= POOL_CONNECTIONS for size, held in pools)
        assert calls.waiting == 0
        for _, held in pools:
            held.answer.set()
        assert [r.status_code for r in await asyncio.gather(*sent)] == [200] * 40


class FrozenClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tokenizing_through(
    model_dir: Path, backend: httpx.AsyncBaseTransport, connections: int, clock: FrozenClock
) -> tuple[RequestPipeline, TokenizeCalls, httpx.AsyncClient]:
    calls = TokenizeCalls(connections, inner=backend, clock=clock)
    client = httpx.AsyncClient(transport=calls, base_url="http://vllm")
    configured = new_pipeline()
    configured.configure(config_for(model_dir, BackendTokenizer(client, MODEL)))
    return configured, calls, client


async def test_a_burst_larger_than_the_tokenize_connections_waits_its_turn_and_is_answered(
    tiny_model_dir: Path,
) -> None:
    """Tokenizing through the backend: 7 arrivals, 2 connections. The backend never holds more
    than 2 calls; the other 5 wait (within their deadline) and every request is evaluated."""
    backend, clock = HeldTokenize(), FrozenClock()
    configured, calls, client = tokenizing_through(tiny_model_dir, backend, 2, clock)
    burst = [
        asyncio.ensure_future(configured.evaluate("completions", body(prompt=f"p{i}", max_tokens=4), clock.now + 30))
        for i in range(7)
    ]
    await wait_for_async(lambda: backend.held == 2 and calls.waiting == 5, timeout_s=10, what="2 sent, 5 waiting")
    backend.answer.set()
    evaluations = await asyncio.gather(*burst)
    assert [e.prediction.demand.prompt_tokens for e in evaluations] == [3] * 7
    assert backend.most_held == 2
    await client.aclose()


async def test_a_request_whose_deadline_passes_waiting_for_a_tokenize_connection_is_a_queue_timeout(
    tiny_model_dir: Path,
) -> None:
    """The wait for /tokenize is part of the request's --max-queue-wait: when its deadline passes
    there it is refused as a queue timeout would be (429, Retry-After), not left hanging behind
    a call that never ends. A request past its deadline that finds a connection free is still
    tokenized: nothing made it wait."""
    backend, clock = HeldTokenize(), FrozenClock()
    configured, calls, client = tokenizing_through(tiny_model_dir, backend, 1, clock)
    holding = asyncio.ensure_future(configured.evaluate("completions", body(prompt="a", max_tokens=4), clock.now + 30))
    await wait_for_async(lambda: backend.held == 1, timeout_s=10, what="the one connection taken")
    for seconds_left in (0.0, 0.01):  # already spent on arrival; spent while waiting
        with pytest.raises(TokenizeWaitTimeout) as refused:
            await configured.evaluate("completions", body(prompt="b", max_tokens=4), clock.now + seconds_left)
        assert (status_of(refused.value), refused.value.code) == (429, "queue_timeout")
        assert "/tokenize (all 1 connections to it busy)" in refused.value.message
        assert int(error_headers(refused.value)["Retry-After"]) >= 1
    assert calls.waiting == 0
    assert backend.most_held == 1
    backend.answer.set()
    assert (await holding).prediction.demand.prompt_tokens == 3
    late = await configured.evaluate("completions", body(prompt="c", max_tokens=4), clock.now - 5)
    assert late.prediction.demand.prompt_tokens == 3
    await client.aclose()


async def test_a_tokenize_connection_not_accepted_in_time_is_tried_again_and_the_backend_stays_up(
    tiny_model_dir: Path,
) -> None:
    """Under a burst the backend's accept queue fills and connects time out: backpressure, not
    death. The call is tried again within the request's deadline, the backend is not marked
    down (admissions are not held); once the deadline is spent the request is a queue timeout."""
    backend, clock = HeldTokenize(connect_timeouts=3), FrozenClock()
    backend.answer.set()
    configured, calls, client = tokenizing_through(tiny_model_dir, backend, 4, clock)
    evaluation = await configured.evaluate("completions", body(prompt="a", max_tokens=4), clock.now + 30)
    assert evaluation.prediction.demand.prompt_tokens == 3
    assert calls.connect_timeouts == 3
    assert configured.budget.backend.status == "up"
    assert configured.budget.hold is None
    backend.connect_timeouts = 1
    with pytest.raises(TokenizeWaitTimeout) as refused:
        await configured.evaluate("completions", body(prompt="b", max_tokens=4), clock.now)
    assert "it accepted no connection in time" in refused.value.message
    assert configured.budget.backend.status == "up"
    await client.aclose()


async def test_a_refused_tokenize_connection_still_marks_the_backend_down_at_once(tiny_model_dir: Path) -> None:
    """A connection refused is a dead backend: marked down on the spot (admissions held), and the
    request is told so (it waits in the queue for the backend: Gate.wait_for_backend)."""

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    clock = FrozenClock()
    configured, _, client = tokenizing_through(tiny_model_dir, httpx.MockTransport(refused), 4, clock)
    with pytest.raises(BackendDown):
        await configured.evaluate("completions", body(prompt="a", max_tokens=4), clock.now + 30)
    assert configured.budget.backend.status == "down"
    assert configured.budget.hold is not None
    await client.aclose()
