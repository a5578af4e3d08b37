"""`kvgate advise` as a user runs it: the installed command, vLLM's command line pasted after `--`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.geometry import write_config


def kvgate(*argv: str) -> subprocess.CompletedProcess[str]:
    """The `kvgate` console script of this venv (pyproject's [project.scripts])."""
    command = Path(sys.executable).parent / "kvgate"
    return subprocess.run([str(command), *argv], capture_output=True, text=True, timeout=120, check=False)


def test_pasted_command_that_dies_in_the_profile(tmp_path: Path) -> None:
    """docs/sources.md#large-max-num-batched-tokens, pasted as the report gives it."""
    folder = write_config(tmp_path, "mistral-7b-instruct-v0.2")
    done = kvgate(
        "advise", "--gpu", "h100-80gb", "--vllm-version", "0.10.1", "--json", "--",
        "vllm", "serve", str(folder), "--max-num-batched-tokens", "200000", "--max-num-seqs", "200", "--port", "8000",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    assert doc["startup"]["fits"] is False
    assert doc["startup"]["failure"]["flag"] == "--max-num-batched-tokens"
    assert doc["advised_startup"]["fits"] is True
    assert "--port" in done.stderr  # vLLM's option that changes no memory: named once, ignored


def test_text_for_a_start_that_fits(tmp_path: Path) -> None:
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    done = kvgate(
        "advise", "--model", str(folder), "--gpu", "79.18GiB", "--vllm-version", "0.11.0", "--max-model-len", "16000"
    )
    assert done.returncode == 0, done.stderr
    assert "Maximum concurrency for 16,000 tokens per request:" in done.stdout
    assert "start-up: fits" in done.stdout
