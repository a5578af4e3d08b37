"""Per run (arm.py's LOG.outs.json): completions and their output tokens, and those whose first
token came within 30 s and 35 s (simulated seconds; wall at S4's speed-up 1)."""

import json
import sys
from pathlib import Path

for f in sys.argv[1:]:
    outs = json.loads(Path(f).read_text())
    done = [o for o in outs if o[0] == "completed"]
    span = max([5.0] + [o[3] for o in done])
    tok = sum(o[4] for o in done)
    line = f"{Path(f).name}: completed {len(done)}, tokens {tok}, span {span:.2f} s, goodput {tok / span:.1f}"
    for lim in (30, 35):
        ok = [o for o in done if o[2] is not None and o[2] <= lim]
        line += f"; TTFT<={lim} s: {len(ok)} req, {sum(o[4] for o in ok)} tok"
    print(line)
