"""The benchmark report's arithmetic: one percentile definition, and plots that draw every arm a
run has (not a hard-coded five)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.percentile import percentile
from bench.report import plots


@pytest.mark.parametrize("samples", [[3.0, 1.0, 2.0, 10.0], [0.5, 0.25], list(map(float, range(1000, 0, -7)))])
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_percentile_is_numpys_linear_interpolation(samples: list[float], q: float) -> None:
    assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q * 100)))


def test_percentile_of_one_and_of_no_sample() -> None:
    assert percentile([4.0], 0.99) == 4.0
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match="hundredths"):
        percentile([1.0, 2.0], 0.999)


def _safety_row(scenario: str, arm: str) -> dict[str, Any]:
    return {"scenario": scenario, "arm": arm, "goodput_tokens_per_s": 10.0, "oom_crashes": 1, "ttft_p99_s": 0.5}


@pytest.mark.parametrize("arms", [["kvgate"], ["none", "static-cap", "saturation", "kvgate", "oracle", "kvgate-v2"]])
def test_plots_draw_every_arm_of_the_run(arms: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.axes

    drawn: list[str] = []
    bar = matplotlib.axes.Axes.bar

    def recording_bar(self: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(kwargs["label"])
        return bar(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    safety = [_safety_row(s, arm) for s in ("S1", "S2") for arm in arms]
    assert plots({"safety": safety}, tmp_path) == ["safety.png", "ttft.png"]
    # goodput, OOM crashes and TTFT: one bar series per arm in each, in the order the arms ran
    assert drawn == [a for arm in arms for a in (arm, arm)] + arms
