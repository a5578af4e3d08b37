"""vLLM's start-up, step by step, predicted offline for one release (`kvgate advise`, `kvgate capacity`).

Every number is kvgate's memory model (kvgate/memory/*): the weights (engine_config.weights_bytes),
the profile's peak (activation.profile_forward_bytes / profile_sampler_bytes, with the sampler path
vllm_runner.resolve_runtime picks for the release), the memory outside vLLM's envelope
(envelope.outside_envelope) and the pool (kv.KVLayout.capacity). This module adds what only the
start-up needs, each with the vLLM code it follows:

1. ``Worker.init_device`` (v1/worker/gpu_worker.py): from 0.9.1 V1 refuses when the free memory is
   below ``total x gpu_memory_utilization`` ("Free memory on device ... is less than desired GPU
   memory utilization"); V0 and 0.9.0 do not check.
2. ``load_model``: the weights; more than the GPU holds dies while loading.
3. ``profile_run`` (``determine_available_memory``): ``_dummy_run(max_num_batched_tokens)`` then
   ``_dummy_sampler_run``; it dies if weights + peak do not fit the GPU. With
   ``--kv-cache-memory-bytes`` vLLM 0.32.0 still runs it ("still need a profile run which compiles
   the model") but skips the measurement.
4. The KV budget: ``requested_memory - non_kv_cache_memory`` (weights, the torch peak, the
   profile's non-torch increase), less the CUDA graph estimate from 0.20.0
   (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``: absent in 0.16.0, "0" in 0.18.0 and 0.19.0, "1"
   from 0.20.0; vllm/envs.py). Zero or less: v1/core/kv_cache_utils.py
   ``_check_enough_kv_cache_memory`` "No available memory for the cache blocks".
5. ``check_enough_kv_cache_memory``: one ``max_model_len`` request must fit the pool, else "To
   serve at least one request with the model's max seq len ..." (V0: "The model's max seq len
   ... is larger than the maximum number of tokens that can be stored in KV cache").
6. ``compile_or_warm_up_model`` then ``capture_model``: before 0.20 the graphs are captured after
   the pool, into their own memory pool, outside ``total x utilization``; they die there when that
   rest is too small (vLLM PR #19480: Llama 4 Maverick at utilization 0.99).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from kvgate.engine_config import engine_shape, weights_bytes
from kvgate.gpus import gpu_total_bytes, is_pre_ampere
from kvgate.memory.activation import (
    EngineShape,
    moe_workspace_bytes,
    profile_forward_bytes,
    profile_sampler_bytes,
    sampler_cost,
)
from kvgate.memory.draft import Drafter
from kvgate.memory.envelope import CUDA_CONTEXT_BYTES, NON_TORCH_INCREASE_BYTES, outside_envelope
from kvgate.memory.geometry import ModelGeometry, dtype_bytes
from kvgate.memory.kv import Capacity, KVLayout
from kvgate.memory.sampler import FP32, v2_penalty_state_bytes
from kvgate.memory.vllm_runner import NEWEST_KNOWN, OLDEST_KNOWN, VllmRuntime, resolve_runtime
from kvgate.model_folder import load_geometry, read_model_config
from kvgate.speculative import resolve_drafter
from kvgate.units import GiB, MiB

# vLLM PR #10511's H100 logs (0.6.5): everything outside torch, the CUDA context included, was
# measured inside the budget before 0.7: "non_torch_memory takes 1.79GiB" at TP 1, 3.58 at TP 2.
LEGACY_NON_TORCH_BYTES_PER_RANK = int(1.79 * GiB)
LEGACY_NON_TORCH_UNTIL = Version("0.7.0")
# Before PR #10511 (0.6.5) the profiler's baseline came after CUDA initialisation and charged only
# what grew outside torch: "non_torch_memory=0.35GiB" on an RTX 3090 (vLLM issue #10517, a
# 0.6.4 log of Llama-3.1-8B at TP 1), the CUDA context held beside the budget.
PRE_10511_NON_TORCH_BYTES = int(0.35 * GiB)
PROFILER_10511_SINCE = Version("0.6.5")
# vllm/envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "1" from 0.20.0 (read in 0.16.0,
# 0.18.0, 0.19.0, 0.20.0, 0.21.0, 0.32.0; docs/calibration.md).
GRAPHS_IN_BUDGET_SINCE = Version("0.20.0")
# v1/worker/gpu_worker.py init_device: the free-memory check is in 0.9.1's V1 worker, not 0.9.0's.
FREE_MEMORY_CHECK_SINCE = Version("0.9.1")
# V1 became the default engine in 0.8.0; before 0.11.0 cards older than Ampere still ran V0.
V1_DEFAULT_SINCE = Version("0.8.0")
V0_REMOVED_IN = Version("0.11.0")
# v1/core/kv_cache_utils.py check_enough_kv_cache_memory plans against the pool less the null block
# in 0.32.0 ("Reserve the null block BlockPool permanently holds back"), against the whole pool in
# 0.10.1.1; the releases between were not read (kvgate takes 0.32.0 as the first).
NULL_BLOCK_IN_CHECK_SINCE = Version("0.32.0")
# --kv-cache-memory-bytes came with vLLM PR #19480 (docs/sources.md#kv-cache-memory-pr), 0.10.x.
KV_CACHE_MEMORY_BYTES_SINCE = Version("0.10.0")
# vllm/config/cache.py gpu_memory_utilization: 0.9 in 0.10.1.1, 0.92 in 0.32.0 (the releases between
# were not read: kvgate takes 0.92 from 0.32.0).
DEFAULT_UTILIZATION = 0.9
DEFAULT_UTILIZATION_0_32 = 0.92
UTILIZATION_092_SINCE = Version("0.32.0")
# vllm/engine/arg_utils.py get_batch_defaults (OPENAI_API_SERVER): 8,192 tokens / 1,024 seqs on GPUs
# of 70 GiB or more that are not A100s, 2,048 / 256 below; 0.32.0 adds 16,384 / 1,024 from 160 GiB
# (0.10.1.1 has no such tier). V0 (vllm/engine/arg_utils.py of 0.6 - 0.10): chunked prefill only
# past 32K of context (2,048 tokens), else max(max_model_len, 2,048) tokens; 256 seqs.
BIG_GPU_BYTES = 70 * GiB
HUGE_GPU_BYTES = 160 * GiB
HUGE_GPU_TIER_SINCE = Version("0.32.0")
V0_LONG_CONTEXT = 32 * 1024
V0_DEFAULT_BATCHED_TOKENS = 2048
# CUDA graph pool per captured size and attention layer (piecewise graphs). Public figures:
# Llama-3.1-8B (32 layers, 67 sizes) 0.52 GiB on 0.10.1.1 and 0.69 GiB with 35 full decode graphs
# as well on 0.11 (docs/calibration.md), gemma-3-4b (34 layers, 67 sizes) 0.65 GB
# (docs/sources.md#kv-cache-memory-pr): 254, 337 and 278 KiB per size and layer. kvgate takes the
# largest, so the room it leaves for graphs is not short.
GRAPH_BYTES_PER_SIZE_LAYER = 337 * 1024
# vllm 0.32.0 v1/worker/gpu_worker.py compile_or_warm_up_model: the --kv-cache-memory-bytes vLLM
# suggests leaves "a small buffer (=150MiB) to avoid OOM".
REDUNDANCY_BUFFER_BYTES = 150 * MiB
# torch.compile's profile holds more than the eager tape: the one public figure
# (docs/sources.md#large-max-num-batched-tokens: vLLM 0.10.1, Mistral-7B, 200,000 tokens, H100
# 79.25 GiB) asked for 5.34 GiB with 4.67 GiB free, 13.49 GiB of weights and 0.5 GiB of context:
# 65.9 GiB needed for a forward whose eager tape is 19.1 GiB (hidden 2 T H + MLP 3 T I, x 2 B),
# 3.45 x. The OOM check of a compiled profile multiplies the forward tape by it; the peak vLLM
# reports (torch's max_memory_allocated, which sees no fragmentation) stays the tape's.
COMPILED_FORWARD_FACTOR = 3.45


# The steps before the pool is sized: a failure there leaves no pool to report.
BEFORE_POOL_STEPS = ("init_device", "load_model", "profile_run")


@dataclass(frozen=True)
class Release:
    """The start-up behaviours that differ by vLLM release (see the module docstring)."""

    version: str
    engine: str  # "v0" | "v1"
    compiled: bool  # V1 compiles the model (torch.compile) unless --enforce-eager
    legacy_non_torch: bool
    graphs_in_budget: bool
    checks_free_memory: bool
    default_utilization: float
    has_kv_cache_memory_bytes: bool  # the --kv-cache-memory-bytes flag exists
    null_block_in_check: bool  # check_enough_kv_cache_memory leaves out the pool's null block

    @property
    def usable_blocks_offset(self) -> int:
        """V1's BlockPool holds block 0 back as its null block: no request ever gets it."""
        return 1 if self.engine == "v1" else 0


def _version(text: str) -> Version:
    try:
        return Version(Version(text).base_version)
    except InvalidVersion:
        raise ValueError(f"--vllm-version {text!r} is not a version number (e.g. 0.11.0)") from None


def release_for(version: str, gpu: str, enforce_eager: bool) -> Release:
    v = _version(version)
    v0 = v < V1_DEFAULT_SINCE or (v < V0_REMOVED_IN and is_pre_ampere(gpu))
    return Release(
        version=version,
        engine="v0" if v0 else "v1",
        compiled=not v0 and not enforce_eager,
        legacy_non_torch=v < LEGACY_NON_TORCH_UNTIL,
        graphs_in_budget=v >= GRAPHS_IN_BUDGET_SINCE,
        checks_free_memory=not v0 and v >= FREE_MEMORY_CHECK_SINCE,
        default_utilization=DEFAULT_UTILIZATION_0_32 if v >= UTILIZATION_092_SINCE else DEFAULT_UTILIZATION,
        has_kv_cache_memory_bytes=v >= KV_CACHE_MEMORY_BYTES_SINCE,
        null_block_in_check=not v0 and v >= NULL_BLOCK_IN_CHECK_SINCE,
    )


@dataclass(frozen=True)
class Request:
    """What `kvgate advise` was asked: the model, the GPU and vLLM's flags (None: vLLM's default)."""

    model: str
    gpu: str
    vllm_version: str = NEWEST_KNOWN
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    model_runner: str = "auto"
    sampler: str = "auto"
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 0
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class Failure:
    """Where vLLM's start-up stops: the step, the allocation (or shortfall) and the flag to change."""

    step: str
    bytes: int
    flag: str
    message: str
    kind: str = "dies"  # "dies" (out of memory) or "refuses" (a check raises)


@dataclass(frozen=True)
class Startup:
    """vLLM's start-up as the release would run it."""

    request: Request
    release: Release
    runtime: VllmRuntime
    gpu_total: int
    outside: int  # CUDA context (+ communicators) outside total x utilization
    utilization: float
    requested: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    weights: int
    runner_state: int  # Model Runner V2's penalty state, allocated before the profile
    profile_forward: int
    profile_sampler: int
    profile_oom_need: int  # what the profile needs beside the weights for its OOM check
    # the fused MoE's workspace, made by the profile's forward and kept (activation.moe_workspace_bytes)
    moe_workspace: int
    # the largest plain step once serving: the profile's (compiled) forward, or a step whose every
    # row samples with top-k/top-p (V2's profile is greedy): what a fixed pool must leave room for
    full_step: int
    non_torch: int
    graphs: int
    graph_sizes: int
    kv_cache_bytes: int
    capacity: Capacity
    layout: KVLayout
    failure: Failure | None
    estimated_max_model_len: int | None  # the longest one request may be in the usable blocks
    warnings: tuple[str, ...] = ()

    @property
    def profile_peak(self) -> int:
        return self.moe_workspace + max(self.profile_forward, self.profile_sampler)

    @property
    def fits(self) -> bool:
        return self.failure is None

    @property
    def sized_the_pool(self) -> bool:
        """Whether vLLM got as far as sizing the pool (it logs it before refusing a max_model_len)."""
        return self.failure is None or not self.failure.step.startswith(BEFORE_POOL_STEPS)

    @property
    def graphs_outside_budget(self) -> int:
        return 0 if self.release.graphs_in_budget else self.graphs

    @property
    def resident(self) -> int:
        """What vLLM holds after start-up inside its own accounting: weights, pool, non-torch, graphs."""
        return self.weights + self.runner_state + self.kv_cache_bytes + self.non_torch + self.graphs

    @property
    def serving_headroom(self) -> int:
        """GPU memory left for the transient peak of a step once vLLM has started."""
        return self.gpu_total - self.outside - self.resident


def load_layout(
    model: str,
    *,
    dtype: str = "auto",
    max_model_len: int | None,
    block_size: int | None,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    kv_cache_dtype: str,
    speculative_method: str | None = None,
    speculative_model: str | None = None,
    release: str | None = None,
) -> tuple[ModelGeometry, KVLayout, int]:
    """The model's geometry, its KV layout under these flags and max_model_len (ValueError: bad input);
    `release`: the vLLM version, whose speculative methods decide the draft (None: before 0.33)."""
    geometry = load_geometry(model)
    if dtype != "auto":
        geometry = replace(geometry, dtype_bytes=dtype_bytes(dtype))
    length = max_model_len or geometry.max_position_embeddings
    if not length:
        raise ValueError("config.json has no max_position_embeddings; pass --max-model-len")
    if block_size is None and geometry.is_hybrid_state:
        raise ValueError(
            "this model keeps a recurrent state in some layers, and vLLM sizes its blocks to "
            "fit one state page: pass the block size vLLM logs (--block-size)"
        )
    drafter: Drafter | None = None
    if speculative_method or speculative_model:
        target_config = json.loads((Path(model) / "config.json").read_text())
        drafter = resolve_drafter(speculative_method, speculative_model, geometry, target_config, release=release)
    layout = KVLayout(
        geometry,
        block_size=block_size or 16,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
        draft=drafter,
    )
    return geometry, layout, int(length)


def batch_defaults(release: Release, gpu: str, total: int, max_model_len: int) -> tuple[int, int]:
    """vLLM's `vllm serve` defaults for --max-num-batched-tokens and --max-num-seqs on this GPU."""
    if release.engine == "v0":
        tokens = V0_DEFAULT_BATCHED_TOKENS if max_model_len > V0_LONG_CONTEXT else max(max_model_len, 2048)
        return tokens, 256
    if total >= HUGE_GPU_BYTES and _version(release.version) >= HUGE_GPU_TIER_SINCE:
        return 16384, 1024
    if total >= BIG_GPU_BYTES and "a100" not in gpu.lower():
        return 8192, 1024
    return 2048, 256


def graph_capture_sizes(request: Request, release: Release, max_num_seqs: int, batched_tokens: int) -> int:
    """How many batch sizes vLLM captures a CUDA graph for (0 with --enforce-eager).

    V1 0.10.1.1 (config/__init__.py, scheduler.py cuda_graph_sizes): [1, 2, 4] + every 8 up to
    min(2 x max_num_seqs, 512); 0.32.0 (config/vllm.py): every 8 below 256, every 16 from 256 to
    the same maximum, capped at max_num_batched_tokens. V0: every size up to the first of those at
    or above max_num_seqs."""
    if request.enforce_eager:
        return 0
    if request.cudagraph_capture_sizes:
        return len({s for s in request.cudagraph_capture_sizes if s <= batched_tokens})
    if release.engine == "v0":
        top = next(s for s in [1, 2, 4, *range(8, 8193, 8)] if s >= min(max_num_seqs, 8192))
        return len([s for s in [1, 2, 4, *range(8, 8193, 8)] if s <= top])
    top = min(request.max_cudagraph_capture_size or min(2 * max_num_seqs, 512), batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top]
    if _version(release.version) >= UTILIZATION_092_SINCE:
        sizes += [*range(8, min(top + 1, 256), 8), *range(256, top + 1, 16)]
    else:
        sizes += list(range(8, top + 1, 8))
    return len(sizes)


def _runtime(request: Request, release: Release, geometry: ModelGeometry, config: dict[str, Any]) -> VllmRuntime:
    """vLLM's runner and sampler for the release; releases before any kvgate read for V2 run V1."""
    before_v2 = _version(request.vllm_version) < Version(OLDEST_KNOWN)
    return resolve_runtime(
        request.vllm_version,
        "v1" if before_v2 or release.engine == "v0" else request.model_runner,
        architectures=config.get("architectures") or (),
        is_moe=geometry.is_moe,
        is_hybrid=geometry.is_hybrid_state,
        quantized="quantization_config" in config,
        speculative_method=request.speculative_method,
        sampler=request.sampler,
    )


def _random_step_bytes(geometry: ModelGeometry, engine: EngineShape) -> int:
    """A step of max_num_batched_tokens tokens whose every row samples with top-k/top-p: V2's
    profile is greedy, so its fp32 copy and top-k/top-p path are not in the peak
    (kvgate/memory/sampler.py, profiled and unprofiled parts of one stage)."""
    cost = sampler_cost(geometry, engine)
    rows = cost.profiled_rows
    stage = cost.stage(rows, False, False, 0, random=True, processing=True, filtered=True)
    hidden = engine.max_num_batched_tokens * geometry.hidden_size * geometry.dtype_bytes
    return hidden + stage.profiled + stage.unprofiled - stage.sample_hidden // 2


def predict(request: Request) -> Startup:
    """vLLM's start-up for `request` (ValueError: input vLLM itself would reject as a flag error)."""
    total = gpu_total_bytes(request.gpu)
    release = release_for(request.vllm_version, request.gpu, request.enforce_eager)
    geometry, layout, max_model_len = load_layout(
        request.model,
        dtype=request.dtype,
        max_model_len=request.max_model_len,
        block_size=request.block_size,
        tensor_parallel_size=request.tensor_parallel_size,
        pipeline_parallel_size=request.pipeline_parallel_size,
        kv_cache_dtype=request.kv_cache_dtype,
        speculative_method=request.speculative_method,
        speculative_model=request.speculative_model,
        release=request.vllm_version,
    )
    if request.kv_cache_memory_bytes is not None and not release.has_kv_cache_memory_bytes:
        raise ValueError(f"vLLM {release.version} has no --kv-cache-memory-bytes (added in 0.10)")
    config = read_model_config(request.model)
    runtime = _runtime(request, release, geometry, config)
    # Before the oldest release kvgate read for the runner rule, advise plays V1 (no V2 then).
    older = _version(request.vllm_version) < Version(OLDEST_KNOWN)
    warnings: tuple[str, ...] = (runtime.warning,) if runtime.warning and not older else ()
    if "quantization_config" in config:
        warnings += (
            "config.json has a quantization_config: kvgate sizes the weights at the model's dtype, more "
            "than a quantized checkpoint holds, so the pool it predicts is too small",
        )
    default_tokens, default_seqs = batch_defaults(release, request.gpu, total, max_model_len)
    tokens = request.max_num_batched_tokens or default_tokens
    seqs = request.max_num_seqs or default_seqs
    if tokens < seqs:  # vllm/config/scheduler.py verify_max_model_len / _verify_args
        raise ValueError(f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs ({seqs})")
    utilization = request.gpu_memory_utilization or release.default_utilization
    tp = request.tensor_parallel_size
    if _version(release.version) < PROFILER_10511_SINCE:
        outside, non_torch = request.cuda_context_bytes, PRE_10511_NON_TORCH_BYTES
    elif release.legacy_non_torch:
        outside, non_torch = 0, LEGACY_NON_TORCH_BYTES_PER_RANK * tp
    else:
        outside = outside_envelope(tp, request.cuda_context_bytes, release.version).total
        non_torch = NON_TORCH_INCREASE_BYTES
    engine = engine_shape(
        runtime,
        max_model_len=max_model_len,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        tensor_parallel_size=request.tensor_parallel_size,
        num_speculative_tokens=request.num_speculative_tokens,
    )
    forward = profile_forward_bytes(geometry, engine)
    sampler = profile_sampler_bytes(geometry, engine)
    workspace = moe_workspace_bytes(geometry, engine)  # held beside both phases
    oom_need = max(int(forward * COMPILED_FORWARD_FACTOR) if release.compiled else forward, sampler)
    full_step = workspace + max(oom_need, _random_step_bytes(geometry, engine))
    oom_need += workspace
    sizes = graph_capture_sizes(request, release, seqs, tokens)
    startup = Startup(
        request=request,
        release=release,
        runtime=runtime,
        gpu_total=total,
        outside=outside,
        utilization=utilization,
        requested=int(total * utilization),
        max_model_len=max_model_len,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        block_size=layout.block_size,
        weights=weights_bytes(layout),
        runner_state=v2_penalty_state_bytes(seqs, geometry.vocab_size) if runtime.runner == "v2" else 0,
        profile_forward=forward,
        profile_sampler=sampler,
        full_step=full_step,
        profile_oom_need=oom_need,
        moe_workspace=workspace,
        non_torch=non_torch,
        graphs=sizes * layout.layers_per_stage * GRAPH_BYTES_PER_SIZE_LAYER,
        graph_sizes=sizes,
        kv_cache_bytes=0,
        capacity=layout.capacity(0, max_model_len, tokens),
        layout=layout,
        failure=None,
        estimated_max_model_len=None,
    )
    if request.kv_cache_memory_bytes is not None:
        available = request.kv_cache_memory_bytes
    else:
        graphs_in = startup.graphs if release.graphs_in_budget else 0
        held = startup.weights + startup.runner_state + startup.profile_peak + non_torch + graphs_in
        available = startup.requested - held
    startup = replace(
        startup,
        kv_cache_bytes=max(0, available),
        capacity=layout.capacity(max(0, available), max_model_len, tokens),
    )
    failure = _before_pool(startup, geometry) or _pool(startup, available) or _after_pool(startup)
    estimated = None
    if failure is not None and failure.flag == "--max-model-len":  # what a request can really get
        usable = startup.capacity.num_blocks - release.usable_blocks_offset
        estimated = _estimated_max_model_len(layout, usable, max_model_len, tokens)
    return replace(startup, failure=failure, estimated_max_model_len=estimated, warnings=warnings)


def _before_pool(s: Startup, geometry: ModelGeometry) -> Failure | None:
    """init_device's free-memory check, load_model, profile_run."""
    usable = s.gpu_total - s.outside  # what this process can allocate on an otherwise empty GPU
    if s.release.checks_free_memory and usable < s.requested:
        return Failure(
            "init_device: free-memory check",
            s.requested - usable,
            "--gpu-memory-utilization",
            f"Free memory on device ({usable / GiB:.2f}/{s.gpu_total / GiB:.2f} GiB) on startup is less "
            f"than desired GPU memory utilization ({s.utilization}, {s.requested / GiB:.2f} GiB)",
            kind="refuses",
        )
    if s.weights > usable:
        return Failure(
            "load_model: weights",
            s.weights,
            "--tensor-parallel-size",
            f"the weights ({s.weights / GiB:.2f} GiB per GPU) do not fit the GPU's {usable / GiB:.2f} GiB",
        )
    if s.weights + s.runner_state + s.non_torch + s.profile_oom_need <= usable:
        return None
    tokens, rows, tp = (
        s.max_num_batched_tokens,
        min(s.max_num_batched_tokens, s.max_num_seqs),
        s.layout.tensor_parallel_size,
    )
    if s.profile_oom_need > s.profile_sampler:
        tensor = tokens * (geometry.intermediate_size // tp) * geometry.dtype_bytes
        what, flag = f"the MLP intermediate [{tokens}, {geometry.intermediate_size // tp}]", "--max-num-batched-tokens"
    else:
        tensor = rows * geometry.vocab_size * FP32
        what, flag = f"the sampler's fp32 logits [{rows}, {geometry.vocab_size}]", "--max-num-seqs"
    return Failure(
        "profile_run: out of memory",
        tensor,
        flag,
        f"the profile needs {(s.weights + s.runner_state + s.non_torch + s.profile_oom_need) / GiB:.2f} GiB "
        "with the weights, "
        f"the GPU has {usable / GiB:.2f} GiB: {what} ({tensor / GiB:.2f} GiB) is an allocation that fails",
    )


def _pool(s: Startup, available: int) -> Failure | None:
    """The KV budget, check_enough_kv_cache_memory, and the pool's allocation."""
    if available <= 0:
        return Failure(
            "determine_available_memory: no KV cache memory",
            -available,
            "--gpu-memory-utilization",
            "No available memory for the cache blocks: the weights, the profile peak and non-torch "
            f"memory take {(s.requested - available) / GiB:.2f} GiB of the {s.requested / GiB:.2f} GiB requested",
            kind="refuses",
        )
    cap, layout = s.capacity, s.layout
    if cap.blocks_per_request > cap.num_blocks - (1 if s.release.null_block_in_check else 0):
        needed = cap.blocks_per_request * layout.page_bytes * layout.group_size
        if s.release.engine == "v0":  # V0 worker/worker.py raise_if_cache_size_invalid
            message = (
                f"The model's max seq len ({s.max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in KV cache ({cap.num_blocks * layout.block_size})."
            )
        else:
            checked = cap.num_blocks - (1 if s.release.null_block_in_check else 0)
            estimated = _estimated_max_model_len(layout, checked, s.max_model_len, s.max_num_batched_tokens)
            message = (
                f"To serve at least one request with the model's max seq len ({s.max_model_len}), "
                f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
                f"memory ({available / GiB:.2f} GiB). Based on the available memory, the estimated maximum "
                f"model length is {estimated}."
            )
        return Failure(
            "check_enough_kv_cache_memory: max_model_len does not fit",
            needed - available,
            "--max-model-len",
            message,
            "refuses",
        )
    # With --kv-cache-memory-bytes the pool is not bounded by the budget: the profile's freed blocks
    # go back to the GPU on the allocator's OOM retry, so the pool needs the rest beside the weights
    # and non-torch memory (initialize_kv_cache).
    usable = s.gpu_total - s.outside
    fixed = s.weights + s.runner_state + s.non_torch
    if s.request.kv_cache_memory_bytes is not None and fixed + available > usable:
        return Failure(
            "initialize_kv_cache: out of memory",
            available,
            "--kv-cache-memory-bytes",
            f"the pool ({available / GiB:.2f} GiB), the weights and non-torch memory need "
            f"{(fixed + available) / GiB:.2f} GiB, the GPU has {usable / GiB:.2f} GiB",
        )
    return None


def _after_pool(s: Startup) -> Failure | None:
    """capture_model: graphs in their own pool, outside the budget before 0.20.

    The profile's blocks stay cached in the general pool (vLLM's warm-up reuses them), so the
    graphs need memory beyond max(requested, what the pool, weights and profile hold)."""
    if not s.graphs or s.release.graphs_in_budget:
        return None
    allocated = s.weights + s.runner_state + s.non_torch + s.kv_cache_bytes + s.profile_peak
    # a fixed pool is not bounded by total x utilization; otherwise vLLM filled it to that
    held = allocated if s.request.kv_cache_memory_bytes is not None else max(s.requested, allocated)
    rest = s.gpu_total - s.outside - held
    if s.graphs <= rest:
        return None
    flag = "--kv-cache-memory-bytes" if s.request.kv_cache_memory_bytes else "--gpu-memory-utilization"
    return Failure(
        "capture_model: CUDA graphs out of memory",
        s.graphs,
        flag,
        f"{s.graph_sizes} CUDA graphs need about {s.graphs / GiB:.2f} GiB after the pool, outside the budget; "
        f"{max(0, rest) / GiB:.2f} GiB are left",
    )


def _estimated_max_model_len(layout: KVLayout, blocks: int, max_model_len: int, tokens: int) -> int:
    """vLLM's ``estimate_max_model_len``: the longest length whose request fits the pool (binary search)."""
    low, high = 0, max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        if layout.max_request_blocks(mid, min(tokens, mid)) <= blocks:
            low = mid
        else:
            high = mid - 1
    return low
