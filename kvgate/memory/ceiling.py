"""The most an idle server ever offers one request, which "could this ever fit" is judged against.

The budget (kvgate/gate/budget.py) knows the live limits and hands out a Ceiling; the predictor
(kvgate/predict.py) knows which engine requests a request becomes and judges them against it.
Both read this module, so neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.frozen_values import direct_init
from kvgate.memory.demand import Demand


def transient_charge(unprofiled: int, profiled: int, profiled_cap: int | None, segment_overhead: float = 0.0) -> int:
    """What transient bytes count against the headroom: the unprofiled ones, plus the profiled
    ones up to `profiled_cap` when the headroom comes from GPU readings (it then includes the part
    of vLLM's profile region the engine emptied; None: a headroom from flags, beside the region).
    Profiled bytes that come out of free memory take the caching allocator's segments, not just
    their bytes: `segment_overhead` is the profile step's segments beyond its allocated peak, as a
    share of the peak (kvgate/memory/activation.py `profile_segment_overhead_bytes`), charged in
    proportion: S13's 400 MiB region takes 480 MiB."""
    if profiled_cap is None:
        return unprofiled
    charged = min(profiled_cap, profiled)
    return unprofiled + charged + math.ceil(charged * segment_overhead)


def transient_need_of_profiled(profiled: int, profiled_cap: int | None, segment_overhead: float) -> int:
    """`transient_charge`'s profiled part."""
    return transient_charge(0, profiled, profiled_cap, segment_overhead)


@dataclass(frozen=True)
class StepHoldings:
    """What the worst step of the in-flight requests holds, by the phase of the step it lives in.

    One vLLM step runs the model's forward pass, then the lm_head and the sampler on the sampled
    rows (vllm 0.32.0 ``v1/worker/gpu/model_runner.py`` ``execute_model`` then ``sample``; V1
    ``v1/worker/gpu_model_runner.py`` ``execute_model`` then ``_sample``). The decoder layers'
    intermediates (MLP, QKV, attention output) are freed layer by layer inside ``model(...)``
    (model_executor/models/llama.py ``LlamaDecoderLayer.forward`` rebinds them), so when the
    lm_head runs only the final hidden states ``[T, H]`` are left of the forward pass. The
    caching allocator hands the freed blocks to the sampler's tensors: the profiled forward terms
    and the sampler stage are never alive at once, and the step needs the larger of the two
    phases, not their sum.

    - `unprofiled`: the prefill terms outside the profile (attention over a computed context, MLA's
      up-projection, prompt logprobs, encoder outputs, V2's held prompt logprobs, LoRA buffers):
      counted in both phases (the cautious side: they are not all forward-pass tensors);
    - `forward_profiled`: the open prefills' profiled terms (hidden states, MLP or MoE);
    - `residual_profiled`: of those, the final hidden states the lm_head reads, which the sampler
      phase still holds (the residual is dead once the model returns: kvgate/memory/activation.py
      `_hidden_states_term`);
    - `sampler_unprofiled` and `sampler_profiled`: the batch's sampler stage (kvgate/memory/sampler.py).
    """

    unprofiled: int
    forward_profiled: int
    residual_profiled: int
    sampler_unprofiled: int
    sampler_profiled: int
    sampled_rows: int = 0  # rows the stage samples (sizes the sampler phase's segment overhead)
    # V1 with a penalty row: of `sampler_unprofiled`, the bin counts and the two prompt-id copies
    # (kvgate/memory/sampler.py), and the longest prompt the ids are padded to
    penalty_bytes: int = 0
    penalty_prompt: int = 0
    # whether its sampler phase copies the logits to fp32 (V1 always; V2 when a row needs
    # processing: kvgate/memory/sampler.py `SamplerStage.copies_logits`)
    copies_logits: bool = True
    # the largest segment its steps can leave cached, in rows of a copying step
    # (kvgate/memory/sampler.py `SamplerCost.segment_rows`)
    segment_rows: int = 0
    # whether a row asks for logprobs (V1: the batch's log-softmax, a [rows, V] fp32 tensor)
    logprobs: bool = False

    @property
    def transient_bytes(self) -> int:
        """The unprofiled bytes of the worst step (what calibration compares with the GPU)."""
        return self.unprofiled + self.sampler_unprofiled

    @property
    def profiled_bytes(self) -> int:
        """The profiled bytes of the larger phase."""
        return max(self.forward_profiled, self.residual_profiled + self.sampler_profiled)

    def profiled_charge(self, charge: int) -> int:
        """Of this step's `charge` (`step_charge`), the profiled bytes at their segments: what is
        not its unprofiled terms (the profile region's part of the larger phase)."""
        return max(0, charge - self.unprofiled - self.sampler_unprofiled)


def forward_phase_bytes(
    step: StepHoldings, profiled_cap: int, forward_cap: int | None = None, forward_bytes_per_token: int = 0
) -> int:
    """The profiled bytes of `step_charge`'s forward phase before their segment overhead: the open
    prefills' profiled terms and the decoding rows' tokens, at most `profiled_cap` and `forward_cap`."""
    # the decoding requests' tokens (one a sampled row) go through the same forward pass
    forward = step.forward_profiled + step.sampled_rows * forward_bytes_per_token
    return min(profiled_cap, forward, forward_cap if forward_cap else forward)


def step_charge(
    step: StepHoldings,
    profiled_cap: int | None,
    segment_overhead: float = 0.0,
    forward_cap: int | None = None,
    forward_bytes_per_token: int = 0,
    residual_cap: int | None = None,
    sampler_overhead: Callable[[int, int, bool], int] | None = None,
    sampler_overhead_scale: float = 1.0,
    forward_overhead: float | None = None,
    sampler_runs: bool = False,
) -> int:
    """What the worst step charges against the headroom: its unprofiled prefill terms and the
    larger of its two phases (`StepHoldings`). The forward phase is the open prefills' profiled
    terms and the decoding rows' tokens at `forward_bytes_per_token` each, at most `forward_cap`
    (one step computes at most max_num_batched_tokens tokens: the profile's own forward pass,
    kvgate/memory/activation.py `profile_forward_bytes`); the sampler phase is the stage with the
    hidden states it reads, those of the open prefills at most `residual_cap` (a step's
    max_num_batched_tokens tokens: the profile's final hidden states). Each phase's profiled bytes, up to `profiled_cap`, take their
    caching-allocator segments (`segment_overhead`, the forward tape's replay,
    kvgate/memory/activation.py `profile_segment_overhead_bytes`); beside others (a nonzero
    `segment_overhead`) the sampler phase's is `sampler_overhead(rows, tokens)`, the replay of
    its tensors after the step's forward pass of `tokens` tokens (kvgate/memory/activation.py
    `sampler_phase_overhead_bytes`: the final hidden states pin a segment of the forward pass's,
    the logits and their fp32 copy split what is cached) times `sampler_overhead_scale` (relaxed
    on the GPU's evidence, kvgate/telemetry/calibration.py `observe_slack`), and never less than
    the same share (which the GPU's growth may have raised, `Calibration.observe_region`).

    Like the share, the replay is charged only on the phase's profiled bytes that come out of free
    memory: in proportion min(`profiled_cap`, phase) / phase, so nothing where `profiled_cap` is 0,
    the engine holding the region, as kvgate's readings found on V1 in benchmarks S3, S4 and S12
    (vLLM 0.31.0 and 0.32.0 ``v1/worker/gpu_worker.py`` ``compile_or_warm_up_model``: after
    ``capture_model`` it runs ``_dummy_run`` of min(max_num_seqs, max_num_batched_tokens) tokens and
    ``_dummy_sampler_run`` to "preallocate memory buffer for logits and other sampling related
    tensors of max possible shape to avoid memory fragmentation issue"; those blocks stay cached in
    the engine's reserved memory, which is not headroom; kvgate/telemetry/headroom.py). Charging the
    whole replay there cost benchmark S4 (V1, fixed pool) all but 29 of its 1,500 requests: two
    requests' 34 MiB of replayed overhead against a live transient limit of 9 MiB. Model
    Runner V2 warms no sampler up after capture: its region comes back whole (`profiled_cap` the
    profile peak) and the replay counts in full.

    `forward_overhead`, where given, is the forward phase's share instead of `segment_overhead`
    (0 where the served steps' replay says the step runs in the headroom whatever ran before it:
    kvgate/gate/budget.py `Budget.shared_step_fits`). `sampler_runs`: the whole step, its sampler
    phase after its forward pass, runs in the headroom from every cache the other requests' steps
    can leave (kvgate/gate/budget.py `Budget.whole_step_runs`), which bounds every history where
    the replay after one earlier step samples one: the sampler phase is charged no overhead.

    With `profiled_cap` None (a headroom from flags, beside the profile region) only the
    unprofiled bytes count, as `transient_charge` does."""
    if profiled_cap is None:
        return step.unprofiled + step.sampler_unprofiled
    forward = forward_phase_bytes(step, profiled_cap, forward_cap, forward_bytes_per_token)
    residual = min(step.residual_profiled, residual_cap) if residual_cap else step.residual_profiled
    phase = residual + step.sampler_profiled
    sampler = min(profiled_cap, phase)
    forward += math.ceil(forward * (segment_overhead if forward_overhead is None else forward_overhead))
    share = 0 if sampler_runs else math.ceil(sampler * segment_overhead)
    if sampler_overhead is not None and segment_overhead and forward_bytes_per_token and sampler and not sampler_runs:
        tokens = math.ceil(step.forward_profiled / forward_bytes_per_token) + step.sampled_rows
        replayed = sampler_overhead(step.sampled_rows, tokens, step.copies_logits)
        replayed = math.ceil(replayed * sampler_overhead_scale)
        # the replay is the phase's overhead out of free memory: only its part out of free memory
        # takes it (none where the engine holds the region, profiled_cap 0: V1, see above)
        replayed = -(-replayed * sampler // phase)
        share = max(share, replayed)  # a share learned from the GPU above the replay's still counts
    sampler += share
    sampler += step.sampler_unprofiled
    return step.unprofiled + max(forward, sampler)


@direct_init
@dataclass(frozen=True)
class Ceiling:
    """vLLM's whole KV pool and the largest transient headroom kvgate has seen (less its safety
    margin); None where unknown, which judges nothing."""

    kv_blocks: int | None
    transient_bytes: int | None
    profiled_cap_bytes: int | None = None
    segment_overhead: float = 0.0
    # a request alone -> whether its forward pass is charged its allocated bytes (Budget.ceiling:
    # its worst step after earlier ones, or its steps from an empty cache); None: always, the
    # segment overhead never counts.
    lone_fits: Callable[[Demand], bool] | None = None

    def _overhead(self, demand: Demand) -> float:
        """The segment overhead its profiled terms are charged alone (see Budget.ceiling)."""
        if self.lone_fits is None or self.lone_fits(demand):
            return 0.0
        return self.segment_overhead

    def profiled_need(self, demand: Demand) -> int:
        """The forward phase of `transient_need`: the profile region's forward tensors (hidden
        states, MLP), at their segments where they count so."""
        return transient_need_of_profiled(
            demand.profiled_prefill_bytes, self.profiled_cap_bytes, self._overhead(demand)
        )

    def transient_need(self, demand: Demand) -> int:
        """What `demand` holds of the transient headroom on an idle server: its own steps' larger
        phase (`step_charge`), at the allocated peak unless its forward pass alone may strand
        segments (see Budget.ceiling)."""
        return step_charge(demand_step(demand), self.profiled_cap_bytes, self._overhead(demand))


def demand_step(demand: Demand) -> StepHoldings:
    """One request's worst step alone on the engine."""
    sampler = demand.sampler.alone if demand.sampler else None
    return StepHoldings(
        unprofiled=demand.transient_prefill_bytes,
        forward_profiled=demand.profiled_prefill_bytes,
        residual_profiled=demand.profiled_residual_bytes,
        sampler_unprofiled=sampler.unprofiled if sampler else 0,
        sampler_profiled=sampler.profiled if sampler else 0,
        sampled_rows=sampler.rows if sampler else 0,
        copies_logits=sampler.copies_logits if sampler else True,
        segment_rows=sampler.segment_rows if sampler else 0,
        logprobs=bool(sampler.logprobs) if sampler else False,
    )
