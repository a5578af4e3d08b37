"""How long a step takes: a fixed cost, a cost per scheduled token and one per context token
read by attention, scaled by model size per GPU and divided by the speed-up factor.

Reference point (Llama-3-8B, one H100, bf16): ~12 ms for a small decode batch, ~0.5 s for an
8192-token prefill, +~25 ms for 64 decodes over 2k tokens of context each. Larger models scale
with their weight bytes per GPU. The model is deliberately simple: it makes queues and
time-to-first-token behave, it does not predict kernel times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

_REF_WEIGHT_BYTES = 16.06e9  # Llama-3-8B in bf16


@dataclass(frozen=True)
class StepTimer:
    weight_bytes_per_gpu: int
    speedup: float = 1.0
    fixed_s: float = 0.012
    per_token_s: float = 6.0e-5
    per_context_token_s: float = 2.0e-7

    def sim_seconds(self, num_tokens: int, context_tokens: int) -> float:
        """Simulated duration of one step."""
        scale = max(0.05, self.weight_bytes_per_gpu / _REF_WEIGHT_BYTES)
        return scale * (self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * context_tokens)

    def wall_seconds(self, num_tokens: int, context_tokens: int) -> float:
        """What the event loop sleeps for the step."""
        return self.sim_seconds(num_tokens, context_tokens) / self.speedup


def now() -> float:
    return time.monotonic()
