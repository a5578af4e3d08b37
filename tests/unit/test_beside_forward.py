"""A step beside other requests runs after whatever their steps left cached (issue 24, held-out H7).

kvgate/memory/activation.py `beside_forward_level` replays a step after histories of up to three
earlier steps, each run in the headroom; the budget's stand-in levels assume that more memory
never runs out a step that less memory runs."""

from __future__ import annotations

import pytest

from kvgate.memory.activation import BesideForward, EngineShape, beside_forward_level, lone_forward_fits
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim.presets import model_config
from kvgate.units import MiB
from support.geometry import model_geometry

QWEN = model_geometry("qwen2.5-7b-instruct")
QWEN_ENGINE = EngineShape(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=512, runner="v2")
LLAMA_70B = ModelGeometry.from_config(model_config("llama-3.1-70b"))
TP4_ENGINE = EngineShape(
    max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, runner="v2", tensor_parallel_size=4
)


def test_three_earlier_steps_lower_h7s_level_below_what_one_earlier_step_runs() -> None:
    """Held-out H7's engine in 616 MiB: one earlier step of any sixteenth leaves room for
    7,168 tokens; histories of three eighths for 6,656, which keeps out the 6,812 - 7,581-token
    steps H7 ran out of memory on behind kvgate (docs/limitations.md)."""
    assert lone_forward_fits(LLAMA_70B, TP4_ENGINE, False, 7168, 616 * MiB)
    assert not lone_forward_fits(LLAMA_70B, TP4_ENGINE, False, 7680, 616 * MiB)
    assert beside_forward_level(LLAMA_70B, TP4_ENGINE, False, 616 * MiB) == 6656


@pytest.mark.parametrize(("geometry", "engine"), [(QWEN, QWEN_ENGINE), (LLAMA_70B, TP4_ENGINE)])
def test_more_headroom_never_lowers_the_level(geometry: ModelGeometry, engine: EngineShape) -> None:
    levels = [beside_forward_level(geometry, engine, False, c * MiB) for c in range(400, 1001, 100)]
    assert levels == sorted(levels)
    assert levels[0] < engine.max_num_batched_tokens == levels[-1]


def test_with_expandable_segments_nothing_strands() -> None:
    assert beside_forward_level(QWEN, QWEN_ENGINE, True, 560 * MiB) > beside_forward_level(
        QWEN, QWEN_ENGINE, False, 560 * MiB
    )


def test_a_smaller_headrooms_level_known_answers_without_a_replay() -> None:
    """The headroom drifts between readings: where a smaller headroom's level, known, runs the
    step, the answer is yes at once; else the level is worked out (on the worker thread) and the
    answer is no until it is known."""
    levels = BesideForward(QWEN, QWEN_ENGINE, False, background=False)
    assert levels(3000, 600 * MiB)  # worked out in the caller's thread (background off)
    known = beside_forward_level(QWEN, QWEN_ENGINE, False, 600 * MiB)
    waiting = BesideForward(QWEN, QWEN_ENGINE, False)
    waiting._known[600 * MiB] = known
    assert waiting(known, 805 * MiB)
    assert not waiting._pending  # no replay asked
    waiting._pending.add(800 * MiB)  # being worked out: the worker is not asked again
    assert not waiting(known + 1, 805 * MiB)
    assert not waiting(1, 590 * MiB)  # nothing known below: no, and asked
    assert 584 * MiB in waiting._pending
