"""Summarise trace.py's TRACE files: wall against simulated GPU time, at full batch (>= 200 rows)."""

import json
import sys
from pathlib import Path

for f in sys.argv[1:]:
    tr = json.loads(Path(f).read_text())
    if tr[0][3] == -1:  # the load generator's start, then the steps
        start, tr = tr[0][0], tr[1:]
        first = next(x for x in tr if x[3] >= 50)
        print(
            f"{f}: first step {tr[0][0] - start:.2f} s after the load began, first of >= 50 rows {first[0] - start:.2f} s"
        )
    wall = tr[-1][1] - tr[0][0]
    full = [x for x in tr if x[3] >= 200]
    print(
        f"{f}: {len(tr)} steps, wall {wall:.1f} s, simulated {sum(x[2] for x in tr):.1f} s; "
        f">= 200 rows: {len(full)} steps, mean rows {sum(x[3] for x in full) / len(full):.0f}, "
        f"simulated {1000 * sum(x[2] for x in full) / len(full):.1f} ms a step, "
        f"wall {1000 * sum(x[1] - x[0] for x in full) / len(full):.1f} ms a step"
    )
