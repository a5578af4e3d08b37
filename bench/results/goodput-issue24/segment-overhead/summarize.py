"""One row per run for the arms no gate, kvgate and oracle, from each run folder's latest.json.

python summarize.py RUN_FOLDER...   (folders written by `python -m bench --out RUN_FOLDER`)
"""

import json
import sys
from pathlib import Path

HEAD = (
    "| run | scenario | arm | OOM | completed | failed | goodput tok/s | TTFT p50 s | TTFT p99 s | rejected "
    "| kvgate / oracle | completed long documents | segment overhead learned |"
)
print(HEAD)
print("|" + "---|" * (HEAD.count("|") - 1))
for folder in sys.argv[1:]:
    path = Path(folder) / "latest.json"
    if not path.is_file():
        continue
    rows = {r["arm"]: r for r in json.loads(path.read_text())["safety"]}
    oracle = rows["oracle"]["goodput_tokens_per_s"]
    for arm in ("none", "kvgate", "oracle"):
        r = rows[arm]
        learned, ratio = "", ""
        if arm == "kvgate":
            ratio = f"{r['goodput_tokens_per_s'] / oracle:.2f}" if oracle else ""
            seen = [w for w in r["notes"].get("kvgate_warnings", []) if "segment overhead up to" in w]
            learned = seen[-1].rsplit(" ", 1)[-1] if seen else "-"
        print(
            f"| {Path(folder).name} | {r['scenario']} | {arm} | {r['oom_crashes']} | {r['completed']} | {r['failed']} "
            f"| {r['goodput_tokens_per_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} "
            f"| {', '.join(f'{k} {v}' for k, v in r['rejected'].items()) or 0} "
            f"| {ratio} "
            f"| {r.get('completed_by_label', {}).get('long document', 0)} | {learned} |"
        )
