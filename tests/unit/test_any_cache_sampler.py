"""A step's sampler phase meets whatever cache the other requests' steps left (issue 24, benchmark S9).

Benchmark S9 (Llama-3.1-8B on an H100, vLLM 0.32.0 Model Runner V2, n-gram speculation of 5
drafts, 304 MiB of headroom as kvgate reads it) ran the simulator out of memory behind kvgate in
6 of 410 runs (session 38, bench/results/hunt-session38), each time on Model Runner V2's fp32 copy
of the logits (`logits_f32`): the step's own small tensors and its bf16 logits took cached free
segments by best fit and pinned them, and the copy found no room. Two runs kept the allocator as
the step began and replay exactly (`replay_oom.py 1254` and `1363`, the records in
raw/S9-lead.jsonl):

- seed 1254: free segments of 20, 70, 118 and 46 MiB, 50 MiB free on the device; a 1,069-token
  prefill beside 38 chats verifying 5 drafts (1,297 tokens, 229 sampled rows);
- seed 1363: free segments of 54, 118 and 130 MiB, 2 MiB free; 45 chats verifying 5 drafts (270
  tokens and rows).

kvgate charged the sampler phase after one earlier step only (kvgate/memory/activation.py
`sampler_phase_overhead_bytes`); `any_cache_sampled_rows` judges the whole step from every cache of
up to three free segments, as the forward pass was judged.
"""

from __future__ import annotations

import copy
import json

import pytest
from sim_support import S9_DRAFTS, played, prefill_beside, runs_out_on, started_s9

from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import (
    ANY_CACHE_SEGMENTS,
    ANY_CACHE_TOKEN_STEPS,
    AnyCacheSampler,
    EngineShape,
    any_cache_forward_level,
    any_cache_sampled_rows,
    cached_segment_sizes,
    sampled_step_tape,
)
from kvgate.memory.allocator import fits_from_any_cache
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.presets import model_config
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape
from kvgate.units import MiB
from support.served_budget import served_v2_budget

LLAMA_8B = ModelGeometry.from_config(model_config("llama-3.1-8b"))
S9_ENGINE = EngineShape(
    max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, runner="v2", num_speculative_tokens=S9_DRAFTS
)
S9_FLAGS = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"]
S9_FLAGS += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": S9_DRAFTS})]
HEADROOM = 304 * MiB
CACHE_1254 = (20, 70, 118, 46)  # MiB, free segments in address order
CACHE_1363 = (54, 118, 130)
CHAT_PROMPT = 200


@pytest.fixture(scope="module")
def s9_gpu() -> tuple[Device, CachingAllocator, StepMemory]:
    return started_s9(HEADROOM)


def from_cache(s9_gpu: tuple[Device, CachingAllocator, StepMemory], segments: tuple[int, ...]):
    """A copy of S9's engine whose allocator holds these free segments (MiB): tensors of those
    sizes made and freed, as earlier steps' tensors left them."""
    device, alloc, steps = copy.deepcopy(s9_gpu)
    for block in [alloc.malloc(size * MiB) for size in segments]:
        alloc.free(block)
    assert device.free() + sum(segments) * MiB == HEADROOM
    return alloc, steps


def step_1254(chats: int = 38) -> StepShape:
    """Seed 1254's step: a 1,069-token chat prompt (one sampled row) beside `chats` verifying."""
    prefill = ReqSlice(1069, 0, random=True, seeded=True, processes=True)
    return StepShape((prefill, *prefill_beside(0, chats, True, S9_DRAFTS).reqs))


def test_both_exact_records_run_out_on_the_fp32_copy_from_their_cache_and_not_from_an_empty_one(s9_gpu) -> None:
    assert (step_1254().num_tokens, step_1254().sampled_rows) == (1297, 229)
    assert runs_out_on(*from_cache(s9_gpu, CACHE_1254), step_1254()) == "logits_f32"
    assert runs_out_on(*from_cache(s9_gpu, CACHE_1363), prefill_beside(0, 45, True, S9_DRAFTS)) == "logits_f32"
    assert played(*from_cache(s9_gpu, ()), step_1254())
    assert played(*from_cache(s9_gpu, ()), prefill_beside(0, 45, True, S9_DRAFTS))


def chat(predictor: Predictor, prompt_tokens: int) -> Demand:
    """A chat of S9 (temperature 0.7: V2's RejectionSampler copies its rows' logits to fp32)."""
    body = {"prompt": "x", "max_tokens": 256, "temperature": 0.7}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[7] * prompt_tokens]).demand


def chats_admitted(budget: Budget, predictor: Predictor) -> int:
    """Chats admitted one after another, each decoding once in (its prefill ended)."""
    ledger = Ledger()
    while budget.shortfall(demand := chat(predictor, CHAT_PROMPT), ledger) is None:
        ledger.end_prefill(ledger.reserve(demand))
    return ledger.in_flight


def beside_chats(predictor: Predictor, chats: int) -> Ledger:
    ledger = Ledger()
    for _ in range(chats):
        ledger.end_prefill(ledger.reserve(chat(predictor, CHAT_PROMPT)))
    return ledger


def test_kvgate_keeps_out_both_recorded_steps_and_runs_what_it_admits_from_their_caches(s9_gpu) -> None:
    """Without the whole step's level kvgate admitted 44 chats and seed 1254's prompt beside 38
    (as it did in the benchmark); with it, 40 chats (240 rows: a 117 MiB copy), whose step runs
    from both recorded caches, and the prompt waits."""
    budget, predictor = served_v2_budget(LLAMA_8B, S9_FLAGS, HEADROOM)
    admitted = chats_admitted(budget, predictor)
    assert admitted == 40
    assert budget.shortfall(chat(predictor, 1069), beside_chats(predictor, 38)) == TRANSIENT_BUSY
    for cache in (CACHE_1254, CACHE_1363):
        assert played(*from_cache(s9_gpu, cache), prefill_beside(0, admitted, True, S9_DRAFTS))
    budget.update(any_cache_sampler=None)  # kvgate before session 39: the sampler after one earlier step
    assert chats_admitted(budget, predictor) == 44
    assert budget.shortfall(chat(predictor, 1069), beside_chats(predictor, 38)) is None


@pytest.mark.parametrize("tokens", [256, 1024, 1536])
def test_every_row_count_up_to_the_level_runs_from_every_cache_and_the_next_does_not(tokens: int) -> None:
    """The bisection's premise, on every 24th row (four sequences of 1 + 5 rows) up to the level."""
    sizes = cached_segment_sizes(LLAMA_8B, S9_ENGINE)
    level = any_cache_sampled_rows(LLAMA_8B, S9_ENGINE, False, HEADROOM, tokens, True, sizes)
    assert 0 < level < 300
    for rows in [*range(24, level + 1, 24), level, level + 1]:
        step = sampled_step_tape(LLAMA_8B, S9_ENGINE, tokens, rows, True)
        assert fits_from_any_cache(step, HEADROOM, sizes, ANY_CACHE_SEGMENTS) == (rows <= level)


def test_a_step_that_copies_nothing_runs_more_rows() -> None:
    sizes = cached_segment_sizes(LLAMA_8B, S9_ENGINE)
    copying = any_cache_sampled_rows(LLAMA_8B, S9_ENGINE, False, HEADROOM, 512, True, sizes)
    assert any_cache_sampled_rows(LLAMA_8B, S9_ENGINE, False, HEADROOM, 512, False, sizes) > copying


def test_where_the_forward_pass_alone_does_not_run_the_forward_level_judges() -> None:
    """-1: no row count is the question there (the step is capped at max_num_batched_tokens
    whoever joins it, `Budget._grows_past_any_cache`)."""
    sizes = cached_segment_sizes(LLAMA_8B, S9_ENGINE)
    assert any_cache_sampled_rows(LLAMA_8B, S9_ENGINE, False, 200 * MiB, 2048, True, sizes) == -1
    levels = AnyCacheSampler(LLAMA_8B, S9_ENGINE, False, background=False)
    assert levels(2048, 600, True, 200 * MiB, 1536)


def test_a_level_known_for_a_larger_step_answers_without_a_replay() -> None:
    """A level known for more tokens, as many sizes or more, a step that copies and no more
    headroom answers a smaller step at once; a step above it waits for its own level, worked out
    once."""
    levels = AnyCacheSampler(LLAMA_8B, S9_ENGINE, False)
    levels._known[levels._key(2048, True, HEADROOM, 1536)] = 150
    assert levels(300, 150, False, HEADROOM + 5 * MiB, 96)
    assert not levels._pending
    assert not levels(300, 151, True, HEADROOM, 96)
    own = levels._key(300, True, HEADROOM, 96)
    assert own[2] == -(-300 * ANY_CACHE_TOKEN_STEPS // 2048)
    assert own in levels._pending
    assert not levels(300, 151, True, HEADROOM - 8 * MiB, 1536)  # less headroom: no floor
    assert len(levels._pending) == 2


def test_where_the_full_step_says_minus_one_the_largest_step_whose_forward_pass_runs_answers_below_it() -> None:
    """S9's full step with every size: -1 (the forward level judges it); the level of the largest
    64th whose forward pass runs from every cache is worked out with it and answers the smaller
    steps at once (held-out H8b: before, each smaller 64th waited for its own level)."""
    levels = AnyCacheSampler(LLAMA_8B, S9_ENGINE, False, background=False)
    sizes = cached_segment_sizes(LLAMA_8B, S9_ENGINE)
    assert levels(2048, 100, True, HEADROOM, 1536)
    forward = any_cache_forward_level(LLAMA_8B, S9_ENGINE, False, HEADROOM)
    below = levels._key(forward, True, HEADROOM, 1536)
    assert below[2] == forward * ANY_CACHE_TOKEN_STEPS // 2048
    rows = levels._known[below]
    assert rows == any_cache_sampled_rows(LLAMA_8B, S9_ENGINE, False, HEADROOM, forward, True, sizes) > 100
    levels._worker = object()  # type: ignore[assignment]  # nothing may be worked out now
    assert levels(512, rows, True, HEADROOM, 1536)
    assert not levels._pending
