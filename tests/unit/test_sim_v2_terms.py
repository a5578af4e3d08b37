"""The simulator's own reading of Model Runner V2 in vLLM 0.32.0 and 0.33.0 (issue #27): prompt
logprobs over the whole step with two sub-chunks alive, -1 results kept across a chunked prompt,
the fp32 copy only for rows that need processing, 0.33's sampler warm-up pass in the profile.
And V1's per-request prompt-logprobs loop, whose rebinding keeps two requests' tensors alive."""

from __future__ import annotations

from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import Block, CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

V = 128256
LLAMA = dict(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=32768, max_logprobs=-1)


def _boot(**kw) -> tuple[startup.Resolved, startup.StartupReport]:
    cfg = SimConfig(**{**LLAMA, **kw})
    dev = Device(gpu_total_bytes(cfg.gpu))
    return startup.start(cfg, load_model(cfg.model), dev, CachingAllocator(dev, "vllm"))


def _peak(r: startup.Resolved, shape: StepShape, held: dict[str, list[Block]] | None = None) -> int:
    alloc = CachingAllocator(Device(1 << 42), "vllm")
    steps, _ = startup.step_memories(r)
    run_tape(alloc, steps.plan(shape), held)
    return alloc.peak_allocated


def test_v2_prompt_logprobs_hold_two_sub_chunks_of_the_whole_step() -> None:
    r, _ = _boot(max_num_batched_tokens=8192)
    assert r.flavor.v2
    plain = _peak(r, StepShape((ReqSlice(3000, samples=False),)))
    k5 = _peak(r, StepShape((ReqSlice(3000, samples=False, prompt_logprob_tokens=3000, prompt_logprobs=5),)))
    two_chunks = 2 * 1024 * V * 2
    hidden = 3000 * 4096 * 2  # the step's hidden states, scored in place
    assert two_chunks + hidden <= k5 <= two_chunks + plain
    # the step's other tokens are scored too (hidden_states[:num_tokens]): a 3,000-token request
    # beside 5,000 tokens of others costs the same two sub-chunks, and the results of all 8,000 rows
    shared = StepShape(
        (ReqSlice(3000, samples=False, prompt_logprob_tokens=3000, prompt_logprobs=5), ReqSlice(5000, samples=False))
    )
    assert _peak(r, shared) >= two_chunks + 8000 * 4096 * 2 + 8000 * (6 * 12 + 8)


def test_v2_prompt_logprobs_concatenate_ids_scores_and_ranks_one_after_the_other() -> None:
    # prompt_logprob.py:315-317: the ids' torch.cat (both copies) beside the scores' and ranks'
    # lists, the last sub-chunk's logits still bound; not one copy of everything at once. 8,192
    # tokens: the cat outweighs every sub-chunk's topk sort (a 3,000-token step peaks in its last
    # sub-chunk's sort instead: the test below)
    r, _ = _boot(max_num_batched_tokens=8192)
    peak = _peak(r, StepShape((ReqSlice(8192, samples=False, prompt_logprob_tokens=8192, prompt_logprobs=-1),)))
    ids, scores = (V + 1) * 8, (V + 1) * 4
    derived = 1024 * V * 2 + 8192 * (2 * ids + scores + 8)
    hidden = 8192 * 4096 * 2
    assert derived + hidden <= peak <= derived + hidden + 32 * MiB
    assert peak < 8192 * 2 * (ids + scores + 8)  # no second copy of the scores and ranks


def test_v2_prompt_logprobs_all_vocab_peak_inside_the_last_sub_chunks_topk_sort() -> None:
    # compute_topk_scores' torch.topk(k = V) on CUDA (TensorTopK.cpp topk_out_cuda: k > 4,096, no
    # in-place sort): the third sub-chunk's (952 rows) bf16 logits, topk values (2) and int64
    # indices (8), sorted copies of both (2 + 8) and the sort's scratch (20 B a logit at 128+ rows),
    # beside the two earlier sub-chunks' ids, scores and ranks
    r, _ = _boot(max_num_batched_tokens=8192)
    peak = _peak(r, StepShape((ReqSlice(3000, samples=False, prompt_logprob_tokens=3000, prompt_logprobs=-1),)))
    row = (V + 1) * 12 + 8
    derived = 2048 * row + 952 * V * (2 + 2 + 8 + 2 + 8 + 20)
    hidden = 3000 * 4096 * 2
    assert derived + hidden <= peak <= derived + hidden + 32 * MiB


def test_v2_prompt_logprobs_minus_one_keep_the_earlier_step_until_the_last() -> None:
    r, _ = _boot(max_num_batched_tokens=8192)
    held: dict[str, list[Block]] = {}
    per_row = (V + 1) * 12 + 8
    first = ReqSlice(
        8192, samples=False, prompt_logprob_tokens=8192, prompt_logprobs=-1, request_id="a", prompt_left=8192
    )
    alloc = CachingAllocator(Device(1 << 42), "vllm")
    steps, _ = startup.step_memories(r)
    run_tape(alloc, steps.plan(StepShape((first,))), held)
    assert sum(b.size for b in held["held:pl:a"]) >= 8192 * per_row
    last = ReqSlice(8192, 8192, prompt_logprob_tokens=8192, prompt_logprobs=-1, request_id="a")
    before = alloc.allocated()
    alloc.reset_peak()
    run_tape(alloc, steps.plan(StepShape((last,))), held)
    # LogprobsTensors.cat: the kept step, this step and the copy of the whole prompt's rows
    assert alloc.peak_allocated - before >= (8192 + 16383) * per_row
    assert "held:pl:a" not in held
    assert alloc.allocated() < before


def test_v2_fp32_copy_only_for_rows_that_need_processing() -> None:
    r, _ = _boot(max_num_batched_tokens=2048)
    plain = _peak(r, StepShape(tuple(ReqSlice(1, random=True, processes=False) for _ in range(256))))
    hot = _peak(r, StepShape(tuple(ReqSlice(1, random=True, processes=True) for _ in range(256))))
    greedy_penalty = _peak(r, StepShape(tuple(ReqSlice(1, processes=True, penalties=True) for _ in range(256))))
    assert hot - plain >= 256 * V * 4
    assert greedy_penalty - plain >= 256 * V * 4


def test_033_profile_holds_the_sampler_warm_up_pass() -> None:
    rows = dict(max_num_batched_tokens=1024, max_num_seqs=1024, max_model_len=8192)
    _, older = _boot(vllm_version="0.32.0", **rows)
    _, newer = _boot(vllm_version="0.33.0", **rows)
    # fp32 copy + FlashInfer's masked logits and probabilities for the 1,024 rows
    assert newer.activation_peak - older.activation_peak >= 1024 * V * (4 + 8) - 64 * MiB


def test_v1_prompt_logprobs_of_two_requests_in_one_step_are_alive_together() -> None:
    """vllm 0.32.0 v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`: the next request's
    logits and fp32 log-softmax (with its fp32 cast of the bf16 logits) are made while the
    previous request's scores are still bound: 4 + 2 + 4 + 4 B a logit, where one request alone
    peaks at 2 + 4 + 4."""
    r, _ = _boot(max_num_batched_tokens=8192, model_runner="v1")
    assert not r.flavor.v2
    n = 1000
    wants = dict(samples=False, prompt_logprob_tokens=n, prompt_logprobs=5)
    plain_one = _peak(r, StepShape((ReqSlice(n, samples=False),)))
    one = _peak(r, StepShape((ReqSlice(n, **wants),)))
    one_of_two = _peak(r, StepShape((ReqSlice(n, **wants), ReqSlice(n, samples=False))))
    two = _peak(r, StepShape((ReqSlice(n, **wants), ReqSlice(n, **wants))))
    logits = n * V
    assert one - plain_one <= 10 * logits + n * 4096 * 2 + n * 6 * 12
    assert two - one_of_two >= (14 - 10) * logits


def test_v1_penalty_step_peaks_at_22_bytes_a_logit_as_vllm_on_cuda() -> None:
    """vllm 0.31.0 - 0.33.0 model_executor/layers/utils.py `apply_penalties`: `_` keeps the
    prompt's `[B, V + 1]` int64 counts until it returns, beside its bool mask, the output's counts
    (int64) and mask, and then one fp32 `[B, V]` frequency (then presence) term; the repetition
    penalty is the in-place CUDA kernel (_custom_ops.py `apply_repetition_penalties`). So a greedy
    batch's penalties add 8 + 1 + 8 + 1 + 4 = 22 B a logit (+ 16 B a row) to its sampler's peak;
    a simulator that frees the prompt's counts early peaks lower, one that plays the CPU
    fallback's temporaries higher."""
    r, _ = _boot(model_runner="v1")
    assert not r.flavor.v2
    rows = 256
    plain = _peak(r, StepShape(tuple(ReqSlice(1, 2000) for _ in range(rows))))
    penalised = _peak(r, StepShape(tuple(ReqSlice(1, 2000, penalties=True) for _ in range(rows))))
    exact = rows * (22 * V + 16)
    assert exact <= penalised - plain <= exact + 4 * MiB  # the allocator rounds each block up
