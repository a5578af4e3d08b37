"""The gate: admit now, wait in the queue, or refuse, and hand out tickets released exactly once.

It is the mechanism; the budget is the policy. Whenever the ledger shrinks or the budget moves,
the gate admits from the head of the queue for as long as the head fits. The head is not bypassed
by smaller requests behind it, so a large request is never starved by a stream of small ones;
the one exception is a head that could not fit even on an idle server (the headroom shrank under
it): it is set aside, so that it does not hold up a line it cannot lead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from prometheus_client import Counter

from app.gate.drain import DrainRate
from app.gate.ledger import Ledger, Reservation
from app.gate.queue import AdmissionQueue, QueueFull, Waiter
from app.memory.budget import Budget
from app.memory.calibration import InFlight
from app.memory.demand import Demand
from app.memory.outputs import OutputLengths
from app.metrics import KvgateMetrics
from app.openai import ApiError

BEHIND_QUEUE = "behind_queue"
_IDLE = Ledger()  # never reserved from: the holdings of an idle server


class ClientGone(Exception):
    """The client disconnected while its request waited in the queue."""


class Ticket:
    """An admitted request's reservation; release() is safe to call any number of times."""

    def __init__(self, gate: "Gate", reservation: Reservation, queue_wait_s: float) -> None:
        self._gate = gate
        self.reservation = reservation
        self.queue_wait_s = queue_wait_s

    def end_prefill(self) -> None:
        """The first output token arrived: prefill-only transient memory is free again."""
        if self._gate.ledger.end_prefill(self.reservation):
            self._gate.changed()

    def release(self, outcome: str = "completed", output_tokens: int | None = None) -> None:
        """Give the reservation back; `output_tokens` (all sequences), when known, teaches the
        gate how long answers really are."""
        if self._gate.ledger.release(self.reservation):
            self._gate.released(outcome, self.reservation, output_tokens)


class Gate:
    def __init__(
        self,
        budget: Budget,
        metrics: KvgateMetrics,
        max_queue: int,
        max_queue_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        outputs: OutputLengths | None = None,
    ) -> None:
        self.budget = budget
        self.outputs = outputs  # learned output lengths: the predictor reads, releases teach
        self.ledger = Ledger()
        self.queue = AdmissionQueue(max_queue)
        self.drain = DrainRate(clock=clock)
        self.metrics = metrics
        self.max_queue_wait_s = max_queue_wait_s
        self._clock = clock
        # What telemetry's KV reconciliation needs of each in-flight request (by reservation id).
        self.admitted: dict[int, InFlight] = {}
        self._admit_fits = metrics.decisions.labels("admit", "fits")
        self._releases: dict[str, Counter] = {}  # bound per outcome: labels() is a locked lookup
        self._bind_gauges()
        budget.subscribe(self.changed)

    def _bind_gauges(self) -> None:
        """The gauges of the queue, the ledger and the budget read them when /metrics is
        scraped: written on every admission and release they cost ten gauge writes a request."""
        m = self.metrics
        m.queue_depth.set_function(lambda: len(self.queue))
        m.in_flight.set_function(lambda: self.ledger.in_flight)
        m.reserved_kv_blocks.set_function(lambda: self.ledger.kv_blocks)
        m.reserved_transient.set_function(lambda: self.budget.transient_charge(self.ledger))
        m.budget_kv_blocks.set_function(_last_known(self.budget.kv_limit))
        m.budget_transient.set_function(_last_known(self.budget.transient_limit))

    def would_wait(self, demand: Demand, priority: int) -> str | None:
        """Why this demand would wait if it arrived now, or None if it would be admitted."""
        head = self.queue.peek()
        if head is not None and head.priority <= priority:
            return BEHIND_QUEUE
        return self.budget.shortfall(demand, self.ledger)

    async def acquire(
        self,
        demand: Demand,
        priority: int,
        tenant: str,
        watch_client: Callable[[], asyncio.Future] | None = None,
        refresh: Callable[[], Demand] | None = None,
    ) -> Ticket:
        """Admit now or wait in line; raises ApiError 429 when the queue is full or time runs out.

        `watch_client` is called only if the request has to wait: the future it returns resolves
        when the client disconnects, and the waiter then leaves the queue at once. `refresh`, if
        given, recomputes the demand of a waiting request before each admission check.
        """
        reason = self.would_wait(demand, priority)
        if reason is None:
            self._admit_fits.inc()
            return self._admit(demand, waited_s=0.0)
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            demand, priority, tenant, self._clock(), loop.create_future(), reason=reason, refresh=refresh
        )
        try:
            self.queue.push(waiter)
        except QueueFull:
            self.metrics.decisions.labels("reject", "queue_full").inc()
            raise self._too_busy(
                "queue_full",
                f"kvgate's admission queue is full ({self.queue.max_size} requests waiting).",
                blocks_ahead=self.queue.blocks_ahead(priority) + demand.kv_blocks,
            ) from None
        self.metrics.decisions.labels("queue", reason).inc()
        self.changed()  # sets it aside at once if it could not fit even alone
        gone = watch_client() if watch_client is not None else None
        try:
            return await self._wait(waiter, gone)
        finally:
            if gone is not None:
                gone.cancel()

    async def _wait(self, waiter: Waiter, gone: asyncio.Future | None) -> Ticket:
        waits: set[asyncio.Future] = {waiter.future}
        if gone is not None:
            waits.add(gone)
        try:
            await asyncio.wait(waits, timeout=self.max_queue_wait_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._abandon(waiter)
            raise
        if gone is not None and gone.done():
            self._abandon(waiter)
            self.metrics.disconnects.labels("queued").inc()
            raise ClientGone()
        if waiter.future.done():
            return waiter.future.result()
        ahead = self.queue.blocks_ahead(waiter.priority, waiter.seq) + waiter.demand.kv_blocks
        self._abandon(waiter)
        if self.budget.hold is not None:
            self.metrics.decisions.labels("reject", "backend_unavailable").inc()
            raise ApiError(
                503, f"Waited {self.max_queue_wait_s:g} s for the backend to come back ({self.budget.hold}).",
                "backend_unavailable", headers={"Retry-After": "5"},
            )
        self.metrics.decisions.labels("reject", "queue_timeout").inc()
        raise self._too_busy(
            "queue_timeout",
            f"Waited {self.max_queue_wait_s:g} s for GPU memory ({waiter.reason}) without admission.",
            blocks_ahead=ahead,
        )

    def _abandon(self, waiter: Waiter) -> None:
        """The waiter gives up: leave the queue, or hand back a ticket granted in the meantime."""
        if waiter.future.done():
            waiter.future.result().release("abandoned")
            return
        self.queue.remove(waiter)
        waiter.future.cancel()

    def _too_busy(self, code: str, message: str, blocks_ahead: int) -> ApiError:
        retry_after = self.drain.retry_after(
            blocks_ahead, busy=self.ledger.in_flight > 0, fallback_s=self.max_queue_wait_s
        )
        return ApiError(
            429, f"{message} Retry after {retry_after} s.", code,
            headers={"Retry-After": str(retry_after)},
        )

    def _admit(self, demand: Demand, waited_s: float) -> Ticket:
        ticket = Ticket(self, self.ledger.reserve(demand), waited_s)
        self.admitted[ticket.reservation.id] = InFlight(demand, self._clock())
        self.metrics.queue_wait.observe(waited_s)
        return ticket

    def released(self, outcome: str, reservation: Reservation, output_tokens: int | None = None) -> None:
        self.admitted.pop(reservation.id, None)
        if outcome == "completed" and output_tokens is not None and self.outputs is not None:
            demand = reservation.demand
            self.outputs.observe(demand.max_new_tokens, output_tokens // max(1, demand.sequences))
        self.drain.record(reservation.demand.kv_blocks)
        released = self._releases.get(outcome)
        if released is None:
            released = self._releases[outcome] = self.metrics.releases.labels(outcome)
        released.inc()
        self.changed()

    def changed(self) -> None:
        """The ledger shrank or the budget moved: admit from the head while it fits.

        A head that would not fit even on an idle server is set aside instead of blocking the
        line: nothing kvgate admits or releases makes it fit, only the headroom coming back does
        (a co-tenant leaving), and until then it waits for its deadline beside the line.
        """
        if not self.queue:  # nothing waits, set aside or not (every release comes here)
            return
        self.queue.restore(keep_aside=lambda waiter: self._stranded(_refreshed(waiter)))
        while (head := self.queue.peek()) is not None:
            demand = _refreshed(head)
            if self.budget.shortfall(demand, self.ledger) is None:
                self.queue.pop_head()
                self.metrics.decisions.labels("admit", "dequeued").inc()
                head.future.set_result(self._admit(demand, self._clock() - head.enqueued_at))
            elif self._stranded(demand):
                self.queue.set_aside_head()
            else:
                break

    def _stranded(self, demand: Demand) -> bool:
        """It would wait even with nothing in flight (and not because the backend is down)."""
        return self.budget.hold is None and self.budget.shortfall(demand, _IDLE) is not None



def _last_known(read: Callable[[], int | None]) -> Callable[[], float]:
    """`read()` when it is known, else the last value it had (0 before the first)."""
    last = 0.0

    def value() -> float:
        nonlocal last
        current = read()
        if current is not None:
            last = current
        return last

    return value


def _refreshed(waiter: Waiter) -> Demand:
    """The waiter's demand as kvgate would predict it now (see Waiter.refresh)."""
    if waiter.refresh is not None:
        waiter.demand = waiter.refresh()
    return waiter.demand
