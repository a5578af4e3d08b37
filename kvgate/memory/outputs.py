"""How many output tokens a request's KV reservation counts on: the pure model's input.

How that number is learned from finished requests is admission policy and lives with the gate
(kvgate/gate/output_lengths.py); the footprint only needs the result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OutputReservation:
    """Output tokens per sequence to reserve KV for, and their variance (tokens^2) around it."""

    tokens: int
    variance: float = 0.0
