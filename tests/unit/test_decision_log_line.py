"""kvgate/http/decision_log.py writes an admission's line from a template: the same line, byte for
byte, as json.dumps of its fields, whatever the request id and the numbers."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.gate.observer import Decision
from kvgate.http.decision_log import DecisionLog, admission_line
from kvgate.memory.demand import Demand

request_ids = st.one_of(
    st.sampled_from(["", "0123456789abcdef0123456789abcdef", 'a"b', "a\\b", "x\ty", "caf\u00e9", "\x7f", "\u2028"]),
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
)
counts = st.integers(min_value=0, max_value=2**62)


def _expected(request_id: str, demand: Demand, queue_wait_s: float) -> str:
    """The line as the decision log wrote it with json.dumps."""
    fields = {
        "request_id": request_id,
        "decision": "admit",
        "reason": "fits",
        "prompt_tokens": demand.prompt_tokens,
        "max_new_tokens": demand.max_new_tokens,
        "kv_blocks": demand.kv_blocks,
        "transient_bytes": demand.transient_bytes,
        "queue_wait_s": round(queue_wait_s, 4),
    }
    return json.dumps(fields)


@given(
    request_id=request_ids,
    prompt=counts,
    new=counts,
    blocks=counts,
    transient=counts,
    hashes=st.lists(st.integers(), max_size=5),
    wait=st.floats(min_value=0, max_value=1e6, allow_nan=False),
)
def test_an_admission_line_is_json_dumps_of_its_fields(
    request_id: str, prompt: int, new: int, blocks: int, transient: int, hashes: list[int], wait: float
) -> None:
    demand = Demand(prompt, new, tuple(hashes), blocks, transient_prefill_bytes=transient)
    line = admission_line(request_id, demand, wait)
    assert line == _expected(request_id, demand, wait)
    assert json.loads(line)["request_id"] == request_id


def test_the_log_writes_the_admission_line(caplog: pytest.LogCaptureFixture) -> None:
    demand = Demand(120, 16, (1, 2, 3), 5, transient_prefill_bytes=4096)
    with caplog.at_level(logging.INFO, logger="kvgate.decision"):
        DecisionLog().decided(Decision("admit", "dequeued", 'id"1', demand, queue_wait_s=0.123456))
    assert [r.getMessage() for r in caplog.records] == [_expected('id"1', demand, 0.123456)]
    assert json.loads(caplog.records[0].getMessage())["queue_wait_s"] == 0.1235
