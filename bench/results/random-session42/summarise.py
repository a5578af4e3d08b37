"""Tables from this folder's raw/*.jsonl (one line a `bench.repeat_arm` run, wrapped with the
scenario and seed): per scenario and arm, runs, OOM runs, goodput, the closest call (the least
margin of any step's allocation, kvgate/sim/gpu.py `CachingAllocator._margin`; negative in a run
that ran out), refusals and failures by reason.

    python bench/results/random-session42/summarise.py bench/results/random-session42/raw/rand-*.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from typing import Any


def order(key: tuple[str, str]) -> tuple[str, int, str, str]:
    name, arm = key
    digits = "".join(ch for ch in name[1:] if ch.isdigit())
    return (name[0], int(digits or 0), name, arm)


def main(paths: list[str]) -> None:
    rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        with open(path) as lines:
            for line in lines:
                wrapped = json.loads(line)
                rows[(wrapped["scenario"], wrapped["run"]["arm"])].append(wrapped["run"])
    print("| scenario | arm | runs | OOM runs | goodput tok/s | closest call MiB | refused | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(rows, key=order):
        runs = rows[key]
        refused: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        for run in runs:
            refused.update(run["rejected"])
            failed.update(run["failed_by_reason"])
        closest = [run["closest_call_mib"] for run in runs if run["closest_call_mib"] is not None]
        goodput = ", ".join(format(run["goodput_tok_s"], ",.0f") for run in runs)
        closest_text = format(min(closest), ",.1f") if closest else "-"
        refused_text = ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "-"
        failed_text = ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "-"
        oom_runs = sum(1 for run in runs if run["oom"])
        print(
            f"| {key[0]} | {key[1]} | {len(runs)} | {oom_runs} | {goodput} | {closest_text} | {refused_text} | {failed_text} |"
        )
    oom = sum(1 for key, runs in rows.items() if key[1] == "kvgate" for run in runs if run["oom"])
    total = sum(len(runs) for key, runs in rows.items() if key[1] == "kvgate")
    print(f"\nkvgate: {oom} OOM runs in {total}")


if __name__ == "__main__":
    main(sys.argv[1:])
