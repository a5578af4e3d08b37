"""The vLLM flags `kvgate advise` proposes: ones the predicted start-up (kvgate/advise_startup.py) says
start, and that leave room for what vLLM's budget does not hold.

Each proposal re-runs the prediction with the changed flag, so a value is proposed only where the
same arithmetic that predicted the failure says it is gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvgate.advise_startup import (
    REDUNDANCY_BUFFER_BYTES,
    Failure,
    Request,
    Startup,
    predict,
)
from kvgate.units import GiB, MiB

# Advice is not given at the edge: a proposed --max-model-len is a multiple of LENGTH_STEP (when
# that leaves one) and a proposed utilization leaves ADVICE_MARGIN_BYTES more than the pool needs,
# so a few MiB kvgate does not model (the RoPE cache, a logged context) do not refuse it again.
LENGTH_STEP = 1024
ADVICE_MARGIN_BYTES = 256 * MiB
# vLLM's --max-num-batched-tokens is proposed in multiples of this (a chunk of whole blocks that
# the CUDA-graph and compile sizes also use).
TOKEN_STEP = 256


@dataclass(frozen=True)
class Recommendation:
    flag: str
    value: int | float
    reason: str


def gib(n: int | float) -> str:
    """Bytes as vLLM prints them."""
    return f"{n / GiB:.2f} GiB"


def round_down_length(tokens: int) -> int:
    """`tokens` rounded down to a multiple of LENGTH_STEP, or to a block when it is shorter."""
    return tokens // LENGTH_STEP * LENGTH_STEP if tokens >= 2 * LENGTH_STEP else tokens // 16 * 16


def serving_failure(s: Startup) -> Failure | None:
    """With --kv-cache-memory-bytes vLLM skips the measurement (the profile ran before the pool):
    a pool that leaves less than the largest plain step (Startup.full_step) beside it starts, then
    dies at the first such step (vLLM PR #56698)."""
    if s.request.kv_cache_memory_bytes is None or s.failure is not None:
        return None
    headroom = s.serving_headroom
    if headroom >= s.full_step:
        return None
    return Failure(
        "first full batch after start-up",
        s.full_step,
        "--kv-cache-memory-bytes",
        f"after the pool, the weights, non-torch memory and CUDA graphs, {gib(max(0, headroom))} are left "
        f"for a step's transient memory; the largest step ({s.max_num_batched_tokens:,} tokens through the "
        f"{'compiled ' if s.release.compiled else ''}forward, or {min(s.max_num_seqs, s.max_num_batched_tokens):,} "
        f"rows sampling with top-k/top-p) needs {gib(s.full_step)}",
    )


def utilization_ceiling(s: Startup, other_processes_bytes: int) -> float:
    """The largest --gpu-memory-utilization that leaves the context (and communicators), the CUDA
    graphs captured outside the budget, other processes and vLLM's 150 MiB buffer outside it."""
    outside = s.outside + s.graphs_outside_budget + other_processes_bytes + REDUNDANCY_BUFFER_BYTES
    return math.floor(100 * (s.gpu_total - outside) / s.gpu_total) / 100


def _largest(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
    """The largest value in [low, high] for which `ok` holds, `ok` being monotone (None: none)."""
    if not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _profile_fits(request: Request) -> bool:
    failure = predict(request).failure
    return failure is None or not failure.step.startswith(("profile_run", "load_model"))


def _fix(s: Startup, other_processes_bytes: int) -> tuple[Request, list[Recommendation]]:
    """The request with the flag each predicted failure names changed, and why."""
    request, reasons = s.request, []
    for _ in range(6):  # each step fixes one failure: profile, pool, graphs, and the pool again
        current = predict(request)
        failure = current.failure
        if failure is None:
            break
        if failure.flag == "--max-num-batched-tokens":
            change = _batched_tokens(request, current, failure)
            if change is None:
                break
            reasons.append(change)
            request = replace(request, max_num_batched_tokens=int(change.value))
        elif failure.flag == "--max-model-len":
            ceiling = utilization_ceiling(current, other_processes_bytes)
            need = current.requested + failure.bytes + current.layout.page_bytes + ADVICE_MARGIN_BYTES
            wanted = math.ceil(100 * need / current.gpu_total) / 100
            if request.kv_cache_memory_bytes is None and wanted <= ceiling:
                reasons.append(
                    Recommendation(
                        "--gpu-memory-utilization",
                        wanted,
                        f"one {current.max_model_len:,}-token request needs {gib(failure.bytes)} more KV cache "
                        f"than the pool's {gib(current.kv_cache_bytes)}; {wanted} gives it room and still "
                        f"leaves the memory outside the budget (at most {ceiling})",
                    )
                )
                request = replace(request, gpu_memory_utilization=wanted)
            else:
                longest = current.estimated_max_model_len or 0
                length = round_down_length(longest)
                if length <= 0:
                    break
                reasons.append(
                    Recommendation(
                        "--max-model-len",
                        length,
                        f"the pool ({gib(current.kv_cache_bytes)}) holds {current.capacity.num_blocks:,} blocks; "
                        f"one {current.max_model_len:,}-token request needs {current.capacity.blocks_per_request:,}; "
                        f"the longest that fits is {longest:,} tokens, rounded down to {length:,} so that a few "
                        "MiB more of profile or context do not refuse it again",
                    )
                )
                request = replace(request, max_model_len=length)
        elif failure.flag == "--gpu-memory-utilization":
            ceiling = utilization_ceiling(current, other_processes_bytes)
            if failure.step.startswith("determine_available_memory"):
                ceiling = max(ceiling, current.utilization)
            if ceiling == current.utilization or ceiling <= 0:
                break
            reasons.append(
                Recommendation(
                    "--gpu-memory-utilization",
                    ceiling,
                    f"{failure.step} at {current.utilization}: {failure.message}; {ceiling} leaves "
                    f"{gib(current.gpu_total * (1 - ceiling))} outside the budget",
                )
            )
            request = replace(request, gpu_memory_utilization=ceiling)
        elif failure.flag == "--tensor-parallel-size":
            change = _tensor_parallel(request, current)
            if change is None:
                break
            reasons.append(change)
            request = replace(request, tensor_parallel_size=int(change.value))
        elif failure.flag == "--kv-cache-memory-bytes":
            request = replace(request, kv_cache_memory_bytes=safe_pool_bytes(current, other_processes_bytes))
        else:
            break
    return request, reasons


def _batched_tokens(request: Request, current: Startup, failure: Failure) -> Recommendation | None:
    """vLLM's default for this GPU when its profile fits (the flag caps tokens per step, not
    concurrency, and vLLM chunks longer prompts), else the largest multiple of TOKEN_STEP that fits."""
    floor = max(current.max_num_seqs, 1)

    def fits(steps: int) -> bool:
        return _profile_fits(replace(request, max_num_batched_tokens=max(floor, steps * TOKEN_STEP)))

    steps = _largest(1, current.max_num_batched_tokens // TOKEN_STEP, fits)
    if steps is None:
        return None
    largest = max(floor, steps * TOKEN_STEP)
    default = predict(replace(request, max_num_batched_tokens=None))
    tokens = min(largest, default.max_num_batched_tokens)
    fixed = predict(replace(request, max_num_batched_tokens=tokens))
    chosen = (
        "vLLM's default on this GPU" if tokens == default.max_num_batched_tokens else "the largest whose profile fits"
    )
    return Recommendation(
        "--max-num-batched-tokens",
        tokens,
        f"at {current.max_num_batched_tokens:,} tokens the start-up profile needs {gib(current.profile_oom_need)} "
        f"beside {gib(current.weights)} of weights on a {gib(current.gpu_total - current.outside)} GPU "
        f"({failure.step}); at {tokens:,} ({chosen}) it needs {gib(fixed.profile_oom_need)}. The flag caps "
        "tokens per step, not concurrency (that is --max-num-seqs); vLLM chunks longer prompts",
    )


# Tensor-parallel sizes vLLM runs on one node (the custom all-reduce's world sizes, kvgate/memory/envelope.py).
TENSOR_PARALLEL_SIZES = (2, 4, 8)


def _tensor_parallel(request: Request, current: Startup) -> Recommendation | None:
    """The smallest tensor parallelism whose weights shard fits one GPU and whose start-up fits
    (vLLM needs the attention heads divisible by it: config/parallel.py verify_with_model_config)."""
    heads = current.layout.geometry.num_attention_heads
    for tp in TENSOR_PARALLEL_SIZES:
        if tp <= request.tensor_parallel_size or heads % tp:
            continue
        trial = predict(replace(request, tensor_parallel_size=tp))
        if trial.failure is None or not trial.failure.step.startswith("load_model"):
            return Recommendation(
                "--tensor-parallel-size",
                tp,
                f"the weights ({gib(current.weights)} per GPU at TP {request.tensor_parallel_size}) do not fit "
                f"one {gib(current.gpu_total)} GPU; at TP {tp} each GPU holds {gib(trial.weights)} ({tp} GPUs)",
            )
    return None


# The Request field each proposed flag sets.
FLAG_FIELDS = {
    "--max-model-len": "max_model_len",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-num-seqs": "max_num_seqs",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--tensor-parallel-size": "tensor_parallel_size",
}


def apply(request: Request, recommended: list[Recommendation]) -> Request:
    """`request` with every proposed flag set (vLLM sizes a fixed pool by --kv-cache-memory-bytes
    and then ignores the utilization for it)."""
    changes: dict[str, Any] = {FLAG_FIELDS[r.flag]: r.value for r in recommended}
    return replace(request, **changes)


def safe_pool_bytes(s: Startup, other_processes_bytes: int) -> int:
    """The --kv-cache-memory-bytes that leaves, on this GPU, room for the weights, the largest
    plain step's transient memory (Startup.full_step), non-torch memory, the CUDA graphs, the memory
    outside vLLM's envelope, other processes and vLLM's own 150 MiB buffer
    (v1/worker/gpu_worker.py compile_or_warm_up_model's suggestion, 0.32.0)."""
    rest = s.gpu_total - s.outside - other_processes_bytes - s.resident + s.kv_cache_bytes - s.full_step
    return max(0, rest - REDUNDANCY_BUFFER_BYTES)


def recommend(
    startup: Startup, request_tokens: int | None = None, other_processes_bytes: int = 0
) -> tuple[Startup, list[Recommendation]]:
    """The start-up with the proposed flags, and the proposals (the changed flags first)."""
    request, changes = _fix(startup, other_processes_bytes)
    advised = predict(request)
    latest = {r.flag: r for r in changes}  # a flag changed twice: its last value and reason
    out = list(latest.values())
    changed = set(latest)
    if advised.failure is not None:
        return advised, out
    if "--max-num-batched-tokens" not in changed:
        sets = "forward pass" if advised.profile_forward >= advised.profile_sampler else "sampler"
        out.append(
            Recommendation(
                "--max-num-batched-tokens",
                advised.max_num_batched_tokens,
                f"the start-up profile at {advised.max_num_batched_tokens:,} tokens needs "
                f"{gib(advised.profile_oom_need)} beside {gib(advised.weights)} of weights (its peak, "
                f"{gib(advised.profile_peak)}, is the {sets}'s): fits",
            )
        )
    ceiling = utilization_ceiling(advised, other_processes_bytes)
    if "--gpu-memory-utilization" not in changed and request.kv_cache_memory_bytes is None:
        value = min(advised.utilization, ceiling)
        graphs = (
            f", CUDA graphs {gib(advised.graphs)} (captured after the pool in vLLM {advised.release.version})"
            if advised.graphs_outside_budget
            else ""
        )
        other = f", other processes {gib(other_processes_bytes)}" if other_processes_bytes else ""
        out.append(
            Recommendation(
                "--gpu-memory-utilization",
                value,
                f"leaves {gib(advised.gpu_total * (1 - value))} outside vLLM's budget for the CUDA context "
                f"{gib(advised.outside)}{graphs}{other} and 150 MiB to spare (at most {ceiling})",
            )
        )
    if advised.release.has_kv_cache_memory_bytes:
        pool = safe_pool_bytes(advised, other_processes_bytes)
        tokens = advised.layout.capacity(pool, advised.max_model_len, advised.max_num_batched_tokens)
        out.append(
            Recommendation(
                "--kv-cache-memory-bytes",
                pool,
                f"{gib(pool)} ({tokens.kv_cache_tokens:,} tokens, {tokens.max_concurrency:.2f}x at "
                f"{advised.max_model_len:,}) leaves the weights {gib(advised.weights)}, a full step's "
                f"transient peak {gib(advised.full_step)}, non-torch {gib(advised.non_torch)}, CUDA graphs "
                f"{gib(advised.graphs)}, the context {gib(advised.outside)} and 150 MiB; vLLM skips its "
                "measurement with this flag, so nothing else checks it",
            )
        )
    seqs = advised.max_num_seqs
    if request_tokens:
        holds = max(1, advised.capacity.num_blocks * advised.block_size // request_tokens)
        value = min(seqs, holds)
        reason = (
            f"the pool holds {holds:,} requests of {request_tokens:,} tokens; more sequences than that "
            "only wait or get preempted"
            if value < seqs
            else f"the pool holds {holds:,} requests of {request_tokens:,} tokens, more than {seqs:,}"
        )
    else:
        value = seqs
        reason = (
            f"the profile sampled {min(seqs, advised.max_num_batched_tokens):,} rows ({gib(advised.profile_sampler)} "
            f"with the step's hidden states); the pool holds {advised.capacity.max_concurrency:.2f} requests of "
            f"{advised.max_model_len:,} tokens (pass --request-tokens for your traffic's length)"
        )
    out.append(Recommendation("--max-num-seqs", value, reason))
    return advised, out
