"""The sampler's top-k/top-p backend by vLLM's own rule per version (kvgate/memory/vllm_runner.py,
read in the wheels of SAMPLER_READ_VERSIONS), and what each path charges (kvgate/memory/sampler.py)."""

from __future__ import annotations

import pytest

from kvgate.memory.sampler import SamplerCost
from kvgate.memory.vllm_runner import resolve_runtime, resolve_sampler

V = 128256


@pytest.mark.parametrize(
    ("version", "backend", "sort_below_rows"),
    [
        ("0.10.1", "pytorch", 0),  # older than any read: 0.16.0's rule
        ("0.16.0", "pytorch", 0),  # no topk_topp_triton.py; FlashInfer opt-in
        ("0.17.0", "triton", 8),  # apply_top_k_top_p: HAS_TRITON and logits.shape[0] >= 8
        ("0.20.2", "triton", 8),
        ("0.21.0", "flashinfer", 8),  # VLLM_USE_FLASHINFER_SAMPLER unset counts as on
        ("0.29.0", "flashinfer", 8),
        ("0.30.0", "flashinfer", 0),  # apply_top_k_top_p: Triton for every batch
        ("0.32.0", "flashinfer", 0),
        ("0.40.0", "flashinfer", 0),  # newer than any read: the newest rule
    ],
)
def test_the_sampler_follows_vllms_rule_for_that_version(version: str, backend: str, sort_below_rows: int) -> None:
    path = resolve_sampler(version)
    assert (path.backend, path.sort_below_rows, path.source) == (backend, sort_below_rows, "vLLM's rule")


def test_processed_logprobs_modes_keep_vllm_off_flashinfer() -> None:
    assert resolve_sampler("0.32.0", logprobs_mode="processed_logprobs").backend == "triton"
    assert resolve_sampler("0.24.0", logprobs_mode="processed_logits").backend == "triton"
    assert resolve_sampler("0.16.0", logprobs_mode="processed_logits").backend == "pytorch"


def test_the_sampler_flag_overrides_the_rule_and_keeps_the_versions_small_batch_sort() -> None:
    cpu = resolve_sampler("0.32.0", "pytorch")
    assert (cpu.backend, cpu.sort_below_rows, cpu.source) == ("pytorch", 0, "--sampler")
    triton = resolve_sampler("0.24.0", "triton")  # VLLM_USE_FLASHINFER_SAMPLER=0 on 0.24
    assert (triton.backend, triton.sort_below_rows) == ("triton", 8)


def test_an_unknown_version_keeps_the_measured_sort() -> None:
    path = resolve_sampler(None)
    assert (path.backend, path.source) == ("pytorch", "version unknown")


def test_the_runtime_names_the_sampler_in_its_labels() -> None:
    runtime = resolve_runtime("0.20.0", "v1")
    assert runtime.sampler_backend == "triton"
    assert runtime.sampler_sort_below_rows == 8
    assert runtime.labels()["sampler"] == "triton"
    assert resolve_runtime("0.32.0", "v1", sampler="pytorch").labels()["sampler"] == "pytorch"


def v1(sampler: str, sort_below_rows: int = 0, max_num_seqs: int = 1024) -> SamplerCost:
    return SamplerCost(V, 2, max_num_seqs, 8192, "v1", sampler=sampler, sort_below_rows=sort_below_rows)


def test_v1_triton_masks_in_place_and_samples_from_softmax_and_noise() -> None:
    """topk_topp_triton.py apply_top_k_top_p_triton: one cached [min(next_pow2(min(SMs, B)), SMs), V]
    fp32 buffer; topk_topp_sampler.py random_sample: softmax and exponential noise, fp32."""
    stage = v1("triton").stage(1000, False, False, 0)
    assert stage.sort == 0
    assert stage.top_k_top_p == 192 * V * 4 + 1000 * V * 8  # the buffer stops at the SM count
    assert v1("triton").stage(20, False, False, 0).top_k_top_p == 32 * V * 4 + 20 * V * 8
    # far below the sort's 32 B per logit: the over-charge kvgate made on CUDA from 0.17
    assert stage.top_k_top_p < v1("pytorch").stage(1000, False, False, 0).sort / 2


def test_v1_batches_under_eight_rows_still_sort_in_017_to_029() -> None:
    small = v1("triton", sort_below_rows=8).stage(7, False, False, 0)
    # CUDA's sort of 2 - 127 rows: 4 + 8 + full-sort scratch 32 B a logit, + CUB's bins, counters,
    # alignment and ceil(7 x V / 2,816) = 319 tiles of lookback: 335,359 B, 335,360 rounded
    assert small.sort == 7 * V * 44 + 335_360 == 39_838_208
    assert small.top_k_top_p == 0
    assert v1("triton", sort_below_rows=8).stage(8, False, False, 0).sort == 0
    assert v1("triton").stage(7, False, False, 0).sort == 0  # 0.30.0+: Triton for every batch


def test_v1_flashinfer_is_charged_the_larger_of_its_path_and_a_seeded_batchs_native_one() -> None:
    """forward_cuda: a seeded request sends the batch to forward_native (Triton + softmax + noise)."""
    flashinfer = v1("flashinfer").stage(1000, False, False, 0)
    assert flashinfer.top_k_top_p == max(1000 * V * 8, v1("triton").stage(1000, False, False, 0).top_k_top_p)
    # 4 rows: 44 B a logit + CUB's rest with 183 tiles of lookback (196,095 B, 196,096 rounded)
    assert v1("flashinfer", sort_below_rows=8).stage(4, False, False, 0).sort == 4 * V * 44 + 196_096


@pytest.mark.parametrize(("sampler", "sort_below_rows"), [("pytorch", 0), ("triton", 8), ("flashinfer", 0)])
def test_v1_profile_covers_its_own_path_up_to_the_profiled_rows(sampler: str, sort_below_rows: int) -> None:
    cost = v1(sampler, sort_below_rows, max_num_seqs=256)
    for rows in (1, 7, 100, 256):
        stage = cost.stage(rows, False, False, 0)
        assert stage.profiled == stage.logits + stage.sort + stage.top_k_top_p
        assert stage.unprofiled == 0


def test_v2_triton_keeps_only_its_buffer() -> None:
    """V2 samples with one Gumbel kernel after Triton's in-place mask: no [B, V] softmax or noise."""
    cost = SamplerCost(V, 2, 1024, 8192, "v2", sampler="triton")
    assert cost.stage(1000, False, False, 0).top_k_top_p == 192 * V * 4
    assert cost.stage(1000, False, False, 0, random=False).top_k_top_p == 0  # greedy: no top-k/top-p


def v2_speculative(k: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> SamplerCost:
    return SamplerCost(V, 2, max_num_seqs, max_num_batched_tokens, "v2", num_speculative_tokens=k, sampler="flashinfer")


def test_v2_verification_takes_triton_not_flashinfer() -> None:
    """vllm 0.32.0 v1/worker/gpu/model_runner.py `sample`: a step with draft tokens samples through
    the RejectionSampler, whose `_verify` masks top-k/top-p with `apply_top_k_top_p` (Triton, in
    place) and never calls `flashinfer_sample`. 64 requests x (1 + 5) rows: the fp32 copy and
    Triton's buffer (192 rows at most), not FlashInfer's 8 B per verified logit."""
    stage = v2_speculative(5).stage(64, False, False, 0)
    assert stage.logits_fp32 == 384 * V * 4
    assert stage.top_k_top_p == 192 * V * 4
    assert stage.sort == 0
    # a first-token step (no drafts: Sampler.sample, FlashInfer) has one row per request: with one
    # draft token and more requests than Triton's buffer has rows, that step is the larger
    first = v2_speculative(1).stage(256, False, False, 0)
    assert first.logits_fp32 == 512 * V * 4
    assert first.top_k_top_p == 256 * V * (4 + 8) - 512 * V * 4
    # greedy batches copy nothing and mask nothing
    greedy = v2_speculative(5).stage(64, False, False, 0, random=False)
    assert greedy.logits_fp32 == greedy.top_k_top_p == 0


def test_v2_verification_copies_its_logits_to_fp32_a_gigabyte_at_a_time() -> None:
    """rejection_sampler.py `_verify_in_chunks`: at most MAX_CHUNK_BYTES (1 GiB) of fp32 logits,
    `get_max_chunk_logits` = 2**30 // (V x 4) = 2,092 rows for Llama 3's vocabulary (whole
    requests per chunk: kvgate charges that bound)."""
    stage = v2_speculative(5, max_num_seqs=1024, max_num_batched_tokens=8192).stage(1024, False, False, 0)
    assert stage.logits == 6144 * V * 2  # the bf16 logits are whole
    assert stage.logits_fp32 == 2092 * V * 4 <= 2**30
    # the first-token step of 1,024 rows (fp32 copy + FlashInfer) exceeds the chunk's copy
    assert stage.top_k_top_p == 1024 * V * 12 - 2092 * V * 4
