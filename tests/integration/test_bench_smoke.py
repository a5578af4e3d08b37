"""`python -m bench --quick` at a tiny size: the harness runs end to end, writes the JSON the
issue specifies (and the tables and plots), and its numbers are sane. Targets are not checked:
that is what the full run and its report are for."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.overhead import nginx_binary

SAFETY_KEYS = {
    "scenario",
    "arm",
    "oom_crashes",
    "failed",
    "abandoned",
    "completed",
    "goodput_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "rejected",
    "preemptions",
}
OVERHEAD_KEYS = {"arm", "scenario", "added_p50_ms", "added_p99_ms", "requests_per_s"}


def test_quick_bench_at_a_tiny_size(tmp_path: Path) -> None:
    from bench.__main__ import main

    assert (
        main(["--quick", "--tiny", "--scale", "0.2", "--scenarios", "S3", "--no-profile", "--out", str(tmp_path)]) == 0
    )
    res = json.loads((tmp_path / "latest.json").read_text())
    assert {"machine", "command", "safety", "overhead"} <= res.keys()
    assert res["machine"]["cpus"] >= 1
    assert res["command"].startswith("python -m bench")

    rows = res["safety"]
    assert {r["arm"] for r in rows} == {"none", "static-cap", "saturation", "vllm-queue", "kvgate", "oracle"}
    for r in rows:
        assert r.keys() >= SAFETY_KEYS, r
        assert r["scenario"] == "S3"
        for k in ("oom_crashes", "failed", "abandoned", "completed", "preemptions"):
            assert isinstance(r[k], int)
            assert r[k] >= 0
        assert r["completed"] + r["failed"] + r["abandoned"] + sum(r["rejected"].values()) == r["requests"] > 0
        assert r["goodput_tokens_per_s"] >= 0
        assert all(isinstance(v, int) and v > 0 for v in r["rejected"].values())
        if r["ttft_p50_s"] is not None:
            assert 0 <= r["ttft_p50_s"] <= r["ttft_p99_s"]
        if r["completed"]:
            assert r["goodput_tokens_per_s"] > 0
    assert next(r for r in rows if r["arm"] == "static-cap")["cap"] >= 1

    ov = res["overhead"]
    arms = {r["arm"] for r in ov}
    assert {"direct", "kvgate"} <= arms
    if nginx_binary() is not None:
        assert "nginx" in arms
    for r in ov:
        assert r.keys() >= OVERHEAD_KEYS, r
        if r["requests_per_s"] is not None:
            assert r["requests_per_s"] > 0
        else:
            assert r["latency_p50_ms"] > 0
            assert math.isfinite(r["added_p50_ms"])
            assert r["latency_p50_ms"] <= r["latency_p99_ms"]
    detail = res["overhead_detail"]
    assert detail["kvgate_cpu_ms_per_request"] > 0
    assert detail["kvgate_rss_bytes"] > 10 * 2**20
    assert [e["target_tokens"] for e in detail["estimate_cost"]] == [100, 1000, 8000]
    assert all(e["tokenize_plus_estimate_ms_p50"] > 0 for e in detail["estimate_cost"])
    assert all(v == 0 for v in detail["errors"].values()), detail["errors"]

    md = (tmp_path / "latest.md").read_text()
    assert "| S3 | kvgate |" in md
    assert "| kvgate | non-streaming, concurrency 1 |" in md
    # every scenario names the engine it plays (S3: vLLM 0.20.0 forced onto V1)
    assert [s["engine"] for s in res["scenarios"]] == ["vLLM 0.20.0, Model Runner V1 (set)"]
    assert "on vLLM 0.20.0, Model Runner V1 (set):" in md
    assert {"safety.png", "overhead.png"} <= set(res["plots"])
    assert all((tmp_path / p).stat().st_size > 1000 for p in res["plots"])
