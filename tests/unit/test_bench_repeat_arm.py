"""`python -m bench.repeat_arm`'s `--arm`: the full benchmark's fixed-cap arms can be run alone."""

from __future__ import annotations

import pytest

from bench.repeat_arm import arm_and_cap, main, outcome
from bench.safety import ArmResult


def test_fixed_cap_arms_name_their_cap() -> None:
    assert arm_and_cap("cap-512") == ("cap", 512)
    assert arm_and_cap("vllm-queue-64") == ("vllm-queue", 64)
    assert arm_and_cap("oracle") == ("oracle", None)


@pytest.mark.parametrize("arm", ["cap", "cap-0", "cap-x", "static-cap-512", "kvgate-2"])
def test_an_arm_the_benchmark_does_not_play_is_a_usage_error(arm: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["S4", "--arm", arm])
    assert exit_.value.code == 2
    assert "cap-N or vllm-queue-N" in capsys.readouterr().err


def test_a_runs_line_carries_the_simulators_oom_records() -> None:
    record = {"phase": "forward", "tensor": "gate_up", "requested_bytes": 114_913_280}
    run = ArmResult("S9", "kvgate", 1, 3, 200, 0, 500.0, 1.0, 9.0, {}, 0, oom_messages=["CUDA out of memory."])
    run.notes["oom_details"] = [record]
    line = outcome(run)
    assert (line["oom"], line["oom_messages"], line["oom_details"]) == (1, ["CUDA out of memory."], [record])
    assert outcome(ArmResult("S9", "kvgate", 0, 0, 200, 0, 500.0, 1.0, 9.0, {}, 0))["oom_details"] == []
