"""The decision log (logger `kvgate.decision`): one JSON line per admission, refusal or client that
left, for operators who grep by request id. An observer of the gate (kvgate.gate.observer)."""

from __future__ import annotations

import json
import logging

from kvgate.errors import TokenizationFailed
from kvgate.gate.observer import Decision, Release
from kvgate.http.errors import status_of

decision_log = logging.getLogger("kvgate.decision")


def log_decision(request_id: str, decision: str, reason: str, **fields: object) -> None:
    decision_log.info(json.dumps({"request_id": request_id, "decision": decision, "reason": reason, **fields}))


class DecisionLog:
    """Logs admissions with their reservation, refusals with the status the client saw, and
    abandons; queueing is not logged (the admission or refusal that ends it is)."""

    def decided(self, decision: Decision) -> None:
        if decision.kind == "queue" or not decision_log.isEnabledFor(logging.INFO):
            return
        if decision.kind == "admit" and decision.demand is not None:
            demand = decision.demand
            log_decision(
                decision.request_id,
                "admit",
                "fits",
                prompt_tokens=demand.prompt_tokens,
                max_new_tokens=demand.max_new_tokens,
                kv_blocks=demand.kv_blocks,
                transient_bytes=demand.transient_bytes,
                queue_wait_s=round(decision.queue_wait_s, 4),
            )
        elif decision.kind == "reject" and decision.error is not None:
            error = decision.error
            # A template's error can quote the conversation: prompts stay out of the log.
            message = None if isinstance(error, TokenizationFailed) else error.message
            log_decision(decision.request_id, "reject", error.code, status=status_of(error), message=message)
        else:
            log_decision(decision.request_id, decision.kind, decision.reason)

    def released(self, release: Release) -> None:
        """Releases are counted, not logged."""
