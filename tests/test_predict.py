"""Predictor: the transient estimate is computed once per (prompt length, sampling shape), and
the demand it gives is the one a fresh estimate gives."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_memory_footprint import layout

import app.predict
from app.gate.output_lengths import OutputLengths
from app.memory.activation import EngineShape, SamplingShape
from app.memory.footprint import predict_footprint
from app.openai import RequestSpec, parse_request
from app.predict import Predictor

ENGINES = {
    "flash-attn": EngineShape(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=256),
    "materializing": EngineShape(32768, 2048, 256, attention_backend="materializing"),
    "flashinfer": EngineShape(32768, 8192, 64, attention_backend="flashinfer"),
}
BODIES = [
    {},
    {"n": 4},
    {"n": 2, "best_of": 3},
    {"logprobs": 5},
    {"prompt_logprobs": 1},
    {"presence_penalty": 0.5, "n": 2},
]
PROMPT_LENGTHS = [[1], [100], [101], [2048], [4097], [20000], [100, 101, 3000]]


def spec_of(body: dict) -> RequestSpec:
    return parse_request("completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 500, **body}).encode())


def fresh_demand(predictor: Predictor, spec: RequestSpec, prompts: list[list[int]]):
    """The demand with every footprint's transient terms estimated and split afresh."""
    sampling = SamplingShape(
        n=spec.n,
        best_of=spec.best_of,
        logprobs=spec.logprobs,
        prompt_logprobs=spec.prompt_logprobs,
        penalties=spec.penalties,
    )
    footprints = [
        predict_footprint(
            predictor.layout,
            predictor.engine,
            ids,
            predictor.max_new_tokens(spec, len(ids)),
            sampling,
            enable_prefix_caching=predictor.enable_prefix_caching,
            reservation=predictor.outputs.reserve(predictor.max_new_tokens(spec, len(ids))),
        )
        for ids in prompts
    ]
    return footprints, predictor._demand(footprints, predictor.sampler_use(spec, footprints))


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_memoised_estimate_gives_the_fresh_demand(engine, prefix_caching) -> None:
    predictor = Predictor(layout("llama-3-8b"), engine, prefix_caching, 2 * 1024**3, outputs=OutputLengths(0.99))
    for _ in range(2):  # the second round comes from the memo
        for body in BODIES:
            for lengths in PROMPT_LENGTHS:
                spec = spec_of(body)
                prompts = [[(7 * i + k) % 5000 for i in range(n)] for k, n in enumerate(lengths)]
                prediction = predictor.predict(spec, prompts)
                footprints, demand = fresh_demand(predictor, spec, prompts)
                assert prediction.demand == demand, (body, lengths)
                assert [fp.transient for fp in prediction.footprints] == [fp.transient for fp in footprints]


def test_each_prompt_length_and_sampling_shape_is_estimated_once(monkeypatch) -> None:
    calls: list[tuple] = []
    real = app.predict.estimate_transient

    def counting(geometry, engine, prompt_tokens, sampling, *rest):
        calls.append((prompt_tokens, sampling))
        return real(geometry, engine, prompt_tokens, sampling, *rest)

    monkeypatch.setattr(app.predict, "estimate_transient", counting)
    predictor = Predictor(layout("llama-3-8b"), ENGINES["flash-attn"], True, 10**9)
    calls.clear()  # the engine-wide workspace estimate at construction
    first = predictor.predict(spec_of({}), [list(range(100))])
    other_tokens = predictor.predict(spec_of({}), [list(range(1000, 1100))])
    predictor.predict(spec_of({}), [list(range(101))])
    predictor.predict(spec_of({"n": 2}), [list(range(100))])
    predictor.predict(spec_of({"n": 2}), [list(range(100))])
    plain = SamplingShape(processing=False, filtered=False)  # temperature 1.0, no top-k/top-p
    assert calls == [(100, plain), (101, plain), (100, SamplingShape(n=2, processing=False, filtered=False))]
    # Same length, other tokens: the estimate is shared, the prefix-cache hashes are not.
    assert other_tokens.footprints[0].transient is first.footprints[0].transient
    assert other_tokens.demand.shared_block_hashes != first.demand.shared_block_hashes


@pytest.mark.parametrize(
    ("refused", "max_tokens", "prefill_only", "kept", "holds_one"),
    [
        (True, 100, False, 4096 - 100, False),  # 0.21-0.31: max_input_tokens = max_model_len - max_tokens
        (False, 100, False, 4096 - 1, False),  # 0.32: max_truncation_tokens keeps one token of output
        (False, None, False, 4096, False),
        (True, None, True, 4096, False),  # pooling asks for no output on every release
        # 0.33.0 chat_completion/protocol.py:694: no max_tokens is None, not 0: one token held back
        (False, None, False, 4096 - 1, True),
        (False, None, True, 4096, True),
    ],
)
def test_truncate_prompt_tokens_minus_one_keeps_what_the_release_allows(
    refused: bool, max_tokens: int | None, prefill_only: bool, kept: int, holds_one: bool
) -> None:
    engine = EngineShape(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256)
    engine = dataclasses.replace(
        engine, max_tokens_past_context_refused=refused, truncation_holds_output_token=holds_one
    )
    predictor = Predictor(layout("llama-3-8b"), engine, True, 10**9)
    spec = RequestSpec(
        "completions", b"{}", None, False, max_tokens, truncate_prompt_tokens=-1, prefill_only=prefill_only
    )
    assert predictor.truncation_length(spec) == kept


def test_a_cache_salt_shares_no_prefix_with_other_salts() -> None:
    """8 copies of one prompt under 8 cache_salt values hold what 8 distinct prompts hold in vLLM
    (the salt keys the first block); under one salt, or none, they share the prompt's blocks."""
    from app.gate.ledger import Ledger

    predictor = Predictor(layout("llama-3-8b"), ENGINES["flash-attn"], True, 2 * 1024**3)
    prompt = list(range(3000))

    def held(salts: list[str | None]) -> int:
        ledger = Ledger()
        for salt in salts:
            extra = {} if salt is None else {"cache_salt": salt}
            ledger.reserve(predictor.predict(spec_of({"max_tokens": 16, **extra}), [prompt]).demand)
        return ledger.kv_blocks

    one = held([None])
    assert held([f"salt-{i}" for i in range(8)]) == 8 * one
    assert held(["same"] * 8) == held([None] * 8) == one + 7 * (one - 3000 // 16)
    assert held([None, "a"]) == 2 * one


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_cache_salt_that_vllm_refuses_is_a_400(salt) -> None:
    from app.errors import InvalidField

    with pytest.raises(InvalidField) as refused:
        spec_of({"cache_salt": salt})
    assert refused.value.param == "cache_salt" and "non-empty string" in refused.value.message
