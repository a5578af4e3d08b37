"""The benchmark's scenarios on vLLM 0.33.0 V2: every S-scenario that plays 0.32.0, the release
changed to 0.33.0 and, where the scenario fixes the pool at vLLM's start-up advice
(`--kv-cache-memory-bytes`), the advice worked out again for 0.33.0 (its profile also samples the
warm-up parameters' pass, so the advised pool is smaller). Keys get a `v33` suffix. The traffic is
each scenario's own generator, seeded by its place in this list, so not call for call the table's.

    python -m bench.repeat_arm S8v33 --scenarios-from tests/heldout/on_vllm_0_33.py --arm kvgate
"""

from __future__ import annotations

import dataclasses

from bench.scenarios import SCENARIOS as BENCHMARK
from bench.scenarios import Scenario
from demo.replay import fully_utilized


def on_0_33(scenario: Scenario) -> Scenario:
    """The scenario on vLLM 0.33.0, its pool re-advised where it was fixed."""
    sim = dataclasses.replace(scenario.sim, vllm_version="0.33.0", kv_cache_memory_bytes=None)
    if scenario.sim.kv_cache_memory_bytes is not None:
        sim = fully_utilized(sim)
    return dataclasses.replace(scenario, key=f"{scenario.key}v33", sim=sim)


SCENARIOS = [on_0_33(s) for s in BENCHMARK if s.sim.vllm_version == "0.32.0"]
