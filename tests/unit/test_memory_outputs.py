"""Learned output lengths and the token counts read off relayed bodies."""

from __future__ import annotations

import json
import random

from kvgate.gate.budget import Budget
from kvgate.http.output_tokens import OutputTokenCounter
from kvgate.memory.activation import EngineShape, SamplingShape
from kvgate.memory.footprint import predict_footprint
from kvgate.memory.outputs import OutputReservation
from kvgate.openai import parse_request
from kvgate.output_lengths import OutputLengths
from kvgate.predict import Predictor
from support.geometry import layout


def test_full_max_tokens_until_enough_answers_are_seen() -> None:
    lengths = OutputLengths(0.99, min_samples=32, refresh_every=1)
    for _ in range(31):
        lengths.observe(2048, 100)
    assert lengths.reserve(2048) == OutputReservation(2048, 0.0)
    lengths.observe(2048, 100)
    assert lengths.reserve(2048) == OutputReservation(100, 0.0)


def test_reservations_change_only_with_a_new_generation() -> None:
    """The gate estimates a waiting request again only when the generation moved (Gate's
    `reestimate_inputs`): between two refreshes every reservation stays what it was."""
    rng = random.Random(3)
    lengths = OutputLengths(0.99, min_samples=8, refresh_every=4)
    seen = (lengths.generation, lengths.reserve(1024), lengths.reserve(300, 50))
    changes = 0
    for i in range(64):
        lengths.observe(rng.choice([300, 1024]), rng.randint(10, 400))
        now = (lengths.generation, lengths.reserve(1024), lengths.reserve(300, 50))
        if now[0] == seen[0]:
            assert now == seen
        else:
            assert now[0] == seen[0] + 1
            assert (i + 1) % 4 == 0
            changes += now[1:] != seen[1:]
        seen = now
    assert lengths.generation == 16
    assert changes >= 10  # the reservations did move, at refreshes only


def test_chat_answers_shorter_than_their_max_tokens_are_learned() -> None:
    """Answers of 16-255 tokens whatever max_tokens (256 to 2048) the clients send: the mean
    (~135) and the variance of a uniform spread (240^2 / 12 = 4800)."""
    rng = random.Random(7)
    lengths = OutputLengths(0.99, refresh_every=1)
    for _ in range(400):
        allowed = rng.choice([256, 512, 1024, 2048])
        lengths.observe(allowed, rng.randint(16, 255))
    for allowed in (2048, 700):
        learned = lengths.reserve(allowed)
        assert 125 <= learned.tokens <= 145
        assert 4000 <= learned.variance <= 5600
    capped = lengths.reserve(100)  # never above max_tokens: the longer answers count as 100
    assert 78 <= capped.tokens <= 92
    assert capped.variance < 900


def test_the_margin_grows_with_the_square_root_of_the_requests_in_flight() -> None:
    """q = 0.99 keeps room for 2.33 standard deviations of the summed outputs: for one request
    about its own 99th percentile, for a hundred far less than a hundred of them."""
    lengths = OutputLengths(0.99, refresh_every=1)
    for i in range(480):  # two of each length 16..255
        lengths.observe(2048, 16 + i % 240)
    learned = lengths.reserve(2048)
    budget = Budget(kv_margin_z=lengths.z)
    one = learned.tokens + budget.kv_margin(learned.variance)
    hundred = 100 * learned.tokens + budget.kv_margin(100 * learned.variance)
    assert learned == OutputReservation(136, 4799.916666666667)  # mean 135.5, variance (240^2 - 1) / 12
    assert one == 136 + 162  # 2.33 x 69.3: near the 99th percentile of the lengths (253)
    assert hundred == 13_600 + 1612  # 2.33 x 10 x 69.3
    assert hundred < 100 * 240  # what a per-request 0.99-quantile would hold


def test_answers_that_fill_max_tokens_keep_full_reservations() -> None:
    """ignore_eos traffic: every answer is as long as allowed, whatever the allowance."""
    lengths = OutputLengths(0.99, refresh_every=1)
    for i in range(200):
        allowed = [128, 300, 900][i % 3]
        lengths.observe(allowed, allowed)
    assert [lengths.reserve(m) for m in (128, 300, 900)] == [OutputReservation(m, 0.0) for m in (128, 300, 900)]
    assert lengths.reserve(200) == OutputReservation(200, 0.0)  # the 300 and 900 answers went past 200


def test_answers_cut_at_their_limit_could_have_gone_on() -> None:
    """Answers that used all of 512 say nothing about what they would do with 4096; answers that
    stopped at 100 of 512 would have stopped at 100 under any allowance."""
    lengths = OutputLengths(0.99, refresh_every=1)
    for _ in range(100):
        lengths.observe(512, 512)
    assert lengths.reserve(4096) == OutputReservation(4096, 0.0)
    stopped = OutputLengths(0.99, refresh_every=1)
    for _ in range(100):
        stopped.observe(512, 100)
    assert stopped.reserve(4096) == OutputReservation(100, 0.0)


def test_quantile_one_turns_learning_off() -> None:
    lengths = OutputLengths(1.0, refresh_every=1)
    for _ in range(100):
        lengths.observe(2048, 10)
    assert not lengths.enabled
    assert lengths.reserve(2048) == OutputReservation(2048, 0.0)
    assert lengths.z == 0.0


def test_footprint_reserves_the_expected_output_but_keeps_full_growth() -> None:
    fp = predict_footprint(
        layout("llama-3-8b"),
        EngineShape(8192, 2048, 256),
        list(range(100)),
        2000,
        SamplingShape(),
        reservation=OutputReservation(60, 400.0),
    )
    assert (fp.kv_blocks, fp.max_kv_blocks) == (10, 132)  # cdiv(160, 16), cdiv(2100, 16)
    assert fp.reserved_variance == 400.0


def sse(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode()


def test_stream_counts_events_even_split_across_chunks() -> None:
    body = b"".join(sse(t) for t in ["a", "b", "c", "d"]) + b"data: [DONE]\n\n"
    counter = OutputTokenCounter(stream=True)
    for i in range(0, len(body), 5):  # markers cut at every position
        counter.feed(body[i : i + 5])
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
        plain.feed(body[i : i + 700])
    assert plain.tokens() == 42
    assert OutputTokenCounter(stream=False).tokens() is None


def test_a_prediction_is_refreshed_with_lengths_learned_since() -> None:
    lengths = OutputLengths(0.99, min_samples=4, refresh_every=1)
    engine = EngineShape(8192, 2048, 256)
    predictor = Predictor(layout("llama-3-8b"), engine, True, 10**9, outputs=lengths)
    spec = parse_request("completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 2000}).encode()).request
    prediction = predictor.predict(spec, [list(range(100))])
    assert prediction.demand.kv_blocks == 132
    assert predictor.refreshed(prediction) is prediction.demand
    for _ in range(4):
        lengths.observe(2000, 60)
    refreshed = predictor.refreshed(prediction)
    assert refreshed.kv_blocks == 10
    assert refreshed.reserved_tokens == 60
    assert refreshed.max_new_tokens == 2000
    assert refreshed.kv_variance_blocks == 0.0  # four answers of exactly 60: no spread
    lengths.observe(2000, 100)  # now 60, 60, 60, 60, 100: mean 68, variance 256 tokens^2 = 1 block^2
    spread = predictor.refreshed(prediction)
    assert spread.reserved_tokens == 68
    assert spread.kv_variance_blocks == 1.0
    assert prediction.max_kv_blocks == 132  # "never fits" is still judged at max_tokens


def test_every_sample_of_a_request_adds_its_spread() -> None:
    """n = 3 answers of one prompt: three mean outputs reserved, three variances to the margin."""
    lengths = OutputLengths(0.99, min_samples=4, refresh_every=1)
    for produced in (60, 60, 60, 60, 100):  # mean 68, variance 256 tokens^2 = 1 block^2
        lengths.observe(2000, produced)
    predictor = Predictor(layout("llama-3-8b"), EngineShape(8192, 2048, 256), True, 10**9, outputs=lengths)
    body = {"model": "m", "prompt": "x", "max_tokens": 2000, "n": 3}
    demand = predictor.predict(
        parse_request("completions", json.dumps(body).encode()).request, [list(range(100))]
    ).demand
    assert demand.reserved_tokens == 68
    assert demand.kv_variance_blocks == 3.0


def test_a_request_that_cannot_stop_early_reserves_its_floor() -> None:
    """After short answers taught a small reservation, ignore_eos still reserves max_tokens and
    min_tokens at least its minimum: the learned lengths below the floor count as the floor."""
    lengths = OutputLengths(0.99, min_samples=16, refresh_every=1)
    for _ in range(64):
        lengths.observe(20_000, 50)
    assert lengths.reserve(20_000) == OutputReservation(50, 0.0)
    assert lengths.reserve(20_000, 20_000) == OutputReservation(20_000, 0.0)  # ignore_eos
    assert lengths.reserve(20_000, 30) == OutputReservation(50, 0.0)  # below what answers use
    assert lengths.reserve(20_000, 1_000) == OutputReservation(1_000, 0.0)
    assert lengths.reserve(500, 1_000) == OutputReservation(500, 0.0)  # never above max_tokens


def test_ignore_eos_and_min_tokens_reserve_their_output_and_teach_nothing() -> None:
    lengths = OutputLengths(0.99, min_samples=4, refresh_every=1)
    for _ in range(8):
        lengths.observe(2000, 60)
    predictor = Predictor(layout("llama-3-8b"), EngineShape(8192, 2048, 256), True, 10**9, outputs=lengths)

    def demand(**extra: object):
        body = {"model": "m", "prompt": "x", "max_tokens": 2000, **extra}
        return predictor.predict(
            parse_request("completions", json.dumps(body).encode()).request, [list(range(100))]
        ).demand

    plain, forced, at_least = demand(), demand(ignore_eos=True), demand(min_tokens=700)
    assert (plain.reserved_tokens, plain.kv_blocks, plain.teaches_output_lengths) == (60, 10, True)
    assert (forced.reserved_tokens, forced.kv_blocks, forced.teaches_output_lengths) == (2000, 132, False)
    assert (at_least.reserved_tokens, at_least.kv_blocks, at_least.teaches_output_lengths) == (700, 50, False)
    # A queued ignore_eos request refreshed after more short answers keeps its full reservation.
    prediction = predictor.predict(
        parse_request(
            "completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}).encode()
        ).request,
        [list(range(100))],
    )
    lengths.observe(2000, 30)
    assert predictor.refreshed(prediction).kv_blocks == 132
