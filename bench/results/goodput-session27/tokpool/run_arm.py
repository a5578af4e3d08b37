"""One scenario's kvgate arm, as `python -m bench.repeat_arm S4 --runs 1` plays it (the same
seeded traffic), printing the whole ArmResult (failed by reason as well as refusals) and the load
average before and after, as one JSON line.

    PYTHONPATH=$PWD .venv/bin/python bench/results/goodput-session27/tokpool/run_arm.py S4 > out.json
"""

import dataclasses
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from bench import safety
from bench.scenarios import SCENARIOS

key = sys.argv[1]
scenarios = list(SCENARIOS)
scn = next(s for s in scenarios if s.key == key)
safety.quiet()
calls = scn.traffic(random.Random(1000 + scenarios.index(scn)), 1.0)
load_before = os.getloadavg()
with tempfile.TemporaryDirectory(prefix=f"kvgate-{key}-") as tmp:
    r = safety.run_arm(scn, "kvgate", calls, 1.0, Path(tmp))
row = dataclasses.asdict(r)
row["load_average_before_after"] = [load_before, os.getloadavg()]
print(json.dumps(row))
