"""S13's forward steps of random sizes on the simulated L4, default allocator vs expandable segments.

    PYTHONPATH=. python bench/results/goodput-issue24/segment-overhead/step_size_histories.py [expandable]

Each life boots S13's engine (547 MiB free after start-up) and plays up to 3,000 steps of 0-3
chat prompts (16-1,000 tokens) and, half the time, a document chunk filling the rest of the
4,096-token budget or part of it: no sampled rows, so every tensor is the forward pass's (all
inside vLLM's profile) and the step never allocates more than the profile's 400 MiB peak.
"""

import dataclasses
import random
import sys

from bench.scenarios import SCENARIOS
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CudaOutOfMemory, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

cfg = next(s for s in SCENARIOS if s.key == "S13").sim
cfg = dataclasses.replace(cfg, expandable_segments=sys.argv[1:] == ["expandable"])
for seed in range(1, 21):
    device = Device(gpu_total_bytes(cfg.gpu))
    engine = Engine(cfg, load_model(cfg.model, cfg.dtype), device, lambda r: (0, False), "m")
    engine.boot()
    alloc, start, rng, grown, played = engine.alloc, engine.alloc.process_bytes(), random.Random(seed), 0, 0
    try:
        while played < 3000:
            played += 1
            reqs, budget = [], 4096
            for _ in range(rng.randint(0, 3)):
                n = min(budget, rng.randint(16, 1000))
                if n > 0:
                    reqs.append(ReqSlice(n, 0, random=True, seeded=True, processes=True))
                    budget -= n
            if rng.random() < 0.5 and budget > 0:
                n = rng.choice([budget, rng.randint(1, budget)])
                reqs.append(ReqSlice(n, rng.randint(0, 12000), random=True, processes=True))
            if reqs:
                for block in run_tape(alloc, engine.steps.plan(StepShape(tuple(reqs))), engine.carry.held):
                    alloc.free(block)
                grown = max(grown, alloc.process_bytes() - start)
        print(f"life {seed}: 3,000 steps, the server grew at most {grown / MiB:.0f} MiB")
    except CudaOutOfMemory as e:
        print(f"life {seed}: OOM at step {played} ({str(e)[20:52]}), the server had grown {grown / MiB:.0f} MiB")
