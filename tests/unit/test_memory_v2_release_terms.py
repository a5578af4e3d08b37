"""Issue #27: Model Runner V2 and vLLM 0.33 terms as their code runs, pinned per release against
bytes derived by hand from the wheels (Llama-3-8B shape, bf16, vocabulary 128,256): kvgate within
-0/+15 % of each, never under."""

from __future__ import annotations

import pytest

from kvgate.memory.activation import (
    EngineShape,
    SamplingShape,
    estimate_transient,
    mla_workspace_tokens,
    profile_peak_bytes,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.sampler import SamplerCost
from kvgate.memory.vllm_runner import NEWEST_KNOWN, resolve_runtime

LLAMA = ModelGeometry(32, 32, 8, 128, 4096, 14336, 128256, 2, 131072)
V, H = 128256, 4096


def within(ours: int, derived: int) -> bool:
    return derived <= ours <= derived * 1.15


def v2_engine(version: str = "0.32.0", **kwargs: object) -> EngineShape:
    runtime = resolve_runtime(version)
    shape: dict = {
        "max_model_len": 32768,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "runner": runtime.runner,
        "sampler": runtime.sampler_backend,
        "sampler_warmup_profile": runtime.sampler_warmup_profile,
    }
    return EngineShape(**(shape | kwargs))


def prompt_logprobs_bytes(engine: EngineShape, prompt: int, k: int) -> int:
    terms = estimate_transient(LLAMA, engine, prompt, SamplingShape(prompt_logprobs=k)).terms
    # the tensors' bytes as vLLM's code makes them; what the allocator strands beside them
    # (prompt_logprobs_segments) is pinned against the simulator's allocator in
    # test_v2_prompt_logprobs_beside.py
    return sum(t.bytes for t in terms if t.name.startswith("prompt_logprobs") and t.name != "prompt_logprobs_segments")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_v2_prompt_logprobs_hold_two_sub_chunks(version: str) -> None:
    # prompt_logprob.py:297-318: `prompt_logits = logits_fn(...)` while the previous sub-chunk's
    # logits are bound: 2 x 1,024 x V x 2 B, + one sub-chunk's (5 + 1) ids/scores and ranks
    derived = 2 * 1024 * V * 2 + 1024 * (6 * 12 + 8)
    assert derived == 525_418_496
    for batched in (2048, 8192):  # the step's every token (:158-173), whoever's
        ours = prompt_logprobs_bytes(v2_engine(version, max_num_batched_tokens=batched), 3000, 5)
        assert within(ours, derived), (batched, ours)


@pytest.mark.parametrize(("prompt", "sub_chunks"), [(3000, 3), (2100, 3), (1024, 1)])
def test_v2_prompt_logprobs_all_vocab_in_one_step_peak_at_the_topk_sort_or_the_ids_cat(
    prompt: int, sub_chunks: int
) -> None:
    # one 8,192-token step: the loop's sub-chunks (the earlier ones' results beside the larger of
    # its logits with the previous ones', its logits inside CUDA's torch.topk(k = V) and its
    # logits with topk's int64 indices beside the [rows, V + 1] ids, scores and ranks: the
    # previous logits go once the new ones are bound) or, after the loop (:315-317), the ids'
    # torch.cat (twice) beside the scores' and ranks' lists and the last logits; one sub-chunk is
    # not cat-ed. Inside topk (TensorTopK.cpp topk_out_cuda, k > 4,096): its bf16 values and int64
    # indices, the sorted copies of both and the sort's scratch (20 B a logit, 32 B for 2 - 127
    # rows: kvgate/memory/sampler.py cuda_sort_scratch_bytes_per_logit)
    ids, scores, row = (V + 1) * 8, (V + 1) * 4, (V + 1) * 12 + 8
    sizes = [min(1024, prompt - start) for start in range(0, prompt, 1024)]
    assert len(sizes) == sub_chunks

    def topk_sort(rows: int) -> int:
        return rows * V * (2 * (2 + 8) + (32 if 1 < rows < 128 else 20))

    loop = max(
        sum(sizes[:i]) * row
        + max(
            (sizes[i - 1] if i else 0) * V * 2 + rows * V * 2,
            rows * V * 2 + max(topk_sort(rows), rows * (V * 8 + row)),
        )
        for i, rows in enumerate(sizes)
    )
    cat = sizes[-1] * V * 2 + prompt * (2 * ids + scores + 8) if sub_chunks > 1 else 0
    derived = max(loop, cat)
    ours = prompt_logprobs_bytes(v2_engine(), prompt, -1)
    assert within(ours, derived), (ours, derived)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_v2_prompt_logprobs_all_vocab_keep_earlier_steps_and_cat_the_prompt(version: str) -> None:
    # 16,384 tokens over two 8,192-token steps: the first step's [8192, V + 1] ids, scores (and
    # ranks) kept (in_progress_prompt_logprobs), the second's, and LogprobsTensors.cat's copy of
    # the 16,383 scored rows
    per_row = (V + 1) * 12 + 8
    derived = (8192 + 8192 + 16383) * per_row
    assert round(derived / 1e9, 1) == 50.4
    ours = prompt_logprobs_bytes(v2_engine(version), 16384, -1)
    assert within(ours, derived)
    kept = estimate_transient(LLAMA, v2_engine(version), 16384, SamplingShape(prompt_logprobs=-1)).term(
        "prompt_logprobs_kept"
    )
    assert kept is not None
    assert kept.stage == "residual"
    assert kept.bytes == 8192 * per_row


def test_v2_processed_logprobs_mode_keeps_flashinfer_and_v1_leaves_it() -> None:
    v2 = resolve_runtime("0.32.0", logprobs_mode="processed_logprobs")
    v1 = resolve_runtime("0.32.0", "v1", logprobs_mode="processed_logprobs")
    assert (v2.runner, v2.sampler_backend) == ("v2", "flashinfer")  # gpu/sample/sampler.py:88-90
    assert (v1.runner, v1.sampler_backend) == ("v1", "triton")
    # n = 64, top-p 0.9, top-k 50: logits bf16 + fp32 copy + FlashInfer's masked logits and probs
    # + the step's hidden states and their gathered copy
    derived = 64 * V * (2 + 4 + 8) + 2 * 64 * H * 2
    assert derived == 115_965_952
    engine = v2_engine(sampler=v2.sampler_backend, processed_logprobs=True)
    terms = estimate_transient(LLAMA, engine, 1, SamplingShape(n=64)).terms
    assert within(sum(t.bytes for t in terms if t.stage == "sampler"), derived)


def test_v2_greedy_with_logits_processors_gets_the_fp32_copy_and_plain_temperature_none() -> None:
    cost = SamplerCost(V, 2, 256, 8192, "v2", sampler="flashinfer")
    greedy_penalty = cost.stage(10, False, True, 100, random=False, processing=True, filtered=False)
    assert greedy_penalty.logits_fp32 == 10 * V * 4
    assert greedy_penalty.top_k_top_p == 0
    plain = cost.stage(10, False, False, 100, random=True, processing=False, filtered=False)
    assert plain.logits_fp32 == plain.top_k_top_p == plain.sort == 0  # states.py:67-72
    assert plain.unprofiled == 0


@pytest.mark.parametrize(("version", "derived"), [("0.32.0", 279_445_504), ("0.33.0", 1_855_455_232)])
def test_v2_profile_peak_per_release(version: str, derived: int) -> None:
    # 1,024 batched tokens and seqs: the step's hidden states and the gathered rows, the logits;
    # 0.33.0's warm-up pass (gpu/model_runner.py:993-1015) adds the fp32 copy and FlashInfer
    engine = v2_engine(version, max_num_batched_tokens=1024, max_num_seqs=1024)
    assert within(profile_peak_bytes(LLAMA, engine), derived)


def test_v2_033_profile_covers_the_warm_up_rows_sampler_terms() -> None:
    engine = v2_engine("0.33.0", max_num_batched_tokens=1024, max_num_seqs=1024)
    est = estimate_transient(LLAMA, engine, 100, SamplingShape(n=8))
    fp32, path = est.term("logits_fp32"), est.term("top_k_top_p")
    assert fp32 is not None
    assert fp32.profiled
    assert fp32.bytes == 8 * V * 4
    assert path is not None
    assert path.profiled
    older = estimate_transient(LLAMA, v2_engine("0.32.0"), 100, SamplingShape(n=8)).term("logits_fp32")
    assert older is not None
    assert not older.profiled


def test_mla_workspace_is_rounded_up_to_the_block_size_without_a_per_seq_floor() -> None:
    # mla_attention.py determine_chunked_prefill_workspace_size + align_..._workspace_size
    # (0.32.0 :1989, 0.33.0 :2014): round_up(max(size, block), block)
    assert mla_workspace_tokens(EngineShape(1001, 2048, 1, block_size=64)) == 8064
    assert mla_workspace_tokens(EngineShape(1000, 2048, 2048, block_size=64)) == 65536


@pytest.mark.parametrize(
    ("version", "model", "warning"),
    [
        ("0.33.0rc1", "0.33.0", False),  # a pre-release is modelled as its release
        ("0.33.0.dev5+g1234", "0.33.0", False),
        ("0.34.0", NEWEST_KNOWN, True),
    ],
)
def test_pre_releases_follow_their_release_and_newer_ones_the_newest(version: str, model: str, warning: bool) -> None:
    runtime = resolve_runtime(version)
    assert runtime.model_version == model
    assert (runtime.warning is not None) == warning
    assert runtime.sampler_warmup_profile  # 0.33's profile rule


def test_medusa_and_mlp_speculator_are_no_methods_from_033(tmp_path) -> None:
    import json

    from kvgate.speculative import resolve_drafter

    folder = tmp_path / "medusa-draft"
    folder.mkdir()
    config = {"model_type": "medusa", "hidden_size": 4096, "num_hidden_layers": 1, "vocab_size": V}
    config |= {"num_attention_heads": 32, "intermediate_size": 14336, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    # 0.32.0: the draft's config makes it a medusa head, which kvgate does not model
    assert resolve_drafter(None, str(folder), LLAMA, {}, release="0.32.0") is None
    # 0.33.0 (config/speculative.py:74-82, :1440-1480): no medusa method, so a separate draft model
    drafter = resolve_drafter(None, str(folder), LLAMA, {}, release="0.33.0")
    assert drafter is not None
    assert drafter.method == "draft_model"
    assert resolve_drafter("mlp_speculator", str(folder), LLAMA, {}, release="0.33.0") is None  # vLLM refuses it
    pre_release = resolve_drafter(None, str(folder), LLAMA, {}, release="0.33.0rc1")  # as its release
    assert pre_release is not None
    assert pre_release.method == "draft_model"
    # `kvgate advise` sizes the same draft for the release it is asked about
    from kvgate.advise_startup import load_layout

    target = tmp_path / "target"
    target.mkdir()
    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
    llama |= {"num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": V, "torch_dtype": "bfloat16"}
    (target / "config.json").write_text(json.dumps(llama | {"max_position_embeddings": 8192}))
    flags = dict(max_model_len=None, block_size=None, tensor_parallel_size=1, pipeline_parallel_size=1)
    for release, method in (("0.32.0", None), ("0.33.0", "draft_model")):
        _, layout, _ = load_layout(
            str(target), kv_cache_dtype="auto", speculative_model=str(folder), release=release, **flags
        )
        assert (layout.draft.method if layout.draft else None) == method, release


def test_the_ledger_sums_what_prefills_hold_across_steps_and_the_shared_step_extra() -> None:
    from kvgate.gate.ledger import Ledger
    from kvgate.memory.activation import SharedStepExtra, v2_prompt_logprobs_shared_step_extra
    from kvgate.memory.demand import Demand

    engine = v2_engine(max_num_batched_tokens=2048)
    # a one-step prompt alone starts on its own step; beside others it can start with one token
    # and span two steps, the first held whole (in_progress_prompt_logprobs)
    row = (V + 1) * 12 + 8
    extra = v2_prompt_logprobs_shared_step_extra(LLAMA, engine, 1500, -1)
    assert extra >= 2048 * row
    held = Demand(10, 1, (), 1, transient_prefill_bytes=10 * row + 100, transient_held_bytes=10 * row)
    ledger = Ledger()
    assert ledger.transient_bytes_with(held) == 10 * row + 100
    ledger.reserve(held)
    assert ledger.transient_bytes_with(held) == 20 * row + 100  # held twice, one step once
    # the held request says nothing of its tokens a step: the step is taken as full
    step = SharedStepExtra(LLAMA, engine, (1500,), -1)
    shared = Demand(10, 1, (), 1, transient_prefill_bytes=5, shared_step=step)
    assert ledger.transient_bytes_with(shared) == 10 * row + 100 + extra
    reservation = ledger.reserve(shared)
    ledger.release(reservation)
    assert ledger.transient_bytes == 10 * row + 100


def test_a_short_prompt_alone_is_charged_its_own_step_and_the_full_step_once_others_join() -> None:
    """V2 computes prompt logprobs over every token of the step: alone, a 100-token prompt's step
    is its 100 tokens (what vLLM runs on an idle server, so such a request is never refused as
    never fitting); beside others the step is taken as full. A prompt admitted alone is charged
    the full step from the next admission on, whoever that is: the newcomer's tokens join its
    steps."""
    from kvgate.gate.ledger import Ledger
    from kvgate.memory.activation import SharedStepExtra, v2_prompt_logprobs, v2_prompt_logprobs_shared_step_extra
    from kvgate.memory.demand import Demand

    engine = v2_engine(max_num_batched_tokens=2048)
    terms = v2_prompt_logprobs(LLAMA, engine, 100, 100, 5)
    alone = sum(t.bytes for t in terms)
    tensors = sum(t.bytes for t in terms if t.name != "prompt_logprobs_segments")
    assert tensors < 2 * 100 * V * 2 + 100 * 1024  # 100 rows of logits (bf16), not a 2,048-token step
    extra = v2_prompt_logprobs_shared_step_extra(LLAMA, engine, 100, 5)
    assert alone + extra >= 2 * 1024 * V * 2  # beside others: two 1,024-row sub-chunks' logits
    first = Demand(10, 1, (), 1, transient_prefill_bytes=alone, shared_step=SharedStepExtra(LLAMA, engine, (100,), 5))
    plain = Demand(10, 1, (), 1, transient_prefill_bytes=7)  # its tokens a step unknown: any number
    ledger = Ledger()
    assert ledger.transient_bytes_with(first) == alone  # nothing in flight: its own step
    ledger.reserve(first)
    assert ledger.transient_bytes == alone
    # a request without prompt logprobs joining it makes its steps full
    assert ledger.transient_bytes_with(plain) == alone + extra
    second = ledger.reserve(plain)
    assert ledger.transient_bytes == alone + extra
    ledger.release(second)
    assert ledger.transient_bytes == alone + extra  # held until its prefill ends


@pytest.mark.parametrize(
    ("version", "newer_rules"),
    [("0.32.0", False), ("0.32.1rc2", False), ("0.33.0rc1", True), ("0.33.0", True), ("0.35.2", True)],
)
def test_every_release_table_follows_the_release_a_version_leads_to(version: str, newer_rules: bool) -> None:
    """Each table kvgate keeps per release, for a release, a pre-release of it and a newer one:
    the runner (speculative methods V2 runs), the sampler (FlashInfer on both), V2's profile
    (0.33.0's warm-up pass), the chat truncation rule (protocol.py:694) and the content-format
    aliases (renderers/hf.py:424-470)."""
    runtime = resolve_runtime(version)
    assert runtime.model_version == ("0.33.0" if newer_rules else "0.32.0")
    assert (runtime.runner, runtime.sampler_backend) == ("v2", "flashinfer")
    assert runtime.sampler_warmup_profile == newer_rules
    assert runtime.truncation_holds_output_token == newer_rules
    assert runtime.content_format_namespace_aliases == newer_rules
    assert resolve_runtime(version, speculative_method="suffix").runner == "v1"  # blocked in both
    assert resolve_runtime(version, speculative_method="draft_model").runner == "v2"
    if not newer_rules:  # 0.33.0 has no medusa method at all (a medusa config is a draft_model)
        assert resolve_runtime(version, speculative_method="medusa").runner == "v1"
    assert (runtime.warning is not None) == (version == "0.35.2")


def test_v2_flashinfer_with_top_p_alone_samples_from_one_softmax() -> None:
    # v1/sample/ops/topk_topp_sampler.py:599-609 flashinfer_sample: k is None (no row sets top-k,
    # gpu/sample/states.py get_top_k_top_p) -> softmax fp32, top_p_sampling_from_probs
    engine = v2_engine()
    assert engine.sampler == "flashinfer"
    shape = SamplingShape(n=8, top_k=False, top_p=True)
    derived = 8 * V * (2 + 4 + 4) + 2 * 8 * H * 2  # logits, fp32 copy, probs; hidden and gathered rows
    terms = estimate_transient(LLAMA, engine, 100, shape).terms
    assert within(sum(t.bytes for t in terms if t.stage == "sampler"), derived)


def test_v2_flashinfer_takes_both_filters_once_the_batch_sets_both() -> None:
    from kvgate.memory.sampler import SamplerBatch, SamplerUse

    cost = SamplerCost(V, 2, 256, 8192, "v2", sampler="flashinfer")
    top_p_only = SamplerUse(cost, rows=8, longest_prompt=100, top_k=False, top_p=True)
    top_k_only = SamplerUse(cost, rows=8, longest_prompt=100, top_k=True, top_p=False)
    batch = SamplerBatch()
    batch.add(top_p_only)
    assert batch.stage().top_k_top_p == 8 * V * 4
    # a top-k row joins: the batch's k and p are both set, top_k_top_p_sampling_from_logits
    assert batch.stage(top_k_only).top_k_top_p == 16 * V * 8
    batch.add(top_k_only)
    batch.remove(top_k_only)
    assert batch.stage().top_k_top_p == 8 * V * 4
