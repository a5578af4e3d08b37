"""S1-S14 replayed with every request non-streaming, as evaluation harnesses and batch jobs send
them (lm-eval's local-completions, a plain OpenAI SDK call): `S8n` is S8's traffic without
`stream` (the held-out H1-H6: non_streaming_heldout.py).

Why: kvgate learns that a request's prefill is over from its stream's first token; a plain
request shows none, so its prefill-only terms stay reserved until its answer ends
(kvgate/gate/ledger.py `Ledger.end_prefill`). These variants measure what that costs against the
oracle, which reads the engine's own state. The client times no first token for them (TTFT is
None): compare goodput.

    python -m bench.repeat_arm S8n --scenarios-from tests/heldout/non_streaming.py --arm kvgate
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from bench.scenarios import SCENARIOS as STREAMING
from bench.scenarios import Scenario
from bench.workloads import Call


def non_streaming(
    traffic: Callable[[random.Random, float], list[Call]],
) -> Callable[[random.Random, float], list[Call]]:
    """The same seeded calls with `stream` and `stream_options` removed."""

    def calls(rng: random.Random, scale: float) -> list[Call]:
        out = traffic(rng, scale)
        for call in out:
            call.body.pop("stream", None)
            call.body.pop("stream_options", None)
        return out

    return calls


def plain_variants(scenarios: list[Scenario]) -> list[Scenario]:
    """Each scenario as `KEYn`, in the same order: `bench.repeat_arm` seeds a scenario's traffic by
    its index in its list, so `S8n` plays S8's very calls."""
    return [dataclasses.replace(s, key=f"{s.key}n", traffic=non_streaming(s.traffic)) for s in scenarios]


SCENARIOS = plain_variants(STREAMING)
