"""Which caches S13's served steps can leave, on the simulator's own allocator (kvgate/sim/gpu.py).

Run from the repository root: `PYTHONPATH=.:tests python bench/results/s13-session36/histories.py`
(the simulated engine and its steps as tests/unit/test_any_cache_rows.py builds them).
Prints (1) the two-step histories (a prefill on a 64-token grid beside 8 - 416 decoding rows whose logits are
copied to fp32, then a whole step beside the same rows) that run the whole step's forward pass out
of memory, and (2) random walks of up to eight steps sampling at most 256 rows, each state tried
with a 2,048- and a 1,760-token step, at 296 MiB free (what kvgate reads) and 302 (the engine's).
"""

from __future__ import annotations

import copy
import random

from sim_support import prefill_beside as step
from sim_support import runs_out_on, started_s13

from kvgate.units import MiB


def two_step_histories() -> None:
    base = started_s13(296 * MiB)
    failed: list[tuple[int, int]] = []
    tried = 0
    for rows in range(8, 420, 8):
        for prefill in range(0, 2048 - rows + 1, 64):
            _, alloc, steps = copy.deepcopy(base)
            if runs_out_on(alloc, steps, step(prefill, rows, copied=True)) is not None:
                continue
            tried += 1
            if runs_out_on(alloc, steps, step(2048 - rows, rows, copied=False)) is not None:
                failed.append((prefill, rows))
    rows_failed = [r for _, r in failed]
    print(
        f"two-step histories: {tried} tried, {len(failed)} ran the whole step out, rows {min(rows_failed)} - {max(rows_failed)}"
    )


def random_walks(free_mib: int, walks: int, seed: int) -> None:
    base = started_s13(free_mib * MiB)
    rng = random.Random(seed)
    states = failing = 0
    for _ in range(walks):
        _, alloc, steps = copy.deepcopy(base)
        for _ in range(8):
            rows = rng.choice([0, 0, rng.randint(1, 256), rng.randint(1, 64)])
            prefill = rng.randint(0, 2048 - rows) if rng.random() < 0.7 else 0
            if prefill + rows == 0:
                continue
            trial = copy.deepcopy(alloc)
            if runs_out_on(trial, steps, step(prefill, rows, copied=rng.random() < 0.8)) is not None:
                continue
            alloc, states = trial, states + 1
            for tokens in (2048, 1760):
                if runs_out_on(copy.deepcopy(alloc), steps, step(tokens - 1, 1, copied=False)) is not None:
                    failing += 1
    print(f"random walks at {free_mib} MiB free: {walks} walks, {states} states, {failing} whole steps ran out")


if __name__ == "__main__":
    two_step_histories()
    random_walks(296, 600, 1)
    random_walks(302, 600, 2)
