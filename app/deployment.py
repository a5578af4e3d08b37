"""The vLLM deployment kvgate guards: flags merged with what the backend itself reports.

What vLLM publishes (cache_config_info on /metrics, max_model_len on /v1/models) is the truth
about the running server and wins over kvgate's flags; each disagreement is logged as a warning
so the operator can fix the flags they copied.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.memory.activation import EngineShape, profile_peak_bytes
from app.memory.budget import Budget
from app.memory.geometry import ModelGeometry
from app.memory.kv import KVLayout
from app.memory.outputs import OutputLengths
from app.memory.vllm_runner import VllmRuntime, resolve_runtime
from app.predict import Predictor
from app.settings import Settings
from app.telemetry.vllm import CacheConfig, ServedModel

log = logging.getLogger("kvgate.deployment")


@dataclass(frozen=True)
class Deployment:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    attention_backend: str
    num_gpu_blocks: int | None
    mamba_cache_mode: str = "none"
    reported_request_blocks: float | None = None  # vLLM's blocks per max_model_len request
    runtime: VllmRuntime = field(default_factory=lambda: resolve_runtime(None))
    num_speculative_tokens: int = 0
    max_logprobs: int = 20

    def engine_shape(self) -> EngineShape:
        return EngineShape(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            tensor_parallel_size=self.tensor_parallel_size,
            attention_backend=self.attention_backend,
            block_size=self.block_size,
            runner=self.runtime.runner,
            num_speculative_tokens=self.num_speculative_tokens,
            max_logprobs=self.max_logprobs,
        )


def _prefer(name: str, flag: object, reported: object, flag_given: bool) -> object:
    if reported is None:
        return flag
    if flag_given and flag != reported:
        log.warning("backend reports %s=%s but kvgate was given %s; using the backend's", name, reported, flag)
    return reported


def _model_config(settings: Settings) -> dict:
    """The model's config.json, for what vLLM's runner rule reads beyond the geometry."""
    path = Path(settings.model) / "config.json" if settings.model else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def vllm_runtime(settings: Settings, geometry: ModelGeometry, reported_version: str | None) -> VllmRuntime:
    """The vLLM behind kvgate: --vllm-version, else the backend's GET /version; its runner by
    vLLM's rule for that version unless --model-runner says."""
    config = _model_config(settings)
    spec = settings.speculative_config
    runtime = resolve_runtime(
        settings.vllm_version or reported_version, settings.model_runner,
        architectures=config.get("architectures") or (), is_moe=geometry.is_moe,
        is_hybrid=geometry.is_hybrid_state, quantized="quantization_config" in config,
        speculative_method=spec.method if spec else None,
    )
    if settings.vllm_version and reported_version and settings.vllm_version != reported_version:
        log.warning("backend reports vLLM %s but kvgate was given --vllm-version %s; using the flag",
                    reported_version, settings.vllm_version)
    return runtime


def resolve(
    settings: Settings,
    geometry: ModelGeometry,
    cache: CacheConfig | None,
    served: ServedModel | None,
    reported_version: str | None = None,
) -> Deployment:
    """Flags, overridden by the backend's own report where it has one."""
    given = settings.model_fields_set
    cache = cache or CacheConfig(None, None, None, None, None, None, None)
    max_model_len = _prefer(
        "max_model_len", settings.max_model_len, served.max_model_len if served else None,
        "max_model_len" in given,
    ) or geometry.max_position_embeddings
    if not max_model_len:
        raise ValueError("max_model_len is unknown: pass --max-model-len")
    if geometry.is_hybrid_state and cache.block_size is None and "block_size" not in given:
        log.warning(
            "this model keeps a recurrent state in some layers, so vLLM raises its block size to fit "
            "a state page, and the backend does not report it: pass the block size vLLM logs "
            "(--block-size), or kvgate counts blocks of %s tokens", settings.block_size,
        )
    backend = settings.attention_backend
    if backend == "auto":
        backend = "mla" if geometry.is_mla else "flash-attn"
    return Deployment(
        max_model_len=int(max_model_len),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        block_size=int(_prefer("block_size", settings.block_size, cache.block_size, "block_size" in given)),
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        kv_cache_dtype=str(
            _prefer("kv_cache_dtype", settings.kv_cache_dtype, cache.cache_dtype, "kv_cache_dtype" in given)
        ),
        gpu_memory_utilization=float(
            _prefer(
                "gpu_memory_utilization", settings.gpu_memory_utilization,
                cache.gpu_memory_utilization, "gpu_memory_utilization" in given,
            )
        ),
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        enable_prefix_caching=bool(
            _prefer(
                "enable_prefix_caching", settings.enable_prefix_caching,
                cache.enable_prefix_caching, "enable_prefix_caching" in given,
            )
        ),
        attention_backend=backend,
        num_gpu_blocks=_prefer("num_gpu_blocks", settings.num_gpu_blocks, cache.num_gpu_blocks, "num_gpu_blocks" in given),
        mamba_cache_mode=cache.mamba_cache_mode or "none",
        reported_request_blocks=cache.max_request_blocks,
        runtime=vllm_runtime(settings, geometry, reported_version),
        num_speculative_tokens=settings.speculative_config.num_speculative_tokens if settings.speculative_config else 0,
        max_logprobs=settings.max_logprobs,
    )


def build_predictor(
    deployment: Deployment, geometry: ModelGeometry, settings: Settings, outputs: OutputLengths | None = None
) -> Predictor:
    layout = KVLayout(
        geometry=geometry,
        block_size=deployment.block_size,
        tensor_parallel_size=deployment.tensor_parallel_size,
        pipeline_parallel_size=deployment.pipeline_parallel_size,
        kv_cache_dtype=deployment.kv_cache_dtype,
        mamba_cache_mode=deployment.mamba_cache_mode,
    )
    layout = checked_against_backend(layout, deployment)
    engine = deployment.engine_shape()
    profiled = settings.profiled_activation_bytes or profile_peak_bytes(geometry, engine)
    return Predictor(
        layout, engine, deployment.enable_prefix_caching, profiled, settings.default_max_tokens, outputs
    )


def checked_against_backend(layout: KVLayout, deployment: Deployment) -> KVLayout:
    """The layout, never counting fewer blocks per sequence than vLLM's own capacity report.

    vLLM states its pool as num_gpu_blocks / (blocks of one max_model_len request). When that
    count exceeds the layout's, kvgate's reading of this architecture misses something vLLM
    allocates (a layer kind it does not know, a grouping of a newer vLLM): every sequence then
    reserves the difference too. The gap between vLLM's count and the layout's can only grow
    with the length for the layer kinds vLLM has, so the gap at max_model_len covers any
    shorter request. A layout that counts more than vLLM is left as it is (cautious), with a
    warning, since it admits fewer requests than fit.
    """
    reported = deployment.reported_request_blocks
    if reported is None:
        return layout
    ours = layout.max_request_blocks(deployment.max_model_len, deployment.max_num_batched_tokens)
    gap = math.floor(reported + 1e-6) - ours
    if gap > 0:
        log.warning(
            "vLLM counts %.1f KV blocks for one %s-token request where kvgate's layout of this model "
            "counts %s: kvgate reserves %s more blocks for every sequence", reported,
            deployment.max_model_len, ours, gap,
        )
        return replace(layout, extra_blocks_per_sequence=gap)
    if reported < ours - 1:
        log.warning(
            "vLLM counts %.1f KV blocks for one %s-token request where kvgate's layout of this model "
            "counts %s: kvgate will admit fewer requests than fit (check --max-num-batched-tokens)",
            reported, deployment.max_model_len, ours,
        )
    return layout


def static_budget(deployment: Deployment, settings: Settings, predictor: Predictor) -> Budget:
    """The budget before any live reading: the pool from vLLM, headroom from flags.

    vLLM reserves block 0 of the pool as its null block, so num_gpu_blocks - 1 are usable.
    Workspaces one engine allocates once (FlashInfer's) come off the headroom once, not per request.
    With --kv-cache-memory-bytes the pool is that size (vLLM ignores gpu_memory_utilization then:
    vllm/config/cache.py ``kv_cache_memory_bytes``), so the headroom is what the GPU has left after
    the weights, that pool and the profiled activation peak.
    """
    blocks = deployment.num_gpu_blocks
    fixed_pool = settings.kv_cache_memory_bytes
    if blocks is None and fixed_pool is not None:
        blocks = predictor.layout.capacity(
            fixed_pool, deployment.max_model_len, deployment.max_num_batched_tokens
        ).num_blocks
    headroom = settings.free_memory_bytes
    if headroom is None and settings.gpu_memory_bytes is not None:
        if fixed_pool is not None:
            headroom = settings.gpu_memory_bytes - fixed_pool - weights_bytes(predictor.layout) - predictor.profiled_peak_bytes
            log.warning(
                "--kv-cache-memory-bytes: the static headroom (%.2f GiB) is the GPU less the weights, "
                "the pool and the profile peak; CUDA graphs and non-torch memory are not known to "
                "kvgate: pass --free-memory-bytes from vLLM's start-up log to be exact",
                max(0, headroom) / 2**30,
            )
        else:
            headroom = int(settings.gpu_memory_bytes * (1.0 - deployment.gpu_memory_utilization))
    if headroom is not None:
        headroom = max(0, headroom - predictor.shared_workspace_bytes)
    return Budget(
        kv_blocks=None if blocks is None else max(0, blocks - 1),
        transient_headroom_bytes=headroom,
        max_transient_headroom_bytes=headroom,
        transient_margin=settings.transient_safety_margin,
        profiled_peak_bytes=predictor.profiled_peak_bytes,
    )


def weights_bytes(layout: KVLayout) -> int:
    """One GPU's share of the weights (biases ignored): parameters x dtype / (TP x PP)."""
    g = layout.geometry
    return math.ceil(g.parameter_count() * g.dtype_bytes / (layout.tensor_parallel_size * layout.pipeline_parallel_size))
