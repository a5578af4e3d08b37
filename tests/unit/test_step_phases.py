"""The worst step's two phases (kvgate/memory/ceiling.py step_charge): the forward pass's profiled
terms and the sampler stage run one after the other in a vLLM step, so the larger counts."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import (
    EngineShape,
    SamplerPhaseOverhead,
    V1AnyCacheStep,
    profile_forward_bytes,
    profile_hidden_bytes,
)
from kvgate.memory.ceiling import StepHoldings, step_charge
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.settings import settings_from_args
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

# Benchmark S9's engine: Llama 3.1 8B (hidden 4,096, intermediate 14,336, bf16), 2,048 batched tokens.
S9_ENGINE = EngineShape(8192, 2048, 256, runner="v2", num_speculative_tokens=5, sampler="flashinfer")


def holdings(
    unprofiled: int = 0,
    forward: int = 0,
    residual: int = 0,
    sampler_unprofiled: int = 0,
    sampler: int = 0,
    rows: int = 0,
) -> StepHoldings:
    return StepHoldings(unprofiled, forward, residual, sampler_unprofiled, sampler, rows)


def test_the_larger_phase_counts_not_their_sum() -> None:
    """An MLP of 300 and a sampler stage of 100 + 150 unprofiled: the step needs 300, where the
    ledger used to charge 550; the prefill's unprofiled terms (attention over its context) count
    in both phases."""
    step = holdings(unprofiled=40, forward=300, sampler_unprofiled=150, sampler=100)
    assert step_charge(step, profiled_cap=1000) == 40 + 300
    bigger_sampler = holdings(unprofiled=40, forward=300, sampler_unprofiled=250, sampler=100)
    assert step_charge(bigger_sampler, profiled_cap=1000) == 40 + 250 + 100


def test_the_sampler_phase_holds_the_hidden_states_it_reads() -> None:
    step = holdings(forward=300, residual=60, sampler_unprofiled=200, sampler=100)
    assert step_charge(step, profiled_cap=1000) == 200 + 100 + 60
    # no step holds more hidden states than max_num_batched_tokens tokens' (the profile's)
    assert step_charge(step, profiled_cap=1000, residual_cap=20) == max(300, 200 + 100 + 20)


def test_profiled_bytes_count_up_to_the_emptied_region_and_at_their_segments() -> None:
    step = holdings(forward=900, sampler_unprofiled=10, sampler=50)
    assert step_charge(step, profiled_cap=400) == 400  # the region is never charged twice
    assert step_charge(step, profiled_cap=400, segment_overhead=0.25) == 500
    assert step_charge(step, profiled_cap=None) == 10  # a headroom from flags: beside the region
    sampler_bound = holdings(forward=10, sampler_unprofiled=100, sampler=200)
    assert step_charge(sampler_bound, profiled_cap=400, segment_overhead=0.25) == 100 + 250


def test_a_step_computes_at_most_max_num_batched_tokens_of_forward_pass() -> None:
    """Open prefills' chunks run in different steps, and the decoding requests' tokens join
    them: the forward phase is at most the profile's own forward pass."""
    forward = profile_forward_bytes(model_geometry("llama-3-8b"), S9_ENGINE)
    per_token = math.ceil(forward / 2048)
    # hidden + residual 2 x 2,048 x 4,096 x 2 B, MLP 3 x 2,048 x 14,336 x 2 B
    assert forward == 2 * 2048 * 4096 * 2 + 3 * 2048 * 14336 * 2 == 200 * MiB
    assert per_token == 100 * 1024
    three_prefills = holdings(forward=3 * 150 * MiB, rows=0)
    assert step_charge(three_prefills, profiled_cap=300 * MiB, forward_cap=forward) == forward
    # 64 S9 decodes verify 1 + 5 tokens each: 384 tokens of forward pass beside a 1,000-token prefill
    decodes = holdings(forward=100 * MiB, rows=384)
    charged = step_charge(decodes, profiled_cap=300 * MiB, forward_cap=forward, forward_bytes_per_token=per_token)
    assert charged == 100 * MiB + 384 * per_token


def test_profile_hidden_bytes_are_the_profiles_final_hidden_states() -> None:
    """The most of the open prefills' forward pass a sampler phase holds: 2,048 tokens' final
    hidden states (the residual is dead when the model returns)."""
    assert profile_hidden_bytes(model_geometry("llama-3-8b"), S9_ENGINE) == 2048 * 4096 * 2


def test_the_sampler_phase_beside_others_takes_its_replayed_overhead_at_the_learned_share() -> None:
    """The sampler phase's overhead is a replay at the step's rows and tokens (the open prefills'
    forward bytes over the per-token bytes, plus the sampled rows, and whether it copies its
    logits to fp32); only beside other requests (a nonzero segment overhead), at the share
    calibration allows."""
    seen: list[tuple[int, int, bool]] = []

    def overhead(rows: int, tokens: int, copies: bool) -> int:
        seen.append((rows, tokens, copies))
        return 40

    step = holdings(forward=100 * 1000, sampler_unprofiled=500 * 1000, sampler=100, rows=60)
    common = dict(profiled_cap=10**9, forward_bytes_per_token=1000, sampler_overhead=overhead)
    assert step_charge(step, segment_overhead=0.1, **common) == 500 * 1000 + 100 + 40  # forward: 160,000 x 1.1
    assert seen == [(60, 100 + 60, True)]
    assert step_charge(step, segment_overhead=0.1, sampler_overhead_scale=0.25, **common) == 500 * 1000 + 100 + 10
    assert step_charge(step, segment_overhead=0.0, **common) == 500 * 1000 + 100  # alone: no overhead


def test_the_replayed_sampler_overhead_of_s9_is_larger_after_a_full_forward_pass() -> None:
    """S9's Llama 3.1 8B: a decode step of 64 requests (384 rows, 384 tokens) strands less of the
    cache than the same rows beside a prefill filling the step's 2,048 tokens, whose hidden states
    pin a segment of the MLP's (kvgate/memory/allocator.py replay). Below the fp32 copy of its
    rows (the most an earlier copy's segment can strand: kvgate/memory/activation.py
    `sampler_phase_overhead_bytes`)."""
    overhead = SamplerPhaseOverhead(model_geometry("llama-3-8b"), S9_ENGINE, False)
    decode_only, beside_prefill = overhead(384, 384), overhead(384, 2048)
    assert 0 < decode_only < beside_prefill <= 384 * 128_256 * 4
    assert SamplerPhaseOverhead(model_geometry("llama-3-8b"), S9_ENGINE, True)(384, 2048) < beside_prefill


def test_a_prefills_hidden_states_are_the_part_of_its_forward_pass_the_sampler_phase_still_holds() -> None:
    """A 1,000-token prompt on S9's engine: its profiled forward terms are its hidden states and
    residual (2 x 1,000 x 4,096 x 2 B) and its MLP (3 x 1,000 x 14,336 x 2 B); of them the sampler
    phase still holds the final hidden states alone (Demand.profiled_residual_bytes)."""
    flags = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"]
    flags += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 5})]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    geometry = model_geometry("llama-3-8b")
    predictor = build_predictor(
        resolve(engine_flags(settings), geometry, None, None, reported_version="0.32.0"), geometry
    )
    body = {"prompt": "x", "max_tokens": 64, "temperature": 0.7}
    spec = parse_request("completions", json.dumps(body).encode()).request
    demand = predictor.predict(spec, [[7] * 1000]).demand
    assert demand.profiled_residual_bytes == 1000 * 4096 * 2
    assert demand.profiled_prefill_bytes == 2 * 1000 * 4096 * 2 + 3 * 1000 * 14336 * 2


def test_a_segment_share_learned_from_the_gpu_above_the_replay_still_counts_on_the_sampler_phase() -> None:
    step = holdings(forward=10, sampler_unprofiled=100, sampler=200, rows=60)
    common = dict(profiled_cap=10**9, forward_bytes_per_token=1, sampler_overhead=lambda rows, tokens, copies: 40)
    assert step_charge(step, segment_overhead=0.1, **common) == 100 + 200 + 40  # the replay: 40 > 20
    assert step_charge(step, segment_overhead=0.5, **common) == 100 + 200 + 100  # the learned share: 100 > 40


def test_the_replayed_sampler_overhead_is_charged_only_on_the_phase_out_of_free_memory() -> None:
    """Like the share, in proportion min(profiled_cap, phase) / phase: nothing where the engine
    holds the whole profile region (profiled_cap 0, V1), all of it where the region came back."""
    step = holdings(forward=10, sampler_unprofiled=100, sampler=200, rows=60)
    common = dict(segment_overhead=0.1, forward_bytes_per_token=1, sampler_overhead=lambda rows, tokens, copies: 40)
    assert step_charge(step, profiled_cap=10**9, **common) == 100 + 200 + 40
    assert step_charge(step, profiled_cap=100, **common) == 100 + 100 + 20  # half the phase: half the replay
    assert step_charge(step, profiled_cap=0, **common) == 100


def s4_budget_and_demands() -> tuple[Budget, list[Demand]]:
    """Benchmark S4's engine (vLLM 0.31.0 V1, Llama 3.1 8B, 8,192 batched tokens, 1,024
    sequences, a fixed pool) as kvgate's live readings left it there: the engine holds the whole
    profile region (profiled_cap 0, the V1 sampler warm-up's buffers cached) and the GPU has 10 MiB
    free; 256 chat requests of S4's kind (250-token prompts, top-p 0.9, every third with a
    presence penalty)."""
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--model-runner", "v1"]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    geometry = model_geometry("llama-3-8b")
    deployment = resolve(engine_flags(settings), geometry, None, None, reported_version="0.31.0")
    assert deployment.runtime.runner == "v1"
    predictor = build_predictor(deployment, geometry)
    budget = Budget(**asdict(static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=40 * GiB)))
    assert budget.sampler_phase_overhead is not None
    assert budget.segment_overhead > 0
    budget.update(kv_blocks=None, transient_headroom_bytes=10 * MiB, profiled_cap_bytes=0)
    # the whole step's level from any cache, worked out in the caller's thread
    budget.update(v1_any_cache=V1AnyCacheStep(geometry, predictor.engine, False, background=False))
    demands = []
    for i in range(256):
        body = {"prompt": "x", "max_tokens": 128, "top_p": 0.9} | ({"presence_penalty": 0.5} if i % 3 == 0 else {})
        spec = parse_request("completions", json.dumps(body).encode()).request
        demands.append(predictor.predict(spec, [[11 + i % 1000] * 250]).demand)
    return budget, demands


def test_a_v1_engine_holding_its_profile_region_admits_s4s_chat_beside_chat() -> None:
    """S4's regression (commit 6b71bf1): the sampler phase's replayed overhead (tens of MiB
    for a decode batch after an 8,192-token forward pass) was charged against the 9 MiB limit
    although none of the phase comes out of free memory on V1: the second request waited. Each
    is charged its unprofiled sampler bytes (a few KiB to tens of KiB: the penalties' prompt ids
    and the like), so all 256 fit, prefilling or decoding."""
    budget, demands = s4_budget_and_demands()
    ledger = Ledger()
    for demand in demands:
        assert budget.shortfall(demand, ledger) is None
        ledger.reserve(demand)
    assert ledger.in_flight == 256
    assert budget.transient_charge(ledger) <= budget.transient_limit()  # type: ignore[operator]
