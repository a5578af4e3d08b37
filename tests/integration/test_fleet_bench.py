"""`python -m bench.fleet` at a tiny size (two engines, S10's mix over three simulated seconds):
the three arms run end to end on the same traffic, the results add up, and no engine behind
kvgate runs out of memory. The comparison between arms is the full run's (bench/results/fleet/)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fleet import DEFAULT_ARMS, main


def test_fleet_bench_at_a_tiny_size(tmp_path: Path) -> None:
    argv = ["--engines", "2", "--scenarios", "S10", "--scale", "0.1", "--speedup", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "fleet.json").read_text())
    assert res["meta"]["command"] == "python -m bench.fleet " + " ".join(argv)
    rows = {r["arm"]: r for r in res["results"]}
    assert list(rows) == list(DEFAULT_ARMS)
    requests = {r["requests"] for r in rows.values()}
    assert len(requests) == 1  # identical traffic in every arm
    assert requests.pop() > 0
    for arm, r in rows.items():
        assert r["scenario"] == "S10", arm
        assert r["engines"] == 2, arm
        assert r["completed"] + r["client_errors"] == r["requests"], arm
        assert sum(r["errors_by_reason"].values()) == r["client_errors"], arm
        assert r["client_429"] == sum(n for k, n in r["errors_by_reason"].items() if k.startswith("429 ")), arm
        assert sum(r["dispatched_by_endpoint"]) <= r["requests"], arm
        assert r["goodput_tokens_per_s"] >= 0, arm
        assert r["output_tokens"] >= 0, arm
        if r["completed"]:
            assert r["goodput_tokens_per_s"] > 0, arm
            assert 0 <= r["ttft_p50_s"] <= r["ttft_p99_s"], arm
    assert rows["router"]["gauge_source"] == rows["router+flow-control"]["gauge_source"] == "vllm"
    assert rows["router+kvgate"]["gauge_source"] == "kvgate"
    assert rows["router+kvgate"]["oom_crashes"] == 0
    assert rows["router+kvgate"]["notes"]["kvgate_command"].startswith("serve --backend")
    table = (tmp_path / "fleet.md").read_text()
    assert all(f"| S10 | {arm} | 2 |" in table for arm in DEFAULT_ARMS)
