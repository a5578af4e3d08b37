"""The decision log (logger `kvgate.decision`): one JSON line per admission, refusal or client that
left, for operators who grep by request id. An observer of the gate (kvgate.gate.observer)."""

from __future__ import annotations

import json
import logging
import time

from kvgate.errors import TokenizationFailed
from kvgate.gate.observer import Decision, Release
from kvgate.http.errors import status_of
from kvgate.logs import LOG_FORMAT, SecondCachedFormatter
from kvgate.memory.demand import Demand

decision_log = logging.getLogger("kvgate.decision")


def log_decision(request_id: str, decision: str, reason: str, **fields: object) -> None:
    write_line(json.dumps({"request_id": request_id, "decision": decision, "reason": reason, **fields}))


class _Moment:
    """What SecondCachedFormatter.formatTime reads of a record: when it was made (LogRecord's
    `created` and `msecs`, CPython 3.11's arithmetic)."""

    __slots__ = ("created", "msecs")

    def __init__(self, created: float) -> None:
        self.created = created
        self.msecs = int((created - int(created)) * 1000) + 0.0


def _only_handler() -> logging.StreamHandler | None:  # type: ignore[type-arg]
    """kvgate's own handler (kvgate.logs.configure_logging's) when it is the one place a decision
    line goes: no handler or filter on this logger (nor disabled by a logging configuration),
    none on its parents before the root, and the root's one handler kvgate's format, with no
    filter. Else None."""
    if decision_log.handlers or decision_log.filters or not decision_log.propagate or decision_log.disabled:
        return None
    logger = decision_log.parent
    while logger is not None and logger.parent is not None:  # up to the root
        if logger.handlers or not logger.propagate:
            return None
        logger = logger.parent
    handlers = logger.handlers if logger is not None else []
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    formatter = handler.formatter
    if (
        type(handler) is not logging.StreamHandler
        or handler.filters
        or handler.level > logging.INFO
        or type(formatter) is not SecondCachedFormatter
        or formatter._fmt != LOG_FORMAT
        or formatter.datefmt is not None
    ):
        return None
    return handler


def write_line(message: str) -> None:
    """One decision line at info, the caller having checked the level. Through kvgate's own
    handler, it is written straight to its stream, as the handler would write it (its format:
    time, level, logger, message; then its flush): logging's record, its dispatch and its
    formatting were 8.5 of the 10.4 us a line cost (the 2-core machine), and every decision is
    logged. Any other configuration (another handler, a filter, a test's capture) goes through
    logging as before."""
    handler = _only_handler()
    if handler is None:
        decision_log.info(message)
        return
    created = time.time()
    line = f"{handler.formatter.formatTime(_Moment(created))} INFO {decision_log.name} {message}"  # type: ignore[union-attr,arg-type]
    with handler.lock:  # type: ignore[union-attr]
        try:
            handler.stream.write(line + handler.terminator)
            handler.stream.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as StreamHandler.emit: a failed write is reported, never raised
            handler.handleError(decision_log.makeRecord(decision_log.name, logging.INFO, "", 0, message, (), None))


def _json_string(text: str) -> str:
    """`text` as json.dumps writes it, through json only when it needs escaping."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text)


def admission_line(request_id: str, reason: str, demand: Demand, queue_wait_s: float) -> str:
    """An admission's line, as json.dumps writes its fields (log_decision's), from a template:
    json's encoder was a fifth of a decision's cost, and every admission is logged. The request
    id and the reason (fits, dequeued, backfilled: until 2026-11-28 every line said fits) are
    written by json only when they need escaping (kvgate's own ids and most clients' are
    printable ASCII without quotes or backslashes); the counts (ints) and the wait (a finite
    float) written as json writes them: their repr."""
    return (
        f'{{"request_id": {_json_string(request_id)}, "decision": "admit", "reason": {_json_string(reason)}, '
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
            write_line(admission_line(decision.request_id, decision.reason, decision.demand, decision.queue_wait_s))
        elif decision.kind == "reject" and decision.error is not None:
            error = decision.error
            # A template's error can quote the conversation: prompts stay out of the log.
            message = None if isinstance(error, TokenizationFailed) else error.message
            log_decision(decision.request_id, "reject", error.code, status=status_of(error), message=message)
        else:
            log_decision(decision.request_id, decision.kind, decision.reason)

    def released(self, release: Release) -> None:
        """Releases are counted, not logged."""
