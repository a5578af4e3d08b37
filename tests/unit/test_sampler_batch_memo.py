"""SamplerBatch keeps the stages it computed (kvgate/memory/sampler.py): the stage a candidate was
admitted with becomes the batch's when it joins, and a candidate joining an empty batch is charged
its own `alone`. These tests compare every memoised answer with a fresh computation over random
sequences of admissions, candidates and releases, on each runner and sampler path."""

from __future__ import annotations

import random

import pytest

from kvgate.memory.sampler import SamplerBatch, SamplerCost, SamplerUse

V = 128_256

COSTS = [
    SamplerCost(V, 2, 256, 8192, "v1"),
    SamplerCost(V, 2, 256, 8192, "v1", num_speculative_tokens=3, draft_probs_per_request=4096),
    SamplerCost(V, 2, 1024, 8192, "v2", sampler="flashinfer", hidden_size=4096),
    SamplerCost(V, 2, 1024, 8192, "v2", sampler="triton", warmup_profile=True),
]


def _use(rng: random.Random, cost: SamplerCost) -> SamplerUse:
    return SamplerUse(
        cost,
        rows=rng.choice([1, 1, 2, 8, 300]),
        longest_prompt=rng.choice([0, 5, 100, 8000]),
        logprobs=rng.random() < 0.3,
        penalties=rng.random() < 0.3,
        random=rng.random() < 0.7,
        all_vocab_logprobs=rng.random() < 0.1,
        structured=rng.random() < 0.2,
        longest_output=rng.choice([0, 16, 4096]),
        processing=rng.choice([None, True, False]),
        filtered=rng.choice([None, True, False]),
        top_k=rng.random() < 0.5,
        top_p=rng.random() < 0.5,
    )


def _fresh(batch: SamplerBatch, extra: SamplerUse | None = None) -> object:
    """The stage computed from the batch's counts, bypassing what it kept."""
    return batch._compute(extra)


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: f"{c.runner}-{c.sampler}-{c.num_speculative_tokens}")
@pytest.mark.parametrize("seed", range(5))
def test_memoised_stages_equal_fresh_ones(cost: SamplerCost, seed: int) -> None:
    rng = random.Random(seed)
    batch = SamplerBatch()
    in_flight: list[SamplerUse] = []
    for _ in range(300):
        if in_flight and rng.random() < 0.4:  # a release
            batch.remove(in_flight.pop(rng.randrange(len(in_flight))))
            assert batch.stage() == _fresh(batch)
            continue
        candidate = _use(rng, cost)
        # asked twice, as an admission asks (transient and profiled bytes)
        assert batch.stage(candidate) == _fresh(batch, candidate)
        assert batch.stage(candidate) == _fresh(batch, candidate)
        if not in_flight:
            assert batch.stage(candidate) == candidate.alone
        if rng.random() < 0.8:  # admitted: the stage it was asked with is the batch's now
            asked = batch.stage(candidate)
            batch.add(candidate)
            in_flight.append(candidate)
            assert batch.stage() == asked == _fresh(batch)
        else:  # refused or queued: another candidate is asked next, the batch is unchanged
            assert batch.stage() == _fresh(batch)


def test_a_candidate_not_the_one_asked_is_computed_afresh() -> None:
    """The kept stage belongs to the candidate it was asked for: another one joining (a use equal
    in value but not the same object, or a different one) is computed from the counts."""
    cost = COSTS[2]
    batch = SamplerBatch()
    batch.add(SamplerUse(cost, rows=3, longest_prompt=10, random=False))
    asked = SamplerUse(cost, rows=1, longest_prompt=50, logprobs=True)
    other = SamplerUse(cost, rows=200, longest_prompt=9000, penalties=True)
    assert batch.stage(asked) == _fresh(batch, asked)
    _fresh_before_other = batch.stage(asked)
    batch.add(other)
    # not the stage kept for `asked`: `other` is much larger
    assert batch.stage() == _fresh(batch) != _fresh_before_other
    batch.remove(other)
    assert batch.stage() == _fresh(batch)


def test_an_emptied_batch_charges_a_newcomer_its_own_stage() -> None:
    cost = COSTS[0]
    batch = SamplerBatch()
    first = SamplerUse(cost, rows=4, longest_prompt=100, penalties=True, longest_output=4096)
    batch.add(first)
    batch.remove(first)
    newcomer = SamplerUse(cost, rows=1, longest_prompt=5)
    assert batch.stage(newcomer) == newcomer.alone == _fresh(batch, newcomer)
    assert batch.stage() == _fresh(batch)
