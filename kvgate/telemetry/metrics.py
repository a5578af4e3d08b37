"""The live-budget metrics: what kvgate sees of vLLM and the GPU, and how it corrects itself.

Names are fixed (alerts and dashboards use them); the aggregate backend figures are sums over
vLLM's engines, `gpu` is the device UUID (a handful at most).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SCRAPE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MODES = ("live", "conservative", "down", "hung")


class TelemetryMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.kv_usage = Gauge(
            "kvgate_backend_kv_usage_ratio",
            "vLLM's KV cache usage (0-1) at the last scrape.",
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "kvgate_backend_kv_blocks_used",
            "KV blocks vLLM holds: usage x (num_gpu_blocks - 1), all engines.",
            registry=r,
        )
        self.running = Gauge("kvgate_backend_running_requests", "vLLM's running requests.", registry=r)
        self.waiting = Gauge("kvgate_backend_waiting_requests", "vLLM's waiting requests.", registry=r)
        self.preemptions = Counter(
            "kvgate_backend_preemptions",
            "vLLM preemptions seen (kept across backend restarts).",
            registry=r,
        )
        self.restarts = Counter("kvgate_backend_restarts", "Backend restarts detected.", registry=r)
        self.gpu_free = Gauge("kvgate_gpu_free_bytes", "Free memory NVML reports per GPU.", ["gpu"], registry=r)
        self.gpu_probe_up = Gauge(
            "kvgate_gpu_probe_available",
            "1 while GPU memory readings are available, else 0.",
            registry=r,
        )
        self.transient_headroom = Gauge(
            "kvgate_transient_headroom_bytes",
            "Live headroom for unprofiled transients: min over GPUs of free + the server's growth since start.",
            registry=r,
        )
        self.scrape_age = Gauge(
            "kvgate_scrape_age_seconds",
            "Seconds since the last good scrape of vLLM's /metrics.",
            registry=r,
        )
        self.scrape_duration = Histogram(
            "kvgate_scrape_duration_seconds",
            "Cost of one scrape of vLLM's /metrics (fetch + parse).",
            buckets=_SCRAPE_BUCKETS,
            registry=r,
        )
        self.scrape_interval = Gauge(
            "kvgate_scrape_interval_seconds",
            "Interval between scrapes of vLLM's /metrics in force: --scrape-interval while requests are "
            "queued, in flight or in vLLM, --idle-scrape-interval otherwise.",
            registry=r,
        )
        self.scrape_errors = Counter(
            "kvgate_scrape_errors",
            "Failed scrapes of vLLM's /metrics.",
            ["kind"],
            registry=r,
        )
        self.mode = Gauge(
            "kvgate_budget_mode",
            "1 for the budget mode in force: live, conservative (stale), down or hung.",
            ["mode"],
            registry=r,
        )
        self.kv_overcommit = Gauge(
            "kvgate_kv_overcommit_factor",
            "Calibrated KV overcommit factor (pool x factor may be reserved).",
            registry=r,
        )
        self.transient_margin = Gauge(
            "kvgate_transient_safety_margin",
            "Calibrated share of the transient headroom kept unspent.",
            registry=r,
        )
        self.plain_prefills = Gauge(
            "kvgate_plain_prefills",
            "Non-streaming requests and streams of several engine requests whose prefill terms kvgate "
            "holds (open) and how many of them vLLM's count of first tokens says surely finished "
            "(finished), as of the last scrape.",
            ["state"],
            registry=r,
        )
        self.kv_error = Gauge(
            "kvgate_kv_prediction_error_blocks",
            "Predicted minus observed KV blocks in use at the last settled scrape.",
            registry=r,
        )
        self.kv_abs_error = Gauge(
            "kvgate_kv_prediction_abs_error_blocks",
            "Smoothed |predicted - observed| KV blocks in use.",
            registry=r,
        )
        self.kv_reconciled_requests = Gauge(
            "kvgate_kv_reconciled_requests",
            "Requests in flight at the last settled comparison (the KV error's sample size).",
            registry=r,
        )
        self.predicted_kv_in_use = Gauge(
            "kvgate_predicted_kv_blocks_in_use",
            "kvgate's estimate of the KV blocks vLLM holds now.",
            registry=r,
        )
        self.transient_error = Gauge(
            "kvgate_transient_prediction_error_bytes",
            "Server memory growth since its start minus kvgate's highest predicted transient reservation "
            "and the part of the profile region that comes out of free memory (docs/telemetry.md).",
            registry=r,
        )
        self.backend_info = Gauge(
            "kvgate_backend_info",
            "1 for the vLLM kvgate models: its version, the known version it is modelled as, its model "
            "runner and sampler backend.",
            ["version", "model_version", "runner", "sampler"],
            registry=r,
        )
        self.lora_adapters = Gauge(
            "kvgate_backend_lora_adapters",
            "Distinct LoRA adapters of vLLM's running / waiting requests (vllm:lora_requests_info).",
            ["state"],
            registry=r,
        )
        self.max_loras = Gauge(
            "kvgate_backend_max_loras",
            "vLLM's --max-loras: adapters one step can run (vllm:lora_requests_info max_lora; 0 without LoRA).",
            registry=r,
        )
        self.served_adapters = Gauge(
            "kvgate_served_lora_adapters",
            "LoRA adapters kvgate lets requests name (the backend's /v1/models as last read).",
            registry=r,
        )
        for mode in MODES:
            self.mode.labels(mode).set(0)

    def set_backend_info(self, labels: dict[str, str]) -> None:
        """One series at 1: the backend's current identity (a restart may change it)."""
        self.backend_info.clear()
        self.backend_info.labels(**labels).set(1)

    def set_mode(self, mode: str) -> None:
        for m in MODES:
            self.mode.labels(m).set(1 if m == mode else 0)
