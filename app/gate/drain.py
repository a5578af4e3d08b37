"""How fast admitted requests finish, so Retry-After tells the truth instead of a constant."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable


class DrainRate:
    """Completions per second over a sliding window of recent releases."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._releases: deque[float] = deque()
        self._started = clock()

    def record(self) -> None:
        """One release. Releases older than the window go as new ones come, not only when a
        refusal asks for the rate: the window holds ~30 s of releases, not all since start-up."""
        now = self._clock()
        self._forget_before(now)
        self._releases.append(now)

    def rate(self) -> float | None:
        """Releases per second seen lately, or None before any was seen."""
        now = self._clock()
        self._forget_before(now)
        if not self._releases:
            return None
        span = min(self.window_s, max(now - self._started, 1e-3))
        return len(self._releases) / span

    def _forget_before(self, now: float) -> None:
        releases = self._releases
        while releases and now - releases[0] > self.window_s:
            releases.popleft()

    def retry_after(self, ahead: int, fallback_s: float, cap_s: float = 600.0) -> int:
        """Whole seconds until `ahead` more requests have drained at the observed rate."""
        rate = self.rate()
        seconds = fallback_s if rate is None else (ahead + 1) / rate
        return max(1, min(math.ceil(seconds), math.ceil(cap_s)))
