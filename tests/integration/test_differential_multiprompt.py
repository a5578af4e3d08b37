"""Differential cases for multi-prompt requests judged per prompt (issue 21, deliver 1): each body
here is served by vLLM (every prompt fits its pool on its own; vLLM makes one request of each and
schedules them as memory allows), and kvgate refused it while it judged the prompts of one body as
their sum (`kv_cache_never_fits`, "needs 24 KV blocks ... holds 15", for lm-eval's first batched
log-likelihood request). Through kvgate each must now get what vLLM gives it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

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
from support.vllm_server import VllmServer

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
