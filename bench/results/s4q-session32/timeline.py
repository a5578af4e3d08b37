"""kvgate's decisions a second, from a decision log kept by arm.py (KVGATE_BENCH_LOG_LEVEL=info),
seconds since the first decision less its queue wait, with the Retry-After of its refusals."""

import collections
import json
import re
import sys
from pathlib import Path

rows: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
t0 = None
for line in Path(sys.argv[1]).read_text().splitlines():
    if "kvgate.decision " not in line:
        continue
    h, m, s = line[11:23].replace(",", ".").split(":")
    t = int(h) * 3600 + int(m) * 60 + float(s)
    d = json.loads(line[line.index("{") :])
    if t0 is None:
        t0 = t - d.get("queue_wait_s", 0.0)
    key = f"{d['decision']}/{d['reason']}"
    if d["decision"] == "reject" and (after := re.search(r"Retry after (\d+) s", d.get("message", ""))):
        key += f" (Retry-After {after.group(1)})"
    rows[int(t - t0)][key] += 1
for second in sorted(rows):
    print(second, dict(rows[second]))
