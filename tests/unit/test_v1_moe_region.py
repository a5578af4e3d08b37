"""Held-out H4: a fixed KV pool on Model Runner V1 whose profile peak is a fused MoE, not the sampler.

V1 re-reserves what its post-capture warm-up makes (vllm 0.31.0 / 0.32.0 v1/worker/gpu_worker.py
`compile_or_warm_up_model`: `_dummy_run` and `_dummy_sampler_run` of max_num_seqs rows). With a
128k vocabulary that is the whole profile region (the sampler set the peak); with Mixtral-8x7B's
32k vocabulary the peak is the MoE intermediates of an 8,192-token step. Those live in vLLM's MoE
workspace (vllm 0.16.0 - 0.33.0 modular_kernel.py `_allocate_buffers` -> v1/worker/workspace.py),
which the profile makes and start-up keeps: neither the simulator nor kvgate charges them to a
step, and the region a step's tensors come back to is the rest of the peak.
"""

from __future__ import annotations

from dataclasses import replace

from sim_support import make_engine

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import StaticLimits, build_predictor, resolve, static_limits
from kvgate.memory.activation import (
    EngineShape,
    SamplingShape,
    estimate_transient,
    moe_workspace_bytes,
    profile_peak_bytes,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.vllm_runner import resolve_runtime
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.engine import Engine
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


def test_the_simulator_runs_a_full_moe_step_after_any_smaller_one() -> None:
    """The judge: vLLM 0.31.0's MoE takes its intermediates from the workspace the profile made
    and start-up locked (1,344 MiB, kept allocated), so no step's history strands the segments
    they need: a full 8,192-token step runs after a 4,096- or 2,048-token one."""
    engine = h4_engine()
    assert engine.steps.moe_workspace_bytes() == 1344 * MiB
    for history in ((8192,), (4096, 8192), (2048, 6144, 8192)):
        play(h4_engine(), *history)


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
    """vLLM 0.31.0 keeps Mixtral's 1,344 MiB MoE workspace after start-up (the simulator's booted
    engine holds it too): of the 1,650 MiB profile peak, the region a step's tensors come back to
    is the other 306 MiB, and kvgate's replay of the warm-up (vLLM 0.31.0's FlashInfer sampler)
    holds 270 MiB of it, as the simulator's engine holds 249: the other 36 MiB are charged against
    the live headroom (before the workspace was read: 1,176 of a 1,472 MiB region). Llama 3.1
    8B's V1 peak is the sampler's, which the warm-up re-reserves whole: nothing changes there
    (S4, S12). The same without a fixed pool (the utilization formula reads less, session 43). A quantized checkpoint
    (some methods still allocate per call) keeps the per-call charge."""
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "512"]
    mixtral, predictor = limits_of(MIXTRAL, "0.31.0", flags, 36 * GiB)
    assert moe_workspace_bytes(MIXTRAL, predictor.engine) == 1344 * MiB
    assert profile_peak_bytes(MIXTRAL, predictor.engine) // MiB == h4_engine().report.activation_peak // MiB + 2
    assert predictor.profiled_peak_bytes // MiB == 306
    assert mixtral.profile_emptied_bytes is not None
    assert mixtral.profile_emptied_bytes // MiB == 36
    llama, _ = limits_of(LLAMA, "0.31.0", ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024"], 60 * GiB)
    assert llama.profile_emptied_bytes == 0
    # the same under utilization: the envelope formula alone reads the graphs as region held
    assert limits_of(MIXTRAL, "0.31.0", flags, None)[0].profile_emptied_bytes == mixtral.profile_emptied_bytes
    quantized = resolve_runtime("0.31.0", is_moe=True, quantized=True)
    assert not quantized.moe_workspace
    assert resolve_runtime("0.31.0", is_moe=True).moe_workspace
    # modelled as 0.22.0, the oldest kvgate knows, but before the workspace (not read): per call
    assert not resolve_runtime("0.15.1", is_moe=True).moe_workspace

    # the live headroom: H4's engine at start-up (pool, weights, graphs) above utilization x total
    total = int(139.8 * GiB)
    free = 1353 * MiB
    reading = GpuReading((DeviceMemory("gpu0", "H200", total, free, total - free, (GpuProcess(7, total - free),)),))
    headroom = HeadroomTracker().update(reading, 0.9, predictor.profiled_peak_bytes, mixtral.profile_emptied_bytes)
    assert headroom is not None
    assert headroom.profiled_cap == mixtral.profile_emptied_bytes
    as_before = HeadroomTracker().update(reading, 0.9, predictor.profiled_peak_bytes, None)
    assert as_before is not None
    assert as_before.profiled_cap == 0


def test_a_full_moe_prefill_is_charged_its_router_not_the_workspace_the_engine_keeps() -> None:
    """An 8,192-token Mixtral prefill on vLLM 0.31.0: its experts' intermediates are the kept
    workspace's, so the step's MoE term is the router's logits, the top-k and the kernel's sort
    (under 4 MiB), where the per-call reading charged 1,344 MiB; the quantized checkpoint keeps
    that charge."""
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "512"]
    _, predictor = limits_of(MIXTRAL, "0.31.0", flags, 36 * GiB)

    def moe_term(engine: EngineShape) -> int:
        terms = estimate_transient(MIXTRAL, engine, 8192, SamplingShape()).terms
        return next(t.bytes for t in terms if t.name == "moe")

    assert predictor.engine.moe_workspace
    assert moe_term(predictor.engine) < 4 * MiB
    assert moe_term(replace(predictor.engine, moe_workspace=False)) == 1344 * MiB
