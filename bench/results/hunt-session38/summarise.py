"""The hunt's counts from its JSON lines (raw/*.jsonl, one line a run of `bench.repeat_arm`):
runs and OOMs per scenario and traffic seed, failures by reason, the closest calls (the least
margin of a step's allocation, kvgate/sim/gpu.py `CachingAllocator._margin`; only the lines of
the code that measures it, `"tree": "d36b914"` or later: before it the field held the device's free bytes
after a new segment), and the 95 % upper bound on the OOM rate (3/N, the rule of three, when no
run ran out).

    python bench/results/hunt-session38/summarise.py
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

RAW = Path(__file__).parent / "raw"
MARGIN_TREES = ("d36b914", "d0d2032")


def runs() -> list[dict]:
    lines = []
    for path in sorted(RAW.glob("*.jsonl")):
        for text in path.read_text().splitlines():
            line = json.loads(text)
            if "oom" in line:
                lines.append({"seed": 1000, "variant": "main", **line})
    return lines


def main() -> None:
    by_scenario: dict[str, list[dict]] = defaultdict(list)
    for line in runs():
        by_scenario[line["scenario"]].append(line)
    total = ooms = 0
    print("| scenario | runs | seeds | OOM runs | failed (by reason) | closest call MiB (min / median, runs with it) |")
    print("|---|---|---|---|---|---|")
    for key in sorted(by_scenario, key=lambda k: (k[0], int("".join(c for c in k[1:] if c.isdigit()) or 0), k)):
        rows = by_scenario[key]
        failed: Counter[str] = Counter()
        for r in rows:
            failed.update(r.get("failed_by_reason") or {})
        unknown = sum(r["failed"] for r in rows) - sum(failed.values())
        if unknown:
            failed["not recorded"] += unknown
        calls = sorted(
            r["closest_call_mib"] for r in rows if r.get("tree") in MARGIN_TREES and r["closest_call_mib"] is not None
        )
        call = f"{calls[0]} / {calls[len(calls) // 2]} ({len(calls)})" if calls else "-"
        oom_runs = sum(r["oom"] > 0 for r in rows)
        total, ooms = total + len(rows), ooms + oom_runs
        reasons = ", ".join(f"{k} {v}" for k, v in failed.most_common()) or "0"
        seeds = len({r["seed"] for r in rows})
        print(f"| {key} | {len(rows)} | {seeds} | {oom_runs} | {reasons} | {call} |")
    bound = f"95 % upper bound {3 / total:.4f} a run" if total and not ooms else ""
    print(f"\nall: {ooms} OOM runs in {total} runs {bound}")


if __name__ == "__main__":
    main()
