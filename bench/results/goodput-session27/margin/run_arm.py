"""One scenario's kvgate arm alone, as bench/safety.py runs it in `python -m bench` (the same
seeded traffic as bench/repeat_arm.py), printing the arm's counts and notes as JSON.

    KVGATE_BENCH_LOG_LEVEL=info PYTHONPATH=$PWD .venv/bin/python \
        bench/results/goodput-session27/margin/run_arm.py S13 OUT [tests/heldout/scenarios.py]
"""

import json
import random
import sys
from pathlib import Path

from bench import safety
from bench.__main__ import scenarios_from
from bench.scenarios import SCENARIOS

key, out = sys.argv[1], Path(sys.argv[2])
scenarios = scenarios_from(Path(sys.argv[3])) if len(sys.argv) > 3 else list(SCENARIOS)
scn = next(s for s in scenarios if s.key == key)
out.mkdir(parents=True, exist_ok=True)
safety.quiet()
calls = scn.traffic(random.Random(1000 + scenarios.index(scn)), 1.0)
r = safety.run_arm(scn, "kvgate", calls, 1.0, out)
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
    "oom_messages": r.oom_messages,
    "notes": r.notes,
}
print(json.dumps(summary, default=str, indent=1))
