"""The live loop's decisions that the simulator cannot show on cue: a cache_config_info change
is applied without a restart (what counts as a restart: tests/unit/test_telemetry_restarts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import support.fake_backend as fake
from support.kvgate_server import running_kvgate
from support.waiting import wait_for


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
