"""The bounded admission queue: priority first, then round-robin across tenants, then arrival.

Priority follows vLLM's convention (a lower value is served earlier). Inside one priority level
each tenant has its own FIFO and tenants take turns, so one tenant's burst cannot starve another
tenant's single request. The queue only orders; the gate decides when the head may go, which
waiters behind it may pass it (backfilling, in this order), and sets aside a head that could not go even on an idle server (a co-tenant took the memory it needs):
such a waiter blocks nobody, and goes back to the front of the line once it could fit again.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvgate.memory.demand import Demand

# What a waiter's demand was estimated from: opaque to the gate, handed back to its re-estimation.
Basis = TypeVar("Basis")


@dataclass(eq=False)
class Waiter(Generic[Basis]):
    """A request waiting for admission; its future resolves when the gate admits it."""

    demand: Demand
    priority: int
    tenant: str
    enqueued_at: float
    arrived_at: float  # when it reached kvgate (the gate's clock): its queue wait counts from there
    future: asyncio.Future[Any] = field(repr=False)
    seq: int = 0
    reason: str = ""
    # What the demand was estimated from: the gate re-estimates it with what kvgate learned while
    # it waited (output lengths).
    basis: Basis | None = field(default=None, repr=False)
    # What the re-estimation read when the demand was last estimated from the basis (Gate's
    # `reestimate_inputs`); None: not estimated again yet.
    estimated_with: Hashable | None = field(default=None, repr=False)
    request_id: str = ""  # labels the gate's decisions for observers (the decision log)
    deadline: float = float("inf")  # when it stops waiting (the gate's clock)


class QueueFull(Exception):
    """The queue already holds max_queue requests."""


class AdmissionQueue(Generic[Basis]):
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._levels: dict[int, OrderedDict[str, deque[Waiter[Basis]]]] = {}
        self._size = 0  # set-aside waiters included
        self._aside: list[Waiter[Basis]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._size

    def push(self, waiter: Waiter[Basis]) -> None:
        if self._size >= self.max_size:
            raise QueueFull()
        waiter.seq = next(self._seq)
        tenants = self._levels.setdefault(waiter.priority, OrderedDict())
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self._size += 1

    def peek(self) -> Waiter[Basis] | None:
        """The next waiter to admit: best priority level, the tenant whose turn it is, oldest."""
        if not self._levels:
            return None
        tenants = self._levels[min(self._levels)]
        return next(iter(tenants.values()))[0]

    def pop_head(self) -> Waiter[Basis]:
        """Remove the peeked waiter and pass the turn to the next tenant of its level."""
        priority = min(self._levels)
        tenants = self._levels[priority]
        tenant, waiters = next(iter(tenants.items()))
        waiter = waiters.popleft()
        if waiters:
            tenants.move_to_end(tenant)
        else:
            del tenants[tenant]
        if not tenants:
            del self._levels[priority]
        self._size -= 1
        return waiter

    def behind_head(self, limit: int) -> list[Waiter[Basis]]:
        """Up to `limit` waiters after the head, in the order they would be admitted: priority
        levels, then tenants' turns (each tenant's first, then each one's second, ...), then
        arrival. Set-aside waiters are not in the line."""
        return list(itertools.islice(self._in_order(), 1, 1 + limit))

    def _in_order(self) -> Iterator[Waiter[Basis]]:
        for level in sorted(self._levels):
            yield from _turns(self._levels[level])

    def take(self, waiter: Waiter[Basis]) -> None:
        """Remove a waiter admitted before its turn (backfilled): its tenant has had a turn and
        goes to the back of its level, unless its line holds the head."""
        tenants = self._levels.get(waiter.priority)
        self.remove(waiter)
        if tenants and waiter.tenant in tenants and next(iter(tenants)) != waiter.tenant:
            tenants.move_to_end(waiter.tenant)

    def set_aside_head(self) -> None:
        """Move the head out of the line; it stays counted until it leaves or is restored."""
        self._aside.append(self.pop_head())
        self._size += 1

    def restore(self, keep_aside: Callable[[Waiter[Basis]], bool]) -> None:
        """Put set-aside waiters back at the front of their tenant's line, oldest first, but those
        `keep_aside` keeps (which may also take one out of the queue: it walks a copy)."""
        for waiter in reversed(list(self._aside)):
            if keep_aside(waiter):
                continue
            self._aside.remove(waiter)
            tenants = self._levels.setdefault(waiter.priority, OrderedDict())
            tenants.setdefault(waiter.tenant, deque()).appendleft(waiter)
            tenants.move_to_end(waiter.tenant, last=False)

    def remove(self, waiter: Waiter[Basis]) -> bool:
        """Take out a waiter that gave up (deadline, disconnect); False if it is not queued."""
        if waiter in self._aside:
            self._aside.remove(waiter)
            self._size -= 1
            return True
        tenants = self._levels.get(waiter.priority)
        waiters = tenants.get(waiter.tenant) if tenants else None
        if not tenants or not waiters or waiter not in waiters:
            return False
        waiters.remove(waiter)
        if not waiters:
            del tenants[waiter.tenant]
            if not tenants:
                del self._levels[waiter.priority]
        self._size -= 1
        return True

    def last_deadline(self) -> float | None:
        """The latest deadline of the waiters queued now, set-aside ones included (None: nobody
        waits). Every one of them has left the queue by then, admitted or refused: the line in
        front of any request cannot outlast it, which bounds a Retry-After."""
        lines = (waiter for tenants in self._levels.values() for line in tenants.values() for waiter in line)
        return max((waiter.deadline for waiter in itertools.chain(self._aside, lines)), default=None)

    def blocks_ahead(self, priority: int, tenant: str, waiter: Waiter[Basis] | None = None) -> int:
        """KV blocks demanded by the waiters admitted before `waiter` in the line's order
        (priority, tenants' turns, arrival), or, without one, before a request of `priority` and
        `tenant` arriving now: behind its tenant's line, a tenant new to its level taking the
        last turn. For Retry-After: the real line, not arrival order (a tenant's first request
        goes before another tenant's hundredth)."""
        ahead = 0
        for level in sorted(self._levels):
            if level > priority:
                break
            lines = self._levels[level]
            if level < priority:
                ahead += sum(other.demand.kv_blocks for line in lines.values() for other in line)
                continue
            if waiter is not None:
                for other in _turns(lines):
                    if other is waiter:
                        break
                    ahead += other.demand.kv_blocks
                continue
            own = lines.get(tenant)
            depth = len(own) if own else 0
            position = list(lines).index(tenant) if own else len(lines)
            for k, line in enumerate(lines.values()):
                turns = min(len(line), depth + 1 if k < position else depth)
                ahead += sum(other.demand.kv_blocks for other in itertools.islice(line, turns))
        return ahead


def _turns(lines: OrderedDict[str, deque[Waiter[Basis]]]) -> Iterator[Waiter[Basis]]:
    """One priority level's waiters in admission order: each tenant's first, in turn order, then
    each one's second, ..."""
    queued = list(lines.values())
    for depth in itertools.count():
        turn = [line[depth] for line in queued if depth < len(line)]
        if not turn:
            return
        yield from turn
