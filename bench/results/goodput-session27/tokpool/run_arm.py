"""One scenario's kvgate arm, as `python -m bench.repeat_arm S4 --runs 1` plays it (the same
seeded traffic), printing the whole ArmResult (failed by reason as well as refusals) and the load
average before and after, as one JSON line.

    PYTHONPATH=$PWD .venv/bin/python bench/results/goodput-session27/tokpool/run_arm.py S4 > out.json

With KVGATE_BENCH_LOG_LEVEL=info kvgate logs every decision; the row then also counts the
refusals by where the request waited, from their messages ("Waited N s for the backend's
/tokenize" against "for GPU memory"), and how many refusals and admissions kvgate logged.
"""

import collections
import dataclasses
import json
import os
import random
import re
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
    log = Path(tmp) / f"kvgate-{key}.log"
    logged: collections.Counter[str] = collections.Counter()
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if '"decision"' not in line:
            continue
        waited_for = re.search(r"Waited [0-9.]+ s for (the backend's /tokenize|GPU memory)", line)
        kind = re.search(r'"decision": ?"(\w+)"', line)
        code = re.search(r'"code": ?"(\w+)"', line) or re.search(r'"reason": ?"(\w+)"', line)
        logged[
            f"{kind.group(1) if kind else '?'}/{code.group(1) if code else '?'}"
            + (f" ({waited_for.group(1)})" if waited_for else "")
        ] += 1
row = dataclasses.asdict(r)
row["decision_log"] = dict(logged)
row["load_average_before_after"] = [load_before, os.getloadavg()]
print(json.dumps(row))
