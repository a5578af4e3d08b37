"""Held-out H1 refuses 13 - 20 RAG queries a run as `allocator_cache_outgrown` (a prompt that runs
alone only from some cache, not from every cache of what the engine has grown by), which the
oracle serves. Are the caches that refuse them ones histories reach?

Plays reachable.py's 2,000 random histories of H1's served steps at 617 MiB, keeps every cache a
step boundary leaves, and plays a lone prompt's prefill chunks (`lone_request_fits`' tape) from
those of at most G MiB, beside the grid's verdict.

    PYTHONPATH=. python bench/results/reachable-session40/lone.py
"""

from __future__ import annotations

import random

from kvgate.memory import allocator as A
from kvgate.memory.activation import (
    EngineShape,
    _chunks_tape,
    lone_request_chunks,
    lone_request_ever_fits,
    lone_request_fits,
    sampled_step_tape,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim.presets import model_config
from kvgate.units import MiB

GEOMETRY = ModelGeometry.from_config(model_config("qwen2.5-7b"))
ENGINE = EngineShape(16384, 4096, 512, runner="v2")
CAPACITY = 617 * MiB


def main() -> None:
    full = ENGINE.max_num_batched_tokens
    rng = random.Random(0)
    caches: set[tuple[int, ...]] = set()
    for _ in range(2000):
        replay = A._Replay(False, CAPACITY)
        requests = rng.randint(1, 520)
        for _ in range(60):
            requests = max(1, min(520, requests + rng.choice([-3, -1, 0, 1, 1, 2, 3, 8])))
            tokens = min(full, requests + rng.choice([0, 0, rng.randint(1, full)]))
            trial = replay.copy()
            try:
                trial.run(sampled_step_tape(GEOMETRY, ENGINE, tokens, requests, rng.random() < 0.9))
            except A._OutOfMemory:
                continue
            replay = trial
            caches.add(tuple(sorted(s.size for s in replay.segments if s.pool == "large")))
    print(f"{len(caches)} distinct caches")
    for prompt in (3000, 5000, 8000):
        chunks = lone_request_chunks(ENGINE, prompt)
        tape = _chunks_tape(GEOMETRY, ENGINE, chunks)
        ever = lone_request_ever_fits(GEOMETRY, ENGINE, False, chunks, CAPACITY)
        for grown in (100, 200, 300, 400, 500, 617):
            grid = lone_request_fits(GEOMETRY, ENGINE, False, chunks, CAPACITY, grown * MiB)
            observed = [c for c in caches if sum(c) <= grown * MiB]
            failing = [c for c in observed if not A._runs_from(tape, CAPACITY, c, False)]
            example = [tuple(x // MiB for x in c) for c in failing[:2]]
            print(
                f"{prompt} tokens {chunks}: runs from some cache {ever}; cache grown to {grown} MiB: the grid "
                f"{'runs it' if grid else 'refuses'}, {len(failing)} of {len(observed)} observed caches fail it {example}"
            )


if __name__ == "__main__":
    main()
