"""kvgate's budget and predictor for a Model Runner V2 deployment on an 80 GiB GPU, built as
`kvgate serve` builds them from its flags (the tests then set the live readings they need)."""

from __future__ import annotations

from dataclasses import asdict

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.memory.activation import AnyCacheForward, AnyCacheSampler
from kvgate.memory.geometry import ModelGeometry
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.units import GiB


def v2_budget(
    geometry: ModelGeometry, flags: list[str], vllm_version: str, kv_cache_memory_bytes: int
) -> tuple[Budget, Predictor]:
    """The static limits of `kvgate serve <flags>` in front of vLLM `vllm_version`, which runs
    Model Runner V2 for this model by its own rule."""
    args = build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)])
    deployment = resolve(engine_flags(settings_from_args(args)), geometry, None, None, reported_version=vllm_version)
    assert deployment.runtime.runner == "v2"
    predictor = build_predictor(deployment, geometry)
    limits = static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=kv_cache_memory_bytes)
    return Budget(**asdict(limits)), predictor


def served_v2_budget(geometry: ModelGeometry, flags: list[str], headroom: int) -> tuple[Budget, Predictor]:
    """`v2_budget` in front of vLLM 0.32.0 as its live readings set it once the engine has served
    large steps: `headroom` bytes, the profile region out of free memory and its segments taken
    and kept by the engine (its growth since start-up: `held_region_bytes`, counted whole, no
    margin), its any-cache levels worked out in the caller's thread."""
    budget, predictor = v2_budget(geometry, flags, "0.32.0", 60 * GiB)
    budget.update(
        transient_headroom_bytes=headroom,
        max_transient_headroom_bytes=headroom,
        profiled_cap_bytes=predictor.profiled_peak_bytes,
        held_region_bytes=predictor.profiled_peak_bytes,
        any_cache_forward=AnyCacheForward(geometry, predictor.engine, False, background=False),
        any_cache_sampler=AnyCacheSampler(geometry, predictor.engine, False, background=False),
    )
    return budget, predictor
