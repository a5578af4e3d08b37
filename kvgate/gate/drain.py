"""How fast admitted work drains, so Retry-After tells the wait a refused request really faces.

Work is counted in KV blocks, the currency of admission: a line of long requests behind the
head needs as many seconds as its blocks take to free at the rate blocks have been freed lately.
Counting completions instead made a stream of small, unrelated answers promise `Retry-After: 1`
to a line that needed 15 minutes.

Backfilling (kvgate/gate/backfill.py) asks a second question: when will one admitted request
end? `Pace` learns it from completed requests, as seconds of admission per output token.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

# Longest Retry-After kvgate sends: past ten minutes an estimate says only "much later", and a
# client told to wait longer may as well be told to go elsewhere.
RETRY_AFTER_CAP_S = 600.0


class DrainRate:
    """KV blocks freed per second over a sliding window of recent releases."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._releases: deque[tuple[float, int]] = deque()
        self._blocks = 0  # freed by the releases in the window
        self._started = clock()

    def record(self, kv_blocks: int) -> None:
        """One release of `kv_blocks`. Releases older than the window go as new ones come, not
        only when a refusal asks for the rate: the window holds ~30 s of releases."""
        now = self._clock()
        self._forget_before(now)
        self._releases.append((now, kv_blocks))
        self._blocks += kv_blocks

    def blocks_per_s(self) -> float | None:
        """Blocks freed per second lately, or None when none were freed within the window."""
        now = self._clock()
        self._forget_before(now)
        if not self._blocks:
            return None
        span = min(self.window_s, max(now - self._started, 1e-3))
        return self._blocks / span

    def _forget_before(self, now: float) -> None:
        releases = self._releases
        while releases and now - releases[0][0] > self.window_s:
            self._blocks -= releases.popleft()[1]

    def retry_after(self, blocks_ahead: int, *, busy: bool, fallback_s: float, cap_s: float = RETRY_AFTER_CAP_S) -> int:
        """Whole seconds until `blocks_ahead` (the demand queued in front of a request, plus its
        own) have drained at the observed rate, at most `cap_s`. Nothing drained within the
        window: the cap if requests are in flight (`busy`: work runs and none finishes), else
        `fallback_s` (nothing learned yet)."""
        rate = self.blocks_per_s()
        seconds = (cap_s if busy else fallback_s) if rate is None else max(blocks_ahead, 1) / rate
        return max(1, min(math.ceil(seconds), math.ceil(cap_s)))


class Pace:
    """Seconds from admission to release per output token of one sequence, learned from
    completed requests (an exponentially weighted mean), to predict when an admitted request
    ends. Unknown (None) until one has completed: the policy then predicts nothing.

    One number for the whole server is crude (a step's time grows with the batch, a long prompt
    adds its prefill); it moves with the load as requests complete, and backfilling cannot
    starve the head however wrong it is (docs/queue.md)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.seconds_per_token: float | None = None

    def record(self, seconds: float, tokens_per_sequence: float) -> None:
        """One completed request: `seconds` from admission to release, `tokens_per_sequence` out."""
        sample = max(0.0, seconds) / max(1.0, tokens_per_sequence)
        known = self.seconds_per_token
        self.seconds_per_token = sample if known is None else known + self.weight * (sample - known)

    def duration_s(self, output_tokens: int) -> float | None:
        """Predicted seconds from admission to release of a request writing `output_tokens` a sequence."""
        known = self.seconds_per_token
        return None if known is None else known * max(1, output_tokens)
