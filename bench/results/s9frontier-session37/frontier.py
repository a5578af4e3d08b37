"""How close kvgate's S9 admissions are to the most chats the simulator runs after every history.

For each open prefill size, kvgate's admitted count of decoding chats on S9's live budget (as
tests/unit/test_speculative_v2_steps.py builds it) beside the first count the simulator (S9's
own engine and allocator, as start-up left it) runs out of memory for after some history: every
one-step history of 0-16 chats fewer beside a prefill on a 128-token grid, and 100 random two-
and three-step histories of such steps. Run: `PYTHONPATH=.:tests python
bench/results/s9frontier-session37/frontier.py`.
"""

from __future__ import annotations

import copy
import random
import sys

sys.path.insert(0, "tests/unit")

import test_speculative_v2_steps as s9
from sim_support import make_engine, played

from bench.scenarios import SCENARIOS
from kvgate.sim.step_memory import ReqSlice, StepShape

ROWS = 1 + s9.K
ENGINE = make_engine(next(s for s in SCENARIOS if s.key == "S9").sim)


def step_of(chats: int, prefill: int = 0) -> StepShape:
    """`chats` decoding S9 chats beside a `prefill`-token chunk (none if 0)."""
    extra = (ReqSlice(prefill, 0, random=True, seeded=True),) if prefill > 0 else ()
    return StepShape((s9.decoding_slice(s9.S9_CHAT),) * chats + extra)


def runs_after(history: list[StepShape], step: StepShape) -> bool | None:
    """Whether `step` runs after `history` on S9's allocator; None: the history itself cannot run."""
    alloc = copy.deepcopy(ENGINE.alloc)
    if not all(played(alloc, ENGINE.steps, earlier) for earlier in history):
        return None
    return played(alloc, ENGINE.steps, step)


def failing_histories(chats: int, prefill: int, rng: random.Random) -> int:
    step = step_of(chats, min(prefill, 2048 - chats * ROWS))
    bad = 0
    for fewer in range(max(1, chats - 16), chats + 1):
        for tokens in range(0, 2049, 128):
            bad += runs_after([step_of(fewer, tokens - fewer * ROWS)], step) is False
    for _ in range(100):
        history = []
        for _ in range(rng.choice([2, 3])):
            fewer = rng.randint(max(1, chats - 16), chats)
            history.append(step_of(fewer, rng.randrange(0, 2049, 64) - fewer * ROWS))
        bad += runs_after(history, step) is False
    return bad


def main() -> None:
    deployment = s9.deployment.__wrapped__()
    predictor = s9.predictor.__wrapped__(deployment)
    capacity = s9.s9_capacity.__wrapped__()
    budget = s9.s9_budget.__wrapped__(deployment, predictor, capacity)
    rng = random.Random(2)
    for prefill in (0, 300, 500, 1000, 1500):
        admitted = s9.chats_admitted(predictor, budget, prefill)
        first_failing = None
        for chats in range(max(1, admitted - 3), admitted + 14):
            bad = failing_histories(chats, prefill, rng)
            print(f"  prefill {prefill}: {chats} chats, {bad} failing histories", flush=True)
            if bad and first_failing is None:
                first_failing = chats
        print(f"prefill {prefill}: kvgate admits {admitted}; the simulator first fails at {first_failing}", flush=True)


if __name__ == "__main__":
    main()
