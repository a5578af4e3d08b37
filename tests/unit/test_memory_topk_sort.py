"""CUDA's torch.topk sort for `logprobs: -1` and `prompt_logprobs: -1` (k = V > 4,096): the
sorted copies and the sort's scratch that PyTorch's TensorTopK.cpp `topk_out_cuda` allocates after
selecting, charged on V1 and V2 (kvgate/memory/sampler.py cuda_topk_sort_bytes_per_logit); and,
whatever k, the multi-block select's scratch before it (cuda_topk_select_scratch_bytes)."""

from __future__ import annotations

import pytest

from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.sampler import (
    SamplerCost,
    cuda_topk_select_scratch_bytes,
    cuda_topk_sort_bytes_per_logit,
    cuda_topk_uses_multiblock,
)

LLAMA = ModelGeometry(32, 32, 8, 128, 4096, 14336, 128256, 2, 131072)
V = 128256


@pytest.mark.parametrize(
    ("rows", "k", "value_bytes", "per_element"),
    [
        # k <= 4,096: Sort.h should_use_small_sort, sorted in place, nothing allocated
        (1024, 4096, 4, 0),
        (64, 20, 4, 0),
        # fp32 values: sortedValues 4 + sortedIndices 8 + the sort scratch (20 B; 32 B for 2 - 127 rows)
        (1, V, 4, 32),
        (2, V, 4, 44),
        (127, V, 4, 44),
        (128, V, 4, 32),
        (1024, 4097, 4, 32),
        # bf16 values: sortedValues 2 + 8 + 20
        (1024, V, 2, 30),
    ],
)
def test_the_topk_sort_allocates_sorted_copies_and_scratch_above_4096(
    rows: int, k: int, value_bytes: int, per_element: int
) -> None:
    assert cuda_topk_sort_bytes_per_logit(rows, k, value_bytes) == per_element


@pytest.mark.parametrize(("rows", "scratch"), [(1, 20), (64, 32), (256, 20)])
def test_v1_sampler_logprobs_all_vocab_peaks_inside_topk(rows: int, scratch: int) -> None:
    # v1/sample/sampler.py gather_logprobs over the fp32 log-probs: after topk its outputs (12) and
    # the cat (12) = 24 B a logit; inside it the outputs (12) + sorted copies (12) + scratch: the
    # excess is the scratch itself
    cost = SamplerCost(V, 2, 1024, 8192, "v1")
    stage = cost.stage(rows, True, False, 0, all_vocab_logprobs=True)
    assert stage.logprobs == rows * V * (4 + 24)
    assert stage.logprobs_topk_sort == rows * V * scratch
    # a top-k of 20 sorts in place: only the select's scratch
    assert cost.stage(rows, True, False, 0).logprobs_topk_sort == cuda_topk_select_scratch_bytes(rows, V)


@pytest.mark.parametrize(("runner", "per_logit"), [("v1", 20), ("v2", 2 + 8 + 2 + 8 + 20 - 20)])
def test_logprobs_all_vocab_charges_the_topk_sort_term(runner: str, per_logit: int) -> None:
    # V2 gpu/sample/logprob.py compute_topk_scores topks the bf16 logits: inside it their values (2)
    # and indices (8) + sorted copies (2 + 8) + scratch (20, 256 rows), above the 20 B after it
    engine = EngineShape(16000, 8192, 1024, runner=runner)
    est = estimate_transient(LLAMA, engine, 100, SamplingShape(n=256, logprobs=-1))
    term = est.term("logprobs_topk_sort")
    assert term is not None
    assert not term.profiled
    assert term.bytes == 256 * V * per_logit
    top5 = estimate_transient(LLAMA, engine, 100, SamplingShape(n=256, logprobs=5)).term("logprobs_topk_sort")
    assert top5 is not None
    assert top5.bytes == cuda_topk_select_scratch_bytes(256, V)


def test_v1_prompt_logprobs_all_vocab_charges_16_bytes_a_logit_more() -> None:
    # _get_prompt_logprobs_dict -> gather_logprobs over a 1,024-token chunk: beside the bf16 logits
    # and fp32 scores, topk's outputs (12) + sorted copies (12) + scratch (20) = 44 B against the
    # 28 B after it (12 topk + 12 cat + 4 int32 ids): 16 B a logit, 2.1 GB over Llama-3's vocabulary
    engine = EngineShape(16000, 1024, 256)
    est = estimate_transient(LLAMA, engine, 1024, SamplingShape(prompt_logprobs=-1))
    assert est.term("prompt_logprobs").bytes == 1024 * V * (2 + 32)
    assert est.term("prompt_logprobs_topk_sort").bytes == 1024 * V * 16 == 2_101_346_304
    assert (
        estimate_transient(LLAMA, engine, 1024, SamplingShape(prompt_logprobs=5)).term("prompt_logprobs_topk_sort")
        is None
    )


def test_v2_prompt_logprobs_all_vocab_charges_the_topk_sort_of_a_sub_chunk() -> None:
    # v1/worker/gpu/sample/prompt_logprob.py: one 1,024-row sub-chunk (a 1,024-token prompt);
    # inside compute_topk_scores' topk: bf16 logits (2) + values (2) + indices (8) + sorted copies
    # (2 + 8) + scratch (20) = 42 B a logit; after it the logits, indices (8) and [rows, V + 1] ids,
    # scores (12) and a rank per row
    engine = EngineShape(16000, 8192, 256, runner="v2")
    est = estimate_transient(LLAMA, engine, 1024, SamplingShape(prompt_logprobs=-1))
    after = 1024 * V * (2 + 8) + 1024 * ((V + 1) * 12 + 8)
    assert est.term("prompt_logprobs").bytes == after
    assert est.term("prompt_logprobs_topk_sort").bytes == 1024 * V * 42 - after


@pytest.mark.parametrize(
    ("rows", "ids", "multiblock"),
    [
        (1, 128256, True),
        (1, 19999, False),
        (20, 20000, True),
        (21, 10000, True),
        (100, 4999, False),
        (200, 3000, True),
        (1000, 799, False),
        (1000, 800, True),
        (4001, 400, True),
        (3, 8, False),
    ],
)
def test_the_multiblock_select_is_taken_as_torch_decides(rows: int, ids: int, multiblock: bool) -> None:
    # TensorTopK.cu should_use_multiblock; the single-block select allocates nothing
    assert cuda_topk_uses_multiblock(rows, ids) is multiblock
    assert (cuda_topk_select_scratch_bytes(rows, ids) > 0) is multiblock


def test_the_select_scratch_grows_with_rows_and_blocks_a_row() -> None:
    # 1,000 rows of Llama-3's vocabulary: 8 blocks of 16,384 ids a row (+ 2,048 spare blocks) x 520 B,
    # 1,048 B a row, 4 KiB of rounding; one row: at most 126 blocks of 1,024 ids
    assert cuda_topk_select_scratch_bytes(1000, V) == 1000 * 1048 + (8000 + 2048) * 520 + 4096
    assert cuda_topk_select_scratch_bytes(1, V) == 1048 + 126 * 520 + 4096
