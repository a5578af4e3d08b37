"""The requests kvgate has in flight, as the KV reconciliation needs them: an observer of the gate.

The budget loop compares the blocks these requests should hold (app.telemetry.calibration's
blocks_in_use) with what vLLM reports; it learns of admissions and releases from the gate's
events instead of reading the gate's ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from app.gate.observer import Decision, Release
from app.telemetry.calibration import InFlight


class InFlightRequests:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.requests: dict[int, InFlight] = {}  # by reservation id

    def decided(self, decision: Decision) -> None:
        if decision.kind == "admit" and decision.reservation is not None:
            self.requests[decision.reservation.id] = InFlight(decision.reservation.demand, self._clock())

    def released(self, release: Release) -> None:
        self.requests.pop(release.reservation.id, None)
