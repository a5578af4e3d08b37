"""How close kvgate's S8 admissions are to the most n = 16 streams the simulator runs after every history.

S8's burst state as tests/unit/test_s8_burst.py builds it: 5 decoding chats (temperature 0.7,
seeded: their rows make V2 copy the whole batch's logits to fp32), 4 greedy labels, k n = 16
streams decoding (vLLM's count relieved their prefills), and one open chat prefill of `prefill`
tokens (none if 0). kvgate's count is how many streams its budget on S8's free memory admits one
after another; the simulator's is the first k whose next stream's first step (its 16 children
prefilling: the first computes the prompt, 15 hit its cached blocks) beside the open prefill's
chunk runs out of memory on S8's own allocator (as start-up left it) after some history: every
one-step history of 0-3 streams fewer beside another chunk on a 128-token grid, and 60 random
two- and three-step histories of such steps. Run: `PYTHONPATH=.:tests
python bench/results/s8-session38/frontier.py`.
"""

from __future__ import annotations

import copy
import random
import sys

sys.path.insert(0, "tests/unit")

import test_s8_burst as s8
from sim_support import played

from kvgate.sim.step_memory import ReqSlice, StepShape

PROMPT = s8.PROMPT
CACHED = (PROMPT - 1) // 16 * 16  # whole blocks, the last token always computed
CHILDREN = (ReqSlice(PROMPT, 0, random=True, processes=False),) + (
    ReqSlice(PROMPT - CACHED, CACHED, random=True, processes=False),
) * 15
CHILD_TOKENS = PROMPT + 15 * (PROMPT - CACHED)
DECODERS = (ReqSlice(1, 440, random=True, seeded=True),) * 5 + (ReqSlice(1, 310),) * 4


def step_of(streams: int, prefill: int, children: bool) -> StepShape:
    """`streams` decoding streams beside the chats and labels, a `prefill`-token chat chunk (none
    if 0, cut to the step's 2,048 tokens) and, if `children`, a new stream's first step."""
    reqs = DECODERS + (ReqSlice(1, PROMPT + 40, random=True, processes=False),) * (16 * streams)
    if children:
        reqs += CHILDREN
    room = 2048 - len(reqs) - (CHILD_TOKENS - 16 if children else 0)
    if min(prefill, room) > 0:
        reqs += (ReqSlice(min(prefill, room), 0, random=True, seeded=True),)
    return StepShape(reqs)


def runs_after(engine, history: list[StepShape], step: StepShape) -> bool | None:
    """Whether `step` runs after `history` on S8's allocator; None: the history itself cannot run."""
    alloc = copy.deepcopy(engine.alloc)
    if not all(played(alloc, engine.steps, earlier) for earlier in history):
        return None
    return played(alloc, engine.steps, step)


def failing_histories(engine, streams: int, prefill: int, rng: random.Random) -> int:
    step = step_of(streams, prefill, children=True)
    grown = step_of(streams + 1, prefill, children=False)  # the new stream's decode steps
    bad = 0
    for fewer in range(max(0, streams - 3), streams + 1):
        for tokens in range(0, 2049, 128):
            bad += runs_after(engine, [step_of(fewer, tokens, children=False)], step) is False
            bad += runs_after(engine, [step_of(fewer, tokens, children=True)], step) is False
            bad += runs_after(engine, [step_of(fewer, tokens, children=False)], grown) is False
    for _ in range(60):
        history = [
            step_of(rng.randint(max(0, streams - 3), streams), rng.randrange(0, 2049, 64), rng.random() < 0.5)
            for _ in range(rng.choice([2, 3]))
        ]
        bad += runs_after(engine, history, step) is False
        bad += runs_after(engine, history, grown) is False
    return bad


def admitted(budget, predictor, prefill: int) -> int:
    """Streams kvgate admits one after another beside the chats, the labels and an open chat prefill."""
    ledger = s8._beside(predictor, 5, 4)
    if prefill:
        ledger.reserve(s8._demand(predictor, s8.CHAT, prefill, 999))
    n = 0
    while n < 40 and budget.shortfall(d := s8._demand(predictor, s8.N16, PROMPT, 3000 + n), ledger) is None:
        ledger.mark_plain(ledger.reserve(d))
        n += 1
        ledger.plain.set_finished(16 * n)
    return n


def main() -> None:
    engine, budget, predictor = s8.s8.__wrapped__()
    rng = random.Random(2)
    for prefill in (0, 500, 1000, 1500):
        count = admitted(budget, predictor, prefill)
        first_failing = None
        for streams in range(max(0, count - 2), count + 8):
            alone = runs_after(engine, [], step_of(streams, prefill, children=True))
            bad = failing_histories(engine, streams, prefill, rng)
            print(
                f"  prefill {prefill}: {streams} streams decoding + 1 prefilling, runs alone {alone}, {bad} failing histories",
                flush=True,
            )
            if bad and first_failing is None:
                first_failing = streams
                break
        print(
            f"prefill {prefill}: kvgate admits {count}; the simulator first fails with {first_failing} decoding",
            flush=True,
        )


if __name__ == "__main__":
    main()
