"""What an engine's CUDA out-of-memory death leaves behind to be diagnosed.

PyTorch's message gives four numbers (requested, free, allocated, reserved but unallocated);
a crash seen once in a hundred benchmark runs cannot be replayed from them: the same size can be
two different tensors (an MLP activation at one token count, a sampler copy at another row
count), and fragmentation and over-admission read alike. The record keeps, beside the message,
what the step asked of the GPU (every scheduled request: prompt, computed and new tokens, drafts,
whether it samples, the sampling parameters that decide the sampler's copies), which part of the
step failed (`phase`: the carried-over sampling metadata, the encoder, the forward pass or the
drafter), the tensor and its size, the step's tensors alive then, and the allocator's segments
(kvgate/sim/gpu.py `CachingAllocator.snapshot`) at the failure and as the step began, so the
step can be replayed on the allocator as tests/unit/test_any_cache*.py do.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.request import Sampling
from kvgate.sim.scheduler import SchedulerOutput
from kvgate.sim.step_memory import StepShape


def oom_record(
    exc: CudaOutOfMemory, phase: str, out: SchedulerOutput, shape: StepShape, cache_before: dict[str, Any]
) -> dict[str, Any]:
    """The structured record of one out-of-memory inside a step (JSON-ready). `cache_before` is
    the allocator's snapshot as the step began: giving the live tensors back to the state at the
    failure merges the blocks they split, so only it replays the step's best fits exactly."""
    return {
        "message": str(exc),
        "phase": phase,
        "tensor": exc.tensor,
        "requested_bytes": exc.requested,
        "live_tensors": dict(exc.live),
        "step": step_record(out, shape),
        "allocator": exc.allocator,
        "allocator_before_step": cache_before,
    }


# The sampling parameters that decide which of the sampler's copies a step makes
# (kvgate/sim/step_memory.py `StepMemory._sampler`); a request's record names those it sets.
SAMPLER_DECIDING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "logprobs",
    "prompt_logprobs",
    "penalties",
    "structured",
    "seed",
    "logits_processor",
)
REQUEST_COLUMNS = (
    "id",
    "prompt_tokens",
    "output_tokens",
    "computed_tokens",
    "new_tokens",
    "draft_tokens",
    "kind",
    "samples",
    "sampling",
)


def step_record(out: SchedulerOutput, shape: StepShape) -> dict[str, Any]:
    """The scheduled batch (`shape` is what the engine made of `out`): tokens, sampled rows and
    one row per request under `columns` (a batch of hundreds stays a few KiB in a benchmark's
    notes); `sampling` holds only the sampler-deciding parameters the request sets."""
    defaults = {f.name: f.default for f in fields(Sampling)}
    rows = []
    for s, part in zip(out.scheduled, shape.reqs, strict=True):
        req, sp = s.request, s.request.sampling
        rows.append(
            [
                req.request_id,
                req.num_prompt_tokens,
                len(req.output_token_ids),
                s.num_context,
                s.num_new_tokens,
                s.num_draft_tokens,
                "decode" if s.num_context >= req.num_prompt_tokens else "prefill",
                part.samples,
                {k: getattr(sp, k) for k in SAMPLER_DECIDING if getattr(sp, k) != defaults[k]},
            ]
        )
    return {
        "num_tokens": shape.num_tokens,
        "sampled_rows": shape.sampled_rows,
        "columns": list(REQUEST_COLUMNS),
        "requests": rows,
    }
