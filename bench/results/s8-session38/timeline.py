"""One instrumented S8 run's timeline, a line a second of wall time: the simulator's running
sequences (largest), the last budget answer's ledger (requests in flight, sampled rows of its
worst step, forward tokens charged: the main ledger's or the head's companion copy's), the
answers by term (charge / anycache / kv refusals, admissions) and the last refusal's charge and
limit. Run: `python timeline.py <dir>` on run_sampled.py's <dir> with shortfall-log.patch's log.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

MiB = 2**20


def main() -> None:
    folder = Path(sys.argv[1])
    samples = json.loads((folder / "samples.json").read_text())
    answers = [json.loads(line) for line in (folder / "shortfall.jsonl").read_text().splitlines()]
    t0 = samples[0][0]
    running: dict[int, int] = collections.defaultdict(int)
    for t, run, _waiting in samples:
        running[int(t - t0)] = max(running[int(t - t0)], run)
    by_second: dict[int, list[dict]] = collections.defaultdict(list)
    for answer in answers:
        if "update" not in answer:
            by_second[int(answer["t"] - t0)].append(answer)
    print(
        "s  sim_running  ledger_inflight  ledger_rows  fwd_tokens  refused(charge/anycache/kv)  admitted  charge/limit_MiB"
    )
    for second in sorted(set(running) | set(by_second)):
        some = by_second.get(second, [])
        busy = [a for a in some if a["inflight"] > 0]
        last = busy[-1] if busy else None
        why = collections.Counter(a["why"] for a in some)
        refused = [a for a in some if a["why"] == "charge"]
        charge = f"{refused[-1]['charge'] // MiB}/{refused[-1]['lim'] // MiB}" if refused else "-"
        tokens = last["fwd_tok"] - (last["rows"] - last["cur_rows"]) if last else 0
        print(
            f"{second:2d} {running.get(second, 0):4d} {last['inflight'] if last else 0:4d} "
            f"{last['cur_rows'] if last else 0:4d} {tokens:5d}  "
            f"{why.get('charge', 0)}/{why.get('anycache', 0)}/{why.get('kv', 0)}  {why.get(None, 0)}  {charge}"
        )


if __name__ == "__main__":
    main()
