"""What the caching allocator holds while the engine is idle, as kvgate learns it (session 36).

A request alone on the engine meets the cache the last steps left; a lone prompt whose steps run
only from a small cache (held-out H8b, H1: kvgate/memory/activation.py `lone_request_fits`) is
admitted when a GPU reading taken while the engine ran nothing shows that cache
(kvgate/telemetry/live.py), and the reading stops counting once a request is admitted (its steps
grow the cache).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvgate.cli import build_parser
from kvgate.errors import CacheOutgrown
from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import ANY_ROWS
from kvgate.gate.observer import Observers
from kvgate.gate.view import GateView
from kvgate.memory.demand import Demand
from kvgate.settings import settings_from_args
from kvgate.telemetry.gpu import DeviceMemory, GpuProcess, GpuReading
from kvgate.telemetry.in_flight import InFlightRequests
from kvgate.telemetry.live import LiveBudget
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.telemetry.vllm import parse_metrics
from kvgate.units import GiB, MiB

HEADROOM = 900 * MiB
ENGINE_AT_START = 70 * GiB


class FixedProbe:
    """A GPU whose engine holds `used` bytes; nothing else runs on it."""

    kind = "test"
    available = True
    problem = None

    def __init__(self) -> None:
        self.used = ENGINE_AT_START

    def reading(self) -> GpuReading:
        total = ENGINE_AT_START + HEADROOM
        device = DeviceMemory("GPU-0", "H100", total, total - self.used, self.used, (GpuProcess(1, self.used),))
        return GpuReading((device,))

    async def read(self) -> GpuReading:
        return self.reading()


def prompts_computed(count: int) -> str:
    """vLLM's /metrics page with its prompt-token counter at `count`."""
    return f'# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{{engine="0",model_name="m"}} {count}.0\n'


def lone_prompt() -> Demand:
    """A 7,000-token prompt (16 tokens out, one KV block) whose forward pass holds 700 MiB."""
    return Demand(7000, 16, (), 1, transient_prefill_bytes=0, profiled_prefill_bytes=700 * MiB)


class RunsFrom:
    """A stand-in replay (kvgate/memory/activation.py LoneRequest): the prompt runs only from a
    cache of at most `most_cached` bytes; records the caches asked about."""

    def __init__(self, most_cached: int = 0) -> None:
        self.most_cached = most_cached
        self.asked: list[int] = []

    def __call__(self, prompt_tokens: int, capacity: int, cached: int, now: bool = False) -> bool:
        self.asked.append(cached)
        return cached <= self.most_cached

    def known(self, prompt_tokens: int, capacity: int, cached: int) -> bool | None:
        return self(prompt_tokens, capacity, cached)

    def ever(self, prompt_tokens: int, capacity: int) -> bool:
        return True


def kvgate_beside(prompts_before: int) -> tuple[Budget, Gate[None], LiveBudget, FixedProbe, list[int]]:
    """kvgate's budget, gate and live loop beside an engine that had computed `prompts_before`
    prompt tokens when kvgate first read it; the caches the stand-in replay was asked about."""
    replay = RunsFrom()
    budget = Budget(
        transient_headroom_bytes=HEADROOM,
        max_transient_headroom_bytes=HEADROOM,
        transient_margin=0.0,
        profiled_peak_bytes=800 * MiB,
        profiled_cap_bytes=800 * MiB,
        segment_overhead=0.4,
        profiled_forward_bytes=800 * MiB,
        forward_bytes_per_token=800 * MiB // 8192,
        lone_forward=lambda tokens, capacity: False,  # some one-step history runs it out of memory
        lone_request=replay,
    )
    gate: Gate[None] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=60.0)
    probe = FixedProbe()

    async def resync() -> None:
        return None

    live = LiveBudget(
        settings_from_args(build_parser().parse_args(["serve"])),
        httpx.AsyncClient(),
        GateView(gate),
        InFlightRequests(),
        budget,
        TelemetryMetrics(CollectorRegistry()),
        probe,  # type: ignore[arg-type]
        resync,
        lambda: 16,
    )
    live.snapshot = parse_metrics(prompts_computed(prompts_before))
    return budget, gate, live, probe, replay.asked


async def test_an_idle_reading_admits_a_lone_prompt_and_an_admission_forgets_it() -> None:
    budget, gate, live, probe, asked = kvgate_beside(0)
    assert budget.shortfall(lone_prompt(), gate.ledger) == TRANSIENT_BUSY  # nothing known of the cache
    live._gpu(probe.reading(), 0.0, idle=True)  # the engine's start-up reading: nothing cached
    assert budget.idle_cache_bytes == 0
    ticket = await gate.acquire(lone_prompt(), 0, "first")
    assert budget.idle_cache_bytes is None  # admitted: its steps will grow the cache
    assert live._engine_idle() is None  # in flight
    probe.used += 600 * MiB  # its steps' segments, cached
    ticket.release("completed")
    idle = live._engine_idle()
    assert idle is not None
    live._gpu(probe.reading(), 1.0, idle=idle == live._engine_idle())
    assert budget.idle_cache_bytes == 600 * MiB
    assert budget.shortfall(lone_prompt(), gate.ledger) == TRANSIENT_BUSY
    assert asked[-1] == 600 * MiB
    live._gpu(probe.reading(), 2.0, idle=False)  # a reading while something ran says nothing
    assert budget.idle_cache_bytes == 600 * MiB
    probe.used -= 600 * MiB  # a failed cudaMalloc released the free segments
    live._gpu(probe.reading(), 3.0, idle=True)
    assert budget.shortfall(lone_prompt(), gate.ledger) is None


def test_beside_an_engine_that_already_served_the_growth_is_not_taken_for_its_cache() -> None:
    """kvgate started after vLLM computed prompts: the first reading's memory may hold their
    cached segments, so growth from it says nothing of the cache and a lone prompt keeps waiting."""
    budget, gate, live, probe, _ = kvgate_beside(5000)
    live._gpu(probe.reading(), 0.0, idle=True)
    assert budget.idle_cache_bytes is None
    assert budget.shortfall(lone_prompt(), gate.ledger) == TRANSIENT_BUSY


def test_beside_an_engine_that_already_served_any_row_count_may_have_left_its_segments() -> None:
    """The cached sizes a step beside others is judged from stop at the largest tensor the steps of
    this engine life made, which kvgate knows by the most rows it let sample at once
    (`Ledger.peak_segment_rows`, kvgate/memory/activation.py `cached_segment_sizes`). Started after
    vLLM computed prompts, kvgate did not see those steps: any row count's segments may be cached.
    Started beside a fresh engine, the mark starts at nothing."""
    _, fresh_gate, fresh, probe, _ = kvgate_beside(0)
    fresh._gpu(probe.reading(), 0.0, idle=True)
    assert fresh_gate.ledger.peak_segment_rows == 0
    _, gate, live, probe, _ = kvgate_beside(5000)
    live._gpu(probe.reading(), 0.0, idle=True)
    assert gate.ledger.peak_segment_rows == ANY_ROWS
    live._gpu(probe.reading(), 1.0, idle=True)  # a later reading of the same life changes nothing
    assert gate.ledger.peak_segment_rows == ANY_ROWS


def chat() -> Demand:
    """A short chat that fits beside anything here (no forward pass of its own beyond the profile)."""
    return Demand(200, 64, (), 1, transient_prefill_bytes=0, profiled_prefill_bytes=0)


def drainable_kvgate() -> tuple[Budget, Gate[None], LiveBudget, FixedProbe]:
    """kvgate beside a fresh engine, where the lone prompt runs from an idle engine's cache of up
    to 100 MiB (a stand-in for kvgate/memory/activation.py `lone_request_fits`), one chat in flight."""
    budget, gate, live, probe, _ = kvgate_beside(0)
    budget.lone_request = RunsFrom(100 * MiB)
    live._gpu(probe.reading(), 0.0, idle=True)  # start-up: nothing cached
    return budget, gate, live, probe


async def test_a_lone_prompt_heads_the_line_while_the_engine_drains_for_it() -> None:
    """A 7,000-token prompt that runs only on an idle engine (held-out H8b, H1) arrives beside a
    chat in flight. Set aside, it waited beside a line that never let the engine go idle, and
    timed out: now it heads the line, the chat that arrives after it waits its turn, and the
    idle reading that follows the first chat's release lets the prompt in."""
    budget, gate, live, probe = drainable_kvgate()
    first = await gate.acquire(chat(), 0, "a")
    assert budget.grown_cache_bytes == 0
    assert budget.idle_cache_bytes is None
    lone = asyncio.ensure_future(gate.acquire(lone_prompt(), 0, "b"))
    later = asyncio.ensure_future(gate.acquire(chat(), 0, "c"))
    await asyncio.sleep(0)
    assert not lone.done()
    assert not later.done()  # the chat would have fit: it waits behind the prompt
    first.release("completed")
    await asyncio.sleep(0)
    assert not lone.done()  # the engine has not been read idle yet
    idle = live._engine_idle()
    live._gpu(probe.reading(), 1.0, idle=idle is not None and idle == live._engine_idle())
    (await asyncio.wait_for(lone, 1.0)).release("completed")
    (await asyncio.wait_for(later, 1.0)).release("completed")


async def test_a_lone_prompt_over_the_limit_even_alone_does_not_hold_the_line_for_a_drain() -> None:
    """Benchmark S6: a co-tenant's reserve leaves less of the headroom than the prompt's forward
    pass takes even at its allocated bytes, alone. A drain would show the idle cache it runs
    from, but the limit would still not hold it: only the headroom coming back lets it in. It
    waits aside, and the chats that arrive after it are admitted at once (they had waited behind
    it for a drain that could not help it, seconds each at the tail of S6's first-token times)."""
    budget, gate, live, probe = drainable_kvgate()
    budget.update(cotenant_reserve_bytes=400 * MiB)  # 500 MiB of the 900 left: the prompt takes 700
    first = await gate.acquire(chat(), 0, "a")
    lone = asyncio.ensure_future(gate.acquire(lone_prompt(), 0, "b"))
    await asyncio.sleep(0)
    later = await asyncio.wait_for(gate.acquire(chat(), 0, "c"), 1.0)
    assert not lone.done()
    first.release("completed")
    later.release("completed")
    idle = live._engine_idle()
    live._gpu(probe.reading(), 1.0, idle=idle is not None and idle == live._engine_idle())
    await asyncio.sleep(0)
    assert not lone.done()  # idle, its cache shown, and still over the limit beside the reserve
    budget.update(cotenant_reserve_bytes=0)  # the co-tenant left
    (await asyncio.wait_for(lone, 1.0)).release("completed")


async def test_a_lone_prompt_that_a_drain_would_not_let_in_does_not_hold_the_line() -> None:
    """Where the engine's cache has grown past what the prompt runs from, no wait on this engine
    lets it in (a caching allocator keeps its segments until it restarts): it is refused at once,
    503 with the cache's size and the remedy, instead of a queue timeout at its deadline. Where
    only the requests in flight are predicted to run past its deadline, it waits aside and the
    line moves on."""
    budget, gate, live, probe = drainable_kvgate()
    first = await gate.acquire(chat(), 0, "a")
    probe.used += 600 * MiB  # the chat's steps grew the cache
    live._gpu(probe.reading(), 1.0, idle=False)
    assert budget.grown_cache_bytes == 600 * MiB
    with pytest.raises(CacheOutgrown, match=r"7,000 prompt tokens.*the 600 MiB of free segments"):
        await gate.acquire(lone_prompt(), 0, "b")  # at once, not at its deadline
    later = await gate.acquire(chat(), 0, "c")
    for ticket in (first, later):
        ticket.release("completed")

    budget, gate, live, probe = drainable_kvgate()
    gate.pace.record(seconds=600.0, tokens_per_sequence=64)  # a chat runs for ten minutes
    first = await gate.acquire(chat(), 0, "a")
    lone = asyncio.ensure_future(gate.acquire(lone_prompt(), 0, "b"))  # 60 s of queue wait
    later = await gate.acquire(chat(), 0, "c")
    assert not lone.done()
    lone.cancel()
    for ticket in (first, later):
        ticket.release("completed")
