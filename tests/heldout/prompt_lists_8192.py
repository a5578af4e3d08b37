"""Held-out H8 on the engine's default step size: `H8b` plays H8's very calls (same seed, same
times) on the same GPU and model with `--max-num-batched-tokens 8192` (vLLM's default on an
H100) instead of 2048, the pool again as vLLM's advice sizes it for that step.

Why: there a list's prompts prefill together in steps of up to 8,192 tokens, and kvgate refuses
every list whose step reaches about 6,500 tokens as `transient_memory_never_fits` (its forward
pass, 854-1,092 MiB, against the 846 MiB it takes an idle server to have), as it refuses a single
prompt of 7,000 tokens, while the oracle serves them all (session 35, docs/limitations.md).

    python -m bench.repeat_arm H8b --scenarios-from tests/heldout/prompt_lists_8192.py --arm kvgate
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.__main__ import scenarios_from
from bench.scenarios import Scenario
from demo.replay import fully_utilized


def at_8192(scenario: Scenario) -> Scenario:
    """`scenario` at 8,192 tokens a step, its pool re-advised for that step's profile."""
    sim = fully_utilized(dataclasses.replace(scenario.sim, max_num_batched_tokens=8192, kv_cache_memory_bytes=None))
    flags = list(scenario.kvgate_flags)
    flags[flags.index("--max-num-batched-tokens") + 1] = "8192"
    return dataclasses.replace(scenario, key=f"{scenario.key}b", sim=sim, kvgate_flags=flags)


# in H8's place in the list: `bench.repeat_arm` seeds a scenario's traffic by its index, so H8b plays H8's calls
SCENARIOS = [at_8192(s) if s.key == "H8" else s for s in scenarios_from(Path(__file__).parent / "scenarios.py")]
