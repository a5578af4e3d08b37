"""Reading vLLM's /metrics and /v1/models: what the backend says about its KV cache and load.

Parsed with prometheus-client's own exposition-format parser. Old and new metric names are both
accepted (vLLM 0.10 `gpu_cache_usage_perc` / `gpu_prefix_cache_*`, later `kv_cache_usage_perc` /
`prefix_cache_*`), and every engine (the `engine` label, data parallel) is read on its own, then
summed: each engine has its own KV pool, so blocks in use add up across engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# New name first: vLLM 0.11 still exposes the old one (hidden) beside the new.
_ALIASES = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "preemptions": ("vllm:num_preemptions_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    # one observation per engine request as its prefill ends (kvgate/gate/plain_prefills.py)
    "first_tokens": ("vllm:time_to_first_token_seconds_count",),
}
COUNTERS = ("preemptions", "generation_tokens", "prompt_tokens", "prefix_queries", "prefix_hits", "first_tokens")
_WANTED = {n for names in _ALIASES.values() for n in names} | {
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
    "process_start_time_seconds",
}
_FAMILIES = {n.removesuffix("_total").removesuffix("_count") for n in _WANTED}  # a histogram's: its _count alone


@dataclass(frozen=True)
class CacheConfig:
    """The fields of vllm:cache_config_info kvgate uses (the smallest engine's pool)."""

    num_gpu_blocks: int | None
    block_size: int | None
    cache_dtype: str | None
    enable_prefix_caching: bool | None
    gpu_memory_utilization: float | None
    mamba_cache_mode: str | None = None  # hybrid state-space models: none | align | all
    # Pool blocks one max_model_len request takes by vLLM's own count (vLLM >= 0.11 states its
    # capacity as num_gpu_blocks / that); kvgate checks its layout of the model against it.
    max_request_blocks: float | None = None
    # --kv-cache-memory-bytes: a fixed pool; gpu_memory_utilization then bounds nothing (vllm/config/cache.py)
    kv_cache_memory_bytes: int | None = None


@dataclass(frozen=True)
class LoraActivity:
    """vllm:lora_requests_info, served only with --enable-lora (vLLM 0.32.0
    vllm/v1/metrics/loggers.py PrometheusStatLogger: a gauge set to the time of each scrape
    interval, labelled with the comma-joined names of the adapters of running and waiting
    requests, and max_lora = --max-loras). Each interval adds a series; the newest one (the
    largest value, summed over engines) is now."""

    max_loras: int | None
    running: frozenset[str]
    waiting: frozenset[str]

    @property
    def live(self) -> frozenset[str]:
        """Adapters some request in vLLM uses now."""
        return self.running | self.waiting


@dataclass(frozen=True)
class EngineStats:
    """One engine's figures; None where its page lacks the family."""

    num_gpu_blocks: int | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def kv_blocks_used(self) -> float | None:
        """vLLM's usage = 1 - free/(num_gpu_blocks - 1): the null block is never in the pool."""
        if self.kv_usage is None or not self.num_gpu_blocks:
            return None
        return self.kv_usage * (self.num_gpu_blocks - 1)


@dataclass(frozen=True)
class BackendSnapshot:
    """One scrape of vLLM's /metrics: per engine, and summed over engines."""

    cache_config: CacheConfig | None
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None
    engines: dict[str, EngineStats] = field(default_factory=dict)
    process_start: float | None = None
    lora: LoraActivity | None = None  # None: the backend runs without --enable-lora
    # What kvgate's /metrics passes on to a router (kvgate/metrics.py PoolGauges): the labels of
    # engine 0's vllm:cache_config_info (the first engine's where there is no "0"), the newest
    # vllm:lora_requests_info series (its value, the time vLLM set it, and its labels), and the
    # model_name label of vLLM's scheduler gauges.
    cache_config_labels: dict[str, str] | None = None
    lora_series: tuple[float, dict[str, str]] | None = None
    model_name: str | None = None

    @property
    def kv_blocks_used(self) -> float | None:
        used = [e.kv_blocks_used for e in self.engines.values()]
        return None if not used or None in used else sum(u for u in used if u is not None)

    @property
    def kv_blocks_usable(self) -> int | None:
        """Blocks the engines can hand out (num_gpu_blocks - 1 each)."""
        pools = [e.num_gpu_blocks for e in self.engines.values()]
        return None if not pools or None in pools else sum(p - 1 for p in pools if p)

    def counter(self, name: str) -> float | None:
        values = [e.counters[name] for e in self.engines.values() if name in e.counters]
        return sum(values) if values else None


def _int(value: str | None) -> int | None:
    try:
        return None if value is None or value in ("", "None") else int(float(value))
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    try:
        return None if value is None or value in ("", "None") else float(value)
    except ValueError:
        return None


def _str(value: str | None) -> str | None:
    return None if value in (None, "", "None") else value


def _bool(value: str | None) -> bool | None:
    return None if value in (None, "", "None") else value == "True"


def _cache_config(labels: list[dict[str, str]]) -> CacheConfig:
    first = labels[0]
    blocks = [_int(lbl.get("num_gpu_blocks")) for lbl in labels]
    known = [b for b in blocks if b is not None]
    return CacheConfig(
        num_gpu_blocks=min(known) if known else None,
        block_size=_int(first.get("block_size")),
        cache_dtype=_str(first.get("cache_dtype")),
        enable_prefix_caching=_bool(first.get("enable_prefix_caching")),
        gpu_memory_utilization=_float(first.get("gpu_memory_utilization")),
        mamba_cache_mode=_str(first.get("mamba_cache_mode")),
        max_request_blocks=_ratio(_int(first.get("num_gpu_blocks")), _float(first.get("kv_cache_max_concurrency"))),
        kv_cache_memory_bytes=_int(first.get("kv_cache_memory_bytes")),
    )


def _ratio(blocks: int | None, concurrency: float | None) -> float | None:
    return blocks / concurrency if blocks and concurrency else None


def _first(per_name: dict[str, float], key: str) -> float | None:
    return next((per_name[n] for n in _ALIASES[key] if n in per_name), None)


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _wanted_lines(text: str) -> str:
    """Only the families kvgate reads: a real page is ~60 KB of histograms the parser would
    otherwise spend most of its time on (13 ms -> 2.5 ms a parse on the test machine)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) > 2 and parts[2] in _FAMILIES:
                keep.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def _names(label: str | None) -> frozenset[str]:
    return frozenset(n for n in (label or "").split(",") if n)


def _newest(samples: list[tuple[float, dict[str, str]]]) -> tuple[float, dict[str, str]] | None:
    """The series with the largest value: vllm:lora_requests_info's value is when vLLM set it."""
    return max(samples, key=lambda sample: sample[0]) if samples else None


def _first_engine(labels: list[dict[str, str]]) -> dict[str, str] | None:
    return next((lbl for lbl in labels if lbl.get("engine") == "0"), labels[0] if labels else None)


def _lora_activity(samples: list[tuple[float, dict[str, str]]]) -> LoraActivity:
    """The newest series of each engine (largest timestamp), their adapters together."""
    newest: dict[str, tuple[float, dict[str, str]]] = {}
    for value, labels in samples:
        engine = labels.get("engine", "0")
        if engine not in newest or value > newest[engine][0]:
            newest[engine] = (value, labels)
    latest = [labels for _, labels in newest.values()]
    limits = [m for lbl in latest if (m := _int(lbl.get("max_lora"))) is not None]
    return LoraActivity(
        max_loras=min(limits) if limits else None,
        running=frozenset().union(*(_names(lbl.get("running_lora_adapters")) for lbl in latest)),
        waiting=frozenset().union(*(_names(lbl.get("waiting_lora_adapters")) for lbl in latest)),
    )


def parse_metrics(text: str) -> BackendSnapshot:
    """Summarise a vLLM /metrics page; absent families come back as None."""
    cache_labels: list[dict[str, str]] = []
    lora_samples: list[tuple[float, dict[str, str]]] = []
    per_engine: dict[str, dict[str, float]] = {}
    process_start: float | None = None
    model_name: str | None = None
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                cache_labels.append(dict(sample.labels))
            elif sample.name == "vllm:lora_requests_info":
                lora_samples.append((sample.value, dict(sample.labels)))
            elif sample.name.startswith("vllm:"):
                model_name = model_name or sample.labels.get("model_name")
                engine = per_engine.setdefault(sample.labels.get("engine", "0"), {})
                engine[sample.name] = engine.get(sample.name, 0.0) + sample.value
            elif sample.name == "process_start_time_seconds":
                process_start = sample.value
    blocks = {lbl.get("engine", "0"): _int(lbl.get("num_gpu_blocks")) for lbl in cache_labels}
    engines = {
        name: EngineStats(
            num_gpu_blocks=blocks.get(name),
            kv_usage=_first(values, "kv_usage"),
            running=_first(values, "running"),
            waiting=_first(values, "waiting"),
            counters={k: v for k in COUNTERS if (v := _first(values, k)) is not None},
        )
        for name, values in sorted({**{e: {} for e in blocks}, **per_engine}.items())
    }
    usages = [e.kv_usage for e in engines.values() if e.kv_usage is not None]
    return BackendSnapshot(
        cache_config=_cache_config(cache_labels) if cache_labels else None,
        kv_usage=sum(usages) / len(usages) if usages else None,
        running=_sum([e.running for e in engines.values()]),
        waiting=_sum([e.waiting for e in engines.values()]),
        preemptions=_sum([e.counters.get("preemptions") for e in engines.values()]),
        engines=engines,
        process_start=process_start,
        lora=_lora_activity(lora_samples) if lora_samples else None,
        cache_config_labels=_first_engine(cache_labels),
        lora_series=_newest(lora_samples),
        model_name=model_name,
    )


async def fetch_snapshot(client: httpx.AsyncClient, request_timeout_s: float | None = None) -> BackendSnapshot:
    response = (
        await client.get("/metrics", timeout=request_timeout_s) if request_timeout_s else await client.get("/metrics")
    )
    response.raise_for_status()
    return parse_metrics(response.text)


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int | None
    # A LoRA adapter's base model (vLLM 0.32.0 vllm/entrypoints/openai/models/serving.py
    # show_available_models: `parent` is the base model's served name, `root` the adapter's path);
    # None for a base model.
    parent: str | None = None
    root: str | None = None


async def fetch_models(client: httpx.AsyncClient) -> list[ServedModel]:
    """The backend's /v1/models: served names (base models and LoRA adapters) and vLLM's max_model_len."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return [
        ServedModel(
            name=m["id"],
            max_model_len=m.get("max_model_len"),
            parent=m.get("parent") if isinstance(m.get("parent"), str) else None,
            root=m.get("root") if isinstance(m.get("root"), str) else None,
        )
        for m in response.json().get("data", [])
    ]


@dataclass(frozen=True)
class EngineLimits:
    """vLLM's scheduler and parallel limits, which its /metrics and /v1/models never state.

    Only vLLM's `GET /server_info?config_format=json` has them (vLLM 0.32.0:
    vllm/entrypoints/serve/dev/server_info/api_router.py, show_server_info: the VllmConfig dumped
    by pydantic), and vLLM serves it only with VLLM_SERVER_DEV_MODE=1.
    """

    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    long_prefill_token_threshold: int | None
    tensor_parallel_size: int | None
    pipeline_parallel_size: int | None


async def fetch_engine_limits(client: httpx.AsyncClient) -> EngineLimits | None:
    """The backend's engine limits, or None where it does not publish them (404 without dev
    mode; any other answer that is not vLLM's JSON counts the same: kvgate then keeps its flags)."""
    response = await client.get("/server_info", params={"config_format": "json"})
    if response.status_code != 200:
        return None
    try:
        config = response.json().get("vllm_config")
    except (ValueError, AttributeError):
        return None
    if not isinstance(config, dict):
        return None
    scheduler = config.get("scheduler_config") or {}
    parallel = config.get("parallel_config") or {}
    return EngineLimits(
        max_num_batched_tokens=_int(_text(scheduler.get("max_num_batched_tokens"))),
        max_num_seqs=_int(_text(scheduler.get("max_num_seqs"))),
        long_prefill_token_threshold=_int(_text(scheduler.get("long_prefill_token_threshold"))),
        tensor_parallel_size=_int(_text(parallel.get("tensor_parallel_size"))),
        pipeline_parallel_size=_int(_text(parallel.get("pipeline_parallel_size"))),
    )


def _text(value: object) -> str | None:
    return None if value is None else str(value)


async def fetch_version(client: httpx.AsyncClient) -> str | None:
    """vLLM's GET /version ({"version": "0.32.0"}, vllm/entrypoints/serve/...: show_version);
    None from a backend that has no such route (a proxy, an old simulator)."""
    try:
        response = await client.get("/version")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        version = response.json().get("version")
    except ValueError:
        return None
    return version if isinstance(version, str) and version else None
