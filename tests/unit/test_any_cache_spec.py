"""Under speculative decoding a step samples 1 + k rows per sequence (issue 24, benchmark S9).

vLLM 0.32.0's Model Runner V2 computes the logits of every row a step samples, each sequence's
bonus row and its drafts, as one tensor in the model dtype (v1/worker/gpu/model_runner.py
``sample``: ``hidden_states[input_batch.logits_indices]``), and its RejectionSampler copies them
to fp32 in chunks of up to 1 GiB (spec_decode/rejection_sampler.py ``get_max_chunk_logits``). On
benchmark S9's engine (Llama-3.1-8B, n-gram k = 5, 2,048 tokens a step, 256 sequences; 304 MiB
of headroom as kvgate reads it in the benchmark) a step of 256 sequences samples 1,536 rows:
376 MiB of logits, a 752 MiB copy. The any-cache sizes stopped at the largest tensor of a row
per sequence (128 MiB), so the segment a step verifying drafts leaves cached was never among the
caches the level is replayed from, and the simulator (kvgate/sim/step_memory.py, its allocator
kvgate/sim/gpu.py) runs out of memory after such a step on a step that level admitted.
"""

from __future__ import annotations

import copy
import json

import pytest
from sim_support import S9_DRAFTS, played, prefill_beside, started_s9

from kvgate.gate.budget import TRANSIENT_BUSY
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import (
    EngineShape,
    any_cache_forward_level,
    cached_segment_sizes,
    sampler_cost,
)
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.presets import model_config
from kvgate.sim.step_memory import StepMemory, StepShape
from kvgate.units import MiB
from support.served_budget import served_v2_budget

LLAMA_8B = ModelGeometry.from_config(model_config("llama-3.1-8b"))
NGRAM_5 = {"method": "ngram", "num_speculative_tokens": S9_DRAFTS}
S9_ENGINE = EngineShape(
    max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, runner="v2", num_speculative_tokens=S9_DRAFTS
)
HEADROOM = 304 * MiB
# 56 sequences verifying 5 drafts each: 336 rows, their fp32 copy 164.4 MiB (a 166 MiB segment)
VERIFYING = 56
ROWS = (1 + S9_DRAFTS) * VERIFYING


def test_the_sizes_reach_the_largest_tensor_of_a_step_verifying_every_sequences_drafts() -> None:
    """A row per sequence keeps the sizes it had (every 4 MiB up to 128 MiB); beyond, every
    1/32 of the 1,536-row step's fp32 copy, up to it."""
    assert sampler_cost(LLAMA_8B, S9_ENGINE).max_sampled_rows == 1536
    one_row_each = cached_segment_sizes(LLAMA_8B, S9_ENGINE, 256)
    assert one_row_each == [4 * MiB * k for k in range(1, 33)]
    everything = cached_segment_sizes(LLAMA_8B, S9_ENGINE)
    assert everything[:32] == one_row_each
    assert everything[32:] == [(128 + 24 * k) * MiB for k in range(1, 27)]
    assert everything[-1] >= 1536 * LLAMA_8B.vocab_size * 4 > everything[-2]
    assert max(cached_segment_sizes(LLAMA_8B, S9_ENGINE, ROWS)) == 176 * MiB


@pytest.fixture(scope="module")
def s9_gpu() -> tuple[Device, CachingAllocator, StepMemory]:
    """S9's simulated engine just started, `HEADROOM` left free on its GPU."""
    return started_s9(HEADROOM)


def step(prefill: int, sequences: int, copied: bool) -> StepShape:
    """A `prefill`-token chunk beside `sequences` decoding requests verifying S9's 5 drafts each;
    `copied`: at a temperature other than 1.0 (S9's chats), the RejectionSampler copies their
    logits to fp32."""
    return prefill_beside(prefill, sequences, copied, S9_DRAFTS)


def test_after_a_step_verifying_drafts_the_simulator_runs_out_on_a_step_the_one_row_sizes_admit(s9_gpu) -> None:
    """A 1,024-token prefill beside 56 sequences verifying 5 drafts at temperature 0.7 (S9's
    chats) leaves their fp32 copy's 166 MiB segment cached, larger than every size of a row per
    sequence. The next step, 1,712 prompt tokens beside the same sequences (2,048 tokens, the
    level of those sizes), runs out of memory on SiluAndMul's 56 MiB output; the level of the
    sizes 336 rows leave, 1,824 tokens, runs after the same step."""
    one_row_level = any_cache_forward_level(LLAMA_8B, S9_ENGINE, False, HEADROOM, 256)
    verified_level = any_cache_forward_level(LLAMA_8B, S9_ENGINE, False, HEADROOM, ROWS)
    assert (one_row_level, verified_level) == (2048, 1824)
    _, alloc, steps = copy.deepcopy(s9_gpu)
    assert played(alloc, steps, step(1024, VERIFYING, copied=True))
    assert sorted(s.size // MiB for s in alloc.segments if s.fully_free()) == [12, 12, 84, 166]
    assert not played(copy.deepcopy(alloc), steps, step(one_row_level - ROWS, VERIFYING, copied=True))
    assert not played(copy.deepcopy(alloc), steps, step(one_row_level - 1, 1, copied=False))
    assert played(copy.deepcopy(alloc), steps, step(verified_level - ROWS, VERIFYING, copied=False))
    assert played(copy.deepcopy(alloc), steps, step(verified_level - 1, 1, copied=False))


def chat(predictor: Predictor, prompt_tokens: int, max_tokens: int) -> Demand:
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 0.7}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[7] * prompt_tokens]).demand


def test_a_prompt_beside_chats_waits_once_this_engine_life_verified_more_rows_than_sequences() -> None:
    """kvgate in front of S9's engine: 56 chats decoding verify 336 rows a step
    (`Ledger.peak_segment_rows` counts sampled rows, 1 + 5 per chat, their logits copied to fp32 at temperature 0.7). Five remain when a
    1,850-token prompt asks in: its step beside them holds 1,886 tokens, which the caches of a
    row per sequence run (2,048) and those of 336 rows do not (1,824), so it waits; in a new
    engine life in which only the five chats' 30 rows were sampled it goes in."""
    flags = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--speculative-config", json.dumps(NGRAM_5)]
    budget, predictor = served_v2_budget(LLAMA_8B, flags, HEADROOM)
    ledger = Ledger()
    chats = [ledger.reserve(chat(predictor, 200, 256)) for _ in range(VERIFYING)]
    for reservation in chats:
        ledger.end_prefill(reservation)
    assert ledger.peak_segment_rows == ROWS
    for reservation in chats[5:]:
        ledger.release(reservation)
    prompt = chat(predictor, 1850, 64)
    assert budget.shortfall(prompt, ledger) == TRANSIENT_BUSY
    ledger.reset_peak()
    assert ledger.peak_segment_rows == 30
    assert budget.shortfall(prompt, ledger) is None
