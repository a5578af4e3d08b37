"""Deliverable 1 of session 36: for each lone request kvgate refused as never fitting on held-out
H8b and H1, which histories of served steps run it out of memory on the simulator's own
allocator (kvgate/sim), and what kvgate's replays now say.

For each prompt: its prefill chunks (max_num_batched_tokens a step, the last sampling its first
token) on the simulated engine just started (the pool vLLM's advice sizes), from a fresh engine,
after one earlier prefill step of every sixteenth of the step size, and after two earlier steps
of every eighth; then kvgate's verdicts: `lone_request_ever_fits` (some cache of its grid runs it:
not refused as never fitting) and `lone_request_fits` from an empty cache (what an idle reading
of 0 cached admits).

    PYTHONPATH=.:tests:tests/unit python bench/results/lone-session36/histories.py
"""

from __future__ import annotations

import copy

from test_lone_step import LLAMA_31, QWEN, started

from kvgate.memory.activation import EngineShape, lone_request_chunks, lone_request_ever_fits, lone_request_fits
from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

H8B = dict(model="llama-3.1-8b", gpu="h100-80gb", vllm_version="0.32.0", max_model_len=16384, max_num_seqs=1024)
H1 = dict(model="qwen2.5-7b", gpu="a100-80gb", vllm_version="0.32.0", max_model_len=16384, max_num_seqs=512)
CASES = [
    ("H8b", H8B, 8192, LLAMA_31, [6000, 7000, 8000, 12000, 16000]),
    ("H1", H1, 4096, QWEN, [3000, 5000, 8000]),
]


def runs(gpu, full: int, earlier: list[int], prompt: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether the engine (a fresh copy) runs the earlier prefill steps, then the prompt's chunks."""
    _, alloc, steps = copy.deepcopy(gpu)
    try:
        for tokens in earlier:
            run_tape(alloc, steps.plan(StepShape((ReqSlice(tokens, 0, samples=False),))))
        done = 0
        while done < prompt:
            chunk = min(full, prompt - done)
            for block in run_tape(
                alloc, steps.plan(StepShape((ReqSlice(chunk, done, samples=done + chunk == prompt),)))
            ):
                alloc.free(block)
            done += chunk
    except CudaOutOfMemory:
        return False
    return True


def main() -> None:
    for name, config, full, geometry, prompts in CASES:
        gpu = started(max_num_batched_tokens=full, **config)
        headroom = gpu[0].free()
        engine = EngineShape(
            max_model_len=16384, max_num_batched_tokens=full, max_num_seqs=config["max_num_seqs"], runner="v2"
        )
        print(f"{name}: {headroom / MiB:.0f} MiB free after start-up")
        sixteenths = [full * k // 16 for k in range(1, 17)]
        eighths = [full * k // 8 for k in range(1, 9)]
        for prompt in prompts:
            fresh = runs(gpu, full, [], prompt)
            one = [t for t in sixteenths if not runs(gpu, full, [t], prompt)]
            two = [(a, b) for a in eighths for b in eighths if not runs(gpu, full, [a, b], prompt)]
            chunks = lone_request_chunks(engine, prompt)
            ever = lone_request_ever_fits(geometry, engine, False, chunks, headroom)
            empty = lone_request_fits(geometry, engine, False, chunks, headroom, 0)
            print(
                f"  {prompt:>6} tokens: fresh engine {'runs' if fresh else 'OOM'}; OOM after one step of {one or 'none'};"
                f" after {len(two)} of {len(eighths) ** 2} two-step histories (e.g. {two[:3]});"
                f" kvgate: some cache runs it {ever}, an empty cache {empty}"
            )


if __name__ == "__main__":
    main()
