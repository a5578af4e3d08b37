"""The step-time model (fixed + per token + per context token, scaled by weight bytes per GPU),
the speed-up factor, and latency histograms on the simulated clock."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest
from sim_support import Job, make_engine, play

import kvgate.sim.engine
from kvgate.sim.config import SimConfig
from kvgate.sim.request import Sampling
from kvgate.sim.timing import StepTimer

LLAMA_8B = 16_060_000_000  # bf16 weight bytes, the reference point


def test_reference_points_of_the_step_time_model() -> None:
    t = StepTimer(LLAMA_8B)
    assert t.sim_seconds(1, 0) == pytest.approx(0.012, abs=1e-4)  # small decode batch
    assert t.sim_seconds(8192, 0) == pytest.approx(0.5035, abs=1e-3)  # full 8192-token prefill
    # 64 decodes over 2k tokens of context each cost ~26 ms more than without context
    extra = t.sim_seconds(64, 64 * 2048) - t.sim_seconds(64, 0)
    assert extra == pytest.approx(0.0262, abs=1e-3)


def test_step_time_scales_with_weights_per_gpu_and_speedup_divides_it() -> None:
    small, big = StepTimer(LLAMA_8B), StepTimer(LLAMA_8B * 70 // 8 // 4)  # ~70B at TP 4
    assert big.sim_seconds(512, 0) / small.sim_seconds(512, 0) == pytest.approx(70 / 32, rel=1e-3)
    fast = StepTimer(LLAMA_8B, speedup=50)
    assert fast.wall_seconds(512, 4096) == pytest.approx(small.sim_seconds(512, 4096) / 50)
    assert StepTimer(10**6).sim_seconds(1, 0) == pytest.approx(0.05 * (0.012 + 6e-5))  # floor: 5 %


def _cfg(**kw) -> SimConfig:
    return SimConfig(
        model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192, max_num_seqs=64, metrics_clock="sim", **kw
    )


def _hist_sum(engine, name: str) -> float:
    text = generate_latest(engine.metrics.registry).decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "_sum"))


def test_speedup_plays_simulated_seconds_in_a_fraction_of_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine sleeps each step's simulated time divided by the speed-up, less the Python time
    the step already took (its sleeps are counted, not the wall clock: a loaded machine adds
    Python time, never sleep)."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def counted_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(kvgate.sim.engine.asyncio, "sleep", counted_sleep)
    job = [Job(3000, Sampling(max_tokens=40, ignore_eos=True), count=4)]
    started = time.monotonic()
    out = play(_cfg(speedup=100), job, keep_speedup=True)
    wall = time.monotonic() - started
    sim = out.engine.sim_clock
    assert out.finished == {"length": 4}
    # 1 prefill step (12000 tokens > 8192: 2 steps) + 39 decode steps of ~12 ms: ~1.2 sim-s
    assert 0.9 < sim < 1.6
    assert wall >= sim / 100
    step_sleeps = sum(s for s in slept if s != 0.001)  # 0.001: an idle loop's nap, not a step
    assert step_sleeps <= sim / 100


def test_latency_histograms_are_in_simulated_seconds_and_deterministic() -> None:
    def run():
        out = play(_cfg(), [Job(8000, Sampling(max_tokens=20, ignore_eos=True))])
        return out.engine

    a, b = run(), run()
    assert a.sim_clock == b.sim_clock  # same workload, same simulated time
    # one request from time 0: its e2e latency is the whole simulated run
    assert _hist_sum(a, "vllm:e2e_request_latency_seconds") == pytest.approx(a.sim_clock)
    # TTFT = the 8000-token prefill step: 12 ms + 8000 x 60 us (+ nothing for context)
    assert _hist_sum(a, "vllm:time_to_first_token_seconds") == pytest.approx(0.492, abs=1e-3)


def test_wall_clock_metrics_by_default() -> None:
    engine = make_engine(SimConfig(model="tiny-llama", gpu="l4-24gb", max_model_len=1024))
    assert engine.cfg.metrics_clock == "wall"
    before = engine.clock()
    time.sleep(0.02)  # the wall clock under test must move
    assert engine.clock() - before >= 0.02
    assert engine.sim_clock == 0.0
