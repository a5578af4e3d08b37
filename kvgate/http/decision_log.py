"""The decision log (logger `kvgate.decision`): one JSON line per admission, refusal or client that
left, for operators who grep by request id. An observer of the gate (kvgate.gate.observer)."""

from __future__ import annotations

import json
import logging

from kvgate.errors import TokenizationFailed
from kvgate.gate.observer import Decision, Release
from kvgate.http.errors import status_of
from kvgate.memory.demand import Demand

decision_log = logging.getLogger("kvgate.decision")


def log_decision(request_id: str, decision: str, reason: str, **fields: object) -> None:
    decision_log.info(json.dumps({"request_id": request_id, "decision": decision, "reason": reason, **fields}))


def admission_line(request_id: str, demand: Demand, queue_wait_s: float) -> str:
    """An admission's line, as json.dumps writes its fields (log_decision's), from a template:
    json's encoder was a fifth of a decision's cost, and every admission is logged. The request
    id is written by json only when it needs escaping (kvgate's own ids and most clients' are
    printable ASCII without quotes or backslashes); the counts (ints) and the wait (a finite
    float) written as json writes them: their repr."""
    quoted = (
        f'"{request_id}"'
        if request_id.isascii() and request_id.isprintable() and '"' not in request_id and "\\" not in request_id
        else json.dumps(request_id)
    )
    return (
        f'{{"request_id": {quoted}, "decision": "admit", "reason": "fits", '
        f'"prompt_tokens": {demand.prompt_tokens!r}, "max_new_tokens": {demand.max_new_tokens!r}, '
        f'"kv_blocks": {demand.kv_blocks!r}, "transient_bytes": {demand.transient_bytes!r}, '
        f'"queue_wait_s": {round(queue_wait_s, 4)!r}}}'
    )


class DecisionLog:
    """Logs admissions with their reservation, refusals with the status the client saw, and
    abandons; queueing is not logged (the admission or refusal that ends it is)."""

    def decided(self, decision: Decision) -> None:
        if decision.kind == "queue" or not decision_log.isEnabledFor(logging.INFO):
            return
        if decision.kind == "admit" and decision.demand is not None:
            decision_log.info(admission_line(decision.request_id, decision.demand, decision.queue_wait_s))
        elif decision.kind == "reject" and decision.error is not None:
            error = decision.error
            # A template's error can quote the conversation: prompts stay out of the log.
            message = None if isinstance(error, TokenizationFailed) else error.message
            log_decision(decision.request_id, "reject", error.code, status=status_of(error), message=message)
        else:
            log_decision(decision.request_id, decision.kind, decision.reason)

    def released(self, release: Release) -> None:
        """Releases are counted, not logged."""
