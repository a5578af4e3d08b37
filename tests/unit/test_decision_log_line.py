"""kvgate/http/decision_log.py writes an admission's line from a template: the same line, byte for
byte, as json.dumps of its fields, whatever the request id and the numbers."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.errors import InvalidField
from kvgate.gate.observer import Decision
from kvgate.http import decision_log as decision_log_module
from kvgate.http.decision_log import DecisionLog, admission_line
from kvgate.logs import LOG_FORMAT, SecondCachedFormatter
from kvgate.memory.demand import Demand

request_ids = st.one_of(
    st.sampled_from(["", "0123456789abcdef0123456789abcdef", 'a"b', "a\\b", "x\ty", "caf\u00e9", "\x7f", "\u2028"]),
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
)
counts = st.integers(min_value=0, max_value=2**62)


def _expected(request_id: str, reason: str, demand: Demand, queue_wait_s: float) -> str:
    """The line as the decision log wrote it with json.dumps."""
    fields = {
        "request_id": request_id,
        "decision": "admit",
        "reason": reason,
        "prompt_tokens": demand.prompt_tokens,
        "max_new_tokens": demand.max_new_tokens,
        "kv_blocks": demand.kv_blocks,
        "transient_bytes": demand.transient_bytes,
        "queue_wait_s": round(queue_wait_s, 4),
    }
    return json.dumps(fields)


@given(
    request_id=request_ids,
    reason=request_ids,
    prompt=counts,
    new=counts,
    blocks=counts,
    transient=counts,
    hashes=st.lists(st.integers(), max_size=5),
    wait=st.floats(min_value=0, max_value=1e6, allow_nan=False),
)
def test_an_admission_line_is_json_dumps_of_its_fields(
    request_id: str, reason: str, prompt: int, new: int, blocks: int, transient: int, hashes: list[int], wait: float
) -> None:
    demand = Demand(prompt, new, tuple(hashes), blocks, transient_prefill_bytes=transient)
    line = admission_line(request_id, reason, demand, wait)
    assert line == _expected(request_id, reason, demand, wait)
    assert json.loads(line)["request_id"] == request_id


def test_the_log_writes_the_admission_line(caplog: pytest.LogCaptureFixture) -> None:
    demand = Demand(120, 16, (1, 2, 3), 5, transient_prefill_bytes=4096)
    with caplog.at_level(logging.INFO, logger="kvgate.decision"):
        DecisionLog().decided(Decision("admit", "dequeued", 'id"1', demand, queue_wait_s=0.123456))
    assert [r.getMessage() for r in caplog.records] == [_expected('id"1', "dequeued", demand, 0.123456)]
    assert json.loads(caplog.records[0].getMessage())["queue_wait_s"] == 0.1235


def kvgate_handler(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """The root's one handler kvgate's own (kvgate.logs.configure_logging's), writing to a
    string; pytest's capture handlers (which it adds as the test starts) set aside for the test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SecondCachedFormatter(LOG_FORMAT))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.INFO)
    monkeypatch.setattr(time, "time", lambda: 1795753506.789123)
    return stream


def _decide_all(log: DecisionLog) -> None:
    demand = Demand(120, 16, (1, 2, 3), 5, transient_prefill_bytes=4096)
    log.decided(Decision("admit", "fits", "a%sb", demand, queue_wait_s=0.5))
    log.decided(Decision("reject", "invalid_json", "r1", error=InvalidField("The body is not valid JSON.")))
    log.decided(Decision("abandon", "client_gone", "r2", stage="queued"))


def test_straight_to_kvgate_s_handler_the_lines_are_logging_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """With kvgate's own handler alone, decision lines are written to its stream directly: the
    same bytes logging writes (its time format, level, logger name, the message as it is, one
    line each)."""
    stream_direct = kvgate_handler(monkeypatch)
    written: list[str] = []
    monkeypatch.setattr(logging.Logger, "_log", lambda self, *a, **k: written.append("through logging"))
    _decide_all(DecisionLog())
    assert written == []  # none went through logging's records
    direct = stream_direct.getvalue()
    monkeypatch.undo()  # logging as it is, the same handler and clock

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SecondCachedFormatter(LOG_FORMAT))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(logging.getLogger(), "handlers", [handler])
        m.setattr(logging.getLogger(), "level", logging.INFO)
        m.setattr(time, "time", lambda: 1795753506.789123)
        m.setattr(decision_log_module, "_only_handler", lambda: None)
        _decide_all(DecisionLog())
    assert direct == stream.getvalue()
    lines = direct.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith(
        ' INFO kvgate.decision {"request_id": "a%sb", "decision": "admit", "reason": "fits", '
        '"prompt_tokens": 120, "max_new_tokens": 16, "kv_blocks": 8, "transient_bytes": 4096, '
        '"queue_wait_s": 0.5}'
    )
    assert lines[0].split(" INFO ")[0].endswith(",789")


def test_a_disabled_decision_logger_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A logging configuration that disables the logger (dictConfig's disable_existing_loggers)
    silences the lines, as logging does."""
    stream = kvgate_handler(monkeypatch)
    monkeypatch.setattr(logging.getLogger("kvgate.decision"), "disabled", True)
    _decide_all(DecisionLog())
    assert stream.getvalue() == ""


@pytest.mark.parametrize("where", ["own handler", "filter", "second root handler", "level", "other format"])
def test_any_other_logging_configuration_gets_the_records(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A handler or filter anywhere on the way, another format or a handler level above info:
    the lines go through logging, which they reach as records."""
    kvgate_handler(monkeypatch)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("kvgate.decision")
    root_handler = logging.getLogger().handlers[0]
    if where == "own handler":
        monkeypatch.setattr(logger, "handlers", [Keep()])
    elif where == "filter":
        monkeypatch.setattr(logger, "filters", [lambda record: records.append(record) or True])
    elif where == "second root handler":
        monkeypatch.setattr(logging.getLogger(), "handlers", [root_handler, Keep()])
    elif where == "level":
        monkeypatch.setattr(root_handler, "level", logging.WARNING)
        monkeypatch.setattr(logger, "handlers", [Keep()])
    else:
        monkeypatch.setattr(root_handler, "formatter", logging.Formatter("%(message)s"))
        monkeypatch.setattr(logger, "handlers", [Keep()])
    assert decision_log_module._only_handler() is None
    _decide_all(DecisionLog())
    assert len(records) == 3
