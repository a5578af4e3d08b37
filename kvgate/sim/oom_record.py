"""What an engine's CUDA out-of-memory death leaves behind to be diagnosed.

PyTorch's message gives four numbers (requested, free, allocated, reserved but unallocated);
a crash seen once in a hundred benchmark runs cannot be replayed from them: the same size can be
two different tensors (an MLP activation at one token count, a sampler copy at another row
count), and fragmentation and over-admission read alike. The record keeps, beside the message,
what the step asked of the GPU (every scheduled request: prompt, computed and new tokens, drafts,
whether it samples, the sampling parameters that decide the sampler's copies), which part of the
step failed (`phase`: the carried-over sampling metadata, the encoder, the forward pass or the
drafter), the tensor and its size, the step's tensors alive then, and the allocator's segments
(kvgate/sim/gpu.py `CachingAllocator.snapshot`), so the step can be replayed on the allocator as
tests/unit/test_any_cache*.py do.
"""

from __future__ import annotations

from typing import Any

from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.scheduler import SchedulerOutput
from kvgate.sim.step_memory import StepShape


def oom_record(exc: CudaOutOfMemory, phase: str, out: SchedulerOutput, shape: StepShape) -> dict[str, Any]:
    """The structured record of one out-of-memory inside a step (JSON-ready)."""
    return {
        "message": str(exc),
        "phase": phase,
        "tensor": exc.tensor,
        "requested_bytes": exc.requested,
        "live_tensors": dict(exc.live),
        "step": step_record(out, shape),
        "allocator": exc.allocator,
    }


def step_record(out: SchedulerOutput, shape: StepShape) -> dict[str, Any]:
    """The scheduled batch (`shape` is what the engine made of `out`): tokens, sampled rows and
    each request's part."""
    reqs = []
    for s, part in zip(out.scheduled, shape.reqs, strict=True):
        req, sp = s.request, s.request.sampling
        reqs.append(
            {
                "id": req.request_id,
                "prompt_tokens": req.num_prompt_tokens,
                "output_tokens": len(req.output_token_ids),
                "computed_tokens": s.num_context,
                "new_tokens": s.num_new_tokens,
                "draft_tokens": s.num_draft_tokens,
                "kind": "decode" if s.num_context >= req.num_prompt_tokens else "prefill",
                "samples": part.samples,
                "sampling": {
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "top_k": sp.top_k,
                    "min_p": sp.min_p,
                    "logprobs": sp.logprobs,
                    "prompt_logprobs": sp.prompt_logprobs,
                    "penalties": sp.penalties,
                    "structured": sp.structured,
                    "seeded": sp.seed is not None,
                    "logits_processor": sp.logits_processor,
                },
            }
        )
    return {"num_tokens": shape.num_tokens, "sampled_rows": shape.sampled_rows, "requests": reqs}
