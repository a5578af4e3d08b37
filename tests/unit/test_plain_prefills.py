"""Non-streaming requests' prefills closed on vLLM's count of first tokens
(kvgate/gate/plain_prefills.py): the count says how many finished, never who, so the ledger's
relieved charge must be at least what ANY choice of that many finished would leave, and the
number telemetry derives from the count must never exceed how many plain requests really have
finished, whatever the order of first tokens, streams, releases and scrapes."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest

from kvgate.gate.ledger import Ledger, Reservation
from kvgate.memory.activation import EngineShape, SamplingShape
from kvgate.memory.ceiling import StepHoldings
from kvgate.memory.demand import Demand
from kvgate.predict import Predictor, TransientSplit
from kvgate.telemetry.first_tokens import FirstTokenAccount, FirstTokenCount
from support.geometry import layout


def _predictor(runner: str, backend: str = "flash-attn", geometry: str = "llama-3.1-8b-instruct") -> Predictor:
    engine = EngineShape(32768, 2048, 256, attention_backend=backend, block_size=16, runner=runner)
    return Predictor(layout(geometry), engine, True, 1 << 40)


def _demand(
    predictor: Predictor, prompt: int, sampling: SamplingShape, sequences: int = 1, beam_iterations: int = 1
) -> Demand:
    """A `prompt`-token request's memory terms as the predictor splits them."""
    _, split = predictor.transient(prompt, sampling)
    assert isinstance(split, TransientSplit)
    return Demand(
        prompt_tokens=prompt,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=prompt // 16 + 1,
        transient_prefill_bytes=split.prefill,
        transient_held_bytes=min(split.prefill, prompt * 1024 if sampling.prompt_logprobs else 0),
        profiled_prefill_bytes=split.profiled_prefill,
        profiled_residual_bytes=split.profiled_residual,
        sequences=sequences,
        beam_iterations=beam_iterations,
    )


def _parts(step: StepHoldings) -> tuple[int, int, int]:
    return step.unprofiled, step.forward_profiled, step.residual_profiled


def _relieved(streams: list[Demand], plain: list[Demand], first_tokens: int) -> Ledger:
    """A ledger of these streams and plain candidates, told `first_tokens` of theirs finished."""
    ledger = Ledger()
    for d in streams:
        ledger.reserve(d)
    for d in plain:
        ledger.mark_plain(ledger.reserve(d))
    ledger.plain.set_finished(first_tokens)
    return ledger


def _assert_covers(relieved: Ledger, exact: Ledger, newcomer: Demand, case: object) -> None:
    """The relieved ledger's step, alone and with a newcomer, is at least the exact one's."""
    for mine, theirs in [(relieved.step(), exact.step()), (relieved.step_with(newcomer), exact.step_with(newcomer))]:
        assert all(a >= b for a, b in zip(_parts(mine), _parts(theirs), strict=True)), case


SAMPLINGS = [SamplingShape(), SamplingShape(random=False), SamplingShape(prompt_logprobs=5), SamplingShape(logprobs=5)]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_relieved_charge_covers_every_choice_of_who_finished(runner: str) -> None:
    """Plain requests of many sizes beside streams: with `k` known finished, the ledger's step
    (alone and with a newcomer) is at least the step of the same ledger in which exactly some `k`
    of the plain requests ended their prefill, for every such choice tried (all of them where
    few, else the largest, the smallest and random ones)."""
    rng = random.Random(11)
    predictor = _predictor(runner)
    for trial in range(12):
        plain = [_demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS)) for _ in range(rng.randint(1, 7))]
        streams = [_demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS)) for _ in range(rng.randint(0, 3))]
        newcomer = _demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS))
        for k in range(len(plain) + 1):
            relieved = _relieved(streams, plain, k)
            assert relieved.plain.finished == k
            choices = list(itertools.combinations(range(len(plain)), k))
            if len(choices) > 12:
                by_size = sorted(range(len(plain)), key=lambda i: plain[i].profiled_prefill_bytes)
                choices = [tuple(by_size[:k]), tuple(by_size[-k:]), *rng.sample(choices, 10)]
            for finished in choices:
                exact = Ledger()
                for d in streams:
                    exact.reserve(d)
                held = [exact.reserve(d) for d in plain]
                for i in finished:
                    assert exact.end_prefill(held[i])
                _assert_covers(relieved, exact, newcomer, (trial, k, finished))
            if k == len(plain) and k:  # all finished: exactly the prefills closed one by one
                assert _parts(relieved.step()) == _parts(exact.step())


def test_a_plain_request_is_closed_only_by_the_count_and_relief_shrinks_as_candidates_leave() -> None:
    predictor = _predictor("v2")
    ledger = Ledger()
    a, b = (ledger.reserve(_demand(predictor, p, SamplingShape())) for p in (2000, 1500))
    ledger.mark_plain(a)
    ledger.mark_plain(b)
    before = ledger.step().forward_profiled
    assert not ledger.end_prefill(a)  # no stream: its first token is not kvgate's to see
    assert ledger.plain.set_finished(5)  # more than there are: both
    assert ledger.plain.finished == 2
    assert ledger.step().forward_profiled < before
    ledger.release(a)  # had it finished, it was one of the two: one is left known
    assert ledger.plain.finished == 1
    ledger.release(b)
    assert (ledger.plain.finished, len(ledger.plain)) == (0, 0)
    assert ledger.step().forward_profiled == 0


def _n4_beside_one(prompt: int) -> tuple[Ledger, Reservation, Reservation]:
    """A ledger holding an n = 4 request of 500 tokens and a `prompt`-token one, both plain candidates."""
    predictor = _predictor("v2")
    ledger = Ledger()
    several = ledger.reserve(_demand(predictor, 500, SamplingShape(n=4), sequences=4))
    one = ledger.reserve(_demand(predictor, prompt, SamplingShape()))
    ledger.mark_plain(several)
    ledger.mark_plain(one)
    return ledger, several, one


def test_a_request_of_several_engine_requests_counts_finished_only_once_all_of_its_may_have() -> None:
    """A list of prompts or `n` > 1 is a candidate too; each engine request adds one first token
    to vLLM's count, and an unfinished one of S hides up to S - 1 of them."""
    ledger, several, one = _n4_beside_one(2000)
    assert (len(ledger.plain), ledger.plain.others_open) == (2, 0)
    before = ledger.step().forward_profiled
    assert not ledger.plain.set_finished(3)  # three of `several`'s four, or `one` and two of them
    assert ledger.step().forward_profiled == before
    assert ledger.plain.set_finished(4)  # one of the two has ended all of its prefills: the smaller
    assert ledger.plain.finished == 1
    smaller = min(several.demand.profiled_prefill_bytes, one.demand.profiled_prefill_bytes)
    assert ledger.step().forward_profiled == before - smaller
    assert ledger.plain.set_finished(5)
    assert ledger.plain.finished == 2
    ledger.release(several)  # its four first tokens leave the account with it
    assert (ledger.plain.finished, ledger.plain.accounted) == (1, 4)


def _first_token_spreads(sizes: list[int], k: int) -> list[tuple[int, ...]]:
    """Every way `k` first tokens can fall on requests of `sizes` engine requests."""
    return [t for t in itertools.product(*(range(s + 1) for s in sizes)) if sum(t) == k]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_relieved_charge_covers_every_spread_of_first_tokens_over_several_engine_requests(runner: str) -> None:
    """Plain requests of 1-4 engine requests beside streams: with `k` first tokens counted from
    them, the ledger's step (alone and with a newcomer) is at least the step of the same ledger in
    which exactly the requests that got all their first tokens ended their prefill, for every way
    the `k` can fall (the others, partly prefilled, are charged in full there: at most that)."""
    rng = random.Random(23)
    predictor = _predictor(runner)
    relieved_some = 0
    for trial in range(10):
        sizes = [rng.choice([1, 1, 2, 3, 4]) for _ in range(rng.randint(1, 4))]
        plain = [_demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS), s) for s in sizes]
        streams = [_demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS)) for _ in range(rng.randint(0, 2))]
        newcomer = _demand(predictor, rng.randint(8, 3000), rng.choice(SAMPLINGS))
        for k in range(sum(sizes) + 1):
            relieved = _relieved(streams, plain, k)
            relieved_some += relieved.plain.finished > 0
            for spread in _first_token_spreads(sizes, k):
                exact = Ledger()
                for d in streams:
                    exact.reserve(d)
                # the truth closes a prefill one engine request at a time: one request per reservation
                held = [exact.reserve(replace(d, sequences=1)) for d in plain]
                for r, t, s in zip(held, spread, sizes, strict=True):
                    if t == s:
                        assert exact.end_prefill(r)
                _assert_covers(relieved, exact, newcomer, (trial, k, spread))
    assert relieved_some > 10


@dataclass
class _Request:
    reservation: Reservation
    plain: bool  # closed on the count: no stream, or a stream of several (kvgate/http/gated_routes.py)
    stream: bool
    engine_requests: int
    first_tokens: int = 0  # of its engine requests, how many vLLM has counted
    shown: bool = False  # a stream's first token that kvgate saw


def test_the_count_never_says_more_plain_prefills_finished_than_did() -> None:
    """Random interleavings of what vLLM does (first tokens, counted at once) and what kvgate sees
    later (a stream's first event, an answer's end, a client leaving before or after its first
    token), with scrapes at random moments read as kvgate/telemetry/live.py reads them: the bound
    derived from the count never exceeds the plain requests (and streams of several engine
    requests) whose every prefill really ended. Beam searches among them put up to n x max_tokens
    first tokens in the count (one engine request per beam per output token) and are never
    candidates."""
    predictor = _predictor("v2")
    relieved = 0  # scrapes that found plain prefills finished: the bound is not merely 0
    for seed in range(60):
        rng = random.Random(seed)
        ledger = Ledger()
        engine_count, base = 0, (0, 0)
        open_: list[_Request] = []
        for _ in range(rng.randint(20, 120)):
            event = rng.random()
            if event < 0.25 or not open_:
                sequences = rng.choice([1, 1, 1, 2, 4])
                beam = rng.choice([1] * 8 + [3, 8])  # a beam search's max_tokens, else 1
                demand = _demand(predictor, rng.randint(8, 1000), SamplingShape(), sequences, beam)
                stream = rng.random() < 0.4
                marked = not stream or sequences > 1  # kvgate/http/gated_routes.py
                request = _Request(ledger.reserve(demand), marked and beam == 1, stream, sequences * beam)
                if marked:
                    ledger.mark_plain(request.reservation)
                assert (request.reservation.id in ledger.plain) == request.plain
                open_.append(request)
            elif event < 0.55:  # vLLM: an engine request's prefill ends, counted
                request = rng.choice(open_)
                if request.first_tokens < request.engine_requests:
                    request.first_tokens += 1
                    engine_count += 1
            elif event < 0.7:  # kvgate: a stream's first event arrives (after vLLM counted it)
                request = rng.choice(open_)
                if request.stream and request.first_tokens and not request.shown:
                    request.shown = True
                    closes = request.engine_requests == 1  # several, or a beam search: a no-op
                    assert ledger.end_prefill(request.reservation) == closes
            elif event < 0.85:  # released: completed (every first token counted), or the client left
                request = open_.pop(rng.randrange(len(open_)))
                if rng.random() < 0.7:
                    engine_count += request.engine_requests - request.first_tokens
                    request.first_tokens = request.engine_requests
                ledger.release(request.reservation)
            else:  # a scrape: the count as of now, read with the ledger's account as of now
                plain = ledger.plain
                if not open_:
                    base = (engine_count, plain.accounted)
                    continue
                plain.set_finished(engine_count - base[0] - (plain.accounted - base[1]) - plain.others_open)
                truly = sum(1 for r in open_ if r.plain and r.first_tokens == r.engine_requests)
                assert plain.finished <= truly, seed
                relieved += plain.finished > 0
            # between scrapes the bound only falls as candidates leave
            truly = sum(1 for r in open_ if r.plain and r.first_tokens == r.engine_requests)
            assert ledger.plain.finished <= truly, seed
    assert relieved > 20


def test_the_count_is_read_from_a_base_where_it_matched_and_not_while_someone_bypasses() -> None:
    count = FirstTokenCount()
    idle = FirstTokenAccount(accounted=40, others_open=0, in_flight=0)
    assert count.finished(100, 0, 0, idle, settled=True) == 0  # the first page: the base
    busy = FirstTokenAccount(accounted=42, others_open=3, in_flight=9)  # 2 released, 3 streams open, 4 plain
    assert count.finished(107, 5, 2, busy, settled=False) == 7 - 2 - 3
    # vLLM runs or queues more than kvgate has in flight: another client's first tokens count too
    assert count.finished(107, 9, 1, busy, settled=False) == 0
    # a new engine life: the count went back, and starts again from there
    assert count.finished(3, 0, 0, busy, settled=False) == 0
    assert count.finished(5, 2, 0, FirstTokenAccount(42, 0, 4), settled=False) == 2
    # idle and settled: the base moves, whatever the count did meanwhile
    assert count.finished(50, 0, 0, FirstTokenAccount(60, 0, 0), settled=True) == 0
    assert count.finished(51, 1, 0, FirstTokenAccount(60, 0, 1), settled=False) == 1


def test_a_stream_whose_every_choice_showed_a_token_closes_its_prefill_at_once() -> None:
    """An n = 4 stream (a plain candidate: its first token is one of four engine requests') whose
    four choices have each shown a token (kvgate/http/choice_watch.py) has prefilled them all:
    its prefill terms leave the step without waiting for vLLM's count, which still counts its
    four first tokens as accounted (released ones' are), never as another candidate's."""
    ledger, several, _ = _n4_beside_one(1500)
    before = ledger.step().forward_profiled
    assert ledger.end_every_prefill(several)
    assert not ledger.end_every_prefill(several)  # once
    assert ledger.step().forward_profiled == before - several.demand.profiled_prefill_bytes
    assert (len(ledger.plain), ledger.plain.accounted, ledger.plain.others_open) == (1, 4, 0)
    # vLLM's count less the accounted four (FirstTokenCount) is the other request's alone now: one first
    # token finishes it, no longer hidden behind the n = 4 stream's three
    assert ledger.plain.set_finished(1)
    assert ledger.plain.finished == 1
    ledger.release(several)
    assert ledger.plain.accounted == 4  # not counted twice


def test_a_beam_search_is_not_closed_by_its_choices() -> None:
    """A beam search's engine requests prefill again for every output token."""
    predictor = _predictor("v2")
    ledger = Ledger()
    beams = ledger.reserve(_demand(predictor, 500, SamplingShape(n=2), sequences=2, beam_iterations=16))
    assert not ledger.end_every_prefill(beams)
    assert beams.prefill_open
