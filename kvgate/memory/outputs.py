"""How many output tokens a request's KV reservation counts on: the pure model's input.

How that number is learned from finished requests is policy (kvgate/output_lengths.py, wired by
the composition root); the footprint only needs the result, from whatever OutputReserver it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class OutputReservation:
    """Output tokens per sequence to reserve KV for, and their variance (tokens^2) around it."""

    tokens: int
    variance: float = 0.0


class OutputReserver(Protocol):
    """What the predictor asks of output-length learning: the reservation for a request allowed
    `max_new_tokens` that will surely generate `min_new_tokens`."""

    def reserve(self, max_new_tokens: int, min_new_tokens: int = 0) -> OutputReservation: ...
