"""One scenario's arm alone, as bench/safety.py runs it, plus each request's outcome
(outcomes-KEY-ARM.json in OUT). EXTRA="flags" appends kvgate flags (experiments only).

    PYTHONPATH=$PWD .venv/bin/python bench/results/goodput-session27/s4s13/run_arm_outcomes.py S4 kvgate OUT
"""

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

from bench import safety
from bench.scenarios import SCENARIOS

key, arm, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
scn = next(s for s in SCENARIOS if s.key == key)
if os.environ.get("EXTRA"):
    scn = dataclasses.replace(scn, kvgate_flags=[*scn.kvgate_flags, *os.environ["EXTRA"].split()])
safety.quiet()
calls = scn.traffic(random.Random(1000 + [s.key for s in SCENARIOS].index(key)), 1.0)
cap = int(sys.argv[4]) if len(sys.argv) > 4 else None
captured = {}
original = safety.replay


async def replay(url, calls_, speedup, **kw):
    outs, span = await original(url, calls_, speedup, **kw)
    captured["outs"] = outs
    return outs, span


safety.replay = replay
r = safety.run_arm(scn, arm, calls, 1.0, out, cap=cap)
rows = [
    {"i": i, "at": c.at, "label": c.label, "kind": o.kind, "reason": o.reason, "status": o.status, "ttft": o.ttft_s}
    for i, (c, o) in enumerate(zip(calls, captured["outs"], strict=True))
]
(out / f"outcomes-{key}-{arm}.json").write_text(json.dumps(rows))
summary = {
    "oom": r.oom_crashes,
    "failed": r.failed,
    "failed_by": r.failed_by_reason,
    "rejected": r.rejected,
    "completed": r.completed,
    "goodput": r.goodput_tokens_per_s,
    "ttft_p50": r.ttft_p50_s,
    "ttft_p99": r.ttft_p99_s,
    "span": r.span_s,
    "notes": r.notes,
}
print(json.dumps(summary, default=str, indent=1))
