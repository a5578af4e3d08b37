"""The predictor makes each distinct SamplerUse once (kvgate/predict.py Predictor.sampler_use): the
use it hands out equals one made afresh, and requests in flight that share one use object are
charged as if each had its own (SamplerBatch keys what it kept by the candidate's identity)."""

from __future__ import annotations

import json
import random

import pytest
from test_sampler_batch_memo import COSTS, _use

from kvgate.memory.activation import EngineShape, SamplingShape
from kvgate.memory.sampler import SamplerBatch, SamplerCost, SamplerUse
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from support.geometry import layout

BODIES = [{}, {"n": 4}, {"logprobs": 5}, {"presence_penalty": 0.5, "n": 2}, {"temperature": 0}, {"top_k": 5}]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("length", [1, 100, 101, 5000])
def test_a_kept_use_equals_a_fresh_one(body: dict, length: int) -> None:
    predictor = Predictor(layout("llama-3-8b"), EngineShape(32768, 2048, 256), True, 10**9)
    spec = parse_request("completions", json.dumps({"model": "m", "prompt": [1] * length, **body}).encode()).request
    prediction = predictor.predict(spec, [[1] * length])
    use = prediction.demand.sampler
    assert use is not None
    sampling: SamplingShape = prediction.sampling
    fresh = SamplerUse(
        predictor.sampler_cost,
        rows=use.rows,
        longest_prompt=length,
        logprobs=spec.sampling.logprobs is not None,
        penalties=spec.sampling.penalties,
        longest_output=prediction.max_new_tokens,
        random=not spec.sampling.greedy,
        all_vocab_logprobs=spec.sampling.logprobs == -1,
        structured=spec.sampling.structured_outputs,
        processing=sampling.processing,
        filtered=sampling.filtered,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
    assert use == fresh
    assert use.alone == fresh.alone
    assert predictor.predict(spec, [[1] * length]).demand.sampler is use  # made once


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: f"{c.runner}-{c.sampler}-{c.num_speculative_tokens}")
@pytest.mark.parametrize("seed", range(5))
def test_requests_sharing_a_use_are_charged_as_with_their_own(cost: SamplerCost, seed: int) -> None:
    """Candidates drawn from a few use objects, each in flight several times at once: every stage
    the batch gives equals its fresh computation."""
    rng = random.Random(seed)
    pool = [_use(rng, cost) for _ in range(3)]
    batch = SamplerBatch()
    in_flight: list[SamplerUse] = []
    for _ in range(300):
        if in_flight and rng.random() < 0.4:
            batch.remove(in_flight.pop(rng.randrange(len(in_flight))))
            assert batch.stage() == batch._compute(None)
            continue
        candidate = rng.choice(pool)
        assert batch.stage(candidate) == batch._compute(candidate)
        assert batch.stage(candidate) == batch._compute(candidate)
        if rng.random() < 0.8:
            asked = batch.stage(candidate)
            batch.add(candidate)
            in_flight.append(candidate)
            assert batch.stage() == asked == batch._compute(None)
        else:
            assert batch.stage() == batch._compute(None)
