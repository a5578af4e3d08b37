"""Reading vLLM's /metrics and /v1/models: what the backend says about its KV cache and load.

Parsed with prometheus-client's own exposition-format parser. Old and new metric names are both
accepted (vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc), and samples of several
engines (data parallel, the `engine` label) are combined.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class CacheConfig:
    """The fields of vllm:cache_config_info kvgate uses (per engine; engines agree)."""

    num_gpu_blocks: int | None
    block_size: int | None
    cache_dtype: str | None
    enable_prefix_caching: bool | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    kv_cache_size_tokens: int | None
    engines: int = 1


@dataclass(frozen=True)
class BackendSnapshot:
    """One scrape of vLLM's /metrics, summed over engines."""

    cache_config: CacheConfig | None
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None
    samples: dict[str, float] = field(default_factory=dict)


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


def _bool(value: str | None) -> bool | None:
    return None if value in (None, "", "None") else value == "True"


def _cache_config(labels: list[dict[str, str]]) -> CacheConfig:
    first = labels[0]
    blocks = [_int(lbl.get("num_gpu_blocks")) for lbl in labels]
    known = [b for b in blocks if b is not None]
    return CacheConfig(
        num_gpu_blocks=min(known) if known else None,
        block_size=_int(first.get("block_size")),
        cache_dtype=first.get("cache_dtype"),
        enable_prefix_caching=_bool(first.get("enable_prefix_caching")),
        gpu_memory_utilization=_float(first.get("gpu_memory_utilization")),
        kv_cache_memory_bytes=_int(first.get("kv_cache_memory_bytes")),
        kv_cache_size_tokens=_int(first.get("kv_cache_size_tokens")),
        engines=len(labels),
    )


def parse_metrics(text: str) -> BackendSnapshot:
    """Summarise a vLLM /metrics page; absent families come back as None."""
    cache_labels: list[dict[str, str]] = []
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                cache_labels.append(dict(sample.labels))
            elif sample.name.startswith("vllm:"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    usage_name = next((n for n in _KV_USAGE if n in sums), None)
    engines = max(1, len(cache_labels))
    return BackendSnapshot(
        cache_config=_cache_config(cache_labels) if cache_labels else None,
        kv_usage=sums[usage_name] / engines if usage_name else None,
        running=sums.get("vllm:num_requests_running"),
        waiting=sums.get("vllm:num_requests_waiting"),
        preemptions=sums.get("vllm:num_preemptions_total"),
        samples=sums,
    )


async def fetch_snapshot(client: httpx.AsyncClient) -> BackendSnapshot:
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int | None


async def fetch_models(client: httpx.AsyncClient) -> list[ServedModel]:
    """The backend's /v1/models: served names and vLLM's max_model_len."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return [
        ServedModel(name=m["id"], max_model_len=m.get("max_model_len"))
        for m in response.json().get("data", [])
    ]
