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


def test_without_a_known_pool_the_verdict_is_unknown_not_fits(tiny_model_dir: Path, tmp_path: Path) -> None:
    code, out = explain(tmp_path, tiny_model_dir, {"prompt": "hi", "max_tokens": 10})
    assert code == 0
    assert out["budget"]["kv_blocks_limit"] is None
    assert out["decision"] == "unknown" and out["reason"] == "budget_unknown"
    assert "KV pool size is unknown" in out["message"] and "transient headroom is unknown" in out["message"]
    code, out = explain(tmp_path, tiny_model_dir, {"prompt": "hi", "max_tokens": 10},
                        "--num-gpu-blocks", "64", "--gpu-memory-bytes", str(8 * 1024**3))
    assert out["decision"] == "admit"


def test_offline_never_calls_a_backend_it_was_not_given(tmp_path: Path) -> None:
    from app.sim.presets import write_model_folder

    folder = write_model_folder("llama-3.1-8b", tmp_path / "no-tokenizer")  # config.json only
    (tmp_path / "body.json").write_text(json.dumps({"prompt": "hi", "max_tokens": 5}))
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", str(tmp_path / "body.json"), "--model", str(folder),
         "--num-gpu-blocks", "100"], capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"kvgate: the model folder {folder} has no tokenizer files; offline, kvgate calls no backend: "
        "give --backend URL to count tokens with vLLM's /tokenize, or --url to ask a running kvgate"
    ]


def test_help_lists_only_the_flags_that_change_the_answer() -> None:
    shown = subprocess.run([sys.executable, "-m", "app.cli", "explain", "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    for flag in ("--num-gpu-blocks", "--max-num-batched-tokens", "--gpu-memory-bytes", "--backend", "--url"):
        assert flag in shown
    for flag in ("--listen", "--max-queue", "--scrape-interval", "--log-level", "--upstream-timeout"):
        assert flag not in shown
