"""`python -m bench.s4_admissions`: how many of benchmark S4's requests kvgate's budget runs at once.

S4's spike (1,521 chats in 5 s, a third with a presence penalty) waits on the transient limit: on
V1 the engine holds its profile region and the pool leaves ~10 MiB free (`--headroom`, what
kvgate's readings showed in session 28). This feeds S4's requests, in arrival order, to kvgate's
Budget and Ledger for S4's deployment (the model folder the benchmark writes, V1, vLLM 0.31.0),
each admitted one decoding and none finishing, until the first the budget holds back: the most
requests kvgate runs at once on those limits, without the event loop, the simulator or the
machine's load. Prompt tokens are the chat's words plus 20 (the template), about what /tokenize
returns. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.scenarios import SCENARIOS
from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import V1PenaltyStep
from kvgate.model_folder import load_geometry
from kvgate.openai import parse_request
from kvgate.settings import settings_from_args
from kvgate.sim.presets import write_model_folder
from kvgate.units import GiB

TEMPLATE_TOKENS = 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headroom", type=int, default=10_653_533, help="live transient headroom, bytes")
    parser.add_argument("--kv-blocks", type=int, default=31_232, help="usable KV blocks (S4's pool less block 0)")
    args = parser.parse_args(argv)
    scn = next(s for s in SCENARIOS if s.key == "S4")
    with tempfile.TemporaryDirectory() as tmp:
        geometry = load_geometry(write_model_folder("llama-3.1-8b", Path(tmp) / "llama-3.1-8b"))
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--model-runner", "v1"]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    deployment = resolve(engine_flags(settings), geometry, None, None, reported_version="0.31.0")
    predictor = build_predictor(deployment, geometry)
    limits = static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=60 * GiB)
    budget = Budget(**asdict(limits))
    if limits.penalty_step is not None:  # its replays worked out here, not on a worker thread
        budget.update(penalty_step=V1PenaltyStep(geometry, predictor.engine, False, background=False))
    budget.update(
        transient_headroom_bytes=args.headroom,
        max_transient_headroom_bytes=args.headroom,
        profiled_cap_bytes=0,  # the engine holds the profile region (V1's readings)
        kv_blocks=args.kv_blocks,
    )
    calls = scn.traffic(random.Random(1000 + SCENARIOS.index(scn)), 1.0)
    ledger, admitted, penalties, held_by = Ledger(), 0, 0, None
    for call in calls:
        body = {k: v for k, v in call.body.items() if k != "messages"} | {"prompt": "x"}
        tokens = len(call.body["messages"][-1]["content"].split()) + TEMPLATE_TOKENS
        prediction = predictor.predict(parse_request("completions", json.dumps(body).encode()).request, [[7] * tokens])
        held_by = budget.shortfall(prediction.demand, ledger)
        if held_by is not None:
            break
        ledger.end_prefill(ledger.reserve(prediction.demand))
        admitted += 1
        penalties += "presence_penalty" in call.body
    print(json.dumps({"admitted": admitted, "with_penalty": penalties, "held_by": held_by}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
