"""`kvgate explain` offline: the footprint and decision for a body, computed from flags alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def explain(tmp_path: Path, model_dir: Path, body: dict, *flags: str) -> tuple[int, dict]:
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", str(path), "--model", str(model_dir), *flags],
        capture_output=True, text=True, timeout=60,
    )
    return done.returncode, json.loads(done.stdout)


def test_explains_terms_and_decision(tiny_model_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": "The quick brown fox " * 20, "max_tokens": 100, "prompt_logprobs": 1}
    code, out = explain(
        tmp_path, tiny_model_dir, body, "--block-size", "128", "--num-gpu-blocks", "16",
        "--free-memory-bytes", str(1024**3), "--max-num-batched-tokens", "1024",
    )
    assert code == 0
    assert out["decision"] == "admit" and out["endpoint"] == "completions"
    assert out["prompt_tokens"] > 100 and out["max_new_tokens"] == 100
    assert out["kv"]["blocks"] == -(-(out["prompt_tokens"] + 100) // 128)
    terms = {t["name"]: t for t in out["transient"]["terms"]}
    # prompt_logprobs over the whole prompt (one chunk): tokens x 2048 vocab x (4 + 4) B, unprofiled
    assert terms["prompt_logprobs"]["bytes"] == out["prompt_tokens"] * 2048 * 8
    assert terms["prompt_logprobs"]["profiled"] is False
    assert out["budget"]["kv_blocks_limit"] == 15


def test_explains_a_refusal(tiny_model_dir: Path, tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "n": 8}
    code, out = explain(tmp_path, tiny_model_dir, body, "--block-size", "128", "--num-gpu-blocks", "16")
    assert code == 0
    assert out["endpoint"] == "chat" and out["decision"] == "reject" and out["reason"] == "kv_cache_never_fits"
    assert "15 blocks" in out["message"]


def test_explains_a_context_length_refusal(tiny_model_dir: Path, tmp_path: Path) -> None:
    code, out = explain(tmp_path, tiny_model_dir, {"prompt": "hi", "max_tokens": 5000})
    assert code == 0
    assert out["decision"] == "reject" and out["reason"] == "context_length_exceeded"
