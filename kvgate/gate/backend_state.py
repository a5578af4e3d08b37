"""What kvgate knows of the backend right now: up, down or hung, since when and why.

One object, shared: the budget holds admissions on it, `/readyz` reports it, the telemetry loop
sets it from its scrapes and the proxy from connections the backend refused. Before there was
one, `/readyz` probed `/health` on its own and could say 503 while the budget, waiting for the
next scrape, still admitted requests that were then forwarded to a dead socket.

- starting: the backend's configuration has not been learned yet (kvgate is not ready anyway).
- up: the last scrape answered.
- down: the backend refused connections or answered 5xx, on /metrics and /health alike, or a
  connection for a request (or for kvgate's /tokenize call) was refused (nothing was sent). A
  connection not accepted in time is not set here: under a burst that is the backend's full
  accept queue, backpressure (errors.BackendBusy), and the request is sent again; a backend that
  really stopped answering fails its /metrics and /health too, and the telemetry loop sets it.
- hung: it accepts connections but answers nothing: the scrape of /metrics timed out (after
  `--max-staleness`) and /health did not answer within its own timeout either (a SIGSTOPped or
  wedged server). Requests already sent wait for it; new ones wait in kvgate's queue.

It also remembers how long the backend's recent outages (down or hung, until up again) lasted,
so that a request refused during one is told an honest Retry-After: a vLLM restart after an OOM
(load the weights, profile, capture graphs) takes about as long each time for one model and
GPU, so the longest of the last few is what is left of this one, less the time it has lasted.
Until one outage has ended, or once this one outlasts every one seen, kvgate cannot know and
says a short default.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvgate.gate.drain import RETRY_AFTER_CAP_S

Status = Literal["starting", "up", "down", "hung"]
_OUT: frozenset[Status] = frozenset({"down", "hung"})
OUTAGES_KEPT = 5
UNKNOWN_OUTAGE_RETRY_S = 5


@dataclass
class BackendState:
    status: Status = "up"
    why: str | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    since: float = field(init=False)
    outages_s: deque[float] = field(default_factory=lambda: deque(maxlen=OUTAGES_KEPT), repr=False)

    def __post_init__(self) -> None:
        self.since = self.clock()

    @property
    def up(self) -> bool:
        return self.status == "up"

    def set(self, status: Status, why: str | None = None) -> bool:
        """Record the backend's status; True when it changed (`since` restarts then, but not
        between down and hung: that is one outage)."""
        self.why = why
        if status == self.status:
            return False
        now = self.clock()
        if status == "up" and self.status in _OUT:
            self.outages_s.append(now - self.since)
        if not (status in _OUT and self.status in _OUT):  # down <-> hung: one outage, timed from its start
            self.since = now
        self.status = status
        return True

    def retry_after_s(self) -> int:
        """Seconds until the backend is likely up again: the longest recent outage less the time
        this one has lasted (at least 1 s, at most kvgate's cap); the default while none is known."""
        if self.status not in _OUT or not self.outages_s:
            return UNKNOWN_OUTAGE_RETRY_S
        left = max(self.outages_s) - (self.clock() - self.since)
        if left <= 0:
            return UNKNOWN_OUTAGE_RETRY_S
        return int(min(RETRY_AFTER_CAP_S, max(1, math.ceil(left))))

    def detail(self) -> dict[str, object]:
        """What /readyz says of the backend."""
        return {"status": self.status, "for_s": round(self.clock() - self.since, 3), "why": self.why}
