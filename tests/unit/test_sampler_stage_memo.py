"""SamplerCost.stage keeps the stages it worked out (kvgate/memory/sampler.py): every answer equals
the stage worked out afresh from the same arguments (`_stage_of`, the longest prompt and output as
given, not as the memo's key drops them without penalties), over random sequences of batches that
repeat (rows, flags) with other prompt and output lengths, on each runner and sampler path; the
memo is bounded."""

from __future__ import annotations

import random

import pytest

from kvgate.memory import sampler
from kvgate.memory.sampler import SamplerCost

V = 128_256

COSTS = [
    SamplerCost(V, 2, 256, 8192, "v1"),
    SamplerCost(V, 2, 256, 8192, "v1", num_speculative_tokens=3, draft_probs_per_request=4096),
    SamplerCost(V, 2, 1024, 8192, "v1", sampler="flashinfer", sort_below_rows=64),
    SamplerCost(V, 2, 1024, 8192, "v2", sampler="flashinfer", hidden_size=4096),
    SamplerCost(V, 2, 1024, 8192, "v2", sampler="triton", warmup_profile=True, num_speculative_tokens=2),
]


def _arguments(rng: random.Random) -> tuple[int | bool | None, ...]:
    """A batch's stage arguments from small pools, so keys repeat with other lengths."""
    return (
        rng.choice([1, 2, 32, 300, 5000]),
        rng.random() < 0.3,  # logprobs
        rng.random() < 0.3,  # penalties
        rng.choice([0, 5, 100, 8000]),  # longest prompt
        rng.random() < 0.7,  # random
        rng.random() < 0.1,  # all-vocab logprobs
        rng.random() < 0.2,  # structured
        rng.choice([0, 16, 4096]),  # longest output
        rng.choice([None, True, False]),  # processing
        rng.choice([None, True, False]),  # filtered
        rng.random() < 0.5,  # both filters
    )


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: f"{c.runner}-{c.sampler}-{c.num_speculative_tokens}")
@pytest.mark.parametrize("seed", range(3))
def test_kept_stages_equal_fresh_ones(cost: SamplerCost, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        arguments = _arguments(rng)
        assert cost.stage(*arguments) == cost._stage_of(arguments)  # type: ignore[arg-type]


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "STAGES_KEPT", 8)
    cost = SamplerCost(V, 2, 256, 8192, "v1")
    for rows in range(1, 30):
        assert cost.stage(rows, False, False, 0) == cost._stage_of(
            (rows, False, False, 0, True, False, False, 0, None, None, True)
        )
        assert len(cost._stages) <= 8
