"""Learned output lengths and the token counts read off relayed bodies."""

from __future__ import annotations

import json
import random

from app.memory.activation import EngineShape, SamplingShape
from app.memory.footprint import predict_footprint
from app.memory.outputs import OutputLengths
from app.openai import parse_request
from app.output_count import OutputTokenCounter
from app.predict import Predictor
from test_memory_footprint import layout


def test_full_max_tokens_until_enough_answers_are_seen() -> None:
    lengths = OutputLengths(0.99, min_samples=32, refresh_every=1)
    for _ in range(31):
        lengths.observe(2048, 100)
    assert lengths.reserve(2048) == 2048
    lengths.observe(2048, 100)
    assert lengths.reserve(2048) == 100


def test_chat_answers_shorter_than_their_max_tokens_are_learned() -> None:
    """Answers of 16-255 tokens whatever max_tokens (256 to 2048) the clients send."""
    rng = random.Random(7)
    lengths = OutputLengths(0.99, refresh_every=1)
    for _ in range(400):
        allowed = rng.choice([256, 512, 1024, 2048])
        lengths.observe(allowed, rng.randint(16, 255))
    assert 240 <= lengths.reserve(2048) <= 255
    assert 240 <= lengths.reserve(700) <= 255
    assert lengths.reserve(100) == 100  # never above max_tokens


def test_answers_that_fill_max_tokens_keep_full_reservations() -> None:
    """ignore_eos traffic: every answer is as long as allowed, whatever the allowance."""
    lengths = OutputLengths(0.99, refresh_every=1)
    for i in range(200):
        allowed = [128, 300, 900][i % 3]
        lengths.observe(allowed, allowed)
    assert (lengths.reserve(128), lengths.reserve(300), lengths.reserve(900)) == (128, 300, 900)
    assert lengths.reserve(200) == 200  # the 300 and 900 answers went past 200


def test_answers_cut_at_their_limit_could_have_gone_on() -> None:
    """Answers that used all of 512 say nothing about what they would do with 4096; answers that
    stopped at 100 of 512 would have stopped at 100 under any allowance."""
    lengths = OutputLengths(0.99, refresh_every=1)
    for _ in range(100):
        lengths.observe(512, 512)
    assert lengths.reserve(4096) == 4096
    stopped = OutputLengths(0.99, refresh_every=1)
    for _ in range(100):
        stopped.observe(512, 100)
    assert stopped.reserve(4096) == 100


def test_quantile_one_turns_learning_off() -> None:
    lengths = OutputLengths(1.0, refresh_every=1)
    for _ in range(100):
        lengths.observe(2048, 10)
    assert not lengths.enabled and lengths.reserve(2048) == 2048


def test_footprint_reserves_the_expected_output_but_keeps_full_growth() -> None:
    fp = predict_footprint(layout("llama-3-8b"), EngineShape(8192, 2048, 256), list(range(100)), 2000,
                           SamplingShape(), reserved_new_tokens=60)
    assert (fp.kv_blocks, fp.max_kv_blocks) == (10, 132)  # cdiv(160, 16), cdiv(2100, 16)


def sse(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode()


def test_stream_counts_events_even_split_across_chunks() -> None:
    body = b"".join(sse(t) for t in ["a", "b", "c", "d"]) + b"data: [DONE]\n\n"
    counter = OutputTokenCounter(stream=True)
    for i in range(0, len(body), 5):  # markers cut at every position
        counter.feed(body[i:i + 5])
    assert counter.tokens() == 4


def test_stream_usage_chunk_and_json_usage_are_exact() -> None:
    counter = OutputTokenCounter(stream=True)
    counter.feed(sse("a") + sse("b"))
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
    counter.feed(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    assert counter.tokens() == 7
    body = json.dumps({"choices": [{"text": "x" * 3000}], "usage": {"completion_tokens": 42}}).encode()
    plain = OutputTokenCounter(stream=False)
    for i in range(0, len(body), 700):
        plain.feed(body[i:i + 700])
    assert plain.tokens() == 42
    assert OutputTokenCounter(stream=False).tokens() is None


def test_a_prediction_is_refreshed_with_lengths_learned_since() -> None:
    lengths = OutputLengths(0.99, min_samples=4, refresh_every=1)
    engine = EngineShape(8192, 2048, 256)
    predictor = Predictor(layout("llama-3-8b"), engine, True, 10**9, outputs=lengths)
    spec = parse_request("completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 2000}).encode())
    prediction = predictor.predict(spec, [list(range(100))])
    assert prediction.demand.kv_blocks == 132 and predictor.refreshed(prediction) is prediction.demand
    for _ in range(4):
        lengths.observe(2000, 60)
    refreshed = predictor.refreshed(prediction)
    assert refreshed.kv_blocks == 10 and refreshed.reserved_tokens == 60 and refreshed.max_new_tokens == 2000
    assert prediction.max_kv_blocks == 132  # "never fits" is still judged at max_tokens
