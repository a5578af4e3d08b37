"""The requests kvgate has in flight, as the KV reconciliation needs them: an observer of the gate.

The budget loop compares the blocks these requests should hold (kvgate.telemetry.calibration's
blocks_in_use) with what vLLM reports; it learns of admissions and releases from the gate's
events instead of reading the gate's ledger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvgate.gate.observer import Decision, Release
from kvgate.telemetry.calibration import InFlight


class InFlightRequests:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.requests: dict[int, InFlight] = {}  # by reservation id
        # When an admitted request last ended with a 5xx answer from the backend (how vLLM's API
        # server reports its engine's death), and with its connection cut (how a killed server
        # goes): what tells an OOM restart from a kill (LiveBudget._on_restart).
        self.last_backend_error = -math.inf
        self.last_cut = -math.inf

    def decided(self, decision: Decision) -> None:
        if decision.kind == "admit" and decision.reservation is not None:
            self.requests[decision.reservation.id] = InFlight(decision.reservation.demand, self._clock())

    def released(self, release: Release) -> None:
        self.requests.pop(release.reservation.id, None)
        if release.outcome == "backend_error":
            self.last_backend_error = self._clock()
        elif release.outcome == "upstream_error":
            self.last_cut = self._clock()
