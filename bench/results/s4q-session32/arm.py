"""One arm of one scenario as `python -m bench.repeat_arm` plays it (same seeded traffic, scale 1),
printing the whole ArmResult row (span, output tokens, the simulated engine's busy seconds) and
this process's and its children's CPU seconds (the simulator and load generator; kvgate's
subprocess), keeping kvgate's log at LOG and every outcome at LOG.outs.json.

    KVGATE_BENCH_LOG_LEVEL=info PYTHONPATH=. python bench/results/s4q-session32/arm.py S4 kvgate LOG

PATIENCE_S=60 (an experiment, not the benchmark's rule): kvgate's and the oracle's queue deadline
set to 60 s instead of the benchmark's min(30, 60 / speed-up), about the patience the cap arm's
client has (the run's drain: 60 s after the last arrival).
"""

import json
import os
import random
import resource
import shutil
import sys
import tempfile
from pathlib import Path

from bench import safety
from bench.repeat_arm import arm_and_cap
from bench.scenarios import SCENARIOS

key, armtext, logout = sys.argv[1], sys.argv[2], sys.argv[3]
scenarios = list(SCENARIOS)
scn = next(s for s in scenarios if s.key == key)
arm, cap = arm_and_cap(armtext)
safety.quiet()
if os.environ.get("PATIENCE_S"):
    patience = float(os.environ["PATIENCE_S"])
    safety.min = lambda *_: patience  # run_arm's queue_wait_s = min(30.0, DRAIN_S / sp)
captured = {}
_summarise = safety.summarise


def summarise(scn_, arm_, outs, span_wall, speedup, *rest):
    captured["outs"] = [(o.kind, o.reason, o.ttft_s, o.end_s, o.tokens) for o in outs]
    return _summarise(scn_, arm_, outs, span_wall, speedup, *rest)


safety.summarise = summarise
calls = scn.traffic(random.Random(1000 + scenarios.index(scn)), 1.0)
with tempfile.TemporaryDirectory(prefix=f"kvgate-{key}-") as tmp:
    r = safety.run_arm(scn, arm, calls, 1.0, Path(tmp), cap=cap)
    log = Path(tmp) / f"kvgate-{key}.log"
    if log.exists():
        shutil.copy(log, logout)
row = r.row()
row["cpu_self_s"] = round(sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), 1)
row["cpu_children_s"] = round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 1)
print(json.dumps(row), flush=True)
Path(logout + ".outs.json").write_text(json.dumps(captured["outs"]))
