"""Start-up as vLLM does it: resolve defaults, load weights, profile, size the KV pool, capture
CUDA graphs, warm up the sampler (V1 only); refuse or die where vLLM refuses or dies.

Model Runner V2 (vllm/v1/worker/gpu/model_runner.py `profile_run`): the same dummy batch, then
`_dummy_sampler_run` on a dummy input batch whose requests are greedy (no logits processing, no
top-k/top-p, no logprobs: "the sampler may skip top_k, top_p, and logprobs"), and no sampler
warm-up after the KV cache; its penalty counts are allocated when the runner is built
(sample/penalties.py `PenaltiesState`), so they count as consumed memory in the profile.
The CUDA context (and, from 0.32, the distributed set-up) sits outside the budget from vLLM 0.7
on (kvgate/sim/flavor.py).

Grounded in vllm/engine/arg_utils.py (`get_batch_defaults`: 8192 batched tokens and 1024
sequences on GPUs of 70 GiB or more that are not A100s, else 2048 and 256),
v1/worker/gpu_worker.py (`determine_available_memory`: KV bytes = total x utilization - weights
- torch peak increase of the profile - non-torch increase [- CUDA graph estimate, kvgate/sim/flavor.py], or
exactly `--kv-cache-memory-bytes`; the start-up check that free memory covers the request),
v1/worker/gpu_model_runner.py (`profile_run`: `_dummy_run(max_num_batched_tokens)` over
`min(tokens, max_num_seqs)` requests with no attention metadata, then `_dummy_sampler_run` with
top-p 0.9 / top-k V-1, no penalties, no logprobs) and v1/core/kv_cache_utils.py (num_blocks =
available // page // layers; the max_model_len check and the log lines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvgate.sim.config import SimConfig
from kvgate.sim.flavor import Flavor
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.kv_layout import KVLayout, build_layout, cdiv
from kvgate.sim.model import ModelConfigError, SimModel, load_model
from kvgate.sim.step_memory import (
    FLASHINFER_WORKSPACE_BYTES,
    ModelDims,
    ReqSlice,
    StepMemory,
    StepShape,
    run_tape,
)
from kvgate.sim.vision import profile_items
from kvgate.units import GiB, MiB
from kvgate.vllm_flags import attention_backend

# CUDA graph pool per captured size and decoder layer (piecewise graphs): fitted to 0.65 GB for
# gemma-3-4b (34 layers) and ~1.3 GB for Llama-4-Maverick (48 layers), 67 sizes each
# (docs/sources.md#kv-cache-memory-pr).
CUDAGRAPH_BYTES_PER_SIZE_LAYER = 320 << 10
# v1/worker/gpu_worker.py `compile_or_warm_up_model`: the margin vLLM leaves in the
# `--kv-cache-memory` it suggests "to fully utilize gpu memory" (`redundancy_buffer_memory`).
REDUNDANCY_BUFFER = 150 * MiB


# mla_attention.py `determine_chunked_prefill_workspace_size`: at most 64k tokens (vLLM 0.32).
MLA_WORKSPACE_CAP = 64 * 1024


class StartupError(RuntimeError):
    """vLLM refused to start (ValueError) or died starting (CUDA OOM); `log` holds the lines
    vLLM had logged before (e.g. "Available KV cache memory" before the max_model_len check)."""

    def __init__(self, message: str, log: list[str] | None = None) -> None:
        super().__init__(message)
        self.log = log or []


@dataclass
class Resolved:
    """The engine parameters after vLLM's defaults are applied."""

    model: SimModel
    flavor: Flavor
    layout: KVLayout
    dims: ModelDims
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    backend: str  # the attention backend's current name (kvgate.vllm_flags.attention_backend)
    capture_sizes: list[int]
    mla_workspace_tokens: int
    num_speculative_tokens: int = 0
    draft: SimModel | None = None  # the speculative draft model, when one is loaded
    draft_dims: ModelDims | None = None

    @property
    def page_bytes(self) -> int:
        """One pool block: a page in every layer slot of one KV cache group."""
        return self.layout.block_bytes


@dataclass
class StartupReport:
    """The numbers vLLM logs at start-up, per GPU."""

    total: int
    requested: int
    weights: int
    persistent: int  # runner state allocated before the profile (V2's penalty counts)
    non_torch: int  # inside the budget ("non-torch forward increase memory")
    context: int  # outside it (CUDA context, communicators), held before the profile
    activation_peak: int
    cudagraph: int
    kv_available: int
    num_gpu_blocks: int
    kv_tokens: int
    max_concurrency: float
    log: list[str] = field(default_factory=list)

    def kv_to_fully_utilize(self, buffer: int = REDUNDANCY_BUFFER) -> int:
        """The `--kv-cache-memory` vLLM suggests "to fully utilize gpu memory": the GPU's free
        memory at start-up (the simulator's GPU starts empty but for the process's context) less
        weights, profile peak, non-torch memory, CUDA graphs and `buffer`."""
        return (
            self.total
            - self.context
            - self.weights
            - self.persistent
            - self.activation_peak
            - self.non_torch
            - self.cudagraph
            - buffer
        )


def resolve(cfg: SimConfig, model: SimModel, total: int) -> Resolved:
    """Apply vLLM's defaults and checks to the configuration."""
    m, tp = model, cfg.tensor_parallel_size
    if m.heads % tp:
        raise StartupError(
            f"Total number of attention heads ({m.heads}) must be divisible by tensor parallel size ({tp})."
        )
    max_len = cfg.max_model_len or m.max_position_embeddings
    if max_len > m.max_position_embeddings:
        raise StartupError(
            f"User-specified max_model_len ({max_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={m.max_position_embeddings} in model's "
            "config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    big = total >= 70 * GiB and "a100" not in cfg.gpu.lower()
    mnbt = cfg.max_num_batched_tokens or (8192 if big else 2048)
    mns = cfg.max_num_seqs or (1024 if big else 256)
    backend = attention_backend(cfg.attention_backend)  # "materializing" is the old name
    if backend == "auto":
        backend = "mla" if m.is_mla else "flash-attn"
    spec_tokens, draft = speculative(cfg)
    try:
        layout = build_layout(m, tp, cfg.kv_cache_dtype, cfg.block_size, draft)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    dims = model_dims(m, tp)
    max_capture = min(mns * 2, 512)
    sizes = [] if cfg.enforce_eager else [1, 2, 4, *range(8, max_capture + 1, 8)]
    workspace = 0
    if m.is_mla:
        block = layout.block_size
        workspace = cdiv(max(min(max(8 * max_len, 4 * mns * block), MLA_WORKSPACE_CAP), block), block) * block
    return Resolved(
        m,
        Flavor.of(cfg, m),
        layout,
        dims,
        max_len,
        mnbt,
        mns,
        layout.block_size,
        backend,
        sizes,
        workspace,
        spec_tokens,
        draft,
        model_dims(draft, tp) if draft else None,
    )


def model_dims(m: SimModel, tp: int) -> ModelDims:
    """Per-GPU widths of `m` at tensor parallelism `tp`."""
    return ModelDims(
        hidden=m.hidden,
        intermediate=m.intermediate // tp,
        q_heads=m.heads // tp,
        kv_heads=max(1, m.kv_heads // tp),
        head_dim=m.head_dim,
        vocab=m.vocab,
        dtype_bytes=m.dtype_bytes,
        num_experts=m.num_experts,
        experts_per_token=m.experts_per_token,
        moe_intermediate=m.moe_intermediate // tp,
        shared_intermediate=m.shared_intermediate // tp,
        dense_layers=m.num_experts > 0 and "dense" in m.mlp_kinds,
        attention_span=attention_span(m),
        kv_lora_rank=m.kv_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
    )


def attention_span(m: SimModel) -> int:
    """How far back the widest attention layer looks: the window (or chunk) when no layer
    attends to the whole context, else 0 (unbounded)."""
    kinds = {k for k in m.layer_kinds if k not in ("mamba", "none")}
    if kinds <= {"sliding", "chunked"} and kinds:
        return max(m.sliding_window or 0, m.attention_chunk or 0)
    return 0


def speculative(cfg: SimConfig) -> tuple[int, SimModel | None]:
    """`--speculative-config`: the draft tokens per step and the draft model, if the method
    runs one (`draft_model`, EAGLE, MTP heads given as `model`; n-gram and suffix look-ups need
    none)."""
    spec = cfg.speculative_config
    if not spec:
        return 0, None
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise StartupError("speculative_config: num_speculative_tokens must be a positive integer")
    name = spec.get("model")
    if spec.get("method") in ("ngram", "suffix") or not name:
        return k, None
    try:
        return k, load_model(str(name), cfg.dtype)
    except (KeyError, ModelConfigError) as exc:
        raise StartupError(f"speculative_config: draft model {name!r}: {exc}") from None


def profile_shape(r: Resolved) -> StepShape:
    """The profile run's dummy batch: tokens split over min(tokens, max_num_seqs) requests; V1
    samples them with top-p 0.9 / top-k V-1, V2 greedily, and from 0.33.0 a second time with the
    warm-up parameters (Flavor.profiles_sampler_warmup: the larger pass is played)."""
    n_tok = r.max_num_batched_tokens
    n_req = min(n_tok, r.max_num_seqs)
    base, extra = divmod(n_tok, n_req)
    warm = r.flavor.profiles_sampler_warmup
    random = not r.flavor.v2 or warm
    logprobs = 5 if warm else None  # sampling_params.py:1490 for_sampler_warmup
    reqs = tuple(
        ReqSlice(base + (1 if i < extra else 0), top_p_k=random, random=random, logprobs=logprobs) for i in range(n_req)
    )
    return StepShape(reqs, attention=False)


def step_memories(r: Resolved) -> tuple[StepMemory, StepMemory | None]:
    """The step tapes of the target model and of the speculative draft model, if any."""
    moe = r.flavor.moe_workspace_tokens(r.max_num_batched_tokens)
    target = StepMemory(r.dims, r.backend, r.mla_workspace_tokens, r.flavor.runner, r.flavor.top_k_top_p, moe)
    if r.draft_dims is None:
        return target, None
    return target, StepMemory(r.draft_dims, "flash-attn", 0, r.flavor.runner, moe_workspace_tokens=moe)


def draft_shape(shape: StepShape) -> StepShape:
    """The draft model's pass over the step (one pass standing for its k proposal steps): the
    same tokens, one greedy proposal row per sampling request."""
    return StepShape(tuple(ReqSlice(r.num_new_tokens, r.num_context, r.samples) for r in shape.reqs), shape.attention)


def v2_penalty_state_bytes(r: Resolved) -> int:
    """`PenaltiesState`: output_bin_counts `max_num_reqs x V` and prompt_bin_mask
    `max_num_reqs x V/32`, int32, allocated with the V2 runner whatever the requests ask."""
    return r.max_num_seqs * (r.dims.vocab + cdiv(r.dims.vocab, 32)) * 4


def sampler_warmup_shape(r: Resolved, seeded: bool = False) -> StepShape:
    """`_dummy_sampler_run` after graph capture: one token per request, max_num_seqs rows."""
    n_req = min(r.max_num_seqs, r.max_num_batched_tokens)
    return StepShape(tuple(ReqSlice(1, top_p_k=True, random=True, seeded=seeded) for _ in range(n_req)), False)


def triton_buffer_bytes(r: Resolved) -> int:
    """V1's cached Triton top-k/top-p buffer (step_memory.TopKTopP.buffer_bytes), made by the
    profile's rows (or its seeded warm-up of forward_native) and kept for good. V2's greedy profile
    never makes it: vLLM allocates it with the first batch that leaves FlashInfer, which the
    simulator does not play (at most SMs x V x 4 B, 66 MB for Llama 3 on an H100)."""
    path, rows = r.flavor.top_k_top_p, min(r.max_num_seqs, r.max_num_batched_tokens)
    if r.flavor.v2 or path.backend == "sort" or rows < path.sort_below_rows:
        return 0
    return path.buffer_bytes(rows, r.dims.vocab)


def native_sampler_warmup(r: Resolved) -> StepShape | None:
    """V1's `_dummy_sampler_run`, where FlashInfer samples, runs the batch again with a seed "to
    warm forward_native" (gpu_model_runner.py, vLLM 0.21.0 - 0.32.0): the Triton or sort path's
    memory is in the profile too."""
    if r.flavor.v2 or r.flavor.top_k_top_p.backend != "flashinfer":
        return None
    return sampler_warmup_shape(r, seeded=True)


def encoder_profile(r: Resolved) -> list[tuple[str, str, int]]:
    """The profile's encoder call on its largest dummy images, where the release makes one
    (Flavor.profiles_encoder; kvgate/sim/vision.py)."""
    tower = r.model.vision
    if tower is None or not r.flavor.profiles_encoder:
        return []
    return tower.encode_tape(profile_items(tower, r.max_num_batched_tokens, r.max_num_seqs, r.max_model_len))


def start(cfg: SimConfig, model: SimModel, device: Device, alloc: CachingAllocator) -> tuple[Resolved, StartupReport]:
    """Bring the engine up on `device`; raises StartupError with vLLM's message on failure."""
    total = device.total
    r = resolve(cfg, model, total)
    tp = cfg.tensor_parallel_size
    log: list[str] = []
    requested = math.ceil(total * cfg.gpu_memory_utilization)
    context = r.flavor.non_torch_outside_budget(cfg)
    alloc.set_non_torch(context)
    free0 = device.free()
    if cfg.kv_cache_memory_bytes is None and free0 < requested and r.flavor.checks_free_memory_at_startup:
        raise StartupError(
            f"Free memory on device ({free0 / GiB:.2f}/{total / GiB:.2f} GiB) on startup is "
            f"less than desired GPU memory utilization ({cfg.gpu_memory_utilization}, "
            f"{requested / GiB:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory "
            "used by other processes."
        )
    params = model.parameter_count() + (r.draft.parameter_count() if r.draft else 0)
    weights = math.ceil(params * model.dtype_bytes / tp)
    non_torch = r.flavor.non_torch_in_budget(cfg)
    steps, draft_steps = step_memories(r)
    try:
        alloc.malloc(weights)
        log.append(f"Model loading took {weights / GiB:.4f} GiB memory")
        persistent = alloc.malloc(v2_penalty_state_bytes(r)).size if r.flavor.v2 else 0
        alloc.set_non_torch(context + non_torch)
        alloc.reset_peak()
        before = alloc.allocated()
        # the MoE workspace the profile's first MoE layer grows; the draft shares it (one manager)
        if workspace := max(s.moe_workspace_bytes() for s in (steps, draft_steps) if s is not None):
            alloc.malloc(workspace)  # kept: vLLM locks it after start-up (workspace.py `lock`)
        if triton := triton_buffer_bytes(r):
            alloc.malloc(triton)  # cached by the profile's top-k/top-p, kept for good
        encoded = run_tape(alloc, encoder_profile(r))  # the dummy images' outputs, held
        run_tape(alloc, steps.plan(profile_shape(r)))
        for block in encoded:
            alloc.free(block)
        if (native := native_sampler_warmup(r)) is not None:
            run_tape(alloc, steps.plan(native))
        if draft_steps:
            run_tape(alloc, draft_steps.plan(draft_shape(profile_shape(r))))
        activation = alloc.peak_allocated - before
        alloc.empty_cache()
    except CudaOutOfMemory as exc:
        raise StartupError(f"torch.OutOfMemoryError: {exc}", log) from exc
    graphs = len(r.capture_sizes) * r.model.attention_layers * CUDAGRAPH_BYTES_PER_SIZE_LAYER
    if cfg.kv_cache_memory_bytes is not None:
        available = cfg.kv_cache_memory_bytes
    else:
        available = requested - weights - persistent - activation - non_torch
        if r.flavor.cudagraphs_in_budget(cfg):
            available -= graphs
    log.append(
        f"Memory profiling takes 1.00 seconds. Total non-KV cache memory: "
        f"{(weights + persistent + activation + non_torch) / GiB:.2f}GiB; torch peak memory "
        f"increase: {activation / GiB:.2f}GiB; non-torch forward increase memory: "
        f"{non_torch / GiB:.2f}GiB; weights memory: {weights / GiB:.2f}GiB."
    )
    log.append(f"Available KV cache memory: {available / GiB:.2f} GiB")
    num_blocks = max(0, available) // r.page_bytes
    check_kv_fits(r, available, log)
    if cfg.num_gpu_blocks_override is not None:
        log.append(f"Overriding num_gpu_blocks={num_blocks} with num_gpu_blocks_override={cfg.num_gpu_blocks_override}")
        num_blocks = cfg.num_gpu_blocks_override
    concurrency = num_blocks / r.layout.max_request_blocks(r.max_model_len, r.max_num_batched_tokens)
    kv_tokens = int(concurrency * r.max_model_len)
    log.append(
        f"GPU KV cache size: {kv_tokens:,} tokens, Maximum concurrency for "
        f"{r.max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
    try:
        layer_bytes = num_blocks * r.layout.page_bytes
        for _ in range(r.layout.layers_per_group):
            alloc.malloc(layer_bytes)
        if r.backend == "flashinfer":
            alloc.malloc(FLASHINFER_WORKSPACE_BYTES)
        if r.mla_workspace_tokens:
            d = r.dims
            alloc.malloc(r.mla_workspace_tokens * (d.kv_lora_rank + d.qk_rope_head_dim) * d.dtype_bytes)
        if r.flavor.profiles_sampler_warmup and graphs:
            # V2's JIT warm-up (vllm 0.33.0 v1/worker/gpu_worker.py `_compile_or_warm_up_model`:
            # `warmup_kernels` before `capture_model`) samples with the warm-up parameters; capture
            # starts with `torch.accelerator.empty_cache()` (v1/worker/gpu/model_runner.py
            # `capture_model`), so none of its segments is cached when serving starts. Without
            # graphs (enforce_eager) 0.33.0 turns the JIT warm-up off (config/vllm.py).
            run_tape(alloc, steps.plan(sampler_warmup_shape(r)))
            alloc.empty_cache()
        if graphs:
            alloc.malloc(graphs, pool="private")
            log.append(f"Graph capturing finished in 5 secs, took {graphs / GiB:.2f} GiB")
        if not r.flavor.v2:  # V1's `_dummy_sampler_run` after capture, kept for good
            run_tape(alloc, steps.plan(sampler_warmup_shape(r)))
            if (native := native_sampler_warmup(r)) is not None:
                run_tape(alloc, steps.plan(native))
    except CudaOutOfMemory as exc:
        raise StartupError(f"torch.OutOfMemoryError: {exc}", log) from exc
    report = StartupReport(
        total,
        requested,
        weights,
        persistent,
        non_torch,
        context,
        activation,
        graphs,
        available,
        num_blocks,
        kv_tokens,
        concurrency,
        log,
    )
    return r, report


def check_kv_fits(r: Resolved, available: int, log: list[str]) -> None:
    """kv_cache_utils.py `check_enough_kv_cache_memory`: after the null block, the pool must hold
    one request of max_model_len in every layer (sliding and chunked layers only their window
    plus the in-flight tokens); else vLLM raises, after it logged the available memory."""
    usable = available - r.page_bytes
    if available <= 0:
        raise StartupError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine.",
            log,
        )
    in_flight = r.max_num_batched_tokens
    needed = r.layout.max_request_bytes(r.max_model_len, in_flight)
    if needed <= usable:
        return
    lo, hi, best = 1, r.max_model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if r.layout.max_request_bytes(mid, in_flight) <= usable:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    estimate = f"Based on the available memory, the estimated maximum model length is {best}. " if best else ""
    raise StartupError(
        f"To serve at least one request with the model's max seq len ({r.max_model_len}), "
        f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV "
        f"cache memory ({usable / GiB:.2f} GiB). {estimate}Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
        log,
    )
