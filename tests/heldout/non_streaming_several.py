"""Held-out H1n with its extraction burst as requests of several engine requests: `H1n4` sends
every fourth extraction call with `n: 4` and drops the other three (the same 480 engine requests
within the same 1.5 s, in 120 requests), non-streaming like H1n (non_streaming.py).

Why: a plain request of several engine requests (a list of prompts, `n` > 1) closes its prefill
on vLLM's count of first tokens only once all of them may have ended
(kvgate/gate/plain_prefills.py); this measures what that costs against the oracle. `n` was
written in session 33 to stand in for lm-eval's lists of prompts, which the simulator then
answered 400; it has served them since session 35 (held-out H8 measures them). kvgate charges
both the same way, one engine request per prompt x n (kvgate/predict.py).

    python -m bench.repeat_arm H1n4 --scenarios-from tests/heldout/non_streaming_several.py --arm kvgate
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from bench.__main__ import scenarios_from
from bench.workloads import Call

N = 4


def fanned_out(
    traffic: Callable[[random.Random, float], list[Call]], label: str
) -> Callable[[random.Random, float], list[Call]]:
    """The same seeded calls, every `N`th `label` call asking `n: N` and the others of that label dropped."""

    def calls(rng: random.Random, scale: float) -> list[Call]:
        out: list[Call] = []
        seen = 0
        for call in traffic(rng, scale):
            if call.label == label:
                seen += 1
                if seen % N:
                    continue
                call.body["n"] = N
            out.append(call)
        return out

    return calls


# in H1n's place in the list: `bench.repeat_arm` seeds a scenario's traffic by its index, so H1n4 plays H1's calls
SCENARIOS = [
    dataclasses.replace(s, key=f"{s.key}{N}", traffic=fanned_out(s.traffic, "extraction")) if s.key == "H1n" else s
    for s in scenarios_from(Path(__file__).parent / "non_streaming_heldout.py")
]
