"""The benchmark's fixed-cap yardstick (bench/safety.py `confirmed_cap`): where the unprotected
engine runs out of memory, kvgate is held to the best cap that survives not only the run's
traffic but further traffic seeds too, as an operator would pick a cap; a cap dropped for an
out-of-memory on another seed is named in the table."""

from __future__ import annotations

from bench.__main__ import goodput_targets
from bench.report import markdown
from bench.safety import ArmResult, confirmed_cap


def _cap(cap: int, goodput: float, oom: int = 0) -> ArmResult:
    return ArmResult("S13", "static-cap", oom, 0, 100, 0, goodput, 1.0, 2.0, {}, 0, cap=cap)


def test_the_best_cap_that_also_survives_further_traffic_is_the_yardstick() -> None:
    sweep = [_cap(64, 1500.0), _cap(288, 1965.0), _cap(512, 300.0, oom=1)]
    asked: list[int] = []

    def oom_seed(cap: int) -> int | None:
        asked.append(cap)
        return 100_012 if cap == 288 else None

    best, dropped = confirmed_cap(sweep, oom_seed)
    assert best is not None
    assert best.cap == 64
    assert dropped == {288: 100_012}
    assert asked == [288, 64]  # best goodput first; a cap that OOMed in the run is never asked


def test_no_cap_survives_further_traffic() -> None:
    best, dropped = confirmed_cap([_cap(2, 50.0), _cap(8, 60.0, oom=1)], lambda cap: 200_001)
    assert best is None
    assert dropped == {2: 200_001}


def test_the_table_says_which_caps_survived_more_traffic_and_which_did_not() -> None:
    cap = _cap(64, 1500.0)
    cap.notes["survived_further_seeds"] = 2
    kvgate = ArmResult("S13", "kvgate", 0, 0, 100, 0, 1600.0, 1.0, 2.0, {}, 0)
    none = ArmResult("S13", "none", 1, 50, 10, 0, 100.0, 1.0, 2.0, {}, 0)
    checks = goodput_targets("S13", kvgate.row(), none.row(), cap.row(), kvgate.row())
    assert any(c["value"] == "1.07 x (cap 64, survived 2 more traffic seeds)" and c["met"] for c in checks)
    page = markdown(
        {
            "command": "python -m bench",
            "started_at": "2026-11-29",
            "duration_s": 1.0,
            "machine": {},
            "safety": [none.row(), cap.row(), kvgate.row()],
            "cap_sweep": {
                "S13": [
                    {"cap": 64, "goodput_tokens_per_s": 1500.0, "oom_crashes": 0},
                    {"cap": 288, "goodput_tokens_per_s": 1965.0, "oom_crashes": 0, "oom_on_further_seed": 100_012},
                ]
            },
        }
    )
    assert "| S13 | static-cap (cap 64, survived 2 more traffic seeds) |" in page
    assert "cap 288: 1965.0 (0 OOM; OOM on traffic seed 100012)" in page
