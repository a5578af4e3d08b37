"""Which caches S13's served steps can leave, on the simulator's own allocator (kvgate/sim/gpu.py).

Run from the repository root: `PYTHONPATH=. python bench/results/s13-session36/histories.py`.
Prints (1) up to which segment size every cache of kvgate's grid runs S13's 1,760- and
2,048-token steps, (2) the
two-step histories (a prefill on a 64-token grid beside 8 - 416 decoding rows whose logits are
copied to fp32, then a whole step beside the same rows) that run the whole step's forward pass out
of memory, and (3) random walks of up to eight steps sampling at most 256 rows, each state tried
with a 2,048- and a 1,760-token step, at 296 MiB free (what kvgate reads) and 302 (the engine's).
"""

from __future__ import annotations

import copy
import random

from demo.replay import fully_utilized
from kvgate.memory.activation import (
    ANY_CACHE_SEGMENTS,
    EngineShape,
    any_cache_forward_level,
    cached_segment_sizes,
    profile_forward_tape,
)
from kvgate.memory.allocator import fits_from_any_cache
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes, model_config
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape
from kvgate.units import MiB

GEOMETRY = ModelGeometry.from_config(model_config("llama-3.1-8b"))
ENGINE = EngineShape(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=512, runner="v2")


def s13_engine(free_mib: int) -> tuple[Device, CachingAllocator, StepMemory]:
    """S13's simulated engine just started, `free_mib` MiB left free on its GPU."""
    cfg = fully_utilized(
        SimConfig(
            model="llama-3.1-8b",
            gpu="h100-80gb",
            vllm_version="0.32.0",
            model_runner="auto",
            max_model_len=32768,
            max_num_batched_tokens=2048,
            max_num_seqs=512,
        )
    )
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm")
    resolved, _ = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    steps, _ = startup.step_memories(resolved)
    device.set_usage("other", device.free() - free_mib * MiB)
    return device, alloc, steps


def step(prefill: int, rows: int, copied: bool) -> StepShape:
    decoding = tuple(ReqSlice(1, 300, random=True, processes=copied and i == 0) for i in range(rows))
    return StepShape(((ReqSlice(prefill, 0, samples=False),) if prefill else ()) + decoding)


def runs_out_on(alloc: CachingAllocator, steps: StepMemory, shape: StepShape) -> str | None:
    """The tensor the step runs out of memory on, or None if it runs (its blocks then freed)."""
    live = {}
    for op, name, nbytes in steps.plan(shape):
        if op == "alloc":
            try:
                live[name] = alloc.malloc(nbytes)
            except CudaOutOfMemory:
                return name
        elif op == "free" and name in live:
            alloc.free(live.pop(name))
        elif op == "rename" and name in live:
            live["hidden"] = live.pop(name)
    for block in live.values():
        alloc.free(block)
    return None


def grid_caches() -> None:
    """The level with every size of kvgate's grid, and with the sizes up to each bound."""
    sizes = cached_segment_sizes(GEOMETRY, ENGINE)
    capacity = 296 * MiB
    print(
        "grid:",
        sizes[0] // MiB,
        "-",
        sizes[-1] // MiB,
        "MiB; level",
        any_cache_forward_level(GEOMETRY, ENGINE, False, capacity),
    )
    for tokens in (1760, 2048):
        tape = profile_forward_tape(GEOMETRY, ENGINE, tokens, served=True)
        runs = [
            bound // MiB
            for bound in sizes
            if fits_from_any_cache(tape, capacity, [s for s in sizes if s <= bound], ANY_CACHE_SEGMENTS)
        ]
        print(f"{tokens} tokens run from every cache of sizes up to {max(runs)} MiB, not {max(runs) + sizes[0] // MiB}")


def two_step_histories() -> None:
    base = s13_engine(296)
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
    base = s13_engine(free_mib)
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
    grid_caches()
    two_step_histories()
    random_walks(296, 600, 1)
    random_walks(302, 600, 2)
