"""The markdown table of README.md from runs.txt: one line per run (start, 1-minute load before and
after, tree, scenario, arm, then bench/results/s4q-session32/arm.py's JSON row).

    python bench/results/patience-session33/table.py
"""

import json
from pathlib import Path

print(
    "| start | load | tree | scenario | arm | OOM | completed | abandoned (by stage) | failed | rejected "
    "| goodput tok/s | TTFT p50 s | TTFT p99 s | span s | engine busy s |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for line in (Path(__file__).parent / "runs.txt").read_text().splitlines():
    head, row = line[: line.index("{")].split(), json.loads(line[line.index("{") :])
    start, load, tree, scenario, arm = head[0], head[2], head[3], head[4], head[5]
    stages = ", ".join(f"{k} {v}" for k, v in sorted(row.get("abandoned_by_stage", {}).items()))
    abandoned = f"{row['abandoned']} ({stages})" if row.get("abandoned") else str(row.get("abandoned", "-"))
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(row["rejected"].items())) or "0"
    print(
        f"| {start} | {load} | {tree} | {scenario} | {arm} | {row['oom_crashes']} | {row['completed']} | {abandoned} "
        f"| {row['failed']} | {rejected} | {row['goodput_tokens_per_s']:,} | {row['ttft_p50_s']} | {row['ttft_p99_s']} "
        f"| {row['span_s']} | {row['notes'].get('engine_busy_sim_s')} |"
    )
