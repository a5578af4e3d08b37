"""Why giving finished choices' rows back was withdrawn: steps kvgate would admit a new n = 16
stream into once rows had fallen, that S8's simulated engine cannot run after an earlier step of
more rows.

S8's budget and engine as frontier.py builds them: 5 decoding chats, 4 labels, and `rows`
decoding stream rows (any count, as finished children would leave: 16-row streams and one of
the remainder), relieved. kvgate is asked whether a new n = 16 stream fits beside them (its
ledger holds the rows as requests of n = 16 and n = rows mod 16, which is what giving finished
rows back would make it hold); where it says yes, the simulator plays the stream's first step
after one earlier step of `more` rows more beside a chat chunk of `tokens` tokens (the batch
before its children finished). Run: `PYTHONPATH=.:tests python bench/results/s8-session38/rows_fall.py`.
"""

from __future__ import annotations

import sys

sys.path.insert(0, "bench/results/s8-session38")

import frontier as f

from kvgate.sim.step_memory import ReqSlice, StepShape

STREAM_ROW = ReqSlice(1, f.PROMPT + 40, random=True, processes=False)


def step(rows: int, prefill: int, children: bool) -> StepShape:
    reqs = f.DECODERS + (STREAM_ROW,) * rows + (f.CHILDREN if children else ())
    room = 2048 - len(reqs) - (f.CHILD_TOKENS - 16 if children else 0)
    if min(prefill, room) > 0:
        reqs += (ReqSlice(min(prefill, room), 0, random=True, seeded=True),)
    return StepShape(reqs)


def kvgate_admits(budget, predictor, rows: int) -> bool:
    ledger = f.s8._beside(predictor, 5, 4)
    sizes = [16] * (rows // 16) + ([rows % 16] if rows % 16 else [])
    for i, n in enumerate(sizes):
        body = {**f.s8.N16, "n": n}
        ledger.mark_plain(ledger.reserve(f.s8._demand(predictor, body, f.PROMPT, 5000 + i)))
    ledger.plain.set_finished(rows)
    return budget.shortfall(f.s8._demand(predictor, f.s8.N16, f.PROMPT, 4000), ledger) is None


def main() -> None:
    engine, budget, predictor = f.s8.s8.__wrapped__()
    for rows in range(240, 341, 4):
        if not kvgate_admits(budget, predictor, rows):
            print(f"{rows} stream rows: kvgate admits no new stream", flush=True)
            continue
        target = step(rows, 0, children=True)
        bad = [
            (more, tokens)
            for more in (1, 2, 4, 8, 12, 16, 24, 32, 48)
            for tokens in range(0, 2049, 256)
            if f.runs_after(engine, [step(rows + more, tokens, children=False)], target) is False
        ]
        print(f"{rows} stream rows: kvgate admits a new stream; fails after {len(bad)} histories {bad[:5]}", flush=True)


if __name__ == "__main__":
    main()
