"""How far is the whole-step level over every cache of the grid (kvgate/memory/activation.py
`any_cache_sampled_rows`) from the level over caches that histories of steps really leave?

Plays random histories of served steps (forward pass, sampler phase, fp32 copy where the step
copies: `sampled_step_tape`) under the caching allocator's rules (kvgate/memory/allocator.py,
a step that runs out of memory is dropped from its history, as kvgate would have held it back),
records the cache every step boundary leaves (its free large-pool segments), and bisects the
rows of a query step over those caches. The observed level is an upper bound on the reachable
one (more histories can only lower it); the grid's is kvgate's.

    PYTHONPATH=. python bench/results/reachable-session40/reachable.py S9 304 2000
"""

from __future__ import annotations

import random
import sys
import time

from kvgate.memory import allocator as A
from kvgate.memory.activation import (
    ANY_CACHE_SEGMENTS,
    EngineShape,
    cached_segment_sizes,
    sampled_step_tape,
    sampler_cost,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim.presets import model_config
from kvgate.units import MiB

ENGINES = {  # model, engine, sampled rows per request, most requests at once
    "S9": ("llama-3.1-8b", EngineShape(8192, 2048, 256, runner="v2", num_speculative_tokens=5), 6, 48),
    "S8": ("qwen2.5-7b", EngineShape(8192, 2048, 1024, runner="v2"), 16, 24),
    "H1": ("qwen2.5-7b", EngineShape(16384, 4096, 512, runner="v2"), 1, 520),
    "S13": ("llama-3.1-8b", EngineShape(32768, 2048, 512, runner="v2"), 1, 512),
}


def main() -> None:
    key, capacity, count = sys.argv[1], int(sys.argv[2]) * MiB, int(sys.argv[3])
    model, engine, per, most_requests = ENGINES[key]
    if len(sys.argv) > 4:  # at most this many requests at once (the rows an engine life has seen)
        most_requests = int(sys.argv[4])
    g = ModelGeometry.from_config(model_config(model))
    full = engine.max_num_batched_tokens
    rng = random.Random(0)
    caches: set[tuple[int, ...]] = set()
    dropped = played = 0
    started = time.process_time()
    for _ in range(count):
        replay = A._Replay(False, capacity)
        requests = rng.randint(1, most_requests)
        for _ in range(60):
            requests = max(1, min(most_requests, requests + rng.choice([-3, -1, 0, 1, 1, 2, 3, 8])))
            rows = requests * per
            tokens = min(full, rows + rng.choice([0, 0, rng.randint(1, full)]))
            tape = sampled_step_tape(g, engine, tokens, rows, rng.random() < 0.9)
            trial = replay.copy()
            try:
                trial.run(tape)
            except A._OutOfMemory:
                dropped += 1
                continue
            played += 1
            replay = trial
            caches.add(tuple(sorted(s.size for s in replay.segments if s.pool == "large")))
    print(
        f"{key} at {capacity // MiB} MiB: {count} histories, {played} steps played, {dropped} dropped, "
        f"{len(caches)} distinct caches, {time.process_time() - started:.1f} s"
    )
    most = sampler_cost(g, engine).max_sampled_rows
    sizes = cached_segment_sizes(g, engine, most_requests * per)
    observed = sorted(caches)
    for tokens in (full // 8, full // 4, full // 2, full):

        def step(rows: int, tokens: int = tokens) -> list[A.TapeOp]:
            return sampled_step_tape(g, engine, tokens, rows, True)

        low, high = -1, most
        while low < high:
            middle = (low + high + 1) // 2
            runs = all(A._runs_from(step(middle), capacity, c, False) for c in observed)
            low, high = (middle, high) if runs else (low, middle - 1)
        grid = A.most_from_any_cache(step, -1, most, capacity, sizes, ANY_CACHE_SEGMENTS)
        print(f"  step of {tokens} tokens: observed caches' level {low} rows, the grid's {grid} ({len(sizes)} sizes)")


if __name__ == "__main__":
    main()
