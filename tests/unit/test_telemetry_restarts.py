"""What the live loop counts as a backend restart: a new process, a counter going backwards, an
engine more (on /metrics pages written out here; the live loop itself: tests/integration/test_telemetry_live.py)."""

from __future__ import annotations

from kvgate.telemetry.live import _restarted
from kvgate.telemetry.vllm import parse_metrics

PAGE = """# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {preempted}
{second}# TYPE process_start_time_seconds gauge
process_start_time_seconds {start}
"""
SECOND = 'vllm:num_preemptions_total{engine="1",model_name="m"} 0.0\n'


def page(preempted: float = 3, start: float = 100.0, two_engines: bool = False) -> str:
    return PAGE.format(preempted=preempted, start=start, second=SECOND if two_engines else "")


def test_what_counts_as_a_restart() -> None:
    before = parse_metrics(page())
    assert not _restarted(before, parse_metrics(page(preempted=5)))
    assert _restarted(before, parse_metrics(page(start=200.0)))  # a new process
    assert _restarted(before, parse_metrics(page(preempted=0)))  # a counter went backwards
    assert _restarted(before, parse_metrics(page(two_engines=True)))  # an engine came
