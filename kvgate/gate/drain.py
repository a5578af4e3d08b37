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
    """When an admitted request ends, learned from completed ones: seconds from admission to the
    first token per prompt token (the wait in vLLM's queue and the prefill's chunks), and seconds
    from the first token to release per output token of one sequence, each an exponentially
    weighted mean. Unknown (None) until one request has completed: the policy then predicts
    nothing.

    Two rates, because one rate per output token predicted a 4,000-token prompt asking one
    output token (an evaluation's prompt_logprobs) to end in one decoding step, and a 120k-token
    document to end with its 256 output tokens. A request whose first token kvgate did not see (a
    non-streaming answer arrives whole) teaches the decoding rate from what its prefill is
    predicted to have taken. Still crude (a step's time grows with the batch); backfilling cannot
    starve the head however wrong it is (docs/queue.md)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.seconds_per_token: float | None = None
        self.seconds_per_prompt_token: float | None = None

    def record(
        self, seconds: float, tokens_per_sequence: float, prompt_tokens: int = 0, first_token_s: float | None = None
    ) -> None:
        """One completed request: `seconds` from admission to release, `tokens_per_sequence`
        out, `prompt_tokens` in, its first token `first_token_s` after admission (None: not seen)."""
        seconds = max(0.0, seconds)
        if first_token_s is not None and prompt_tokens > 0:
            first = min(max(0.0, first_token_s), seconds)
            self.seconds_per_prompt_token = self._mean(self.seconds_per_prompt_token, first / prompt_tokens)
            decoding = seconds - first
        else:
            decoding = max(0.0, seconds - (self.seconds_per_prompt_token or 0.0) * prompt_tokens)
        self.seconds_per_token = self._mean(self.seconds_per_token, decoding / max(1.0, tokens_per_sequence))

    def _mean(self, known: float | None, sample: float) -> float:
        return sample if known is None else known + self.weight * (sample - known)

    def duration_s(self, output_tokens: int, prompt_tokens: int = 0) -> float | None:
        """Predicted seconds from admission to release of a request of `prompt_tokens` writing
        `output_tokens` a sequence."""
        known = self.seconds_per_token
        if known is None:
            return None
        return (self.seconds_per_prompt_token or 0.0) * prompt_tokens + known * max(1, output_tokens)
