"""`python -m bench.cotenant_race`: S6's out-of-memory as one race, played on purpose.

S6 (bench/scenarios.py) lost its simulated engine behind kvgate in about 1 run in 18 when its third
trainer took 2.5 GiB between kvgate's last GPU reading and an 8,000-token prefill's step (its MLP
then found 112 MiB free). Here the timing is not left to chance: S6's engine and kvgate flags,
without the scheduled trainers; two of its trainers take their memory before kvgate starts, so
its first reading shows them; once kvgate is ready the third takes as much (the simulator's
`POST /sim/cotenant`) and the 8,000-token prompt is sent through kvgate at once, before its
next reading (`--scrape-interval` 0.25 s, 1 s idle). Prints one JSON line: what the client got
(status, tokens streamed), the simulator's out-of-memory messages, and kvgate's decision.

    python -m bench.cotenant_race --runs 3
"""

from __future__ import annotations

import argparse
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
from bench.scenarios import SCENARIOS, TRAINER_BYTES
from bench.workloads import document_call
from demo.replay import decisions, kvgate
from kvgate.sim.presets import gpu_total_bytes, write_model_folder

TRAINERS_BEFORE = (("trainer-1", TRAINER_BYTES), ("trainer-2", TRAINER_BYTES))
TRAINER_AFTER = ("trainer-3", TRAINER_BYTES)
PROMPT_TOKENS = 8000
QUEUE_WAIT_S = 5.0


def take(sim_url: str, name: str, nbytes: int) -> None:
    """A co-tenant takes `nbytes` of the simulated GPU now."""
    httpx.post(sim_url + "/sim/cotenant", json={"name": name, "bytes": nbytes}, timeout=5).raise_for_status()


def read_gpu_once(kvgate_url: str) -> None:
    """Wait until kvgate's budget has a GPU reading (its /readyz telemetry shows a headroom)."""
    deadline = time.monotonic() + 30
    while (httpx.get(kvgate_url + "/readyz", timeout=5).json().get("telemetry") or {}).get(
        "transient_headroom_bytes"
    ) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("kvgate took no GPU reading in 30 s")
        time.sleep(0.05)


def race(workdir: Path) -> dict[str, Any]:
    """One race: the prompt sent right after the third trainer took its memory."""
    scn = next(s for s in SCENARIOS if s.key == "S6")
    cfg = replace(scn.sim, speedup=scn.speedup, cotenants=[])
    prompt = document_call(random.Random(0), 0.0, PROMPT_TOKENS, "long prompt")
    with safety.simulator(cfg) as (sim, _, _):
        for name, nbytes in TRAINERS_BEFORE:
            take(sim.url, name, nbytes)
        model_dir = write_model_folder(cfg.model, workdir / cfg.model)
        flags = [*scn.kvgate_flags, "--max-queue-wait", f"{QUEUE_WAIT_S:g}"]
        with kvgate(sim.url, model_dir, flags, gpu_total_bytes(cfg.gpu), workdir / "kvgate.log") as (url, _, _):
            read_gpu_once(url)
            take(sim.url, *TRAINER_AFTER)
            answer = httpx.post(url + prompt.path, json=prompt.body, timeout=QUEUE_WAIT_S + 60)
            decided = {f"{d}/{r}": n for (d, r), n in decisions(url).items()}
        return {
            "status": answer.status_code,
            "completion_tokens": answer.json().get("usage", {}).get("completion_tokens")
            if answer.status_code == 200
            else None,
            "kvgate_decisions": decided,
            "oom": len(sim.engine.ooms),
            "oom_messages": [m[:300] for m in sim.engine.ooms],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cotenant_race", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    safety.quiet()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvgate-cotenant-race-") as tmp:
            print(json.dumps({"run": run + 1, **race(Path(tmp))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
