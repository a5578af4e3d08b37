"""What the budget loop and `explain` may see of the gate: a read-only view, not the ledger and
queue themselves.

vLLM hands its scheduler a `KVCacheBlocks` view "to hide KVCacheManager's internal data
structure" (vllm/v1/core/kv_cache_manager.py); this is the same for telemetry and `kvgate explain`,
so the gate can change how it holds reservations and waiters without either noticing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.gate.gate import Gate
from kvgate.memory.demand import Demand
from kvgate.memory.sampler import SamplerStage


@dataclass(frozen=True)
class Preview:
    """What the gate would do with a demand arriving now, and the holdings it weighed it against."""

    wait_reason: str | None  # why it would wait (a shortfall, behind_queue, the backend); None: admitted now
    new_kv_blocks: int  # what it adds to the pool beside what is held (shared prefixes once)
    kv_blocks_reserved: int
    kv_margin_blocks: int  # kept free for the spread of the in-flight outputs, its own included
    transient_reserved_bytes: int
    sampler_stage: SamplerStage  # the sampler's stage with it in the batch
    waiting: int  # requests in the queue


class GateView:
    def __init__(self, gate: Gate[Any]) -> None:
        self._gate = gate

    @property
    def in_flight(self) -> int:
        """Admitted requests not yet released."""
        return self._gate.ledger.in_flight

    @property
    def admissions(self) -> int:
        """Requests ever admitted: whether one came between two looks."""
        return self._gate.ledger.reserved_total

    @property
    def peak_transient_bytes(self) -> int:
        """The highest transient reservation since the last reset_peak()."""
        return self._gate.ledger.peak_transient_bytes

    def reset_peak(self) -> None:
        """Start a new peak window (the backend started a new life). One of the view's writes:
        the watermark exists only for telemetry."""
        self._gate.ledger.reset_peak()

    def unseen_steps(self) -> None:
        """The backend had served requests when kvgate first read this life's GPU baseline: the
        segments its steps left cached may be any row count's (the view's third write)."""
        self._gate.ledger.unseen_steps()

    def first_token_account(self) -> tuple[int, int, int]:
        """What kvgate's requests may have put in vLLM's count of first tokens
        (kvgate/gate/plain_prefills.py): (accounted for good, the most the in-flight requests that
        are no plain candidates may add, engine requests in flight)."""
        ledger = self._gate.ledger
        sequences = sum(r.demand.sequences for r in ledger.reservations())
        return ledger.plain.accounted, ledger.plain.others_open, sequences

    def plain_prefills_finished(self, count: int) -> tuple[int, int]:
        """The engine's evidence that at least `count` of the plain candidates' engine requests
        have finished their prefill; the view's second write. Waiters are re-checked when it frees memory. Returns
        (candidates, how many of them count as finished)."""
        plain = self._gate.ledger.plain
        before = plain.finished
        if plain.set_finished(count) and plain.finished > before:
            self._gate.prefill_relieved()
        return len(plain), plain.finished

    def head_shortfall(self) -> str | None:
        """Why the head of the queue waits (a budget shortfall), or None when nothing waits."""
        head = self._gate.queue.peek()
        return None if head is None else self._gate.budget.shortfall(head.demand, self._gate.ledger)

    def preview(self, demand: Demand, priority: int) -> Preview:
        """The decision `demand` would get if it arrived now, without taking it: nothing is reserved."""
        gate, ledger, budget = self._gate, self._gate.ledger, self._gate.budget
        return Preview(
            wait_reason=gate.would_wait(demand, priority),
            new_kv_blocks=ledger.new_blocks(demand),
            kv_blocks_reserved=ledger.kv_blocks,
            kv_margin_blocks=budget.kv_margin(ledger.kv_variance_blocks + demand.kv_variance_blocks),
            transient_reserved_bytes=budget.transient_charge(ledger),
            sampler_stage=ledger.sampler_with(demand),
            waiting=gate.waiting,
        )
