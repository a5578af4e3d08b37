"""bench/advised.py at a bounded size (issue #26 item 3): two of docs/advise.md's stories on the
simulator, the report's flags against the flags `kvgate advise` proposes, the same seeded traffic.

What it checks is what does not depend on the machine's speed: where the report's flags die (at
start-up, or under the traffic) and that the advised ones start and serve every request with no
OOM. Goodput is a timing and stays in the committed benchmark (bench/results/advised/).
"""

from __future__ import annotations

import json

import pytest

from bench.advised import main


@pytest.fixture(scope="module")
def stories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("advised")
    main(["--stories", "graphs-0.99,kv-cache-62GiB", "--scale", "0.3", "--repeat", "1", "--out", str(out)])
    rows = json.loads((out / "advised.json").read_text())["stories"]
    assert "| graphs-0.99 | report |" in (out / "advised.md").read_text()
    return {row["story"]: row for row in rows}


def test_graphs_outside_the_budget_die_at_start_up_and_the_advised_flags_serve(stories: dict[str, dict]) -> None:
    row = stories["graphs-0.99"]
    assert row["advise_predicts_report"] == {"fits": False, "failure": "capture_model: CUDA graphs out of memory"}
    (report,), (advised,) = row["arms"]["report"], row["arms"]["advised"]
    assert "OutOfMemoryError" in report["notes"]["startup_failed"]
    assert report["completed"] == 0
    assert {r["flag"]: r["value"] for r in row["recommended"]}["--gpu-memory-utilization"] < 0.99
    assert "startup_failed" not in advised["notes"]
    assert advised["oom_crashes"] == 0
    assert advised["completed"] == advised["requests"] == row["requests"]


def test_a_fixed_pool_without_room_for_a_step_dies_under_traffic_and_the_advised_one_does_not(
    stories: dict[str, dict],
) -> None:
    row = stories["kv-cache-62GiB"]
    assert row["advise_predicts_report"]["fits"]  # it starts: the failure comes with the traffic
    (report,), (advised,) = row["arms"]["report"], row["arms"]["advised"]
    assert "startup_failed" not in report["notes"]
    assert report["oom_crashes"] >= 1
    proposed = {r["flag"]: r["value"] for r in row["recommended"]}["--kv-cache-memory-bytes"]
    assert proposed < row["report_flags"]["kv_cache_memory_bytes"]
    assert row["advised_flags"]["kv_cache_memory_bytes"] == proposed
    assert advised["oom_crashes"] == 0
    assert advised["completed"] == advised["requests"] == row["requests"]
