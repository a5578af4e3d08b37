"""The ledger, the queue and the gate, without any network."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import replace

import pytest

from kvgate.errors import BackendDown, ClientGone, QueueFull, QueueTimeout
from kvgate.gate.backend_state import BackendState
from kvgate.gate.backfill import HeadReservation
from kvgate.gate.budget import BACKEND_HUNG, KV_BUSY, TRANSIENT_BUSY, Budget
from kvgate.gate.drain import RETRY_AFTER_CAP_S, DrainRate, Pace
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import Ledger
from kvgate.gate.observer import Observers
from kvgate.gate.queue import AdmissionQueue, Waiter
from kvgate.gate.queue import QueueFull as QueueAtCapacity
from kvgate.gate.view import GateView
from kvgate.http.errors import error_headers, status_of
from kvgate.memory.demand import Demand
from kvgate.memory.sampler import SamplerCost, SamplerUse
from kvgate.metrics import GateMetrics, KvgateMetrics
from kvgate.output_lengths import OutputLengths
from support.waiting import wait_for_async

# Profiled, per sampled row: logits 2 x (1 + 4) = 10 B; and the CUDA sort's peak (kvgate/memory/
# sampler.py sort_bytes): a 2-id vocabulary sorts in place in its outputs (PyTorch's small sort:
# fp32 values + int64 indices, each at least the caching allocator's 512 B), or 2 x 18 = 36 B a row
# after it (masks, softmax), the larger. Unprofiled: logprobs 2 x 4 = 8 B a row.


def profiled_sampler(rows: int) -> int:
    """1,044 B for 2 rows, 1,054 for 3, 1,380 for 30 (36 B a row from 29 rows), 46,000 for 1,000."""
    outputs = -(-rows * 2 * 4 // 512) * 512 + -(-rows * 2 * 8 // 512) * 512
    return rows * 10 + max(rows * 2 * 18, outputs)


COST = SamplerCost(vocab_size=2, dtype_bytes=1, max_num_seqs=1000, max_num_batched_tokens=2000)


def demand(
    blocks: int = 1,
    shared: tuple[int, ...] = (),
    prefill: int = 0,
    rows: int = 0,
    profiled_prefill: int = 0,
    logprobs: bool = True,
    penalties: bool = False,
    prompt: int = 0,
) -> Demand:
    """`rows` sampled rows, asking for logprobs unless told otherwise (8 B of headroom a row)."""
    return Demand(
        prompt_tokens=prompt or 16 * len(shared),
        max_new_tokens=16,
        shared_block_hashes=shared,
        private_blocks=blocks,
        transient_prefill_bytes=prefill,
        profiled_prefill_bytes=profiled_prefill,
        sampler=SamplerUse(COST, rows, prompt, logprobs=logprobs, penalties=penalties) if rows else None,
    )


def sample(metrics: KvgateMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


class TestLedger:
    def test_shared_prefix_blocks_count_once(self) -> None:
        ledger = Ledger()
        first = ledger.reserve(demand(blocks=2, shared=(1, 2, 3)))
        assert ledger.kv_blocks == 5
        second_demand = demand(blocks=2, shared=(1, 2, 3, 4))
        assert ledger.new_blocks(second_demand) == 3  # only hash 4 and its 2 private blocks
        second = ledger.reserve(second_demand)
        assert ledger.kv_blocks == 8
        ledger.release(first)
        assert ledger.kv_blocks == 6  # hashes 1-3 still held by the second request
        ledger.release(second)
        assert ledger.kv_blocks == 0

    def test_release_is_exactly_once(self) -> None:
        ledger = Ledger()
        reservation = ledger.reserve(demand(blocks=3, prefill=100, rows=1))
        assert ledger.release(reservation) is True
        assert ledger.release(reservation) is False
        assert (ledger.kv_blocks, ledger.transient_bytes, ledger.in_flight) == (0, 0, 0)

    def test_prefill_terms_count_the_largest_sampled_rows_add_up(self) -> None:
        """One step schedules at most a full chunk of prompt tokens across all requests."""
        ledger = Ledger()
        ledger.reserve(demand(prefill=700, rows=1))
        second = ledger.reserve(demand(prefill=300, rows=2))
        assert ledger.transient_bytes == 700 + 3 * 8
        assert ledger.transient_bytes_with(demand(prefill=900, rows=1)) == 900 + 4 * 8
        ledger.release(second)
        assert ledger.transient_bytes == 708

    def test_one_row_asking_for_logprobs_makes_the_whole_batch_pay(self) -> None:
        """vLLM's compute_logprobs runs over every row once one row asks."""
        ledger = Ledger()
        plain = ledger.reserve(demand(rows=30, logprobs=False))
        assert ledger.transient_bytes == 0
        assert ledger.profiled_bytes == profiled_sampler(30) == 1_380
        assert ledger.transient_bytes_with(demand(rows=1)) == 31 * 8
        asking = ledger.reserve(demand(rows=1))
        ledger.release(plain)
        assert ledger.transient_bytes == 8
        ledger.release(asking)

    def test_one_penalty_request_makes_the_whole_batch_hold_prompt_ids(self) -> None:
        """[requests, longest prompt] int64, twice while the batch changes, for every request."""
        ledger = Ledger()
        long_plain = ledger.reserve(demand(rows=9, logprobs=False, prompt=4000))
        assert ledger.transient_bytes == 0
        penalised = demand(rows=1, logprobs=False, penalties=True, prompt=10)
        assert penalised.transient_bytes == 2 * 1 * 10 * 8  # alone: its own row and prompt
        assert ledger.transient_bytes_with(penalised) == 2 * 10 * 4000 * 8
        held = ledger.reserve(penalised)
        ledger.release(long_plain)
        assert ledger.transient_bytes == 2 * 1 * 10 * 8
        ledger.release(held)
        assert (ledger.transient_bytes, ledger.profiled_bytes) == (0, 0)

    def test_penalty_bin_counts_of_more_than_half_the_profiled_rows_need_free_memory(self) -> None:
        """Two int64 [B, V+1] bin counts fit in the sampler warm-up's cached fp32 [R, V] blocks
        only while 2 B (V + 1) <= R V: B <= 333 here (R = 1000 rows, V = 2), not R / 2, where a
        count outgrows a block by 8 B bytes. Above that all of them (22 B a logit, 44 a row here)
        are charged against the headroom."""
        ledger = Ledger()
        ledger.reserve(demand(rows=332, logprobs=False))
        penalised = demand(rows=1, logprobs=False, penalties=True)
        assert ledger.transient_bytes_with(penalised) == 0
        ledger.reserve(demand(rows=1, logprobs=False))
        assert ledger.transient_bytes_with(penalised) == 334 * 44
        assert ledger.transient_bytes_with(demand(rows=1, logprobs=False)) == 0  # no penalty, no bins

    def test_sampled_rows_stop_at_what_one_step_can_sample(self) -> None:
        """No step samples more than max_num_seqs rows: the profile's dummy sampler run covered
        exactly that many, so the profiled part of the stage never outgrows it."""
        ledger = Ledger()
        for _ in range(3):
            ledger.reserve(demand(rows=400))
        assert ledger.profiled_bytes == profiled_sampler(1000) == 46_000
        assert ledger.transient_bytes == 1000 * 8

    def test_an_empty_ledger_charges_a_demand_what_it_asks_alone(self) -> None:
        d = demand(prefill=70, profiled_prefill=5, rows=3, penalties=True, prompt=40)
        assert Ledger().transient_bytes_with(d) == d.transient_bytes == 70 + 24 + 2 * 3 * 40 * 8
        # its forward pass (5) and its sampler stage run one after the other: the larger counts
        assert Ledger().step_with(d).profiled_bytes == d.profiled_bytes == profiled_sampler(3) == 1_054

    def test_high_water_mark_sees_short_lived_prefills(self) -> None:
        ledger = Ledger()
        short = ledger.reserve(demand(prefill=900, rows=1))
        ledger.end_prefill(short)
        ledger.release(short)
        assert ledger.transient_bytes == 0
        assert ledger.peak_transient_bytes == 908
        kept = ledger.reserve(demand(prefill=0, rows=5))
        ledger.reset_peak()  # a new engine life starts from what is held now
        assert ledger.peak_transient_bytes == 40
        ledger.release(kept)

    def test_end_prefill_frees_only_prefill_bytes(self) -> None:
        ledger = Ledger()
        reservation = ledger.reserve(demand(prefill=100, rows=1))
        assert ledger.transient_bytes == 108
        assert ledger.end_prefill(reservation) is True
        assert ledger.end_prefill(reservation) is False
        assert ledger.transient_bytes == 8
        ledger.release(reservation)
        assert ledger.transient_bytes == 0

    def test_a_request_of_several_engine_requests_keeps_its_prefill_until_released(self) -> None:
        """The first token of a batch is one prompt's: the others may prefill later in vLLM."""
        ledger = Ledger()
        batch = ledger.reserve(dataclasses.replace(demand(prefill=100, rows=1), sequences=3))
        assert ledger.end_prefill(batch) is False
        assert ledger.transient_bytes == 108
        ledger.release(batch)
        assert ledger.transient_bytes == 0

    def test_profiled_forward_terms_add_up_over_open_prefills_and_the_sampler_phase_is_apart(self) -> None:
        """Chunks of several prefills share a step's MLP, so their forward terms add up; the
        sampler runs after the forward pass has freed them (kvgate/memory/ceiling.py StepHoldings),
        with the hidden states it reads: the larger phase counts."""
        ledger = Ledger()
        first = ledger.reserve(replace(demand(profiled_prefill=5000, rows=1), profiled_residual_bytes=50))
        second = ledger.reserve(demand(profiled_prefill=3000, rows=1))
        assert ledger.step().forward_profiled == 8000
        assert ledger.step().residual_profiled == 50
        assert ledger.step().sampler_profiled == profiled_sampler(2) == 1_044
        assert ledger.profiled_bytes == 8000
        assert ledger.step_with(demand(profiled_prefill=1000)).profiled_bytes == 9000
        ledger.end_prefill(first)
        assert ledger.profiled_bytes == 3000
        ledger.end_prefill(second)
        assert ledger.profiled_bytes == profiled_sampler(2)  # decoding only: the sampler's
        ledger.release(second)
        ledger.release(first)
        assert ledger.profiled_bytes == 0


class TestBudgetCharges:
    def test_stale_readings_halve_the_headroom_not_the_pool(self) -> None:
        """Conservative mode (kvgate/telemetry/live.py: scale = --stale-budget-fraction, overcommit
        off): what stale readings may miss is another process taking GPU memory, so the transient
        limit shrinks; the KV pool is vLLM's own and a full one makes it queue, never OOM."""
        budget = Budget(kv_blocks=100, transient_headroom_bytes=1000, transient_margin=0.0, kv_overcommit=1.2)
        assert (budget.kv_limit(), budget.transient_limit()) == (120, 1000)
        budget.update(scale=0.5, kv_overcommit=1.0)
        assert (budget.kv_limit(), budget.transient_limit()) == (100, 500)

    def test_profiled_terms_are_free_beside_a_headroom_from_flags(self) -> None:
        budget = Budget(kv_blocks=10, transient_headroom_bytes=100, transient_margin=0.0)
        assert budget.shortfall(demand(profiled_prefill=10**9), Ledger()) is None

    def test_profiled_terms_are_charged_up_to_the_emptied_region(self) -> None:
        """A live headroom includes the profile region: a co-tenant that took it leaves the MLP of
        a long prefill nowhere to go, though the request has no unprofiled term at all."""
        budget = Budget(kv_blocks=10, transient_headroom_bytes=100, transient_margin=0.0, profiled_cap_bytes=400)
        ledger = Ledger()
        assert budget.shortfall(demand(profiled_prefill=150), ledger) == TRANSIENT_BUSY
        assert budget.shortfall(demand(profiled_prefill=60, prefill=40), ledger) is None
        budget.update(transient_headroom_bytes=1000)
        ledger.reserve(demand(profiled_prefill=900, prefill=100))
        assert budget.transient_charge(ledger) == 100 + 400  # the region is never charged twice
        # unprofiled prefill terms take the largest open prefill (600), the profiled ones the cap
        assert budget.shortfall(demand(profiled_prefill=900, prefill=600), ledger) is None
        assert budget.shortfall(demand(profiled_prefill=900, prefill=601), ledger) == TRANSIENT_BUSY
        # its MLP is freed before its sampler runs: the larger phase counts, its profiled bytes up to
        # the region. The sampler's (1 row: 10 B + its sort's two 512-B outputs, 8 B unprofiled) is
        # the larger here: the region + 8
        assert budget.ceiling().transient_need(demand(profiled_prefill=900, rows=1)) == 400 + 8
        assert budget.ceiling().transient_need(demand(profiled_prefill=900)) == 400

    def test_profiled_terms_charged_to_free_memory_take_the_allocators_segments(self) -> None:
        """S13: a 400 MiB profile peak that comes back out of free memory takes 480 MiB of
        segments (kvgate/memory/allocator.py); a 547 MiB headroom, less a 10 % margin, then has
        12 MiB left beside it where the allocated peak alone left 92."""
        mib = 2**20
        budget = Budget(
            kv_blocks=10,
            transient_headroom_bytes=547 * mib,
            transient_margin=0.1,
            profiled_cap_bytes=400 * mib,
            segment_overhead=0.2,
        )
        ledger = Ledger()
        ledger.reserve(demand(profiled_prefill=400 * mib))
        assert budget.transient_charge(ledger) == 480 * mib
        assert budget.shortfall(demand(prefill=12 * mib), ledger) is None
        assert budget.shortfall(demand(prefill=13 * mib), ledger) == TRANSIENT_BUSY
        # alone on an idle engine a request's steps run largest first: judged and admitted at the
        # allocated peak, as vLLM's profile sized it
        assert budget.ceiling().transient_need(demand(profiled_prefill=400 * mib)) == 400 * mib
        assert budget.shortfall(demand(profiled_prefill=400 * mib, prefill=92 * mib), Ledger()) is None
        # the GPU showed the region taking 520 MiB: the learned share counts, the larger wins
        budget.update(learned_segment_overhead=0.3)
        assert budget.transient_charge(ledger) == 520 * mib
        assert budget.ceiling().transient_need(demand(profiled_prefill=400 * mib)) == 400 * mib
        assert budget.shortfall(demand(prefill=1), ledger) == TRANSIENT_BUSY
        budget.update(segment_overhead=0.0, learned_segment_overhead=0.0)  # --expandable-segments
        assert budget.shortfall(demand(prefill=92 * mib), ledger) is None

    def test_kv_keeps_room_for_the_spread_of_the_in_flight_outputs(self) -> None:
        """Each request reserves its mean output; z standard deviations of their sum stay free."""
        budget, ledger = Budget(kv_blocks=100, kv_margin_z=2.0), Ledger()
        spread = replace(demand(blocks=20), kv_variance_blocks=9.0)  # 3 blocks of deviation each
        held = [ledger.reserve(spread) for _ in range(3)]
        assert ledger.kv_variance_blocks == 27.0
        # 60 held + 20 new + 2 x sqrt(36) = 92 fits; a fifth request: 100 + 2 x sqrt(45) does not
        assert budget.shortfall(spread, ledger) is None
        ledger.reserve(spread)
        assert budget.shortfall(spread, ledger) == KV_BUSY
        assert budget.shortfall(demand(blocks=6), ledger) is None  # 80 + 6 + 2 x 6 = 98
        for reservation in held:
            ledger.release(reservation)
        assert ledger.kv_variance_blocks == 9.0


class TestQueue:
    def _waiter(self, priority: int, tenant: str) -> Waiter:
        return Waiter(demand(), priority, tenant, 0.0, 0.0, asyncio.get_running_loop().create_future())

    async def test_priority_then_round_robin_across_tenants(self) -> None:
        queue = AdmissionQueue(max_size=10)
        a1, a2, a3 = (self._waiter(0, "a") for _ in range(3))
        b1 = self._waiter(0, "b")
        urgent = self._waiter(-1, "c")
        for w in (a1, a2, a3, b1, urgent):
            queue.push(w)
        order = [queue.pop_head() for _ in range(5)]
        assert order == [urgent, a1, b1, a2, a3]

    async def test_blocks_ahead_follow_the_turns_not_arrival(self) -> None:
        """Retry-After counts the line as it will be admitted: a tenant's first request goes
        before another tenant's later ones, whenever it came."""
        queue = AdmissionQueue(max_size=10)
        a1, a2, a3 = (self._waiter(0, "a") for _ in range(3))
        b1 = self._waiter(0, "b")
        urgent = self._waiter(-1, "c")
        for w in (a1, a2, a3, b1, urgent):
            queue.push(w)  # order of admission: urgent, a1, b1, a2, a3
        assert queue.blocks_ahead(0, "b", b1) == 2  # urgent, a1
        assert queue.blocks_ahead(0, "a", a3) == 4  # urgent, a1, b1, a2
        assert queue.blocks_ahead(0, "d") == 3  # a new tenant: urgent, then a1 and b1 in their turn
        assert queue.blocks_ahead(0, "b") == 4  # b's second: urgent, a1, b1, a2
        assert queue.blocks_ahead(0, "a") == 5  # a's fourth: behind everything

    async def test_bounded_and_removable(self) -> None:
        queue = AdmissionQueue(max_size=2)
        first, second = self._waiter(0, "a"), self._waiter(0, "b")
        queue.push(first)
        queue.push(second)
        with pytest.raises(QueueAtCapacity):
            queue.push(self._waiter(0, "a"))
        assert queue.blocks_ahead(0, "b", second) == 1  # the first's one block
        assert queue.blocks_ahead(0, "c") == 2
        assert queue.blocks_ahead(-1, "c") == 0
        assert queue.remove(first) is True
        assert queue.remove(first) is False
        assert queue.peek() is second
        assert len(queue) == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestDrainRate:
    def test_retry_after_follows_the_observed_rate(self) -> None:
        clock = FakeClock()
        drain = DrainRate(window_s=10.0, clock=clock)
        assert drain.retry_after(50, busy=False, fallback_s=30) == 30  # nothing drained yet
        clock.now += 10
        for _ in range(20):  # 2 completions of 4 blocks per second: 8 blocks/s
            drain.record(4)
        assert drain.retry_after(40, busy=True, fallback_s=30) == 5
        assert drain.retry_after(800, busy=True, fallback_s=30) == 100

    def test_small_completions_do_not_promise_a_long_line_a_short_wait(self) -> None:
        """Issue 15, finding 6: many small answers drained, the line ahead holds big requests."""
        clock = FakeClock()
        drain = DrainRate(window_s=30.0, clock=clock)
        clock.now += 30
        for _ in range(60):  # 2 small (1-block) answers a second
            drain.record(1)
        # 20 requests of 900 blocks in front: 18,000 blocks at 2 blocks/s, capped at ten minutes.
        assert drain.retry_after(20 * 900, busy=True, fallback_s=30) == RETRY_AFTER_CAP_S
        assert drain.retry_after(900, busy=True, fallback_s=30) == 450

    def test_nothing_drained_while_work_runs_is_the_cap(self) -> None:
        clock = FakeClock()
        drain = DrainRate(window_s=30.0, clock=clock)
        drain.record(10)
        clock.now += 31  # the last release left the window
        assert drain.retry_after(10, busy=True, fallback_s=30) == RETRY_AFTER_CAP_S
        assert drain.retry_after(10, busy=False, fallback_s=30) == 30


def metered_gate(budget: Budget, max_queue: int = 8, wait_s: float = 5.0) -> tuple[Gate, KvgateMetrics]:
    """A gate whose decisions are counted as kvgate counts them (GateMetrics observes it)."""
    metrics = KvgateMetrics()
    observer = GateMetrics(metrics)
    gate = Gate(budget, Observers(observer), max_queue=max_queue, max_queue_wait_s=wait_s)
    observer.watch(gate)
    return gate, metrics


def make_gate(kv_blocks: int = 10, transient: int | None = None, max_queue: int = 8, wait_s: float = 5.0) -> Gate:
    budget = Budget(kv_blocks=kv_blocks, transient_headroom_bytes=transient, transient_margin=0.0)
    return metered_gate(budget, max_queue, wait_s)[0]


class TestGate:
    async def test_admits_when_it_fits_and_queues_when_kv_is_busy(self) -> None:
        gate, metrics = metered_gate(Budget(kv_blocks=10, transient_margin=0.0))
        first = await gate.acquire(demand(blocks=8), 0, "a")
        assert gate.would_wait(demand(blocks=3), 0) == KV_BUSY
        waiting = asyncio.create_task(gate.acquire(demand(blocks=3), 0, "a"))
        await asyncio.sleep(0)
        assert len(gate.queue) == 1
        assert not waiting.done()
        first.release()
        second = await asyncio.wait_for(waiting, 1)
        assert gate.ledger.kv_blocks == 3
        assert second.queue_wait_s >= 0
        second.release()
        assert sample(metrics, "kvgate_decisions_total", decision="queue", reason=KV_BUSY) == 1
        assert sample(metrics, "kvgate_decisions_total", decision="admit", reason="dequeued") == 1

    async def test_gauges_read_the_queue_ledger_and_budget_when_scraped(self, monkeypatch) -> None:
        from prometheus_client import Gauge

        budget = Budget(transient_margin=0.0)  # unknown until the backend is synchronised
        gate, metrics = metered_gate(budget)
        writes: list[float] = []  # a request pays no gauge write
        monkeypatch.setattr(Gauge, "set", lambda gauge, value: writes.append(value))

        def gauges() -> tuple[float, ...]:
            names = (
                "kvgate_queue_depth",
                "kvgate_in_flight_requests",
                "kvgate_reserved_kv_blocks",
                "kvgate_reserved_transient_bytes",
                "kvgate_budget_kv_blocks",
                "kvgate_budget_transient_bytes",
            )
            return tuple(sample(metrics, name) for name in names)

        assert gauges() == (0, 0, 0, 0, 0, 0)
        budget.update(kv_blocks=10, transient_headroom_bytes=1000)
        assert gauges() == (0, 0, 0, 0, 10, 1000)
        first = await gate.acquire(demand(blocks=8, prefill=300), 0, "a")
        assert gauges() == (0, 1, 8, 300, 10, 1000)
        waiting = asyncio.create_task(gate.acquire(demand(blocks=3), 0, "a"))
        await asyncio.sleep(0)
        assert gauges() == (1, 1, 8, 300, 10, 1000)
        budget.update(kv_blocks=None, transient_headroom_bytes=None)  # unknown again: the last values stay
        assert gauges()[4:] == (10, 1000)
        first.release()
        second = await asyncio.wait_for(waiting, 1)
        assert gauges() == (0, 1, 3, 0, 10, 1000)
        second.release()
        assert gauges() == (0, 0, 0, 0, 10, 1000)
        assert writes == []

    async def test_transient_headroom_gates_and_prefill_end_frees_it(self) -> None:
        gate = make_gate(kv_blocks=100, transient=1000)
        first = await gate.acquire(demand(prefill=900), 0, "a")
        assert gate.would_wait(demand(prefill=100, rows=15), 0) == TRANSIENT_BUSY  # 900 + 120
        waiting = asyncio.create_task(gate.acquire(demand(prefill=100, rows=15), 0, "a"))
        await asyncio.sleep(0)
        assert not waiting.done()
        first.end_prefill()  # 900 B of prefill-only tensors are gone: 100 + 120 fits
        await asyncio.wait_for(waiting, 1)
        assert gate.ledger.transient_bytes == 220

    async def test_a_head_the_headroom_shrank_under_waits_aside_without_blocking_the_line(self) -> None:
        """A co-tenant took memory: the big request cannot run even alone, the small ones can."""
        gate = make_gate(kv_blocks=100, transient=1000)
        running = await gate.acquire(demand(rows=60), 0, "a")
        big = asyncio.create_task(gate.acquire(demand(rows=90), 0, "a"))
        await asyncio.sleep(0)
        # 480 + 320 B fit now, but not beside the big one's 720 B: it waits behind it
        small = asyncio.create_task(gate.acquire(demand(rows=40), 0, "b"))
        await asyncio.sleep(0)
        assert not big.done()
        assert not small.done()
        gate.budget.update(transient_headroom_bytes=500)  # the co-tenant grows
        running.release()
        second = await asyncio.wait_for(small, 1)  # the big one no longer holds up the line
        assert not big.done()
        assert len(gate.queue) == 1
        gate.budget.update(transient_headroom_bytes=900)  # the co-tenant shrinks
        assert not big.done()  # back at the front, waiting for the 320 B in flight (720 + 320 > 900)
        second.release()
        (await asyncio.wait_for(big, 1)).release()
        assert len(gate.queue) == 0
        assert gate.ledger.in_flight == 0

    async def test_set_aside_requests_are_weighed_again_only_when_the_budget_moves(self) -> None:
        """Releases and arrivals change only what is in flight, and a set-aside request is judged
        against an idle server: it is not estimated again for them (held-out H1, session 36: a
        dozen long RAG queries set aside while they waited for an empty cache, each estimated
        again at every release, took kvgate's CPU from the requests it was serving)."""
        estimated: list[str] = []

        def reestimate(basis: str) -> Demand:
            estimated.append(basis)
            return demand(prefill=900) if basis == "big" else demand(prefill=50)

        gate: Gate[str] = Gate(
            Budget(kv_blocks=100, transient_headroom_bytes=100, transient_margin=0.0),
            Observers(),
            max_queue=8,
            max_queue_wait_s=5.0,
            reestimate=reestimate,
        )
        big = asyncio.create_task(gate.acquire(demand(prefill=900), 0, "a", basis="big"))
        await asyncio.sleep(0)
        for _ in range(5):
            (await gate.acquire(demand(prefill=50), 0, "a", basis="small")).release()
            await asyncio.sleep(0)  # the release's re-check of the queue runs
        assert estimated.count("big") <= 1
        gate.budget.update(transient_headroom_bytes=1000)  # the headroom came back
        (await asyncio.wait_for(big, 1)).release()
        assert estimated.count("big") >= 2

    async def test_a_set_aside_request_still_expires_and_leaves_the_queue(self) -> None:
        gate = make_gate(kv_blocks=100, transient=100, wait_s=0.05)
        with pytest.raises(QueueTimeout) as expired:
            await gate.acquire(demand(prefill=900), 0, "a")
        assert status_of(expired.value) == 429
        assert expired.value.code == "queue_timeout"
        assert len(gate.queue) == 0
        (await gate.acquire(demand(prefill=50), 0, "a")).release()

    async def test_completed_requests_teach_the_output_lengths_observing_the_gate(self) -> None:
        """As the composition root wires it: the learner is one of the gate's observers."""
        outputs = OutputLengths(0.99, min_samples=2, refresh_every=1)
        gate = Gate(Budget(kv_blocks=100, transient_margin=0.0), Observers(outputs), max_queue=8, max_queue_wait_s=5.0)
        forced = replace(demand(), max_new_tokens=1000, teaches_output_lengths=False)  # ignore_eos, min_tokens
        releases = [("completed", 240), ("disconnected", 3), ("completed", 2 * 100), ("completed", None)]
        for outcome, tokens in releases:
            ticket = await gate.acquire(replace(demand(), max_new_tokens=1000, sequences=2), 0, "a")
            ticket.release(outcome, tokens)
        (await gate.acquire(forced, 0, "a")).release("completed", 1000)
        assert outputs.samples == 2  # per sequence: 120 and 100; the cut, unknown and forced ones teach nothing
        assert outputs.reserve(1000).tokens == 110  # the mean of 120 and 100

    async def test_a_waiting_request_is_admitted_with_its_refreshed_demand(self) -> None:
        """Output lengths learned while it waited shrink its KV reservation."""
        learned = {"chat": 5}  # what a re-estimation finds now, by basis
        gate: Gate[str] = Gate(
            Budget(kv_blocks=10, transient_margin=0.0),
            Observers(),
            max_queue=8,
            max_queue_wait_s=5.0,
            reestimate=lambda basis: demand(blocks=learned[basis]),
        )
        holder = await gate.acquire(demand(blocks=8), 0, "a")
        waiting = asyncio.create_task(gate.acquire(demand(blocks=5), 0, "a", basis="chat"))
        await asyncio.sleep(0)
        assert not waiting.done()
        learned["chat"] = 2
        gate.changed()
        ticket = await asyncio.wait_for(waiting, 1)
        assert ticket.reservation.demand.private_blocks == 2
        assert gate.ledger.kv_blocks == 10
        ticket.release()
        holder.release()

    async def test_a_waiting_request_is_estimated_again_only_when_what_it_reads_changed(self) -> None:
        """Each release re-checks the line; a waiter is estimated again only once the inputs of its
        estimate (the composition root's: the predictor and the output lengths' generation) moved,
        and is then admitted with the new demand."""
        learned = {"generation": 0, "blocks": 5}
        estimated: list[str] = []

        def reestimate(basis: str) -> Demand:
            estimated.append(basis)
            return demand(blocks=learned["blocks"])

        gate: Gate[str] = Gate(
            Budget(kv_blocks=10, transient_margin=0.0),
            Observers(),
            max_queue=8,
            max_queue_wait_s=5.0,
            reestimate=reestimate,
            reestimate_inputs=lambda: learned["generation"],
        )
        holder = await gate.acquire(demand(blocks=8), 0, "a")
        waiting = asyncio.create_task(gate.acquire(demand(blocks=5), 0, "a", basis="chat"))
        await asyncio.sleep(0)
        for _ in range(4):
            gate.changed()
        assert estimated == ["chat"]
        learned["blocks"] = 2  # learned, but not yet published as a new generation: not read
        gate.changed()
        assert not waiting.done()
        learned["generation"] = 1
        gate.changed()
        ticket = await asyncio.wait_for(waiting, 1)
        assert estimated == ["chat", "chat"]
        assert ticket.reservation.demand.private_blocks == 2
        ticket.release()
        holder.release()

    async def test_a_preview_says_what_acquire_would_and_reserves_nothing(self) -> None:
        """`kvgate explain` asks the gate through its view: the same verdict as an arrival, the
        holdings it was weighed against, and the ledger and queue untouched."""
        gate = make_gate(kv_blocks=10)
        view = GateView(gate)
        holder = await gate.acquire(demand(blocks=8), 0, "a")
        busy = view.preview(demand(blocks=3), 0)
        assert (busy.wait_reason, busy.new_kv_blocks, busy.kv_blocks_reserved, busy.waiting) == (KV_BUSY, 3, 8, 0)
        assert view.preview(demand(blocks=2), 0).wait_reason is None
        assert gate.ledger.kv_blocks == 8
        assert gate.ledger.in_flight == 1
        assert len(gate.queue) == 0
        queued = asyncio.create_task(gate.acquire(demand(blocks=9), 0, "a"))
        await asyncio.sleep(0)
        behind = view.preview(demand(blocks=2), 0)  # it would fit now, but leave the head no room
        assert (behind.wait_reason, behind.waiting) == ("behind_queue", 1)
        beside = view.preview(demand(blocks=1), 0)  # the head's 9 blocks fit beside it: it passes
        assert (beside.wait_reason, beside.waiting) == (None, 1)
        assert gate.ledger.in_flight == 1
        holder.release()
        (await asyncio.wait_for(queued, 1)).release()

    async def test_queue_full_is_a_429_with_retry_after(self) -> None:
        gate = make_gate(kv_blocks=1, max_queue=1)
        await gate.acquire(demand(blocks=1), 0, "a")
        queued = asyncio.create_task(gate.acquire(demand(blocks=1), 0, "a"))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await gate.acquire(demand(blocks=1), 0, "b")
        assert status_of(refused.value) == 429
        assert refused.value.code == "queue_full"
        assert int(error_headers(refused.value)["Retry-After"]) >= 1
        queued.cancel()

    async def test_wait_expiry_is_a_429_and_leaves_nothing_behind(self) -> None:
        gate = make_gate(kv_blocks=1, wait_s=0.05)
        holder = await gate.acquire(demand(blocks=1), 0, "a")
        with pytest.raises(QueueTimeout) as expired:
            await gate.acquire(demand(blocks=1), 0, "a")
        assert status_of(expired.value) == 429
        assert expired.value.code == "queue_timeout"
        assert len(gate.queue) == 0
        holder.release()
        assert gate.ledger.kv_blocks == 0

    async def test_a_wait_spent_before_the_queue_is_named_in_the_refusal(self) -> None:
        """A deadline that evaluation used up: the refusal says the queue had none of the wait."""
        gate = make_gate(kv_blocks=1, wait_s=30)
        holder = await gate.acquire(demand(blocks=1), 0, "a")
        with pytest.raises(QueueTimeout) as expired:  # arrived 30 s ago: its deadline is now
            await gate.acquire(demand(blocks=1), 0, "a", deadline=gate.deadline(gate.now() - 30))
        assert expired.value.message.startswith(
            f"Waited 30 s for GPU memory ({KV_BUSY}; 0.0 s of it in the queue, the rest reading and "
            "evaluating the request) without admission."
        )
        assert len(gate.queue) == 0
        holder.release()

    async def test_a_backend_not_up_holds_arrivals_until_it_is_back_or_their_deadline(self) -> None:
        """The budget's view of the backend (shared with /readyz): while it is hung or down
        nothing is admitted; a request keeps the deadline it arrived with when it queues again."""
        gate = make_gate(kv_blocks=10, wait_s=5.0)
        now = [0.0]
        gate.budget.backend = BackendState(clock=lambda: now[0])
        gate.budget.set_backend("hung", "no answer")
        assert gate.would_wait(demand(), 0) == BACKEND_HUNG
        waiting = asyncio.create_task(gate.acquire(demand(), 0, "a"))
        await wait_for_async(lambda: len(gate.queue) == 1, timeout_s=1, what="the request to queue")
        assert not waiting.done()
        now[0] += 45.0  # the backend was out for 45 s
        gate.budget.set_backend("up")  # the next scrape answered
        (await asyncio.wait_for(waiting, 1)).release()
        gate.budget.set_backend("down", "connection refused")
        now[0] += 30.0
        with pytest.raises(BackendDown) as refused:  # its deadline has passed: no wait at all
            await asyncio.wait_for(gate.acquire(demand(), 0, "a", deadline=gate.deadline(gate.now() - 5.0)), 1)
        assert status_of(refused.value) == 503
        assert "has been down for 30 s" in refused.value.message
        # the last outage lasted 45 s, this one 30 s so far
        assert error_headers(refused.value) == {
            "Retry-After": "15",
            "x-llm-d-request-dropped-reason": "rejected-no-endpoints",
        }
        assert len(gate.queue) == 0

    async def test_client_gone_leaves_the_queue(self) -> None:
        gate = make_gate(kv_blocks=1)
        holder = await gate.acquire(demand(blocks=1), 0, "a")
        gone = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(gate.acquire(demand(blocks=1), 0, "a", lambda: gone))
        await asyncio.sleep(0)
        gone.set_result(None)
        with pytest.raises(ClientGone):
            await waiting
        assert len(gate.queue) == 0
        holder.release()
        assert gate.ledger.in_flight == 0

    async def test_cancelled_waiter_never_leaks_a_ticket(self) -> None:
        gate = make_gate(kv_blocks=1)
        holder = await gate.acquire(demand(blocks=1), 0, "a")
        waiting = asyncio.create_task(gate.acquire(demand(blocks=1), 0, "a"))
        await asyncio.sleep(0)
        holder.release()  # admits the waiter...
        waiting.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.ledger.in_flight == 0
        assert gate.ledger.kv_blocks == 0

    async def test_higher_priority_goes_first_and_budget_growth_admits(self) -> None:
        gate = make_gate(kv_blocks=0)
        low = asyncio.create_task(gate.acquire(demand(blocks=1), 5, "a"))
        await asyncio.sleep(0)
        high = asyncio.create_task(gate.acquire(demand(blocks=1), 0, "b"))
        await asyncio.sleep(0)
        gate.budget.update(kv_blocks=1)
        first = await asyncio.wait_for(high, 1)
        assert not low.done()
        first.release()
        (await asyncio.wait_for(low, 1)).release()

    async def test_behind_queue_requests_do_not_jump_the_line(self) -> None:
        gate = make_gate(kv_blocks=4)
        holder = await gate.acquire(demand(blocks=3), 0, "a")
        big = asyncio.create_task(gate.acquire(demand(blocks=4), 0, "a"))
        await asyncio.sleep(0)
        assert gate.would_wait(demand(blocks=1), 0) == "behind_queue"
        holder.release()
        (await asyncio.wait_for(big, 1)).release()

    async def test_a_waiter_that_does_not_fit_now_is_not_weighed_against_the_head(self, monkeypatch) -> None:
        """Passing the head needs both: fitting now, and not delaying the head. The first is one
        budget check; the second reserves the waiter beside the head's companions and checks the
        head, so it is asked only of a waiter that fits now."""
        gate = make_gate(kv_blocks=100, transient=100)  # 8 B of headroom a sampled row
        holder = await gate.acquire(demand(rows=10), 0, "a")  # 80 B
        other = await gate.acquire(demand(), 0, "a")
        head = await queued(gate, demand(rows=5))  # 120 > 100: waits
        behind = await queued(gate, demand(rows=5), tenant="b")
        weighed = 0
        passing = HeadReservation.passing

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal weighed
            weighed += 1
            return passing(*args, **kwargs)

        monkeypatch.setattr(HeadReservation, "passing", counted)
        other.release()  # the line is weighed again: neither fits now
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not head.done()
        assert not behind.done()
        assert weighed == 0
        holder.release()  # 40 + 40 B: both fit
        for task in (head, behind):
            (await asyncio.wait_for(task, 1)).release()
        assert gate.ledger.in_flight == 0

    async def test_a_burst_of_releases_checks_the_queue_once(self, monkeypatch) -> None:
        """An engine step ends many streams at once: the queue is weighed once for the burst, not
        once per release (each weighing checks the head and the waiters behind it against the
        budget; in benchmark S4 that was half of kvgate's CPU). What is admitted is the same."""
        gate = make_gate(kv_blocks=10, max_queue=16)
        holders = [await gate.acquire(demand(blocks=1), 0, "a") for _ in range(10)]
        head = await queued(gate, demand(blocks=5))
        behind = [await queued(gate, demand(blocks=5), tenant=f"t{k}") for k in range(3)]
        checks = 0
        shortfall = gate.budget.shortfall

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal checks
            checks += 1
            return shortfall(*args, **kwargs)

        monkeypatch.setattr(gate.budget, "shortfall", counted)
        for holder in holders[:5]:  # one turn of the event loop: nothing awaited in between
            holder.release()
        admitted = await asyncio.wait_for(head, 1)  # 5 blocks free: the head's 5 fit
        assert gate.ledger.kv_blocks == 10
        assert not any(task.done() for task in behind)  # nothing else fits beside it
        assert checks <= 3  # the head (fits), the next head (does not), whether it fits alone
        for ticket in [admitted, *holders[5:]]:
            ticket.release()
        for task in behind[:2]:
            (await asyncio.wait_for(task, 1)).release()
        (await asyncio.wait_for(behind[2], 1)).release()
        assert gate.ledger.in_flight == 0


def clocked_gate(kv_blocks: int, clock: FakeClock, max_queue: int = 64) -> tuple[Gate, KvgateMetrics]:
    """A metered gate on a fake clock: backfilling's predictions (Pace) read it."""
    metrics = KvgateMetrics()
    observer = GateMetrics(metrics)
    budget = Budget(kv_blocks=kv_blocks, transient_margin=0.0)
    gate = Gate(budget, Observers(observer), max_queue=max_queue, max_queue_wait_s=60.0, clock=clock)
    observer.watch(gate)
    return gate, metrics


def short(blocks: int, tokens: int) -> Demand:
    """A request of `blocks` KV blocks that may write `tokens` output tokens."""
    return replace(demand(blocks=blocks), max_new_tokens=tokens)


async def queued(gate: Gate, request: Demand, priority: int = 0, tenant: str = "a") -> asyncio.Task:
    """Send a request that has to wait; returns its task, checked to be waiting in the queue."""
    before = len(gate.queue)
    task = asyncio.create_task(gate.acquire(request, priority, tenant))
    await wait_for_async(lambda: len(gate.queue) == before + 1, timeout_s=1, what="the request to queue")
    return task


class TestPace:
    def test_learns_seconds_per_output_token_from_completed_requests(self) -> None:
        pace = Pace(weight=0.5)
        assert pace.duration_s(100) is None  # nothing completed yet: nothing predicted
        pace.record(seconds=2.0, tokens_per_sequence=20)
        assert pace.duration_s(100) == pytest.approx(10.0)
        pace.record(seconds=6.0, tokens_per_sequence=20)  # 0.3 s a token: halfway there
        assert pace.duration_s(100) == pytest.approx(20.0)
        assert pace.duration_s(0) == pytest.approx(0.2)  # at least one token

    def test_a_long_prompt_is_predicted_to_take_its_prefill_too(self) -> None:
        """A stream's first token splits its time: prefill per prompt token, decoding per output
        token. A 4,000-token prompt asking one output token is not over in one decoding step."""
        pace = Pace(weight=1.0)
        pace.record(seconds=3.0, tokens_per_sequence=100, prompt_tokens=1000, first_token_s=1.0)
        assert pace.duration_s(1, prompt_tokens=4000) == pytest.approx(4.0 + 0.02)
        assert pace.duration_s(100, prompt_tokens=0) == pytest.approx(2.0)
        # A non-streaming answer (first token not seen) teaches decoding net of its predicted prefill.
        pace.record(seconds=5.0, tokens_per_sequence=100, prompt_tokens=1000)
        assert pace.duration_s(100) == pytest.approx(4.0)


class TestBackfill:
    """EASY backfilling (kvgate/gate/backfill.py): requests that fit now pass a head that waits for
    memory when they do not delay its reservation, and nothing can keep the head waiting forever."""

    async def test_a_small_request_passes_a_waiting_head_when_the_head_still_fits_beside_it(self) -> None:
        clock = FakeClock()
        gate, metrics = clocked_gate(10, clock)
        holder = await gate.acquire(demand(blocks=6), 0, "a")
        head = await queued(gate, demand(blocks=8))  # 14 > 10: waits for the holder
        # Nothing has completed, so nothing is predicted: the head will start once what is in
        # flight now has ended, and a request may pass it if the head fits beside it then.
        first = await asyncio.wait_for(gate.acquire(demand(blocks=2), 0, "b"), 1)  # 8 + 2 <= 10
        assert gate.would_wait(demand(blocks=2), 0) == "behind_queue"  # fits now, but 8 + 2 + 2 > 10
        second = await queued(gate, demand(blocks=2), tenant="b")
        holder.release()  # 2 in flight: the head's 8 fit beside them
        admitted = await asyncio.wait_for(head, 1)
        assert gate.ledger.kv_blocks == 10
        assert not second.done()  # its turn comes after the head's
        admitted.release()
        first.release()
        (await asyncio.wait_for(second, 1)).release()
        assert sample(metrics, "kvgate_decisions_total", decision="admit", reason="backfilled") == 1
        assert gate.ledger.in_flight == 0
        assert len(gate.queue) == 0

    async def test_waiting_requests_pass_in_priority_order(self) -> None:
        gate, _ = clocked_gate(10, FakeClock())
        big_holder = await gate.acquire(demand(blocks=6), 0, "a")
        small_holder = await gate.acquire(demand(blocks=3), 0, "a")
        head = await queued(gate, demand(blocks=8))
        low = await queued(gate, demand(blocks=2), priority=5, tenant="b")  # 9 + 2 > 10: waits
        high = await queued(gate, demand(blocks=2), priority=1, tenant="c")
        small_holder.release()  # room for one of them beside the head's 8: the more urgent one
        passed = await asyncio.wait_for(high, 1)
        assert not low.done()
        assert not head.done()
        big_holder.release()
        (await asyncio.wait_for(head, 1)).release()
        passed.release()
        (await asyncio.wait_for(low, 1)).release()
        assert gate.ledger.in_flight == 0

    async def test_a_request_predicted_to_end_before_the_head_starts_passes_it(self) -> None:
        """With a pace learned, the head's start is predicted: a short request that ends by then
        passes even where it would not fit beside the head; a long one does not."""
        clock = FakeClock()
        gate, _ = clocked_gate(10, clock)
        taught = await gate.acquire(short(1, 10), 0, "a")
        clock.now += 1.0
        taught.release("completed", 10)  # 0.1 s an output token
        holder = await gate.acquire(short(6, 16), 0, "a")  # predicted to end 1.6 s from now
        head = await queued(gate, demand(blocks=8))
        assert gate.would_wait(short(3, 20), 0) == "behind_queue"  # ends after 2 s, no room beside
        quick = await asyncio.wait_for(gate.acquire(short(3, 4), 0, "b"), 1)  # ends after 0.4 s
        clock.now += 0.4
        quick.release("completed", 4)
        holder.release("completed", 16)
        (await asyncio.wait_for(head, 1)).release()
        assert gate.ledger.in_flight == 0

    async def test_a_companion_that_ends_its_prefill_leaves_the_head_room_beside_it(self) -> None:
        """The head is to run beside a companion that was still prefilling when its reservation was
        made; once that companion's prefill-only memory is gone, the room it held beside the head
        is free for another request to pass (it used to stay charged until the companion ended)."""
        clock = FakeClock()
        metrics = KvgateMetrics()
        observer = GateMetrics(metrics)
        budget = Budget(kv_blocks=100, transient_headroom_bytes=100, transient_margin=0.0)
        gate = Gate(budget, Observers(observer), max_queue=8, max_queue_wait_s=60.0, clock=clock)
        observer.watch(gate)

        def holding(held: int, tokens: int) -> Demand:
            """Prefill memory held across its prefill's steps (summed over open prefills)."""
            return replace(demand(prefill=held), transient_held_bytes=held, max_new_tokens=tokens)

        taught = await gate.acquire(short(1, 10), 0, "a")
        clock.now += 1.0
        taught.release("completed", 10)  # 0.1 s an output token
        ending = await gate.acquire(holding(60, 16), 0, "a")  # predicted to end at +1.6 s
        companion = await gate.acquire(holding(40, 1000), 0, "a")  # still running when the head starts
        head = await queued(gate, holding(50, 16))  # 100 + 50 > 100
        long_one = holding(40, 1000)  # fits beside `ending` and the companion decoding, not before the head starts
        assert gate.would_wait(long_one, 0) == "behind_queue"  # the companion still prefills
        companion.end_prefill()
        assert not head.done()  # 60 + 0 + 50 > 100: it waits for `ending`
        passed = await asyncio.wait_for(gate.acquire(long_one, 0, "b"), 1)  # 0 + 40 + 50 beside the companion
        ending.release("completed", 16)
        (await asyncio.wait_for(head, 1)).release()
        passed.release()
        companion.release()
        assert sample(metrics, "kvgate_decisions_total", decision="admit", reason="backfilled") == 1
        assert gate.ledger.in_flight == 0

    async def test_a_long_prompt_asking_one_token_is_not_taken_for_a_quick_one(self) -> None:
        """Predicted from its prompt too, a scoring request (4,000 prompt tokens, one output token)
        does not pass a waiting head as "ends before the head starts" when its prefill alone
        takes longer than the head waits; a short prompt asking one token does."""
        clock = FakeClock()
        gate, _ = clocked_gate(10, clock)
        taught = await gate.acquire(replace(short(1, 10), prompt_tokens=100), 0, "a")
        clock.now += 0.1
        taught.end_prefill()  # 1 ms a prompt token
        clock.now += 1.0
        taught.release("completed", 10)  # 0.1 s an output token
        holder = await gate.acquire(short(6, 16), 0, "a")  # predicted to end at +1.6 s
        head = await queued(gate, demand(blocks=8))
        assert gate.would_wait(replace(short(3, 1), prompt_tokens=4000), 0) == "behind_queue"  # 2 x 4.1 s
        quick = await asyncio.wait_for(gate.acquire(replace(short(3, 1), prompt_tokens=100), 0, "b"), 1)
        quick.release("completed", 1)
        holder.release("completed", 16)
        (await asyncio.wait_for(head, 1)).release()
        assert gate.ledger.in_flight == 0

    async def test_a_stream_of_small_requests_cannot_starve_the_head(self) -> None:
        """The head's reservation is fixed when it becomes the head. Short requests pass it while
        they are predicted to end before it starts; these overrun, and small requests keep coming
        (each would fit now). Past the predicted start only those leaving the head room beside
        them pass, so once the requests in flight then have ended, the head is admitted, however
        many more small ones arrive."""
        clock = FakeClock()
        gate, metrics = clocked_gate(10, clock)
        taught = await gate.acquire(short(1, 10), 0, "a")
        clock.now += 1.0
        taught.release("completed", 10)  # 0.1 s an output token
        holder = await gate.acquire(short(6, 16), 0, "a")  # predicted to end at +1.6 s
        head = await queued(gate, demand(blocks=8))
        overrunning = [await asyncio.wait_for(gate.acquire(short(2, 4), 0, "b"), 1) for _ in range(2)]
        assert gate.ledger.kv_blocks == 10  # both predicted to end by +0.4 s: both passed
        clock.now += 5.0  # they did not; the holder has ended by now
        holder.release("completed", 16)
        in_flight: list = []
        for _ in range(100):  # a small request arrives, the oldest small one ends, and again
            arrival = asyncio.create_task(gate.acquire(short(2, 4), 0, "c"))
            await wait_for_async(
                lambda a=arrival: a.done() or len(gate.queue) > 1, timeout_s=1, what="the arrival to pass or queue"
            )
            if arrival.done():
                in_flight.append(arrival.result())
            else:
                arrival.cancel()  # it would wait behind the head: its client gives up
                with pytest.raises(asyncio.CancelledError):
                    await arrival
            assert len(in_flight) <= 1  # past the start, only one 2-block request fits beside the 8
            assert not head.done()  # the two overrunning requests still hold 4 blocks
            if len(in_flight) == 1 and clock.now % 2:
                in_flight.pop().release("completed", 4)
            clock.now += 1.0
        for ticket in overrunning:  # the requests in flight at the predicted start end at last
            ticket.release("completed", 4)
        big = await asyncio.wait_for(head, 1)  # admitted beside the small one still in flight
        assert gate.ledger.kv_blocks == 8 + 2 * len(in_flight)
        big.release()
        for ticket in in_flight:
            ticket.release()
        assert sample(metrics, "kvgate_decisions_total", decision="admit", reason="backfilled") >= 3
        assert gate.ledger.in_flight == 0
        assert len(gate.queue) == 0

    async def test_a_head_that_used_half_its_wait_is_passed_on_no_prediction(self) -> None:
        """Backfilling must not be why a large request is refused for waiting too long: once the
        head has waited half of --max-queue-wait, nothing passes it on a prediction ("ends
        first") any more, and companions join only while no request that passed on one still
        runs. A companion cannot delay it: the head fits beside the companions."""
        clock = FakeClock()
        gate, _ = clocked_gate(10, clock)  # --max-queue-wait 60 s
        taught = await gate.acquire(short(1, 10), 0, "a")
        clock.now += 1.0
        taught.release("completed", 10)  # 0.1 s an output token
        holder = await gate.acquire(short(6, 1000), 0, "a")  # predicted to end at +100 s
        head = await queued(gate, demand(blocks=8))
        straggler = await asyncio.wait_for(gate.acquire(short(3, 4), 0, "b"), 1)  # ends first (not beside: 8 + 3 > 10)
        clock.now += 30.0  # half of the head's wait; the straggler overran its prediction
        assert gate.would_wait(short(1, 4), 0) == "behind_queue"  # would fit beside, but the straggler runs
        straggler.release("completed", 4)
        assert gate.would_wait(replace(short(3, 4), prompt_tokens=0), 0) == "behind_queue"  # no more predictions
        companion = await asyncio.wait_for(gate.acquire(short(2, 1000), 0, "c"), 1)  # 8 + 2 beside: joins
        holder.release("completed", 1000)
        (await asyncio.wait_for(head, 1)).release()  # admitted beside the companion at once
        companion.release()
        assert gate.ledger.in_flight == 0

    async def test_a_head_that_leaves_lets_the_line_move_up(self) -> None:
        gate = make_gate(kv_blocks=10)
        holder = await gate.acquire(demand(blocks=6), 0, "a")
        gone = asyncio.get_running_loop().create_future()
        head = asyncio.create_task(gate.acquire(demand(blocks=8), 0, "a", lambda: gone))
        await wait_for_async(lambda: len(gate.queue) == 1, timeout_s=1, what="the head to queue")
        behind = await queued(gate, demand(blocks=3), tenant="b")  # fits now, not beside the head
        gone.set_result(None)
        with pytest.raises(ClientGone):
            await head
        (await asyncio.wait_for(behind, 1)).release()  # it leads the line now, and fits
        holder.release()
        assert gate.ledger.in_flight == 0

    async def test_retry_after_counts_the_real_line(self) -> None:
        """A refused request is told how long the line ahead of it takes to drain, the waiting
        head included, whatever may pass it."""
        clock = FakeClock()
        gate, _ = clocked_gate(10, clock, max_queue=1)
        clock.now += 30
        for _ in range(30):  # 1 block a second drained
            (await gate.acquire(demand(blocks=1), 0, "a")).release("disconnected")
        holder = await gate.acquire(demand(blocks=6), 0, "a")
        head = await queued(gate, demand(blocks=8))
        with pytest.raises(QueueFull) as refused:
            await gate.acquire(demand(blocks=5), 0, "b")  # fits now, not beside the head: the queue is full
        assert error_headers(refused.value) == {
            "Retry-After": "13",
            "x-llm-d-request-dropped-reason": "rejected-saturated",
        }  # (8 + 5) blocks at 1 a second
        holder.release()
        (await asyncio.wait_for(head, 1)).release()

    async def test_retry_after_is_no_later_than_the_last_deadline_in_the_queue(self) -> None:
        """Before anything has drained the rate is unknown (the estimate is its 600 s cap), yet
        every waiter in front leaves the queue by its deadline: a request refused at a full
        queue is told that much at most."""
        clock = FakeClock()
        gate, _ = clocked_gate(10, clock, max_queue=1)  # --max-queue-wait 60 s
        holder = await gate.acquire(demand(blocks=8), 0, "a")
        head = await queued(gate, demand(blocks=8))  # its deadline: 60 s from now
        clock.now += 20
        with pytest.raises(QueueFull) as refused:
            await gate.acquire(demand(blocks=3), 0, "b")  # does not fit now: the queue is full
        assert error_headers(refused.value)["Retry-After"] == "40"
        holder.release()
        (await asyncio.wait_for(head, 1)).release()


class TestQueueOrderBehindTheHead:
    async def test_behind_the_head_in_turn_order_and_a_passing_tenant_goes_to_the_back(self) -> None:
        loop = asyncio.get_running_loop()
        queue = AdmissionQueue(max_size=10)

        def waiter(priority: int, tenant: str) -> Waiter:
            return Waiter(demand(), priority, tenant, 0.0, 0.0, loop.create_future())

        a1, a2, b1, b2, c1 = (waiter(0, tenant) for tenant in "aabbc")
        late = waiter(3, "a")
        for w in (a1, a2, b1, b2, c1, late):
            queue.push(w)
        assert queue.behind_head(10) == [b1, c1, a2, b2, late]
        assert queue.behind_head(2) == [b1, c1]
        queue.take(b1)  # b had its turn
        assert queue.behind_head(10) == [c1, b2, a2, late]
        queue.take(a2)  # the head's tenant keeps the head's place
        assert queue.peek() is a1
        assert [queue.pop_head() for _ in range(len(queue))] == [a1, c1, b2, late]
