"""What the gate tells the rest of kvgate: each decision and each release, as plain events.

The gate only decides; counting (Prometheus), logging, telemetry's in-flight view and learning
how long answers are (kvgate/output_lengths.py) are observers of these events, so the gate imports
none of them and each event is counted once, by whoever observes it. Refusals made before the gate (a malformed body, a prompt that never fits)
are reported to the same observers by the HTTP handler, so every decision a client meets goes
through one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from kvgate.errors import KvgateError
from kvgate.gate.ledger import Reservation
from kvgate.memory.demand import Demand

DecisionKind = Literal["admit", "queue", "reject", "abandon"]


# Not frozen: a frozen dataclass is built through object.__setattr__, ~3 us an event on the
# 2-core machine, paid twice per request; observers only read them.
@dataclass(slots=True)
class Decision:
    """One decision about one request. `reason`: why (fits, dequeued, a shortfall, an error code);
    `stage`: where an abandoning client was (queued, request_body)."""

    kind: DecisionKind
    reason: str
    request_id: str = ""
    demand: Demand | None = None
    reservation: Reservation | None = None  # set on admission
    queue_wait_s: float = 0.0
    error: KvgateError | None = None  # set on rejection
    stage: str = ""


@dataclass(slots=True)
class Release:
    """An admitted request gave its reservation back; `output_tokens` when it is known."""

    outcome: str
    reservation: Reservation
    output_tokens: int | None = None


class GateObserver(Protocol):
    def decided(self, decision: Decision) -> None: ...

    def released(self, release: Release) -> None: ...


class Observers:
    """Fans each event out to every observer, in the order they were given."""

    def __init__(self, *observers: GateObserver) -> None:
        self._observers = observers

    def decided(self, decision: Decision) -> None:
        for observer in self._observers:
            observer.decided(decision)

    def released(self, release: Release) -> None:
        for observer in self._observers:
            observer.released(release)
