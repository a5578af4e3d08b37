"""Under speculative decoding a step samples 1 + k rows per sequence (issue 24, benchmark S9).

vLLM 0.32.0's Model Runner V2 computes the logits of every row a step samples, each sequence's
bonus row and its drafts, as one tensor in the model dtype (v1/worker/gpu/model_runner.py
``sample``: ``hidden_states[input_batch.logits_indices]``), and its RejectionSampler copies them
to fp32 in chunks of up to 1 GiB (spec_decode/rejection_sampler.py ``get_max_chunk_logits``). On
benchmark S9's engine (Llama-3.1-8B, n-gram k = 5, 2,048 tokens a step, 256 sequences, about
300 MiB of headroom) a step of 256 sequences samples 1,536 rows: 376 MiB of logits, a 752 MiB
copy. The any-cache sizes stopped at the largest tensor of a row per sequence (128 MiB), so a
segment a step verifying drafts leaves cached was never among the caches the level is replayed
from; the simulator (kvgate/sim/step_memory.py, its allocator kvgate/sim/gpu.py) runs out of
memory from such a cache on a step that level admitted.
"""

from __future__ import annotations

import copy
import json

import pytest
from sim_support import started

from kvgate.gate.budget import TRANSIENT_BUSY
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import (
    AnyCacheForward,
    EngineShape,
    any_cache_forward_level,
    cached_segment_sizes,
    sampler_cost,
)
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.presets import model_config
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape, run_tape
from kvgate.units import GiB, MiB
from support.served_budget import v2_budget

LLAMA_8B = ModelGeometry.from_config(model_config("llama-3.1-8b"))
NGRAM_5 = {"method": "ngram", "num_speculative_tokens": 5}
S9_ENGINE = EngineShape(
    max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, runner="v2", num_speculative_tokens=5
)
HEADROOM = 300 * MiB
# 103 sequences verifying 5 drafts each: 618 rows, 151.2 MiB of logits in a 152 MiB segment
VERIFYING = 103


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
    assert 152 * MiB in cached_segment_sizes(LLAMA_8B, S9_ENGINE, 6 * VERIFYING)


@pytest.fixture(scope="module")
def s9_gpu() -> tuple[Device, CachingAllocator, StepMemory]:
    """S9's simulated engine just started, `HEADROOM` left free on its GPU."""
    device, alloc, steps = started(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        vllm_version="0.32.0",
        max_model_len=8192,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        speculative_config=NGRAM_5,
    )
    device.set_usage("other", device.free() - HEADROOM)
    return device, alloc, steps


def step(prefill: int, sequences: int, drafts: int) -> StepShape:
    """A `prefill`-token chunk (none if 0) beside `sequences` decoding rows at temperature 1.0
    (no fp32 copy), each verifying `drafts` draft tokens."""
    decoding = tuple(
        ReqSlice(1 + drafts, 300, random=True, draft_tokens=drafts, processes=False) for _ in range(sequences)
    )
    return StepShape(((ReqSlice(prefill, 0, samples=False),) if prefill else ()) + decoding)


def played(alloc: CachingAllocator, steps: StepMemory, shape: StepShape) -> bool:
    try:
        for block in run_tape(alloc, steps.plan(shape)):
            alloc.free(block)
    except CudaOutOfMemory:
        return False
    return True


def cached(alloc: CachingAllocator) -> list[int]:
    """The simulator's free segments, in MiB."""
    return sorted(s.size // MiB for s in alloc.segments if s.fully_free())


def test_a_step_verifying_drafts_leaves_a_segment_no_step_of_a_row_per_sequence_makes(s9_gpu) -> None:
    """After a 1,024-token prefill, 103 sequences verifying 5 drafts each put their 618 rows of
    logits in a new 152 MiB segment, left cached: larger than every size of a row per sequence."""
    _, alloc, steps = copy.deepcopy(s9_gpu)
    assert played(alloc, steps, step(1023, 1, 0))
    assert played(alloc, steps, step(0, VERIFYING, 5))
    assert 152 in cached(alloc)
    assert max(cached_segment_sizes(LLAMA_8B, S9_ENGINE, 256)) == 128 * MiB


def test_the_simulator_runs_out_beside_that_segment_on_a_step_the_one_row_sizes_admit(s9_gpu) -> None:
    """From a cache of that 152 MiB segment and a 96 MiB one (a row per sequence's size), built
    with the simulator's allocator, the 1,920-token step the sizes of a row per sequence admit
    runs out of memory; from the empty cache it runs. Once the engine life has sampled 618 rows
    the sizes reach 152 MiB and the level is 1,824 tokens, a step the simulator runs from it."""
    one_row_level = any_cache_forward_level(LLAMA_8B, S9_ENGINE, False, HEADROOM, 256)
    verified_level = any_cache_forward_level(LLAMA_8B, S9_ENGINE, False, HEADROOM, 6 * VERIFYING)
    assert (one_row_level, verified_level) == (1920, 1824)

    def runs_from(cache_mib: list[int], tokens: int) -> bool:
        _, alloc, steps = copy.deepcopy(s9_gpu)
        blocks = [alloc.malloc(size * MiB) for size in cache_mib]
        for block in blocks:
            alloc.free(block)
        assert cached(alloc) == sorted(cache_mib)
        return played(alloc, steps, step(tokens - 1, 1, 0))

    assert runs_from([], one_row_level)
    assert runs_from([96], one_row_level)
    assert not runs_from([96, 152], one_row_level)
    assert runs_from([96, 152], verified_level)


def chat(predictor: Predictor, prompt_tokens: int, max_tokens: int) -> Demand:
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 1.0}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[7] * prompt_tokens]).demand


def test_a_prompt_beside_chats_waits_once_this_engine_life_verified_more_rows_than_sequences() -> None:
    """kvgate in front of S9's engine, 300 MiB of headroom: 103 chats decoding verify 618 rows a
    step (`Ledger.peak_sampled_rows` counts sampled rows, 1 + 5 per chat). Five remain when a
    1,850-token prompt asks in: its step beside them holds 1,886 tokens, which the caches of a
    row per sequence run (1,920) and those of 618 rows do not (1,824), so it waits; in a new
    engine life in which only the five chats' 30 rows were sampled it goes in."""
    flags = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--speculative-config", json.dumps(NGRAM_5)]
    budget, predictor = v2_budget(LLAMA_8B, flags, "0.32.0", 60 * GiB)
    budget.update(
        transient_headroom_bytes=HEADROOM,
        max_transient_headroom_bytes=HEADROOM,
        profiled_cap_bytes=predictor.profiled_peak_bytes,
        held_region_bytes=predictor.profiled_peak_bytes,
        any_cache_forward=AnyCacheForward(LLAMA_8B, predictor.engine, False, background=False),
    )
    ledger = Ledger()
    chats = [ledger.reserve(chat(predictor, 200, 256)) for _ in range(VERIFYING)]
    for reservation in chats:
        ledger.end_prefill(reservation)
    assert ledger.peak_sampled_rows == 6 * VERIFYING
    for reservation in chats[5:]:
        ledger.release(reservation)
    prompt = chat(predictor, 1850, 64)
    assert budget.shortfall(prompt, ledger) == TRANSIENT_BUSY
    ledger.reset_peak()
    assert ledger.peak_sampled_rows == 30
    assert budget.shortfall(prompt, ledger) is None
