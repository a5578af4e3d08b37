"""`python -m bench.repeat_arm H1 --runs 10`: one scenario's arm, again and again, on the full
benchmark's seeded traffic: for an intermittent failure (an out-of-memory seen once in many runs)
and for before/after comparisons of one arm without the full table.

Each run prints one JSON line: OOM crashes, completed and failed requests (failures by reason:
an HTTP status, a timeout at a stage, a broken stream), goodput, TTFT p50/p99, refusals by
reason, TTFT p99 and refusals by the kind of request (who forms the tail), the simulator's own
out-of-memory messages (whose reserved-but-unallocated bytes tell fragmentation from
over-admission) with, for each, the step, the tensor and the allocator's segments it failed with
(`oom_details`), and the run's closest call: the least margin of any step's allocation, the
MiB it could have grown by and still found room (`closest_call_mib`). The traffic is what `python -m bench` plays for the
scenario (`random.Random(seed + its index in its list)`, scale 1), so a run here is one of the
table's runs.

    python -m bench.repeat_arm S4 --arm kvgate --runs 3
    python -m bench.repeat_arm S4 --arm cap-512
    python -m bench.repeat_arm H1 --scenarios-from tests/heldout/scenarios.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import safety
from bench.__main__ import scenarios_from
from bench.scenarios import SCENARIOS

ARMS = ("kvgate", "oracle", "none", "saturation")
CAPPED = ("cap", "vllm-queue")  # `cap-N`, `vllm-queue-N`: the full benchmark's fixed-cap arms at N


def arm_and_cap(text: str) -> tuple[str, int | None]:
    """`--arm`'s value as `safety.run_arm` takes it: a fixed-cap arm names its N (`cap-512`, the
    static cap's sweep; `vllm-queue-512`, vLLM's own queue limit at that cap)."""
    if text in ARMS:
        return text, None
    name, _, n = text.rpartition("-")
    if name in CAPPED and n.isdigit() and int(n) > 0:
        return name, int(n)
    raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(ARMS)}, cap-N or vllm-queue-N (N > 0)")


def outcome(r: safety.ArmResult) -> dict[str, Any]:
    """What one JSON line says of a run: OOMs, completions, goodput, TTFT, refusals, the
    simulator's out-of-memory messages and their records (kvgate/sim/oom_record.py), and the
    least margin of a step's allocation in MiB (how close it came to one)."""
    return {
        "oom": r.oom_crashes,
        "completed": r.completed,
        "failed": r.failed,
        "failed_by_reason": r.failed_by_reason,
        "abandoned": r.abandoned,
        "goodput_tok_s": r.goodput_tokens_per_s,
        "ttft_p50_s": r.ttft_p50_s,
        "ttft_p99_s": r.ttft_p99_s,
        "rejected": r.rejected,
        "ttft_p99_by_label": r.ttft_p99_by_label,
        "rejected_by_label": r.rejected_by_label,
        "oom_messages": r.oom_messages,
        "oom_details": r.notes.get("oom_details", []),
        "closest_call_mib": r.notes.get("closest_call_mib"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repeat_arm", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", help="its key, e.g. S4 or H1")
    parser.add_argument(
        "--arm", default="kvgate", type=arm_and_cap, help=f"{', '.join(ARMS)}, cap-N or vllm-queue-N (default kvgate)"
    )
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--scenarios-from", type=Path, help="a Python file with a SCENARIOS list")
    parser.add_argument("--seed", type=int, default=1000, help="the full benchmark's base seed")
    args = parser.parse_args(argv)
    scenarios = scenarios_from(args.scenarios_from) if args.scenarios_from else list(SCENARIOS)
    scn = next((s for s in scenarios if s.key == args.scenario), None)
    if scn is None:
        raise SystemExit(f"no scenario {args.scenario}: {', '.join(s.key for s in scenarios)}")
    arm, cap = args.arm
    safety.quiet()
    for run in range(args.runs):
        calls = scn.traffic(random.Random(args.seed + scenarios.index(scn)), 1.0)
        with tempfile.TemporaryDirectory(prefix=f"kvgate-{scn.key}-") as tmp:
            r = safety.run_arm(scn, arm, calls, 1.0, Path(tmp), cap=cap)
        line = {"scenario": scn.key, "arm": arm if cap is None else f"{arm}-{cap}", "run": run + 1, **outcome(r)}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
