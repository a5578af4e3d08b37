"""Held-out H8 with every list of prompts sent as one request per prompt: `H8s` plays H8's very
calls (same seed, same times), each eval list split into its prompts, sent at the list's time.

Why: kvgate reserves a list of prompts as one request and gives it back when its last prompt
ends, while vLLM frees each prompt's KV blocks when that prompt ends (no per-prompt relief is
built: docs/limitations.md). The same prompts as single requests were meant to bound what such a
relief could reach; on the shared 2-core machine its 686 plain requests are more than the client
drives (a quarter failed at the client in a second run, in both arms:
bench/results/lists-session35), so it is a measurement only on a machine that drives them.

    python -m bench.repeat_arm H8s --scenarios-from tests/heldout/prompt_lists_split.py --arm kvgate
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

from bench.__main__ import scenarios_from
from bench.workloads import Call


def split_lists(traffic: Callable[[random.Random, float], list[Call]]) -> Callable[[random.Random, float], list[Call]]:
    """The same seeded calls, each call whose `prompt` is a list of strings sent as one call per prompt."""

    def calls(rng: random.Random, scale: float) -> list[Call]:
        out: list[Call] = []
        for call in traffic(rng, scale):
            prompt = call.body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                out += [dataclasses.replace(call, body={**call.body, "prompt": p}) for p in prompt]
            else:
                out.append(call)
        return out

    return calls


# in H8's place in the list: `bench.repeat_arm` seeds a scenario's traffic by its index, so H8s plays H8's calls
SCENARIOS = [
    dataclasses.replace(s, key=f"{s.key}s", traffic=split_lists(s.traffic)) if s.key == "H8" else s
    for s in scenarios_from(Path(__file__).parent / "scenarios.py")
]
