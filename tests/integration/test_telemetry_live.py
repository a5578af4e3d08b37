"""The live loop's decisions that the simulator cannot show on cue: a cache_config_info change
is applied without a restart, and what counts as a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

import support.fake_backend as fake
from kvgate.telemetry.live import _restarted
from kvgate.telemetry.vllm import parse_metrics
from support.kvgate_server import running_kvgate
from support.waiting import wait_for

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


def test_cache_config_change_is_applied(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with fake.running_fake_backend() as backend:
        with running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate:
            # 64 blocks, the null block out, times the default KV overcommit (1.2)
            assert kvgate.metric("kvgate_budget_kv_blocks") == int(63 * 1.2)
            monkeypatch.setattr(fake, "METRICS", fake.METRICS.replace('num_gpu_blocks="64"', 'num_gpu_blocks="128"'))
            wait_for(
                lambda: kvgate.metric("kvgate_budget_kv_blocks") == int(127 * 1.2),
                timeout_s=10,
                what=lambda: f"the new pool in the budget:\n{kvgate.log()}",
            )
            assert "cache_config_info changed" in kvgate.log()
            assert kvgate.metric("kvgate_backend_restarts_total") == 0
