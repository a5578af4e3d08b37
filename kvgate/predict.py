"""From a parsed request and its token ids to the demand the gate weighs, or NeverFits.

This is the glue between the pure memory model and the gate: it applies the max_tokens policy,
combines the footprints of a request with several prompts, and turns each never-fits case into an
error that names the numbers and what to change.

A request with several prompts (a completions prompt list or token-id batch, pooling inputs,
score/rerank pairs) is, to vLLM, one engine request per prompt and per sample: vLLM 0.32.0
entrypoints/openai/completion/serving.py `create_completion` renders every prompt and
`generate`s each as its own request (`f"{request_id}-{i}"`), merged back into one answer; n > 1
fans each out into n child requests (v1/engine/parallel_sampling.py ParentRequest). The
scheduler (v1/core/sched/scheduler.py `schedule`) takes them like any others: as many as the KV
pool and the step's token budget (max_num_batched_tokens) allow, the rest wait or are preempted
(recomputed later), never refused. So "never fits" is judged per engine request, and the
reservation is what vLLM can hold of them at once (docs/memory-model.md, "Requests with several
prompts").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial

from kvgate.errors import ContextTooLong, KvNeverFits, TransientNeverFits
from kvgate.memory.activation import (
    EngineShape,
    SamplingShape,
    SharedStepExtra,
    TransientEstimate,
    TransientTerm,
    estimate_transient,
    mla_prompt_upproject_bytes,
    prefill_chunk,
    sampler_cost,
    step_forward_bound,
)
from kvgate.memory.ceiling import Ceiling
from kvgate.memory.demand import Demand
from kvgate.memory.encoder import EncoderBudget, stand_in_tiles
from kvgate.memory.footprint import Footprint, kv_blocks_for, predict_footprint, with_reservation
from kvgate.memory.kv import KVLayout, PrefixKeys
from kvgate.memory.outputs import OutputReserver
from kvgate.memory.sampler import SamplerUse
from kvgate.request import ValidRequest
from kvgate.sampling_params import v2_filters, v2_sampler_needs
from kvgate.units import MiB

# What helps when one prompt's own worst step is too large (by its largest term).
_ADVICE = {
    "prompt_logprobs": "drop prompt_logprobs or shorten the prompt",
    "logprobs": "ask for fewer logprobs or a smaller n",
    "penalties": "drop the penalties or lower n",
    "penalty_prompt_ids": "drop the penalties or lower n",
}
# vLLM 0.32.0 v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict` (V1 runner) computes each
# request's prompt logprobs in a Python loop over the step's requests: the previous request's
# logits and scores stay referenced until the next iteration rebinds them, so at most two
# requests' tensors are alive at once, over at most max_num_batched_tokens prompt tokens.
PROMPT_LOGPROBS_ALIVE_V1 = 2


# Distinct (prompt length, sampling shape) pairs whose transient estimate a predictor keeps.
TRANSIENT_MEMO_SIZE = 4096


def peak_of(terms: Sequence[TransientTerm]) -> int:
    """The most of these terms alive at once, by the estimate's own stage rules."""
    return TransientEstimate(tuple(terms)).peak_bytes


@dataclass(frozen=True)
class TransientSplit:
    """One footprint's transient terms as the demand counts them: the peak of its unprofiled
    prefill terms, of its profiled terms overall and in the prefill phase. (Its decode terms are
    the sampler's, which the ledger sizes per batch from the demand's SamplerUse.)"""

    prefill: int
    profiled: int
    profiled_prefill: int
    # Of `prefill`, what the request holds from step to step (unprofiled residual terms: V2's
    # prompt logprobs of earlier steps): concurrent prefills each hold theirs at once.
    held: int = 0
    # Of `profiled_prefill`, the hidden states alive into the sampler phase (Demand.profiled_residual_bytes).
    profiled_residual: int = 0

    @classmethod
    def of(cls, transient: TransientEstimate) -> TransientSplit:
        per_request = [t for t in transient.terms if not t.profiled and not t.shared]
        in_profile = [t for t in transient.terms if t.profiled]
        prefill_terms = [t for t in per_request if t.phase == "prefill"]
        profiled_prefill = [t for t in in_profile if t.phase == "prefill"]
        return cls(
            prefill=peak_of(prefill_terms),
            profiled=peak_of(in_profile),
            profiled_prefill=peak_of(profiled_prefill),
            held=sum(t.bytes for t in prefill_terms if t.stage == "residual"),
            profiled_residual=sum(t.into_sampler for t in profiled_prefill if t.stage == "residual"),
        )


@dataclass(frozen=True)
class Prediction:
    prompt_tokens: int
    max_new_tokens: int
    footprints: tuple[Footprint, ...]
    demand: Demand
    sampling: SamplingShape = field(default_factory=SamplingShape)  # what every prompt asks

    @property
    def transient_terms(self) -> list[TransientTerm]:
        return [term for fp in self.footprints for term in fp.transient.terms]

    @property
    def transient_peak_bytes(self) -> int:
        return sum(fp.transient.peak_bytes for fp in self.footprints)

    @property
    def max_kv_blocks(self) -> int:
        """KV blocks at full growth to max_tokens (the reservation may expect less)."""
        return self.demand.kv_blocks + sum(fp.max_kv_blocks - fp.kv_blocks for fp in self.footprints)


def image_items(ids: Sequence[int]) -> list[int]:
    """Each image's embeddings in the prompt, in order: kvgate/multimodal.py gives every feature
    token of one image the same negative stand-in id."""
    counts: dict[int, int] = {}
    for token in ids:
        if token < 0:
            counts[token] = counts.get(token, 0) + 1
    return list(counts.values())


def image_tiles(ids: Sequence[int]) -> list[int]:
    """The tiles each image's stand-in carries (kvgate/memory/encoder.py `stand_in_tiles`), in
    `image_items`' order."""
    return [stand_in_tiles(token) for token in dict.fromkeys(t for t in ids if t < 0)]


class Predictor:
    """Memory model settings of one deployment, applied to one request at a time."""

    def __init__(
        self,
        layout: KVLayout,
        engine: EngineShape,
        enable_prefix_caching: bool,
        profiled_peak_bytes: int,
        default_max_tokens: int | None = None,
        outputs: OutputReserver | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
        encoder: EncoderBudget | None = None,
    ) -> None:
        self.layout = layout
        self.encoder = encoder  # the vision encoder's budgets; None: no images charged
        self.sampling_defaults = dict(sampling_defaults or {})  # generation_config.json's
        self.outputs = outputs
        self.engine = engine
        self.enable_prefix_caching = enable_prefix_caching
        self.profiled_peak_bytes = profiled_peak_bytes
        self.default_max_tokens = default_max_tokens
        self.sampler_cost = sampler_cost(layout.geometry, engine)
        self.step_bound = step_forward_bound(layout.geometry, engine)  # None: no context parts to sum
        # Engine-wide workspaces (one per engine, kept once allocated) do not grow per request.
        self.shared_workspace_bytes = estimate_transient(layout.geometry, engine, 1, SamplingShape()).shared_bytes
        # A request's transient estimate is a pure function of its prompt length and sampling
        # shape here (geometry and engine are this predictor's): each pair is estimated once.
        self.transient = lru_cache(maxsize=TRANSIENT_MEMO_SIZE)(self._transient)
        # A SamplerUse is a frozen value of its fields and this predictor's sampler cost; making
        # one computes its `alone` stage (a sixth of a short chat's prediction): each is made once.
        self._sampler_use = lru_cache(maxsize=TRANSIENT_MEMO_SIZE)(partial(SamplerUse, self.sampler_cost))

    def _transient(self, prompt_tokens: int, sampling: SamplingShape) -> tuple[TransientEstimate, TransientSplit]:
        estimate = estimate_transient(self.layout.geometry, self.engine, prompt_tokens, sampling)
        return estimate, TransientSplit.of(estimate)

    def max_new_tokens(self, spec: ValidRequest, prompt_tokens: int) -> int:
        """max_tokens if given (at most the context the prompt leaves, where vLLM clamps it
        rather than refusing); else what vLLM would allow (or the configured reservation)."""
        room = self.engine.max_model_len - prompt_tokens
        clamped = spec.context_caps_output or not self.engine.max_tokens_past_context_refused
        asked = spec.sampling.max_tokens
        if asked is not None and clamped:
            return max(1, min(asked, room))
        if asked is not None:
            return asked
        if self.default_max_tokens is not None:
            return max(1, min(self.default_max_tokens, room))
        return max(1, room)

    @staticmethod
    def min_new_tokens(spec: ValidRequest, max_new_tokens: int) -> int:
        """Output tokens each sequence will surely generate (vLLM 0.32.0): with ignore_eos the end
        of sequence never stops it (vllm/v1/core/sched/utils.py check_stop), so only max_tokens or
        the context's end does; with min_tokens nothing stops it before that many
        (MinTokensLogitsProcessor in vllm/v1/sample/logits_processor/builtin.py masks the stop
        tokens, and check_stop returns early)."""
        if spec.sampling.ignore_eos:
            return max_new_tokens
        return min(spec.sampling.min_tokens, max_new_tokens)

    def truncation_length(self, spec: ValidRequest) -> int:
        """The tokens vLLM keeps of each prompt for `truncate_prompt_tokens` (set on `spec`): k
        as given; -1 the most the release lets a prompt have (vllm/renderers/params.py
        TokenizeParams): max_model_len for pooling requests (they ask for no output); for
        generation, up to 0.31.0 `max_input_tokens` = max_model_len - max_tokens, from 0.32.0
        `max_truncation_tokens` = max_model_len - 1 when max_tokens is given (else
        max_model_len; from 0.33.0 max_model_len - 1 for a chat request without max_tokens too)."""
        assert spec.truncation is not None
        keep = spec.truncation.tokens
        if keep >= 0:
            return keep
        limit = self.engine.max_model_len
        output = 0 if spec.prefill_only else spec.sampling.max_tokens or 0
        if self.engine.max_tokens_past_context_refused:
            return max(0, limit - output)
        holds_one = output or (self.engine.truncation_holds_output_token and not spec.prefill_only)
        return limit - 1 if holds_one else limit

    def predict(
        self, spec: ValidRequest, prompts: Sequence[Sequence[int]], cache_key: tuple[str | None, ...] | None = None
    ) -> Prediction:
        """`cache_key`: what besides the token ids keys every one of vLLM's prefix-cache blocks for
        this request (a LoRA adapter's ("lora", name, path)); with the request's cache_salt, which
        keys its first block (kvgate/memory/kv.py PrefixKeys), only requests vLLM lets share blocks
        share them here. The request is checked against the server's limits before it is
        tokenized (kvgate/request.py check_limits); its prompts' lengths are checked here."""
        top_k, top_p = v2_filters(spec.sampling, self.sampling_defaults)
        processing, filtered = v2_sampler_needs(spec.sampling, self.sampling_defaults, (top_k, top_p))
        sampling = SamplingShape(
            n=spec.sampling.n,
            best_of=spec.best_of,
            logprobs=spec.sampling.engine_logprobs,
            prompt_logprobs=spec.sampling.prompt_logprobs,
            penalties=spec.sampling.penalties,
            random=not spec.sampling.greedy,
            structured=spec.sampling.structured_outputs,
            processing=processing,
            filtered=filtered,
            top_k=top_k,
            top_p=top_p,
            beam_search=spec.sampling.beam_search,
        )
        footprints, splits = [], []
        keys = PrefixKeys.of(spec.cache_salt, cache_key)
        logprob_prompts: list[int] = []
        splittable = False
        for ids, from_text in zip(prompts, spec.prompts_from_text, strict=True):
            max_new = self.max_new_tokens(spec, len(ids))
            self._check_context_length(spec, len(ids), from_text)
            transient, split = self.transient(len(ids), sampling)
            if self.encoder is not None and ids and min(ids) < 0:
                images = self.encoder.terms(
                    image_items(ids), split.profiled_prefill, self.profiled_peak_bytes, image_tiles(ids)
                )
                transient = TransientEstimate(transient.terms + tuple(images))
                split = TransientSplit.of(transient)
            floor = self.min_new_tokens(spec, max_new)
            footprints.append(
                predict_footprint(
                    self.layout,
                    self.engine,
                    ids,
                    max_new,
                    sampling,
                    enable_prefix_caching=self.enable_prefix_caching,
                    reservation=self.outputs.reserve(max_new, floor) if self.outputs else None,
                    transient=transient,
                    prefix_keys=keys,
                    min_new_tokens=floor,
                )
            )
            splits.append(split)
            if spec.sampling.prompt_logprobs is not None and self.engine.runner == "v2" and ids:
                logprob_prompts.append(len(ids))
                splittable = splittable or min(ids) < 0  # an encoder's budget may cut its prompt
        demand = self._demand(footprints, sampling, self.sampler_use(spec, footprints, sampling), splits)
        if logprob_prompts:
            assert spec.sampling.prompt_logprobs is not None
            shared = SharedStepExtra(
                self.layout.geometry,
                self.engine,
                tuple(logprob_prompts),
                spec.sampling.prompt_logprobs,
                splittable,
            )
            demand = replace(demand, shared_step=shared)
        return Prediction(
            prompt_tokens=sum(len(ids) for ids in prompts),
            max_new_tokens=max(fp.max_new_tokens for fp in footprints),
            footprints=tuple(footprints),
            demand=demand,
            sampling=sampling,
        )

    def sampler_use(self, spec: ValidRequest, footprints: Sequence[Footprint], sampling: SamplingShape) -> SamplerUse:
        """What the request puts in the sampler's batch: every prompt's n rows, its longest prompt
        and output; its Model Runner V2 needs (logits processing, top-k/top-p, which filters) as
        predict found them for `sampling` (worked out once a request)."""
        return self._sampler_use(
            rows=sum(fp.n for fp in footprints),
            longest_prompt=max(fp.prompt_tokens for fp in footprints),
            logprobs=spec.sampling.engine_logprobs is not None,
            penalties=spec.sampling.penalties,
            longest_output=max(fp.max_new_tokens for fp in footprints),
            random=not spec.sampling.greedy,
            all_vocab_logprobs=spec.sampling.engine_logprobs == -1,
            structured=spec.sampling.structured_outputs,
            processing=sampling.processing,
            filtered=sampling.filtered,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )

    def refreshed(self, prediction: Prediction) -> Demand:
        """The demand with the output reservation learned since it was predicted: a request that
        waited in the queue is admitted with what kvgate knows at admission, not at arrival."""
        if self.outputs is None:
            return prediction.demand
        footprints = [
            with_reservation(
                fp,
                self.layout,
                self.engine,
                self.outputs.reserve(fp.max_new_tokens, fp.min_new_tokens),
                self.enable_prefix_caching,
            )
            for fp in prediction.footprints
        ]
        if all(new is old for new, old in zip(footprints, prediction.footprints, strict=True)):
            return prediction.demand
        demand = self._demand(footprints, prediction.sampling, prediction.demand.sampler)
        return replace(demand, shared_step=prediction.demand.shared_step)

    def _demand(
        self,
        footprints: Sequence[Footprint],
        sampling: SamplingShape,
        sampler: SamplerUse | None,
        splits: Sequence[TransientSplit] | None = None,
    ) -> Demand:
        """Sums the footprints' KV and prefill terms; their sampler terms are `sampler`, which the
        ledger sizes with the rest of the batch."""
        shared: list[int] = []
        private = profiled = profiled_prefill = residual = held = pair = 0
        variance = 0.0
        for i, fp in enumerate(footprints):
            hashes = fp.block_hashes if self.enable_prefix_caching else ()
            shared.extend(hashes)
            private += fp.kv_blocks - len(set(hashes))
            variance += fp.n * fp.reserved_variance
            split = splits[i] if splits is not None else TransientSplit.of(fp.transient)
            held += split.held
            profiled = max(profiled, split.profiled)
            profiled_prefill += split.profiled_prefill
            residual += split.profiled_residual
            if self.engine.runner == "v1":
                pair = max(pair, sum(t.bytes for t in fp.transient.terms if t.stage == "prompt_logprobs"))
        if len(footprints) == 1:
            prefill = splits[0].prefill if splits is not None else TransientSplit.of(footprints[0].transient).prefill
        else:
            prefill = peak_of(self.step_terms(footprints, sampling))
        # A profiled term larger than the profile's own peak spills into the free headroom.
        prefill += max(0, profiled - self.profiled_peak_bytes)
        return Demand(
            prompt_tokens=sum(fp.prompt_tokens for fp in footprints),
            max_new_tokens=max(fp.max_new_tokens for fp in footprints),
            shared_block_hashes=tuple(shared),
            private_blocks=private,
            transient_prefill_bytes=prefill,
            transient_held_bytes=held,
            profiled_prefill_bytes=min(profiled_prefill, self.profiled_peak_bytes),
            profiled_residual_bytes=min(residual, profiled_prefill, self.profiled_peak_bytes),
            sampler=sampler,
            reserved_new_tokens=max(fp.reserved_new_tokens for fp in footprints),
            kv_variance_blocks=variance / self.layout.block_size**2,
            sequences=sum(fp.n for fp in footprints),
            beam_iterations=max(fp.max_new_tokens for fp in footprints) if sampling.beam_search else 1,
            teaches_output_lengths=all(fp.min_new_tokens == 0 for fp in footprints),
            step_pair_bytes=pair,
            upproject_bytes=self._upproject_bytes(footprints),
            step_bound=self.step_bound,
            step_tokens=min(
                sum(prefill_chunk(self.engine, fp.prompt_tokens) * fp.n for fp in footprints),
                self.engine.max_num_batched_tokens,
            ),
            decode_tokens=sum(fp.n for fp in footprints) * (1 + self.engine.num_speculative_tokens),
            growth_blocks=sum(fp.max_kv_blocks - fp.kv_blocks for fp in footprints),
        )

    def _upproject_bytes(self, footprints: Sequence[Footprint]) -> int:
        """Demand.upproject_bytes: every engine request's (prompts x n)."""
        if self.step_bound is None:
            return 0
        g, e = self.layout.geometry, self.engine
        return sum(mla_prompt_upproject_bytes(g, e, fp.prompt_tokens) * fp.n for fp in footprints)

    def step_terms(self, footprints: Sequence[Footprint], sampling: SamplingShape) -> list[TransientTerm]:
        """The unprofiled prefill terms of the worst step vLLM can run of these prompts' requests.

        Each prompt's own terms are sized for its worst step (kvgate/memory/activation.py). One step
        holds chunks of several of them, up to max_num_seqs requests and max_num_batched_tokens
        tokens in all, and each request's share of a term is at most its own worst: a term of
        the step is at most the sum of its largest values over as many prompts as a step holds.
        Prompt logprobs are bounded tighter, as vLLM 0.32.0 computes them: V1's per-request loop
        keeps two requests' tensors at most (PROMPT_LOGPROBS_ALIVE_V1); V2 (gpu/sample/
        prompt_logprob.py `compute_prompt_logprobs`) runs the step's tokens at once, 1,024 rows
        at a time; either way the step needs no more than a prompt whose chunk is a whole
        max_num_batched_tokens step (`full_step`). Terms held from step to step (residual: V2's
        kept prompt-logprobs results, summed as Demand.transient_held_bytes) add up over all of
        them."""
        by_name: dict[str, list[TransientTerm]] = {}
        for fp in footprints:
            for term in fp.transient.terms:
                if term.phase == "prefill" and not term.profiled and not term.shared and term.bytes:
                    by_name.setdefault(term.name, []).append(term)
        in_one_step = min(len(footprints), self.engine.max_num_seqs, self.engine.max_num_batched_tokens)
        step: list[TransientTerm] = []
        full_step: TransientEstimate | None = None  # made once, for the first prompt-logprobs term
        for name, terms in by_name.items():
            terms.sort(key=lambda t: t.bytes, reverse=True)
            logprobs = terms[0].stage == "prompt_logprobs"  # the term and its CUDA topk scratch
            if terms[0].stage == "residual":  # held from step to step: every started prompt holds its own
                alive = terms
            else:
                alive = terms[: PROMPT_LOGPROBS_ALIVE_V1 if logprobs and self.engine.runner == "v1" else in_one_step]
            total = sum(t.bytes for t in alive)
            detail = terms[0].detail if len(alive) == 1 else f"{len(alive)} prompts' {terms[0].detail}, in one step"
            if logprobs and full_step is None:
                full_step = self._full_step(sampling)
            # A term the whole step does not have (its CUDA topk scratch hidden under its two
            # sub-chunks' logits) is 0 there. Never below one prompt's own (V2's last step of a
            # long prompt also concatenates its whole prompt's rows, activation.py v2_prompt_logprobs).
            if logprobs and full_step is not None and full_step.terms:
                in_full_step = full_step.term(name)
                bound = max(in_full_step.bytes if in_full_step else 0, terms[0].bytes)
                if bound < total:
                    total = bound
                    detail = f"{(in_full_step or terms[0]).detail}: a whole step of these prompts' tokens"
            step.append(TransientTerm(name, total, False, "prefill", detail, terms[0].stage))
        return step

    def _full_step(self, sampling: SamplingShape) -> TransientEstimate:
        """The terms of a prompt whose worst step is one whole max_num_batched_tokens chunk (an
        empty estimate where a request's chunk is capped lower, long_prefill_token_threshold,
        while a step of several still holds max_num_batched_tokens; and for V2's whole-vocabulary
        prompt logprobs, whose kept scores grow with each request's prompt, not the step)."""
        engine = self.engine
        capped = 0 < engine.long_prefill_token_threshold < engine.max_num_batched_tokens
        if capped or (engine.runner == "v2" and sampling.prompt_logprobs == -1):
            return TransientEstimate(())
        return self.transient(engine.max_num_batched_tokens, sampling)[0]

    def _check_context_length(self, spec: ValidRequest, prompt_tokens: int, from_text: bool) -> None:
        """A prompt past the input limit of the backend's release (vllm/renderers/params.py
        `_token_len_check`): the whole context from 0.32.0; 0.21.0 - 0.31.0 less the request's
        max_tokens (`max_input_tokens`). A pooling request asks for no output: vLLM's pooling
        routes build their TokenizeParams with max_output_tokens=0
        (vllm/entrypoints/pooling/base/protocol.py), so a prompt may fill the context; kvgate
        still reserves its one step's KV."""
        limit = self.engine.max_model_len
        output = None
        if self.engine.max_tokens_past_context_refused:
            output = 0 if spec.prefill_only or spec.context_caps_output else spec.sampling.max_tokens or 0
        if prompt_tokens > limit - (output or 0):
            raise ContextTooLong.prompt(limit, prompt_tokens, from_text, output)
        if prompt_tokens == limit and not spec.prefill_only:
            raise ContextTooLong.no_room(limit)

    def check_fits_ever(self, prediction: Prediction, ceiling: Ceiling) -> None:
        """NeverFits when no amount of waiting would let this request in: one of the requests vLLM
        creates for it needs more KV blocks than the whole pool, or the worst step vLLM can run
        of them more transient memory than an idle server has (`ceiling`, from the budget). The
        sum of its prompts' blocks is no such bound: vLLM runs them as the pool allows (and the
        budget waits for an idle pool at most, kvgate/gate/budget.py)."""
        if ceiling.kv_blocks is not None:
            self._check_kv_fits(prediction, ceiling.kv_blocks)
        limit = ceiling.transient_bytes
        needed = ceiling.transient_need(prediction.demand)
        if limit is not None and needed > limit:
            raise self._transient_never_fits(prediction, needed, limit, ceiling)

    def _check_kv_fits(self, prediction: Prediction, pool: int) -> None:
        """KvNeverFits for the first prompt one of whose engine requests (a sample, grown to
        max_tokens) needs more blocks than the pool."""
        footprints = prediction.footprints
        for i, fp in enumerate(footprints):
            needed = kv_blocks_for(
                self.layout, self.engine, fp.prompt_tokens, fp.max_new_tokens, 1, self.enable_prefix_caching
            )
            if needed > pool:
                which = "This request" if len(footprints) == 1 else f"Prompt {i} of this request's {len(footprints)}"
                if fp.n > 1:
                    which += f" (each of its {fp.n} samples)"
                raise KvNeverFits(needed, pool, self.layout.block_size, fp.prompt_tokens, fp.max_new_tokens, which)

    def _transient_never_fits(
        self, prediction: Prediction, needed: int, limit: int, ceiling: Ceiling
    ) -> TransientNeverFits:
        """The error naming the term that sets the step's peak, and advice that can lower it."""
        footprints = prediction.footprints
        profiled = ceiling.profiled_need(prediction.demand)
        if profiled > needed - profiled:  # the profile region's tensors
            what = f"its forward pass (the profiled hidden states and MLP, {profiled / MiB:.0f} MiB)"
            # vLLM prefills a list's prompts in one step: when each prompt's own forward pass fits,
            # the list's size is what to change, not a prompt's length
            each_fits = all(
                ceiling.profiled_need(self._demand([fp], prediction.sampling, None)) <= limit for fp in footprints
            )
            several = len(footprints) > 1 and each_fits
            advice = f"send fewer of its {len(footprints)} prompts in one request" if several else "shorten the prompt"
            return TransientNeverFits(needed, limit, what, advice)
        if len(footprints) == 1:
            terms = [t for t in footprints[0].transient.terms if not t.profiled]
            several = False
        else:
            step = self.step_terms(footprints, prediction.sampling)
            terms = step + [
                t for fp in footprints for t in fp.transient.terms if not t.profiled and t.phase == "decode"
            ]
            alone = max(TransientSplit.of(fp.transient).prefill for fp in footprints)
            several = peak_of(step) > alone
        worst = max(terms, key=lambda t: t.bytes, default=None)
        what = f"{worst.name} ({worst.detail})" if worst else "its transient tensors"
        advice = _ADVICE.get(worst.name if worst else "", "shorten the prompt")
        if several:
            advice = f"send fewer of its {len(footprints)} prompts in one request"
        elif worst is not None and worst.phase == "decode" and len(footprints) > 1:
            advice += f", or send fewer of its {len(footprints)} prompts in one request"
        return TransientNeverFits(needed, limit, what, advice)
