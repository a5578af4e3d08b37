"""What kvgate knows of the backend right now: up, down or hung, since when and why.

One object, shared: the budget holds admissions on it, `/readyz` reports it, the telemetry loop
sets it from its scrapes and the proxy from connections the backend refused. Before there was
one, `/readyz` probed `/health` on its own and could say 503 while the budget, waiting for the
next scrape, still admitted requests that were then forwarded to a dead socket.

- starting: the backend's configuration has not been learned yet (kvgate is not ready anyway).
- up: the last scrape answered.
- down: the backend refused connections or answered 5xx, on /metrics and /health alike, or a
  connection for a request was refused (nothing was sent).
- hung: it accepts connections but answers nothing: the scrape of /metrics timed out (after
  `--max-staleness`) and /health did not answer within its own timeout either (a SIGSTOPped or
  wedged server). Requests already sent wait for it; new ones wait in kvgate's queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["starting", "up", "down", "hung"]


@dataclass
class BackendState:
    status: Status = "up"
    why: str | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    since: float = field(init=False)

    def __post_init__(self) -> None:
        self.since = self.clock()

    @property
    def up(self) -> bool:
        return self.status == "up"

    def set(self, status: Status, why: str | None = None) -> bool:
        """Record the backend's status; True when it changed (`since` restarts then)."""
        self.why = why
        if status == self.status:
            return False
        self.status, self.since = status, self.clock()
        return True

    def detail(self) -> dict[str, object]:
        """What /readyz says of the backend."""
        return {"status": self.status, "for_s": round(self.clock() - self.since, 3), "why": self.why}
