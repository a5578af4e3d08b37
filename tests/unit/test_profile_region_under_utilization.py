"""The profile region a V2 engine emptied, under --gpu-memory-utilization: all of it comes back out
of free memory, though the envelope formula (utilization x total less what the engine holds at
start-up) reads less, the CUDA graphs captured after the pool counted as region held. Benchmark S6
on V2 (session 43): a co-tenant left 296 MiB free, kvgate charged an 8,000-token prefill 249 MiB
of its profiled tensors and the engine ran out on its 437.5 MiB MLP with nothing cached."""

from __future__ import annotations

from sim_support import make_engine

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.settings import settings_from_args
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import PROCESS
from kvgate.telemetry.gpu import DeviceMemory, GpuProcess, GpuReading
from kvgate.telemetry.headroom import HeadroomTracker
from kvgate.units import MiB
from support.geometry import model_geometry

LLAMA = model_geometry("llama-3.1-8b-instruct")


def test_a_v2_engine_under_utilization_has_its_whole_profile_peak_charged_against_free_memory() -> None:
    cfg = SimConfig(
        model="llama-3.1-8b", vllm_version="0.32.0", model_runner="auto", max_num_batched_tokens=8192, max_num_seqs=1024
    )
    engine = make_engine(cfg)
    assert engine.resolved.flavor.v2
    cached = engine.alloc.reserved() - engine.alloc.allocated()
    graphs = engine.alloc.allocated("private")
    assert graphs > 100 * MiB

    flags = [
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "1024",
        "--gpu-memory-bytes",
        str(engine.device.total),
    ]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags]))
    deployment = resolve(engine_flags(settings), LLAMA, None, None, reported_version="0.32.0")
    assert deployment.runtime.runner == "v2"
    predictor = build_predictor(deployment, LLAMA)
    limits = static_limits(deployment, predictor, None, engine.device.total)
    assert limits.profile_emptied_bytes == predictor.profiled_peak_bytes
    assert cached < predictor.profiled_peak_bytes // 10  # the region is free memory, not cache

    used = engine.device.processes[PROCESS]
    device = DeviceMemory("GPU-0", "H100", engine.device.total, engine.device.free(), used, (GpuProcess(1, used),))
    reading = GpuReading((device,))
    formula_alone = HeadroomTracker().update(reading, 0.9, predictor.profiled_peak_bytes, None)
    assert formula_alone is not None
    assert formula_alone.profiled_cap < predictor.profiled_peak_bytes - graphs // 2  # the graphs read as region held
    headroom = HeadroomTracker().update(reading, 0.9, predictor.profiled_peak_bytes, limits.profile_emptied_bytes)
    assert headroom is not None
    assert headroom.profiled_cap == predictor.profiled_peak_bytes
