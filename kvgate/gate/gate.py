"""The gate: admit now, wait in the queue, or refuse, and hand out tickets released exactly once.

It is the mechanism; the budget is the policy. It reports each decision and release to its
observers (kvgate.gate.observer) and raises domain errors (kvgate.errors): counting, logging and HTTP
are other layers' business. Whenever the ledger shrinks or the budget moves, the gate admits
from the head of the queue for as long as the head fits. A head that waits for memory gets a
reservation (kvgate/gate/backfill.py): requests behind it that fit now start now if they do not
delay it (EASY backfilling), so the memory the head cannot use yet is not wasted, and a stream
of small requests still cannot starve a large one (docs/queue.md). A head that could not fit
even on an idle server (the headroom shrank under it) is set aside, so that it does not hold up
a line it cannot lead.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from kvgate.errors import BackendDown, ClientGone, KvgateError, QueueFull, QueueTimeout, Refused
from kvgate.gate.backfill import HeadReservation, Passing
from kvgate.gate.budget import Budget
from kvgate.gate.drain import DrainRate, Pace
from kvgate.gate.ledger import Ledger, Reservation
from kvgate.gate.observer import Decision, Observers, Release
from kvgate.gate.queue import AdmissionQueue, Basis, Waiter
from kvgate.gate.queue import QueueFull as QueueAtCapacity
from kvgate.memory.demand import Demand

BEHIND_QUEUE = "behind_queue"
BACKFILLED = "backfilled"  # admitted ahead of a waiting head without delaying it
# Waiters behind the head checked for backfilling on each change: bounds the event loop's work
# a release costs; a request further back waits its turn to come within reach.
BACKFILL_LOOKAHEAD = 256
# A request passes by ending before the head starts only if it would still end first taking this
# many times as long as predicted: backfilled requests enlarge the batch, which slows every step.
ENDS_FIRST_SLACK = 2.0
# Share of its wait (--max-queue-wait, or what was left of it) after which nothing passes the head
# on a prediction any more (rule "ends first"), and companions join only while no request that
# passed on one is still running: backfilling must not be why a large request is refused for
# waiting too long.
HEAD_ALONE_AFTER = 0.5
_IDLE = Ledger()  # never reserved from: the holdings of an idle server
_Refusal = TypeVar("_Refusal", bound=KvgateError)


class Ticket:
    """An admitted request's reservation; release() is safe to call any number of times."""

    def __init__(self, gate: Gate[Any], reservation: Reservation, queue_wait_s: float, line_wait_s: float) -> None:
        self._gate = gate
        self.reservation = reservation
        self.queue_wait_s = queue_wait_s  # from its arrival at kvgate: reading and evaluating it too
        self.line_wait_s = line_wait_s  # in the gate's line alone

    def end_prefill(self) -> None:
        """The first output token arrived: prefill-only transient memory is free again."""
        if self.reservation.first_token_at is None:
            self.reservation.first_token_at = self._gate._clock()
        if self._gate.ledger.end_prefill(self.reservation):
            self._gate.prefill_ended(self.reservation)

    def end_every_prefill(self) -> None:
        """A stream of several engine requests showed a token of each (`Ledger.end_every_prefill`)."""
        if self._gate.ledger.end_every_prefill(self.reservation):
            self._gate.prefill_ended(self.reservation)

    def mark_plain(self) -> None:
        """No first token kvgate sees will end its prefill (it does not stream, or it is several
        engine requests: `Ledger.end_prefill`); vLLM's count of first tokens does
        (kvgate/gate/plain_prefills.py)."""
        self._gate.ledger.mark_plain(self.reservation)

    def release(self, outcome: str = "completed", output_tokens: int | None = None) -> None:
        """Give the reservation back; `output_tokens` (all sequences), when known, goes to the
        observers (kvgate/output_lengths.py learns how long answers really are from it)."""
        if self._gate.ledger.release(self.reservation):
            self._gate.released(outcome, self.reservation, output_tokens)


class Gate(Generic[Basis]):
    """Admission for requests whose demand was estimated from a `Basis` (kvgate: a Prediction).

    `reestimate`, if given, computes a waiting request's demand again from its basis before each
    admission check: what kvgate learned while it waited (output lengths) is what it is admitted
    with. `reestimate_inputs`, if given, names what a re-estimation reads (a value that changes
    whenever it may give another demand): a waiter is estimated again only when it changed. The
    gate never looks inside a basis.
    """

    def __init__(
        self,
        budget: Budget,
        observers: Observers,
        max_queue: int,
        max_queue_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        reestimate: Callable[[Basis], Demand] | None = None,
        reestimate_inputs: Callable[[], Hashable] | None = None,
    ) -> None:
        self.budget = budget
        self._reestimate = reestimate
        self._reestimate_inputs = reestimate_inputs
        self.ledger = Ledger(pool=lambda: self.budget.kv_blocks)
        self.queue: AdmissionQueue[Basis] = AdmissionQueue(max_queue)
        self.drain = DrainRate(clock=clock)
        self.pace = Pace()
        self._reservation: HeadReservation | None = None  # the waiting head's (backfill.py)
        self._aside_weighed_at = -1  # the budget's moves when the set-aside waiters were last weighed
        self.observers = observers
        self.max_queue_wait_s = max_queue_wait_s
        self._clock = clock
        # Requests that wait for the backend before they can even be evaluated (kvgate tokenizes
        # through it): they have no demand yet, so they wait beside the queue, counted in it.
        self._awaiting_backend: set[asyncio.Future[None]] = set()
        self._recheck: asyncio.Handle | None = None  # a `changed` due this turn of the loop (`_changed_soon`)
        self._loop: asyncio.AbstractEventLoop | None = None  # where requests wait (`changed_from_thread`)
        budget.subscribe(self.changed)

    @property
    def waiting(self) -> int:
        """Requests waiting in kvgate's queue: for memory, or for the backend to evaluate them."""
        return len(self.queue) + len(self._awaiting_backend)

    def now(self) -> float:
        """The gate's clock: a request's arrival is stamped with it at the HTTP edge."""
        return self._clock()

    def deadline(self, arrived_at: float) -> float:
        """When a request that arrived at `arrived_at` (the gate's clock) must have been admitted:
        its wait runs from its arrival, reading and evaluating it included."""
        return arrived_at + self.max_queue_wait_s

    def would_wait(self, demand: Demand, priority: int) -> str | None:
        """Why this demand would wait if it arrived now, or None if it would be admitted."""
        head = self.queue.peek()
        if head is not None and head.priority <= priority:
            return None if self._passing(demand) is not None else BEHIND_QUEUE
        return self.budget.shortfall(demand, self.ledger)

    async def acquire(
        self,
        demand: Demand,
        priority: int,
        tenant: str,
        watch_client: Callable[[], asyncio.Future[None]] | None = None,
        basis: Basis | None = None,
        request_id: str = "",
        deadline: float | None = None,
        arrived_at: float | None = None,
    ) -> Ticket:
        """Admit now or wait in line; raises QueueFull, QueueTimeout or BackendDown when refused,
        ClientGone when the client leaves the queue.

        `watch_client` is called only if the request has to wait: the future it returns resolves
        when the client disconnects, and the waiter then leaves the queue at once. `basis`: what
        `demand` was estimated from, re-estimated while it waits (the gate's `reestimate`).
        `request_id` only labels the decisions observers see. `deadline` (the gate's clock) ends
        the wait instead of --max-queue-wait from now: a request that comes back to the queue
        (the backend refused its connection) keeps the deadline it arrived with. `arrived_at`
        (the gate's clock; now if None): when the request reached kvgate, from which its queue
        wait is counted.
        """
        now = self._clock()
        arrived = now if arrived_at is None else arrived_at
        head = self.queue.peek()
        if head is not None and head.priority <= priority:
            ticket = self._backfill(demand, request_id, arrived, now)
            if ticket is not None:
                return ticket
            reason: str | None = BEHIND_QUEUE
        else:
            reason = self.budget.shortfall(demand, self.ledger)
        if reason is None:
            return self._admit(demand, "fits", request_id, arrived, now)
        loop = self._loop = asyncio.get_running_loop()
        wait_s = self.max_queue_wait_s if deadline is None else max(0.0, deadline - now)
        waiter = Waiter(
            demand,
            priority,
            tenant,
            now,
            arrived,
            loop.create_future(),
            reason=reason,
            basis=basis,
            request_id=request_id,
            deadline=now + wait_s,
        )
        try:
            self.queue.push(waiter)
        except QueueAtCapacity:
            retry_after = self._retry_after(self.queue.blocks_ahead(priority, tenant) + demand.kv_blocks)
            raise self._refuse(waiter, QueueFull(self.queue.max_size, retry_after)) from None
        self.observers.decided(Decision("queue", reason, request_id, demand))
        if self.queue.peek() is waiter:  # a new head: set aside at once if it could not fit even alone
            self.changed()
        gone = watch_client() if watch_client is not None else None
        try:
            return await self._wait(waiter, gone, wait_s)
        finally:
            if gone is not None:
                gone.cancel()

    async def _wait(self, waiter: Waiter[Basis], gone: asyncio.Future[None] | None, wait_s: float) -> Ticket:
        waits: set[asyncio.Future[Any]] = {waiter.future}
        if gone is not None:
            waits.add(gone)
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._abandon(waiter)
            raise
        if gone is not None and gone.done():
            self._abandon(waiter)
            self.observers.decided(
                Decision("abandon", ClientGone.code, waiter.request_id, waiter.demand, stage="queued")
            )
            raise ClientGone()
        if waiter.future.done():
            result: Ticket = waiter.future.result()
            return result
        ahead = self.queue.blocks_ahead(waiter.priority, waiter.tenant, waiter) + waiter.demand.kv_blocks
        self._abandon(waiter)
        if self.budget.hold is not None:
            raise self._refuse(waiter, self._backend_still_down(wait_s))
        retry_after = self._retry_after(ahead)
        raise self._refuse(waiter, QueueTimeout(self.max_queue_wait_s, self._where_the_wait_went(waiter), retry_after))

    def _where_the_wait_went(self, waiter: Waiter[Basis]) -> str:
        """The refusal's reason, and how much of the wait the queue had: a request's deadline runs
        from its arrival, and reading and evaluating it (tokenizing through the backend when
        kvgate has no tokenizer files) can use most of it (benchmark S4 under load: 931 of 1,134
        queued requests had lost over 5 s of their 30 s before they reached the queue)."""
        queued_s = self._clock() - waiter.enqueued_at
        if self.max_queue_wait_s - queued_s < 1.0:
            return waiter.reason
        return f"{waiter.reason}; {queued_s:.1f} s of it in the queue, the rest reading and evaluating the request"

    async def wait_for_backend(
        self,
        deadline: float,
        watch_client: Callable[[], asyncio.Future[None]] | None = None,
        request_id: str = "",
    ) -> None:
        """Wait in the queue until the backend is up again: a request kvgate cannot evaluate while
        it is down (kvgate tokenizes through its /tokenize) waits as one it has evaluated would,
        until its `deadline`. Raises BackendDown then (with the outage's Retry-After), QueueFull
        if the queue is full, ClientGone if the client leaves."""
        hold = self.budget.hold
        if hold is None:
            return
        if self.waiting >= self.queue.max_size:
            error: Refused = QueueFull(self.queue.max_size, self.budget.backend.retry_after_s())
            self.observers.decided(Decision("reject", error.code, request_id, error=error))
            raise error
        up: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._awaiting_backend.add(up)
        self.observers.decided(Decision("queue", hold, request_id))
        gone = watch_client() if watch_client is not None else None
        timeout = max(0.0, deadline - self._clock())
        try:
            await asyncio.wait(
                {up} if gone is None else {up, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._awaiting_backend.discard(up)
            up.cancel()
            if gone is not None:
                gone.cancel()
        if gone is not None and gone.done() and not gone.cancelled():
            self.observers.decided(Decision("abandon", ClientGone.code, request_id, stage="queued"))
            raise ClientGone()
        if self.budget.hold is not None:
            error = self._backend_still_down(timeout)
            self.observers.decided(Decision("reject", error.code, request_id, error=error))
            raise error

    def _backend_still_down(self, waited_s: float) -> BackendDown:
        backend = self.budget.backend
        return BackendDown(
            f"Waited {waited_s:g} s for the backend to come back: it has been {backend.status} for "
            f"{backend.clock() - backend.since:.0f} s ({backend.why or self.budget.hold}).",
            backend.retry_after_s(),
        )

    def _refuse(self, waiter: Waiter[Basis], error: _Refusal) -> _Refusal:
        """Report the refusal to the observers and hand back the error to raise."""
        self.observers.decided(Decision("reject", error.code, waiter.request_id, waiter.demand, error=error))
        return error

    def _retry_after(self, blocks_ahead: int) -> int:
        """Seconds until `blocks_ahead` KV blocks have drained at the observed rate (kvgate.gate.drain),
        and no later than the last deadline in the queue: by then every waiter now in front has
        been admitted or refused. Before the first release the rate is unknown and the estimate
        is the cap (600 s), while a full queue is gone within --max-queue-wait (benchmark S4:
        49 `queue_full` refusals 8 s into a spike were told 600 s; that line was gone by 38 s)."""
        estimate = self.drain.retry_after(
            blocks_ahead, busy=self.ledger.in_flight > 0, fallback_s=self.max_queue_wait_s
        )
        last = self.queue.last_deadline()
        if last is None or not math.isfinite(last):
            return estimate
        return max(1, min(estimate, math.ceil(last - self._clock())))

    def _abandon(self, waiter: Waiter[Basis]) -> None:
        """The waiter gives up: leave the queue, or hand back a ticket granted in the meantime."""
        if waiter.future.done():
            waiter.future.result().release("abandoned")
            return
        was_head = self.queue.peek() is waiter
        self.queue.remove(waiter)
        waiter.future.cancel()
        if was_head:  # the line behind it moves up
            self._changed_soon()

    def _admit(self, demand: Demand, reason: str, request_id: str, arrived_at: float, enqueued_at: float) -> Ticket:
        """Reserve and report; the queue wait counts from the request's arrival at kvgate."""
        now = self._clock()
        ticket = Ticket(self, self.ledger.reserve(demand), now - arrived_at, now - enqueued_at)
        ticket.reservation.admitted_at = now
        self.budget.forget_idle_cache()  # its steps will grow the cache the last idle reading saw
        if self.budget.releases_warmup_cache(self.ledger):  # from now on V1 steps meet any cache
            self.ledger.warmup_released = True
        self.observers.decided(Decision("admit", reason, request_id, demand, ticket.reservation, now - arrived_at))
        return ticket

    def released(self, outcome: str, reservation: Reservation, output_tokens: int | None = None) -> None:
        if outcome != "requeued":  # never reached the backend: nothing drained
            self.drain.record(reservation.demand.kv_blocks)
        if outcome == "completed" and output_tokens:
            demand, first = reservation.demand, reservation.first_token_at
            self.pace.record(
                self._clock() - reservation.admitted_at,
                output_tokens / demand.sequences,
                demand.prompt_tokens,
                None if first is None else first - reservation.admitted_at,
            )
        if self._reservation is not None:
            self._reservation.released(reservation)
        self.observers.released(Release(outcome, reservation, output_tokens))
        self._changed_soon()

    def prefill_ended(self, reservation: Reservation) -> None:
        """An admitted request's prefill-only terms are gone: from its companion copy in the head's
        reservation too (the head is to run beside it decoding), then admit what fits."""
        if self._reservation is not None:
            self._reservation.prefill_ended(reservation)
        self._changed_soon()

    def prefill_relieved(self) -> None:
        """vLLM's count says more plain prefills have ended (kvgate/gate/plain_prefills.py): admit
        what fits now. Not who: the head's companions keep them all (the safe side)."""
        self._changed_soon()

    def changed_from_thread(self) -> None:
        """`changed` on the loop the requests wait on, called from another thread: a worker that
        has learned something the budget asks of it (kvgate/memory/activation.py `SharedForward`'s
        level of a headroom, which it answers no to until known). Without it the requests waiting
        on that cautious answer waited for the next release or arrival. Coalesced with that turn's
        other events (`_changed_soon`); nothing has waited yet: nothing to wake."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._budget_learned)

    def _budget_learned(self) -> None:
        """The budget answers something anew without a move of its limits (a replay worked out):
        the set-aside waiters are weighed again too."""
        self._aside_weighed_at = -1
        self._changed_soon()

    def _changed_soon(self) -> None:
        """`changed`, once the event loop has handled the events already due: an engine step ends
        many streams and starts many more at once, and each release or first token re-checked
        the whole queue (the head and up to BACKFILL_LOOKAHEAD waiters behind it, a budget check
        each). In benchmark S4 (1,500 chats in 5 s, a queue of hundreds) those checks were half
        of kvgate's CPU, which was saturated, so requests waited to be read at all; a head that
        timed out re-checked it too. The ledger (or the line) has already changed when this is
        called; only the re-check waits, for one turn of the loop, and serves every release,
        first token and departed head of that turn. Without a running loop
        (a synchronous caller) it runs at once."""
        if self._recheck is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.changed()
            return
        self._recheck = loop.call_soon(self.changed)

    def changed(self) -> None:
        """The ledger shrank or the budget moved: admit from the head while it fits.

        A head that would not fit even on an idle server is set aside instead of blocking the
        line: nothing kvgate admits or releases makes it fit, only the headroom coming back does
        (a co-tenant leaving), and until then it waits for its deadline beside the line.
        """
        if self._recheck is not None:  # this check serves a deferred one (`_changed_soon`)
            self._recheck.cancel()
            self._recheck = None
        if self._awaiting_backend and self.budget.hold is None:
            for up in self._awaiting_backend:
                if not up.done():
                    up.set_result(None)
        if not self.queue:  # nothing waits, set aside or not (every release comes here)
            self._reservation = None
            return
        if self._aside_weighed_at != self.budget.moves:  # only the budget's moves let them fit alone
            self._aside_weighed_at = self.budget.moves
            self.queue.restore(keep_aside=self._kept_aside)
        while (head := self.queue.peek()) is not None:
            demand = self._refreshed(head)
            if self.budget.shortfall(demand, self.ledger) is None:
                self.queue.pop_head()
                head.future.set_result(
                    self._admit(demand, "dequeued", head.request_id, head.arrived_at, head.enqueued_at)
                )
            elif self._stranded(demand, head.deadline):
                self.queue.set_aside_head()
                self._refuse_if_outgrown(head, demand)
            else:
                break
        self._backfill_queue()

    def _backfill_queue(self) -> None:
        """Admit the waiters behind the waiting head that may pass it (kvgate/gate/backfill.py),
        in the line's order: priority, tenants' turns, arrival."""
        if self.queue.peek() is None or self.budget.hold is not None:
            return
        for waiter in self.queue.behind_head(BACKFILL_LOOKAHEAD):
            if self._pool_full():
                return
            ticket = self._backfill(self._refreshed(waiter), waiter.request_id, waiter.arrived_at, waiter.enqueued_at)
            if ticket is not None:
                self.queue.take(waiter)
                waiter.future.set_result(ticket)

    def _backfill(self, demand: Demand, request_id: str, arrived_at: float, enqueued_at: float) -> Ticket | None:
        """Admit a demand ahead of the waiting head if it may pass it; None if it waits its turn."""
        passing = self._passing(demand)
        if passing is None:
            return None
        ticket = self._admit(demand, BACKFILLED, request_id, arrived_at, enqueued_at)
        if self._reservation is not None:
            if passing == "beside":
                self._reservation.joined(ticket.reservation)
            else:
                self._reservation.passed_first(ticket.reservation)
        return ticket

    def _passing(self, demand: Demand) -> Passing | None:
        """How a demand may pass the head waiting for memory now, or None if it waits its turn.
        Cheap checks first: while the line is long most waiters are turned down by them."""
        head = self.queue.peek()
        if head is None or self.budget.hold is not None or not self._kv_room(demand):
            return None
        now = self._clock()
        reservation = self._head_reservation(head)
        if now >= head.enqueued_at + (head.deadline - head.enqueued_at) * HEAD_ALONE_AFTER:
            # The head has used most of its wait: no more predictions. A companion still may
            # join, since the head fits beside the companions whatever they are, unless one that
            # passed on a prediction still runs: the head would wait for it beside them.
            if reservation.overrunning:
                return None
            ends_at = None
        else:
            duration = self.pace.duration_s(demand.reserved_tokens, demand.prompt_tokens)
            ends_at = None if duration is None else now + ENDS_FIRST_SLACK * duration
        # Whether it fits now first: a budget check, where the head's trial reserves it beside
        # the companions and checks the head (in S4's line, 13 % of kvgate's CPU against 2 %).
        if self.budget.shortfall(demand, self.ledger) is not None:
            return None
        return reservation.passing(demand, ends_at, head.demand, self.budget)

    def _pool_full(self) -> bool:
        """Every KV block the budget allows is reserved: nothing more fits now."""
        kv_limit = self.budget.kv_limit()
        return kv_limit is not None and kv_limit > 0 and self.ledger.kv_blocks >= kv_limit

    def _kv_room(self, demand: Demand) -> bool:
        """Whether the pool has room for the demand's private blocks, which are always new to it
        (the budget charges at most its limit): a necessary condition for fitting now."""
        kv_limit = self.budget.kv_limit()
        if kv_limit is None or kv_limit <= 0:
            return True
        return min(demand.private_blocks, kv_limit) <= kv_limit - self.ledger.kv_blocks

    def _head_reservation(self, head: Waiter[Basis]) -> HeadReservation:
        """The head's reservation: made the first time a request may pass it, then kept (fixed)
        for as long as it is the head."""
        if self._reservation is None or self._reservation.head is not head:
            self._reservation = HeadReservation.plan(
                head, head.demand, self.ledger, self.budget, self._ends_at, self._clock()
            )
        return self._reservation

    def _ends_at(self, reservation: Reservation) -> float | None:
        """When an in-flight request is predicted to end (None: nothing learned yet)."""
        demand = reservation.demand
        duration = self.pace.duration_s(demand.reserved_tokens, demand.prompt_tokens)
        return None if duration is None else max(self._clock(), reservation.admitted_at + duration)

    def _stranded(self, demand: Demand, deadline: float) -> bool:
        """It would wait even with nothing in flight (and not because the backend is down), and
        draining the engine would not let it in by its deadline. A long prompt that runs only from
        an idle engine's cache (held-out H8b's and H1's: `Budget.fits_once_drained`) is not
        stranded while the requests in flight are predicted to end in time: it heads the line,
        the requests behind it pass only where they end before those in flight
        (kvgate/gate/backfill.py), and the idle reading that follows lets it in. Set aside, it
        waited beside a line that never let the engine go idle, and timed out."""
        if self.budget.hold is not None or self.budget.shortfall(demand, _IDLE) is None:
            return False
        return not (self.budget.fits_once_drained(demand, _IDLE) and self._drained_by(deadline))

    def _kept_aside(self, waiter: Waiter[Basis]) -> bool:
        """Whether a set-aside waiter stays out of the line: still stranded, or refused now (it
        then leaves the queue), its demand estimated once for both."""
        demand = self._refreshed(waiter)
        return self._refuse_if_outgrown(waiter, demand) or self._stranded(demand, waiter.deadline)

    def _refuse_if_outgrown(self, waiter: Waiter[Basis], demand: Demand) -> bool:
        """Refuse a set-aside waiter now where no wait on this engine lets it in (`Budget.outgrown`),
        instead of at its deadline with a Retry-After no retry before a restart could honour.
        Whether it was refused."""
        error = self.budget.outgrown(demand)
        if error is None or not self.queue.remove(waiter):
            return False
        waiter.future.set_exception(self._refuse(waiter, error))
        return True

    def _drained_by(self, deadline: float) -> bool:
        """Whether the requests in flight are predicted to have ended by `deadline` (unknown: yes)."""
        ends = [self._ends_at(reservation) for reservation in self.ledger.reservations()]
        known = [end for end in ends if end is not None]
        return len(known) < len(ends) or max(known, default=self._clock()) <= deadline

    def _refreshed(self, waiter: Waiter[Basis]) -> Demand:
        """The waiter's demand as kvgate would estimate it now (see `reestimate`); not estimated
        again while what the estimate reads is unchanged (`reestimate_inputs`): in benchmark S13's
        line of ~200 waiters the re-estimates were a third of each backfill scan's CPU."""
        if self._reestimate is None or waiter.basis is None:
            return waiter.demand
        inputs = None if self._reestimate_inputs is None else self._reestimate_inputs()
        if inputs is None or inputs != waiter.estimated_with:
            waiter.demand = self._reestimate(waiter.basis)
            waiter.estimated_with = inputs
        return waiter.demand
