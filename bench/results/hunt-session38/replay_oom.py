"""Replay one OOM record's step on the simulator's allocator (raw/S9*.jsonl, seed 1119 by
default): the allocator as the step began (`allocator_before_step`; a record made before
d0d2032 lacks it, and the one at the failure with the step's live tensors given back stands in,
which merges the blocks they split), then the step's tape as the simulator plays it for S9's
engine.

    python bench/results/hunt-session38/replay_oom.py [seed]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.scenarios import SCENARIOS
from kvgate.sim import startup
from kvgate.sim.gpu import Block, CachingAllocator, CudaOutOfMemory, Device, Segment
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.request import Sampling
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

RAW = Path(__file__).parent / "raw"


def record_of(seed: int) -> dict:
    for text in (t for path in sorted(RAW.glob("S9*.jsonl")) for t in path.read_text().splitlines()):
        line = json.loads(text)
        if line.get("seed") == seed and line.get("oom_details"):
            return line["oom_details"][0]
    raise SystemExit(f"no OOM record for seed {seed}")


def cache_before(record: dict, total: int) -> CachingAllocator:
    """The allocator as the step began, or the one at the failure with the live tensors freed."""
    exact = "allocator_before_step" in record
    state = record["allocator_before_step" if exact else "allocator"]
    device = Device(total)
    alloc = CachingAllocator(device, "vllm")
    for seg in state["segments"]:
        segment = Segment(seg["size"], seg["pool"])
        offset = 0
        for size, allocated in seg["blocks"]:
            segment.blocks.append(Block(segment, offset, size, allocated, size if allocated else 0))
            offset += size
        alloc.segments.append(segment)
    alloc.set_non_torch(state["non_torch"])
    # the device's other bytes (none in S9): what the record saw free
    device.set_usage("others", device.free() - state["device_free"])
    for name, nbytes in ({} if exact else record["live_tensors"]).items():
        fits = [
            b
            for s in alloc.segments
            for b in s.blocks
            if b.allocated and nbytes <= b.size < nbytes + MiB + 512 and s.size < 1024 * MiB
        ]
        assert len(fits) == 1, (name, len(fits))
        alloc.free(fits[0])
    return alloc


def shape_of(record: dict) -> StepShape:
    cols = record["step"]["columns"]
    reqs = []
    for row in record["step"]["requests"]:
        r = dict(zip(cols, row, strict=True))
        sp = Sampling(max_tokens=1, **{k: v for k, v in r["sampling"].items()})
        reqs.append(
            ReqSlice(
                r["new_tokens"] + r["draft_tokens"],
                r["computed_tokens"],
                r["samples"],
                random=sp.random,
                seeded=sp.seed is not None,
                processes=sp.processes_logits,
                draft_tokens=r["draft_tokens"],
                request_id=r["id"],
                top_k=sp.random and sp.top_k > 0,
                top_p=sp.random and sp.top_p < 1.0,
                top_p_k=sp.top_p_k,
            )
        )
    return StepShape(tuple(reqs))


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1119
    record = record_of(seed)
    scn = next(s for s in SCENARIOS if s.key == "S9")
    cfg = scn.sim
    model = load_model(cfg.model, cfg.dtype)
    boot_alloc = CachingAllocator(Device(gpu_total_bytes(cfg.gpu)), "boot")
    resolved, _ = startup.start(cfg, model, boot_alloc.device, boot_alloc)
    steps, _ = startup.step_memories(resolved)
    alloc = cache_before(record, gpu_total_bytes(cfg.gpu))
    shape = shape_of(record)
    print(
        f"seed {seed}: {shape.num_tokens} tokens, {shape.sampled_rows} sampled rows; before the step "
        f"{alloc.device.free() / MiB:.2f} MiB free on the device, "
        f"{(alloc.reserved() - alloc.allocated()) / MiB:.2f} MiB cached and free"
    )
    try:
        run_tape(alloc, steps.plan(shape))
        print("the step fits")
    except CudaOutOfMemory as exc:
        print(f"out of memory on {exc.tensor}: {str(exc)[:160]}")


if __name__ == "__main__":
    main()
