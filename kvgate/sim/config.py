"""The simulator's configuration: vLLM's engine flags (names and defaults) plus the GPU and the
simulation knobs (speed-up, restart time, co-tenants) that a real deployment gets from the world.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.vllm_flags import AttentionBackend, ModelRunner


@dataclass(frozen=True)
class CoTenant:
    """Another process on the same GPU: takes `bytes` from `start_s` to `end_s` (sim seconds)."""

    name: str
    bytes: int
    start_s: float = 0.0
    end_s: float | None = None


@dataclass
class SimConfig:
    """Everything one simulated vLLM server needs. Field names are vLLM's `EngineArgs` names."""

    model: str = "llama-3.1-8b"
    gpu: str = "h100-80gb"
    served_model_name: str | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # vLLM's API-server admission (0.32.0: --max-num-queued-reqs, --max-num-queued-tokens; None:
    # no limit): a request over either is refused 503 before it reaches the engine (engine.py
    # `Engine.queue_refusal`).
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    # vLLM's --dtype: auto runs a float32 (or unset) checkpoint in bfloat16 on a CUDA GPU.
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    num_gpu_blocks_override: int | None = None
    attention_backend: AttentionBackend = "auto"
    # Whether the CUDA-graph memory estimate comes out of the KV budget (newer V1 releases) or
    # the graphs are captured on top of it (V0 and older V1); None: as the release does
    # (kvgate/sim/flavor.py `Flavor.cudagraphs_in_budget`).
    cudagraph_memory_in_budget: bool | None = None
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    expandable_segments: bool = False
    # Measured "non-torch forward increase memory" (inside the budget); None: kvgate/sim/flavor.py.
    non_torch_bytes: int | None = None
    # Device memory held before the profile's baseline (CUDA context); None: kvgate/sim/flavor.py.
    cuda_context_bytes: int | None = None
    seed: int = 0
    speedup: float = 1.0
    # "wall": latency histograms in wall-clock seconds (as a real vLLM); "sim": in simulated
    # seconds (the sum of step times), for benchmarks that play minutes of traffic in seconds.
    metrics_clock: Literal["wall", "sim"] = "wall"
    restart_seconds: float = 60.0
    startup_seconds: float = 0.0
    cotenants: list[CoTenant] = field(default_factory=list)
    vllm_version: str = "0.32.0"
    # "auto": the runner that release picks for this model by its own rule (kvgate/sim/flavor.py).
    model_runner: ModelRunner = "auto"
    # --sampler: the top-k/top-p path; "auto": the release's on CUDA (kvgate/sim/flavor.py).
    sampler: Literal["auto", "flashinfer", "triton", "pytorch"] = "auto"
    # --max-logprobs (vLLM's default 20; -1 allows the whole vocabulary).
    max_logprobs: int = 20
    # --speculative-config, e.g. {"method": "draft_model", "model": "<preset or folder>",
    # "num_speculative_tokens": 4} or {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: dict[str, Any] | None = None
