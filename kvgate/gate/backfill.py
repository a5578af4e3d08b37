"""Backfilling: which requests may start ahead of a head that waits for memory, without delaying it.

A strict line wastes the memory a waiting head cannot use yet: in the 2026-11-24 benchmark 125
requests that would each have fit waited behind one that did not (issue 24). Batch schedulers
solve the same problem with EASY backfilling (Lifka, 1995; Slurm's and Maui's default): the head
gets a reservation, the earliest moment it is predicted to fit, and a job behind it may start
now if it does not push that moment back. Here the head's reservation is

- `start`: when enough of the in-flight requests are predicted to have ended for the head to
  fit (kvgate.gate.drain.Pace predicts when each ends), and
- `companions`: the in-flight requests predicted to still run then, in a ledger of their own,
  beside which the head fits.

A request behind the head that fits now may start now if it is predicted to end by `start`
(it is gone before the head needs its memory), or if the head still fits beside the companions
with it added (it then becomes a companion: the head's reservation has room for it). Until one
request has completed nothing can be predicted: `start` is unknown, every in-flight request is
counted as ending before the head starts, and only the second rule admits.

The reservation is fixed when the request becomes the head and is never moved later, which is
why the head cannot starve (docs/queue.md): after `start` the first rule admits nobody, and the
second admits only what leaves the head room beside it, so once the requests in flight at
`start` that are not companions have ended (a fixed, finite set: each ends with its max_tokens),
the head fits. A wrong prediction can delay the head by the time the finite set overran; it
cannot keep it waiting beyond that. Past half of the head's wait (kvgate/gate/gate.py
HEAD_ALONE_AFTER) the first rule is off and the second admits only while no request that passed
by the first still runs (`overrunning`): the head then waits for the in-flight requests that are
not companions alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger, Reservation
from kvgate.memory.demand import Demand

# How a request passes the head: it ends before the head starts, or runs beside it.
Passing = Literal["ends_first", "beside"]


class HeadReservation:
    """The waiting head's reservation: when it starts and beside whom (see the module's docstring)."""

    def __init__(self, head: object, start: float | None, companions: Ledger, copies: dict[int, Reservation]) -> None:
        self.head = head  # the waiter it was made for (the gate makes a new one for a new head)
        self.start = start
        self.companions = companions
        self._copies = copies  # an in-flight reservation's id -> its copy among the companions
        self._ends_first: set[int] = set()  # requests that passed predicted to end by `start`, still running

    @classmethod
    def plan(
        cls,
        head: object,
        head_demand: Demand,
        ledger: Ledger,
        budget: Budget,
        ends_at: Callable[[Reservation], float | None],
        now: float,
    ) -> HeadReservation:
        """The earliest moment `head_demand` fits once the in-flight requests of `ledger` (the
        gate's) end in their predicted order, and those still running then. With any end unknown:
        no start, no companions.

        The companions start as a copy of the ledger (`Ledger.copy`) and are given back, earliest
        end first, while the pool could not hold the head's private blocks beside them, then
        until the budget says the head fits (fitting only gets easier as companions leave): so it
        costs about one budget check while the head waits for KV blocks."""
        in_flight = ledger.reservations()
        ends = [ends_at(reservation) for reservation in in_flight]
        known = [(end, reservation) for end, reservation in zip(ends, in_flight, strict=True) if end is not None]
        if not known or len(known) < len(in_flight):
            empty = Ledger(
                pool=lambda: budget.kv_blocks,
                peak_segment_rows=ledger.peak_segment_rows,
                snapshots=False,
                warmup_released=ledger.warmup_released,
            )
            return cls(head, None, empty, {})
        known.sort(key=lambda pair: pair[0])
        companions = ledger.copy()
        copies = {reservation.id: companions.reservation(reservation.id) for _, reservation in known}
        kv_limit = budget.kv_limit()
        head_private = 0 if kv_limit is None else min(head_demand.private_blocks, max(kv_limit, 0))
        start = now
        for end, reservation in known:  # the earliest end still among the companions first
            kv_short = kv_limit is not None and companions.kv_blocks + head_private > kv_limit
            if not kv_short and budget.shortfall(head_demand, companions) is None:
                break
            companions.release(copies.pop(reservation.id))  # the head waits for it
            start = max(start, end)
        return cls(head, start, companions, copies)

    def passing(self, demand: Demand, ends_at: float | None, head_demand: Demand, budget: Budget) -> Passing | None:
        """How a request that fits now may pass the head, or None if it would delay it."""
        if self.start is not None and ends_at is not None and ends_at <= self.start:
            return "ends_first"
        kv_limit = budget.kv_limit()
        if kv_limit is not None and kv_limit > 0:  # a cheap no first: private blocks are always new
            private = min(demand.private_blocks, kv_limit) + min(head_demand.private_blocks, kv_limit)
            if self.companions.kv_blocks + private > kv_limit:
                return None
        trial = self.companions.reserve(demand)
        fits = budget.shortfall(head_demand, self.companions) is None
        self.companions.release(trial)
        return "beside" if fits else None

    def joined(self, reservation: Reservation) -> None:
        """A request admitted to run beside the head: the head's reservation now makes room for it."""
        self._copies[reservation.id] = self.companions.reserve(reservation.demand)

    def passed_first(self, reservation: Reservation) -> None:
        """A request admitted as predicted to end before the head starts."""
        self._ends_first.add(reservation.id)

    @property
    def overrunning(self) -> bool:
        """Whether a request that passed on a prediction still runs (once `start` has come, it
        overran it)."""
        return bool(self._ends_first)

    def prefill_ended(self, reservation: Reservation) -> None:
        """An in-flight request's prefill ended: if the head is to run beside it, beside it decoding
        (a companion copied while it prefilled kept its prefill terms until now)."""
        copy = self._copies.get(reservation.id)
        if copy is not None:
            self.companions.end_prefill(copy)

    def released(self, reservation: Reservation) -> None:
        """An in-flight request ended: if the head was to run beside it, that room is free again."""
        self._ends_first.discard(reservation.id)
        copy = self._copies.pop(reservation.id, None)
        if copy is not None:
            self.companions.release(copy)
