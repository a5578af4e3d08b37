"""What the budget loop may see of the gate: a read-only view, not the ledger and queue themselves.

vLLM hands its scheduler a `KVCacheBlocks` view "to hide KVCacheManager's internal data
structure" (vllm/v1/core/kv_cache_manager.py); this is the same for telemetry, so the gate can
change how it holds reservations and waiters without the budget loop noticing.
"""

from __future__ import annotations

from typing import Any

from kvgate.gate.gate import Gate


class GateView:
    def __init__(self, gate: Gate[Any]) -> None:
        self._gate = gate

    @property
    def in_flight(self) -> int:
        """Admitted requests not yet released."""
        return self._gate.ledger.in_flight

    @property
    def peak_transient_bytes(self) -> int:
        """The highest transient reservation since the last reset_peak()."""
        return self._gate.ledger.peak_transient_bytes

    def reset_peak(self) -> None:
        """Start a new peak window (the backend started a new life). The view's one write: the
        watermark exists only for telemetry."""
        self._gate.ledger.reset_peak()

    def head_shortfall(self) -> str | None:
        """Why the head of the queue waits (a budget shortfall), or None when nothing waits."""
        head = self._gate.queue.peek()
        return None if head is None else self._gate.budget.shortfall(head.demand, self._gate.ledger)
