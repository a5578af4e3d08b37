"""`python -m bench.cotenant_static`: what the co-tenants' reserve costs beside a neighbour that never moves.

S6's engine and kvgate flags (bench/scenarios.py), without its trainers: one other process (a
second small model, an embedding server) takes `--neighbour-gib` of the simulated GPU before
kvgate starts and holds it, unchanged, to the end. kvgate's first reading shows it. The traffic,
S6's (30 s of chat at 2.5/s and long prompts of 4k-8k tokens at `--long-per-s`, S6's 0.4 and
seed by default), starts once kvgate has run `--wait-s`, longer than the `SETTLE_S` a holding
seen at the first reading counts as a step (kvgate/telemetry/cotenants.py): it meets whatever
reserve kvgate keeps for a neighbour it has watched hold still. The default 4.5 GiB leaves the
engine 4,778 MiB of headroom: kept back whole, the 4,608 MiB step leaves the long prompts' MLP
(390-781 MiB, out of free memory) no room. Prints one JSON line a run: the reserve and headroom
kvgate showed when the traffic started (/readyz), and the run's OOMs, completed requests,
goodput, TTFT and refusals as `python -m bench.repeat_arm` prints them.

    python -m bench.cotenant_static --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench import safety
from bench.cotenant_race import take
from bench.repeat_arm import outcome
from bench.scenarios import SCENARIOS, chat_with_long_prompts
from demo.replay import kvgate
from kvgate.sim.presets import gpu_total_bytes, write_model_folder
from kvgate.units import GiB, MiB

SEED = 1000  # the full benchmark's base seed: at S6's 0.4 long prompts a second, S6's own calls


def telemetry(kvgate_url: str) -> dict[str, Any]:
    """kvgate's /readyz telemetry: its headroom and co-tenants' reserve."""
    return httpx.get(kvgate_url + "/readyz", timeout=5).json().get("telemetry") or {}


def run(workdir: Path, neighbour_bytes: int, wait_s: float, long_per_s: float) -> dict[str, Any]:
    """One run: the neighbour in, kvgate started and left `wait_s`, then the traffic through it."""
    scn = next(s for s in SCENARIOS if s.key == "S6")
    cfg = replace(scn.sim, speedup=scn.speedup, cotenants=[])
    calls = chat_with_long_prompts(
        random.Random(SEED + SCENARIOS.index(scn)), 30.0, 2.5, long_per_s, [4000, 6000, 8000]
    )
    queue_wait_s = min(30.0, safety.DRAIN_S / scn.speedup)  # as safety.run_arm sets it
    with safety.simulator(cfg) as (sim, counts, _):
        take(sim.url, "neighbour", neighbour_bytes)
        model_dir = write_model_folder(cfg.model, workdir / cfg.model)
        flags = [*scn.kvgate_flags, "--max-queue-wait", f"{queue_wait_s:g}"]
        with kvgate(sim.url, model_dir, flags, gpu_total_bytes(cfg.gpu), workdir / "kvgate.log") as (url, _, _):
            time.sleep(wait_s)
            seen = telemetry(url)
            outs, span = asyncio.run(safety.replay(url, calls, scn.speedup, patience_s=queue_wait_s * scn.speedup))
        r = safety.summarise(scn, "kvgate", outs, span, scn.speedup, list(sim.engine.ooms), counts["preemptions"])
    return {
        "neighbour_mib": neighbour_bytes // MiB,
        "long_per_s": long_per_s,
        "reserve_mib_at_start": (seen.get("cotenant_reserve_bytes") or 0) // MiB,
        "headroom_mib_at_start": (seen.get("transient_headroom_bytes") or 0) // MiB,
        **outcome(r),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cotenant_static", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--neighbour-gib", type=float, default=4.5)
    parser.add_argument("--long-per-s", type=float, default=0.4, help="long prompts a simulated second")
    parser.add_argument("--wait-s", type=float, default=35.0, help="wall seconds between kvgate ready and the traffic")
    args = parser.parse_args(argv)
    safety.quiet()
    for n in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvgate-cotenant-static-") as tmp:
            line = run(Path(tmp), int(args.neighbour_gib * GiB), args.wait_s, args.long_per_s)
            print(json.dumps({"run": n + 1, **line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
