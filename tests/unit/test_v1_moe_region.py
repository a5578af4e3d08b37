"""Held-out H4: a fixed KV pool on Model Runner V1 whose profile peak is a fused MoE, not the sampler.

V1 re-reserves what its post-capture warm-up makes (vllm 0.31.0 / 0.32.0 v1/worker/gpu_worker.py
`compile_or_warm_up_model`: `_dummy_run` and `_dummy_sampler_run` of max_num_seqs rows). With a
128k vocabulary that is the whole profile region (the sampler set the peak); with Mixtral-8x7B's
32k vocabulary the peak is the MoE intermediates of an 8,192-token step, and most of it comes back
out of free memory. kvgate took the whole region as held on V1 with `--kv-cache-memory-bytes`, so
it charged a full step nothing and the simulator ran out of memory behind it.
"""

from __future__ import annotations

import pytest
from sim_support import make_engine

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import StaticLimits, build_predictor, resolve, static_limits
from kvgate.memory.geometry import ModelGeometry
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.telemetry.gpu import DeviceMemory, GpuProcess, GpuReading
from kvgate.telemetry.headroom import HeadroomTracker
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

MIXTRAL = model_geometry("mixtral-8x7b-v0.1")
LLAMA = model_geometry("llama-3.1-8b-instruct")


def h4_engine() -> Engine:
    """Held-out H4's simulated engine booted: Mixtral-8x7B on an H200, vLLM 0.31.0 on V1, the pool
    as vLLM's start-up advice sizes it (the profile peak and 150 MiB left over)."""
    from demo.replay import fully_utilized
    from kvgate.sim.config import SimConfig

    return make_engine(
        fully_utilized(
            SimConfig(
                model="mixtral-8x7b",
                gpu="h200-141gb",
                vllm_version="0.31.0",
                model_runner="v1",
                metrics_clock="sim",
                max_model_len=32768,
                max_num_batched_tokens=8192,
                max_num_seqs=512,
            )
        )
    )


def play(engine: Engine, *step_tokens: int) -> None:
    for tokens in step_tokens:
        for block in run_tape(engine.alloc, engine.steps.plan(StepShape((ReqSlice(tokens, 0),))), engine.carry.held):
            engine.alloc.free(block)


def test_the_simulator_runs_a_full_moe_step_alone_but_not_after_a_half_one() -> None:
    """The judge: the booted engine holds 301 MiB of cached segments, far below the 1.5 GiB of the
    profile step; a full step then needs free memory, and after a 4,096-token step the allocator's
    segments strand too much for the 448 MiB `intermediate_cache2`."""
    engine = h4_engine()
    cached = engine.alloc.reserved() - engine.alloc.allocated()
    assert cached < engine.report.activation_peak // 4
    play(engine, 8192)
    with pytest.raises(CudaOutOfMemory, match=r"Tried to allocate 448\.00 MiB"):
        play(h4_engine(), 4096, 8192)


def limits_of(
    geometry: ModelGeometry, version: str, flags: list[str], pool: int | None
) -> tuple[StaticLimits, Predictor]:
    settings = settings_from_args(
        build_parser().parse_args(["serve", *flags, "--model-runner", "v1", "--gpu-memory-bytes", str(140 * GiB)])
    )
    deployment = resolve(engine_flags(settings), geometry, None, None, reported_version=version)
    assert deployment.runtime.runner == "v1"
    predictor = build_predictor(deployment, geometry)
    return static_limits(deployment, predictor, None, 140 * GiB, kv_cache_memory_bytes=pool), predictor


def test_a_fixed_pool_on_v1_charges_what_the_warm_up_does_not_hold_back_to_free_memory() -> None:
    """kvgate's replay of the warm-up (vLLM 0.31.0's FlashInfer sampler) holds 296 MiB of
    Mixtral's 1,472 MiB profile region, as the simulator's booted engine holds 301: the other
    1,176 MiB are charged against the live headroom. Llama 3.1 8B's V1 peak is the sampler's,
    which the warm-up re-reserves whole: nothing changes there (S4, S12). No fixed pool: the
    utilization formula decides, as before."""
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "512"]
    mixtral, predictor = limits_of(MIXTRAL, "0.31.0", flags, 36 * GiB)
    assert predictor.profiled_peak_bytes == 1472 * MiB
    assert mixtral.profile_emptied_bytes == 1176 * MiB
    llama, _ = limits_of(LLAMA, "0.31.0", ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024"], 60 * GiB)
    assert llama.profile_emptied_bytes == 0
    assert limits_of(MIXTRAL, "0.31.0", flags, None)[0].profile_emptied_bytes is None

    # the live headroom: H4's engine at start-up (pool, weights, graphs) above utilization x total
    total = int(139.8 * GiB)
    free = 1353 * MiB
    reading = GpuReading((DeviceMemory("gpu0", "H200", total, free, total - free, (GpuProcess(7, total - free),)),))
    headroom = HeadroomTracker().update(reading, 0.9, mixtral.profiled_peak_bytes, mixtral.profile_emptied_bytes)
    assert headroom is not None
    assert headroom.profiled_cap == 1176 * MiB
    as_before = HeadroomTracker().update(reading, 0.9, mixtral.profiled_peak_bytes, None)
    assert as_before is not None
    assert as_before.profiled_cap == 0
