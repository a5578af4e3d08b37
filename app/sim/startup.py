"""Start-up as vLLM does it: resolve defaults, load weights, profile, size the KV pool, capture
CUDA graphs, warm up the sampler; refuse or die where vLLM refuses or dies.

Grounded in vllm/engine/arg_utils.py (`get_batch_defaults`: 8192 batched tokens and 1024
sequences on GPUs of 70 GiB or more that are not A100s, else 2048 and 256),
v1/worker/gpu_worker.py (`determine_available_memory`: KV bytes = total x utilization - weights
- torch peak increase of the profile - non-torch increase [- CUDA graph estimate from v0.21], or
exactly `--kv-cache-memory-bytes`; the start-up check that free memory covers the request),
v1/worker/gpu_model_runner.py (`profile_run`: `_dummy_run(max_num_batched_tokens)` over
`min(tokens, max_num_seqs)` requests with no attention metadata, then `_dummy_sampler_run` with
top-p 0.9 / top-k V-1, no penalties, no logprobs) and v1/core/kv_cache_utils.py (num_blocks =
available // page // layers; the max_model_len check and the log lines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from app.memory.geometry import ModelGeometry
from app.memory.kv import kv_cache_dtype_bytes
from app.sim.config import GiB, MiB, SimConfig
from app.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from app.sim.step_memory import (
    FLASHINFER_WORKSPACE_BYTES,
    ModelDims,
    ReqSlice,
    StepMemory,
    StepShape,
    run_tape,
)

# Non-torch memory per GPU (CUDA context growth, NCCL, cuBLAS workspaces): 1.79 GiB at TP 1 and
# 3.58 GiB at TP 2 for Llama-3-8B on H100 (vLLM PR #10511); linear in TP through both points.
NON_TORCH_PER_TP_RANK = int(1.79 * GiB)
# CUDA graph pool per captured size and decoder layer (piecewise graphs): fitted to 0.65 GB for
# gemma-3-4b (34 layers) and ~1.3 GB for Llama-4-Maverick (48 layers), 67 sizes each
# (docs/sources.md#kv-cache-memory-pr).
CUDAGRAPH_BYTES_PER_SIZE_LAYER = 320 << 10
# v1/worker/gpu_worker.py `compile_or_warm_up_model`: the margin vLLM leaves in the
# `--kv-cache-memory` it suggests "to fully utilize gpu memory" (`redundancy_buffer_memory`).
REDUNDANCY_BUFFER = 150 * MiB


class StartupError(RuntimeError):
    """vLLM refused to start (ValueError) or died starting (CUDA OOM)."""


@dataclass
class Resolved:
    """The engine parameters after vLLM's defaults are applied."""

    geometry: ModelGeometry
    dims: ModelDims
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_dtype_bytes: int
    backend: str
    capture_sizes: list[int]
    mla_workspace_tokens: int
    page_bytes: int  # one block, all layers


@dataclass
class StartupReport:
    """The numbers vLLM logs at start-up, per GPU."""

    total: int
    requested: int
    weights: int
    non_torch: int
    activation_peak: int
    cudagraph: int
    kv_available: int
    num_gpu_blocks: int
    kv_tokens: int
    max_concurrency: float
    log: list[str] = field(default_factory=list)

    def kv_to_fully_utilize(self, buffer: int = REDUNDANCY_BUFFER) -> int:
        """The `--kv-cache-memory` vLLM suggests "to fully utilize gpu memory": the GPU (free at
        start-up: the simulator's GPU starts empty) less weights, profile peak, non-torch memory,
        CUDA graphs and `buffer`."""
        return (self.total - self.weights - self.activation_peak - self.non_torch
                - self.cudagraph - buffer)


def resolve(cfg: SimConfig, geometry: ModelGeometry, total: int) -> Resolved:
    """Apply vLLM's defaults and checks to the configuration."""
    g, tp = geometry, cfg.tensor_parallel_size
    if g.num_attention_heads % tp:
        raise StartupError(
            f"Total number of attention heads ({g.num_attention_heads}) must be divisible by "
            f"tensor parallel size ({tp})."
        )
    max_len = cfg.max_model_len or g.max_position_embeddings
    if max_len > g.max_position_embeddings:
        raise StartupError(
            f"User-specified max_model_len ({max_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={g.max_position_embeddings} in model's "
            "config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    big = total >= 70 * GiB and "a100" not in cfg.gpu.lower()
    mnbt = cfg.max_num_batched_tokens or (8192 if big else 2048)
    mns = cfg.max_num_seqs or (1024 if big else 256)
    backend = cfg.attention_backend
    if backend == "auto":
        backend = "mla" if g.is_mla else "flash-attn"
    block = cfg.block_size or (64 if g.is_mla else 16)
    kv_dt = kv_cache_dtype_bytes(cfg.kv_cache_dtype, g.dtype_bytes)
    dims = ModelDims(
        hidden=g.hidden_size,
        intermediate=g.intermediate_size // tp,
        q_heads=g.num_attention_heads // tp,
        kv_heads=max(1, g.num_kv_heads // tp),
        head_dim=g.head_dim,
        vocab=g.vocab_size,
        dtype_bytes=g.dtype_bytes,
        num_experts=g.num_experts if g.is_moe else 0,
        experts_per_token=g.experts_per_token if g.is_moe else 0,
        moe_intermediate=(g.moe_intermediate_size or 0) // tp,
        shared_intermediate=g.shared_expert_intermediate_size // tp,
        kv_lora_rank=g.kv_lora_rank or 0,
        qk_rope_head_dim=g.qk_rope_head_dim or 0,
        qk_nope_head_dim=g.qk_nope_head_dim or 0,
        v_head_dim=g.v_head_dim or 0,
    )
    if g.is_mla:
        per_layer = block * (dims.kv_lora_rank + dims.qk_rope_head_dim) * kv_dt
    else:
        per_layer = 2 * block * dims.kv_heads * dims.head_dim * kv_dt
    max_capture = min(mns * 2, 512)
    sizes = [] if cfg.enforce_eager else [1, 2, 4, *range(8, max_capture + 1, 8)]
    workspace = 0
    if g.is_mla:
        workspace = max(min(max(8 * max_len, 4 * mns * block), 128 * 1024), mns * block)
    return Resolved(
        g, dims, max_len, mnbt, mns, block, kv_dt, backend, sizes, workspace,
        per_layer * g.num_layers,
    )


def profile_shape(r: Resolved) -> StepShape:
    """The profile run's dummy batch: tokens split over min(tokens, max_num_seqs) requests."""
    n_tok = r.max_num_batched_tokens
    n_req = min(n_tok, r.max_num_seqs)
    base, extra = divmod(n_tok, n_req)
    reqs = tuple(
        ReqSlice(base + (1 if i < extra else 0), top_p_k=True, random=True) for i in range(n_req)
    )
    return StepShape(reqs, attention=False)


def sampler_warmup_shape(r: Resolved) -> StepShape:
    """`_dummy_sampler_run` after graph capture: one token per request, max_num_seqs rows."""
    n_req = min(r.max_num_seqs, r.max_num_batched_tokens)
    return StepShape(tuple(ReqSlice(1, top_p_k=True, random=True) for _ in range(n_req)), False)


def start(cfg: SimConfig, geometry: ModelGeometry, device: Device,
          alloc: CachingAllocator) -> tuple[Resolved, StartupReport]:
    """Bring the engine up on `device`; raises StartupError with vLLM's message on failure."""
    total = device.total
    r = resolve(cfg, geometry, total)
    tp = cfg.tensor_parallel_size
    log: list[str] = []
    requested = int(total * cfg.gpu_memory_utilization)
    free0 = device.free()
    if cfg.kv_cache_memory_bytes is None and free0 < requested:
        raise StartupError(
            f"Free memory on device ({free0 / GiB:.2f}/{total / GiB:.2f} GiB) on startup is "
            f"less than desired GPU memory utilization ({cfg.gpu_memory_utilization}, "
            f"{requested / GiB:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory "
            "used by other processes."
        )
    weights = math.ceil(geometry.parameter_count() * geometry.dtype_bytes / tp)
    non_torch = cfg.non_torch_bytes if cfg.non_torch_bytes is not None else (
        NON_TORCH_PER_TP_RANK * tp)
    steps = StepMemory(r.dims, r.backend, r.mla_workspace_tokens)
    try:
        alloc.malloc(weights)
        log.append(f"Model loading took {weights / GiB:.4f} GiB memory")
        alloc.set_non_torch(non_torch)
        alloc.reset_peak()
        before = alloc.allocated()
        run_tape(alloc, steps.plan(profile_shape(r)))
        activation = alloc.peak_allocated - before
        alloc.empty_cache()
    except CudaOutOfMemory as exc:
        raise StartupError(f"torch.OutOfMemoryError: {exc}") from exc
    graphs = len(r.capture_sizes) * geometry.num_layers * CUDAGRAPH_BYTES_PER_SIZE_LAYER
    if cfg.kv_cache_memory_bytes is not None:
        available = cfg.kv_cache_memory_bytes
    else:
        available = requested - weights - activation - non_torch
        if cfg.cudagraph_memory_in_budget:
            available -= graphs
    log.append(
        f"Memory profiling takes 1.00 seconds. Total non-KV cache memory: "
        f"{(weights + activation + non_torch) / GiB:.2f}GiB; torch peak memory increase: "
        f"{activation / GiB:.2f}GiB; non-torch forward increase memory: "
        f"{non_torch / GiB:.2f}GiB; weights memory: {weights / GiB:.2f}GiB."
    )
    log.append(f"Available KV cache memory: {available / GiB:.2f} GiB")
    num_blocks = max(0, available) // r.page_bytes
    if cfg.num_gpu_blocks_override is not None:
        log.append(f"Overriding num_gpu_blocks={num_blocks} with "
                   f"num_gpu_blocks_override={cfg.num_gpu_blocks_override}")
        num_blocks = cfg.num_gpu_blocks_override
    if num_blocks <= 0:
        raise StartupError("No available memory for the cache blocks. Try increasing "
                           "`gpu_memory_utilization` when initializing the engine.")
    per_req_blocks = -(-r.max_model_len // r.block_size)
    if num_blocks < per_req_blocks:
        needed = per_req_blocks * r.page_bytes
        est = num_blocks * r.block_size
        raise StartupError(
            f"To serve at least one request with the models's max seq len "
            f"({r.max_model_len}), ({needed / GiB:.2f} GiB KV cache is needed, which is larger "
            f"than the available KV cache memory ({available / GiB:.2f} GiB). Based on the "
            f"available memory, the estimated maximum model length is {est}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
        )
    try:
        layer_bytes = num_blocks * r.page_bytes // geometry.num_layers
        for _ in range(geometry.num_layers):
            alloc.malloc(layer_bytes)
        if r.backend == "flashinfer":
            alloc.malloc(FLASHINFER_WORKSPACE_BYTES)
        if r.mla_workspace_tokens:
            d = r.dims
            alloc.malloc(r.mla_workspace_tokens * (d.kv_lora_rank + d.qk_rope_head_dim)
                         * d.dtype_bytes)
        if graphs:
            alloc.malloc(graphs, pool="private")
            log.append(f"Graph capturing finished in 5 secs, took {graphs / GiB:.2f} GiB")
        run_tape(alloc, steps.plan(sampler_warmup_shape(r)))
    except CudaOutOfMemory as exc:
        raise StartupError(f"torch.OutOfMemoryError: {exc}") from exc
    kv_tokens = num_blocks * r.block_size
    concurrency = kv_tokens / r.max_model_len
    log.append(f"GPU KV cache size: {kv_tokens:,} tokens")
    log.append(f"Maximum concurrency for {r.max_model_len:,} tokens per request: "
               f"{concurrency:.2f}x")
    report = StartupReport(total, requested, weights, non_torch, activation, graphs, available,
                           num_blocks, kv_tokens, concurrency, log)
    return r, report
