"""kvgate reads a body's sampling parameters as vLLM does: the rules here; the field-by-field
comparison with vLLM's own `to_sampling_params` over a corpus of bodies is in
tests/integration/test_sampling_params_vllm.py."""

from __future__ import annotations

import pytest

from kvgate.sampling_params import v2_sampler_needs, vllm_sampling_params


def test_echo_with_logprobs_is_a_prompt_logprobs_request() -> None:
    params = vllm_sampling_params("completions", {"echo": True, "logprobs": 1, "max_tokens": 0})
    assert params.prompt_logprobs == 1
    assert params.max_tokens == 1


@pytest.mark.parametrize(
    ("body", "defaults", "needs"),
    [
        # vllm 0.32.0/0.33.0 gpu/sample/states.py:67-72: temperature 1.0 and no top-k/top-p/min-p
        # samples from the model-dtype logits, no fp32 copy, no filter
        ({}, {}, (False, False)),
        ({"temperature": 1.0}, {}, (False, False)),
        ({"temperature": 0.7}, {}, (True, False)),
        ({"top_p": 0.9}, {}, (True, True)),
        ({"top_k": 50}, {}, (True, True)),
        ({"min_p": 0.1}, {}, (True, False)),
        # greedy: no filter (SamplingParams resets top-k/top-p), but the logits processors
        # (penalties.py:55-64, logit_bias.py:57-110, bad_words.py:40-44) still copy to fp32
        ({"temperature": 0, "top_p": 0.5}, {}, (False, False)),
        ({"temperature": 0, "repetition_penalty": 1.2}, {}, (True, False)),
        ({"temperature": 0, "logit_bias": {"5": 1.0}}, {}, (True, False)),
        ({"temperature": 0, "bad_words": ["x"]}, {}, (True, False)),
        ({"temperature": 0, "allowed_token_ids": [1, 2]}, {}, (True, False)),
        ({"temperature": 0, "min_tokens": 3}, {}, (True, False)),
        # the server's defaults (generation_config.json) fill what the body leaves out
        ({}, {"temperature": 0.6, "top_p": 0.9}, (True, True)),
        ({"temperature": 1.0, "top_p": 1.0}, {"temperature": 0.6, "top_p": 0.9}, (False, False)),
        ({"temperature": 0}, {"repetition_penalty": 1.1}, (True, False)),
    ],
)
def test_v2_fp32_copy_and_filter_follow_vllms_rows(body: dict, defaults: dict, needs: tuple[bool, bool]) -> None:
    assert v2_sampler_needs(vllm_sampling_params("completions", body), defaults) == needs


@pytest.mark.parametrize(
    ("value", "beam"),
    # pydantic's lax booleans, as vLLM's request models read `use_beam_search: bool`; a value
    # pydantic refuses (vLLM's 400) reads as a beam search: only a larger charge until that answer
    [(None, False), (False, False), (0, False), ("no", False), (" False ", False), ("off", False),
     (True, True), (1, True), ("true", True), ("yes", True), ("maybe", True), ([], True)],
)  # fmt: skip
def test_use_beam_search_is_read_as_vllms_request_model_reads_it(value: object, beam: bool) -> None:
    body = {"n": 3, "logprobs": 1, "use_beam_search": value}
    params = vllm_sampling_params("completions", body)
    assert params.beam_search is beam
    # each of a beam search's engine requests asks 2 x the beam width of logprobs (vllm 0.32.0
    # entrypoints/generate/beam_search/online.py beam_search), whatever the request's own
    assert params.engine_logprobs == (6 if beam else 1)
    assert params.logprobs == 1  # the request's own, checked against --max-logprobs as vLLM does
