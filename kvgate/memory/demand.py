"""A request's demand on the GPU, in the units the ledger and the budget count."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvgate.memory.activation import SharedStepExtra, StepForwardBound
from kvgate.memory.sampler import SamplerUse


@dataclass(frozen=True)
class Demand:
    """What one request asks of the GPU if admitted."""

    prompt_tokens: int
    max_new_tokens: int
    shared_block_hashes: tuple[int, ...]
    private_blocks: int
    transient_prefill_bytes: int
    # Terms the start-up profile measured (MLP, hidden states): they live in the profile region,
    # which only a live GPU reading can show taken by someone else.
    profiled_prefill_bytes: int = 0
    # Of those, the final hidden states of its chunk (the `residual` stage's part the sampler phase
    # holds, TransientTerm.into_sampler): still alive when the lm_head and the sampler run
    # (kvgate/memory/ceiling.py StepHoldings), where its MLP's and its residual's blocks are free again.
    profiled_residual_bytes: int = 0
    # Its part of every step's sampler stage, which the ledger sizes for the whole batch.
    sampler: SamplerUse | None = None
    # Output tokens per sequence the KV reservation covers (learned, see outputs.py); None: all.
    reserved_new_tokens: int | None = None
    # Variance of its KV blocks at the end, from the spread of learned output lengths (blocks^2):
    # the budget keeps a margin for the sum over the in-flight requests.
    kv_variance_blocks: float = 0.0
    sequences: int = 1  # prompts x n: how the output token count splits when it finishes
    # Engine requests per sequence: 1, or its max_tokens under beam search, which runs one engine
    # request per beam per output token (kvgate/sampling_params.py SamplingParams.beam_search).
    beam_iterations: int = 1
    # Its answers' lengths are the model's choice (no ignore_eos, no min_tokens): the learned
    # output lengths (kvgate/output_lengths.py) may learn from them.
    teaches_output_lengths: bool = True
    # Of transient_prefill_bytes, what it holds across its prefill's steps (V2's prompt logprobs
    # of earlier steps, kvgate/memory/activation.py v2_prompt_logprobs): the ledger sums these over
    # the open prefills, where the rest of each is one step's and only the largest counts.
    transient_held_bytes: int = 0
    # What its prefill takes more when other requests' tokens share its steps (V2's prompt
    # logprobs over the whole step: kvgate/memory/activation.py SharedStepExtra); the ledger adds
    # it, as held, for the tokens the others in flight can put in a step.
    shared_step: SharedStepExtra | None = None
    # The most tokens it puts in one engine step while it prefills (each prompt's chunk x n, at
    # most max_num_batched_tokens) and while it decodes (its sequences x (1 + speculative
    # tokens)): what it adds to the steps of another request's V2 prompt logprobs. None: unknown,
    # any number (the others' steps are then taken as full).
    step_tokens: int | None = None
    decode_tokens: int | None = None
    # KV blocks beyond private_blocks it may grow to by max_tokens (its reservation may expect
    # fewer outputs): while the in-flight requests fit vLLM's pool at full growth, vLLM never
    # preempts one, whose resumption would prefill its prompt and outputs again. None: unknown.
    growth_blocks: int | None = None
    # Of its one-step bytes, what stays alive while another request in the same step makes its
    # own: V1's prompt-logprobs loop frees one request's tensors only when the next request's
    # replace them (kvgate/predict.py PROMPT_LOGPROBS_ALIVE_V1); the ledger adds the second
    # largest of these over the open prefills to the largest one-step term.
    step_pair_bytes: int = 0
    # The most of its prompts' MLA up-projections (new tokens and computed context) one step holds,
    # whoever shares the step (kvgate/memory/activation.py mla_prompt_upproject_bytes, prompts x n):
    # the ledger sums these over the open prefills into `step_bound`.
    upproject_bytes: int = 0
    # The deployment's bound on one step's forward pass (kvgate/memory/activation.py
    # StepForwardBound): however many prefills are open, the ledger charges their summed profiled
    # forward terms at most this; None: only the profile's forward pass caps them (the budget).
    step_bound: StepForwardBound | None = None

    @cached_property
    def kv_blocks(self) -> int:
        """Blocks this request holds at full growth, counting its shared prefix as its own
        (read several times a request: the set of its hashes is built once)."""
        return len(set(self.shared_block_hashes)) + self.private_blocks

    @property
    def engine_requests(self) -> int:
        """The engine requests vLLM runs for it, at most: each observes one first token
        (kvgate/gate/plain_prefills.py)."""
        return self.sequences * self.beam_iterations

    @property
    def reserved_tokens(self) -> int:
        return self.max_new_tokens if self.reserved_new_tokens is None else self.reserved_new_tokens

    @property
    def transient_bytes(self) -> int:
        """Unprofiled transient memory at this request's worst step (its prefill), alone."""
        return self.transient_prefill_bytes + (self.sampler.alone.unprofiled if self.sampler else 0)

    @property
    def profiled_bytes(self) -> int:
        """Profiled memory at its worst step, alone: the larger of its forward pass and its
        sampler phase with the hidden states it reads (kvgate/memory/ceiling.py StepHoldings)."""
        sampler = self.sampler.alone.profiled if self.sampler else 0
        return max(self.profiled_prefill_bytes, self.profiled_residual_bytes + sampler)
