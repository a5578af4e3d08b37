"""The caching allocator's segment overhead: the rules kvgate replays and the profile step's bytes.

kvgate/memory/allocator.py follows c10/cuda/CUDACachingAllocator.cpp; the numbers here are the
allocator's rounding and reuse rules worked by hand, and the S13 profile step (Llama 3.1 8B,
4,096 tokens, Model Runner V2) that bench/results/goodput-issue24/s13-finding.md traced.
"""

from __future__ import annotations

import math

import pytest

from kvgate.memory.activation import (
    EngineShape,
    profile_forward_tape,
    profile_peak_bytes,
    profile_segment_overhead_bytes,
)
from kvgate.memory.allocator import alloc, footprint, free, worst_need
from kvgate.memory.ceiling import transient_charge
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CudaOutOfMemory, Device
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import KiB, MiB
from support.geometry import model_geometry

LLAMA_31 = model_geometry("llama-3-8b")  # the 8B geometry S13 runs (3.1 differs in context length only)
S13 = EngineShape(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=256, runner="v2")


class TestRules:
    def test_sizes_round_to_their_pools_segments(self) -> None:
        """get_allocation_size: small requests in 2 MiB segments, 1-10 MiB in 20 MiB ones, larger
        in their own size rounded up to 2 MiB; round_size: 512 B blocks."""
        assert footprint([alloc("a", 100)]).reserved_peak == 2 * MiB
        assert footprint([alloc("a", 100)]).allocated_peak == 512
        assert footprint([alloc("a", 3 * MiB)]).reserved_peak == 20 * MiB
        assert footprint([alloc("a", 11 * MiB + 1)]).reserved_peak == 12 * MiB
        # the pools never share a segment: a small request does not take the large one's rest
        assert footprint([alloc("a", 3 * MiB), alloc("b", 512 * KiB)]).reserved_peak == 22 * MiB

    def test_a_freed_block_serves_a_smaller_request_never_a_larger_one(self) -> None:
        smaller = [alloc("a", 48 * MiB), *free("a"), alloc("b", 32 * MiB)]
        assert footprint(smaller).reserved_peak == 48 * MiB
        larger = [alloc("a", 32 * MiB), *free("a"), alloc("b", 48 * MiB)]
        assert footprint(larger).reserved_peak == 80 * MiB  # the free 32 MiB segment stays cached
        assert footprint(larger).need == 48 * MiB  # ... until a failed cudaMalloc gives it back

    def test_blocks_merge_inside_their_segment_only(self) -> None:
        """Two split halves freed merge back into one block that fits the whole request again;
        two segments side by side never do."""
        one = [alloc("big", 40 * MiB), *free("big"), alloc("a", 20 * MiB), alloc("b", 20 * MiB)]
        one += [*free("a", "b"), alloc("c", 40 * MiB)]
        assert footprint(one).reserved_peak == 40 * MiB
        two = [alloc("a", 20 * MiB), alloc("b", 20 * MiB), *free("a", "b"), alloc("c", 40 * MiB)]
        assert footprint(two).reserved_peak == 80 * MiB

    def test_expandable_segments_strand_nothing(self) -> None:
        tape = [alloc("a", 32 * MiB), *free("a"), alloc("b", 48 * MiB)]
        assert footprint(tape, expandable_segments=True).reserved_peak == 48 * MiB
        pages = footprint([alloc("a", 3 * MiB)], expandable_segments=True)
        assert (pages.allocated_peak, pages.reserved_peak) == (3 * MiB, 4 * MiB)


class TestProfileStep:
    def test_s13s_profile_step_alone_and_after_a_step_of_another_size(self) -> None:
        """hidden, residual, o_proj 32 MiB each; qkv 48; attention output 32; gate_up 224;
        SiluAndMul 112. From an empty cache: segments 32 + 32 + 48 + 32 + 224 + 112 = 480 MiB
        cached, of which 416 hold a live block when SiluAndMul's is made (o_proj reuses qkv's
        segment; the freed 32 MiB ones would be released by a failed cudaMalloc). After a
        2,560-token step, the hidden states and residual split its larger segments and gate_up
        and SiluAndMul need new ones: 546 MiB."""
        step = profile_forward_tape(LLAMA_31, S13)
        alone = footprint(step)
        assert alone.allocated_peak == profile_peak_bytes(LLAMA_31, S13) == 400 * MiB
        assert (alone.reserved_peak, alone.need) == (480 * MiB, 416 * MiB)
        assert worst_need(step, [[profile_forward_tape(LLAMA_31, S13, 2560)]]) == 546 * MiB
        assert profile_segment_overhead_bytes(LLAMA_31, S13, expandable_segments=False) == 146 * MiB
        assert profile_segment_overhead_bytes(LLAMA_31, S13, expandable_segments=True) == 0

    def test_the_overhead_scales_with_the_step_not_a_constant(self) -> None:
        half = EngineShape(max_model_len=16384, max_num_batched_tokens=2048, max_num_seqs=256, runner="v2")
        assert footprint(profile_forward_tape(LLAMA_31, half)).reserved_peak == 240 * MiB
        assert profile_segment_overhead_bytes(LLAMA_31, half, False) == 74 * MiB
        # V1's profile peak is the sampler's full-vocabulary sort (1.19 GiB); the replay covers the
        # forward pass, whose overhead is the same 146 MiB
        v1 = EngineShape(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=256, runner="v1")
        assert profile_peak_bytes(LLAMA_31, v1) > 1024 * MiB
        assert profile_segment_overhead_bytes(LLAMA_31, v1, False) == 146 * MiB

    def test_the_budget_charges_the_segments_where_profiled_bytes_come_out_of_free_memory(self) -> None:
        peak, share = 400 * MiB, 146 / 400
        assert transient_charge(13 * MiB, peak, peak, share) == 13 * MiB + 546 * MiB
        assert transient_charge(0, 100 * MiB, peak, share) == math.ceil(100 * MiB * (1 + share))  # its share
        assert transient_charge(13 * MiB, peak, None, share) == 13 * MiB  # headroom from flags: beside it
        assert transient_charge(13 * MiB, peak, 0, share) == 13 * MiB  # the engine still holds the region


def s13_engine(spare: int) -> Engine:
    """S13's simulated engine as it was when this finding was made (an L4 fully utilized as vLLM
    0.32.0 advises, V2; the scenario has since moved to an H100) booted, with a co-tenant taking
    all but `spare` of the free memory."""
    from demo.replay import fully_utilized
    from kvgate.sim.config import SimConfig
    from kvgate.sim.model import load_model
    from kvgate.sim.presets import gpu_total_bytes

    cfg = fully_utilized(
        SimConfig(
            model="llama-3.1-8b",
            gpu="l4-24gb",
            metrics_clock="sim",
            vllm_version="0.32.0",
            model_runner="auto",
            max_model_len=16384,
            max_num_batched_tokens=4096,
            max_num_seqs=256,
        )
    )
    device = Device(gpu_total_bytes(cfg.gpu))
    engine = Engine(cfg, load_model(cfg.model, cfg.dtype), device, lambda r: (0, False), "m")
    engine.boot()
    device.set_usage("co-tenant", device.free() - spare)
    return engine


def play(engine: Engine, *step_tokens: int) -> None:
    for tokens in step_tokens:
        for block in run_tape(engine.alloc, engine.steps.plan(StepShape((ReqSlice(tokens, 0),))), engine.carry.held):
            engine.alloc.free(block)


def test_the_simulators_allocator_agrees_with_the_replay() -> None:
    """The judge: the simulator (kvgate/sim/gpu.py, written separately from kvgate's replay) boots
    S13's engine; the profile's own step grows it by the 480 MiB of segments the replay caches,
    and a 4,096-token step after a 2,560-token one runs in the 546 MiB the replay says it needs,
    and not in 2 MiB less: vLLM's 400 MiB budget and the 480 MiB one-step figure both OOM."""
    from kvgate.sim import startup

    engine = s13_engine(spare=10**12)
    start = engine.alloc.process_bytes()
    for block in run_tape(engine.alloc, engine.steps.plan(startup.profile_shape(engine.resolved)), engine.carry.held):
        engine.alloc.free(block)
    # the simulator's peak also holds the step's input ids and positions (4,096 x 12 B)
    assert engine.report.activation_peak - 4096 * 12 == 400 * MiB
    assert engine.alloc.process_bytes() - start == 480 * MiB

    need = profile_peak_bytes(LLAMA_31, S13) + profile_segment_overhead_bytes(LLAMA_31, S13, False)
    play(s13_engine(spare=need), 2560, 4096)
    for too_little in (need - 2 * MiB, 480 * MiB, 400 * MiB):
        with pytest.raises(CudaOutOfMemory, match=r"Tried to allocate (112|224)\.00 MiB"):
            play(s13_engine(spare=too_little), 2560, 4096)
