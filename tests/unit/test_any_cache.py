"""A step beside other requests runs from whatever cache their steps left (issue 24, held-out H7).

kvgate/memory/activation.py `any_cache_forward_level` bisects the step sizes that run from every
cache of a few free segments (kvgate/memory/allocator.py `fits_from_any_cache`); these tests check
what the bisection and the budget's stand-in levels assume: a larger step is never safer, more
memory never runs out a step that less memory runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvgate.memory import allocator
from kvgate.memory.activation import (
    ANY_CACHE_SEGMENTS,
    ANY_CACHE_TOKEN_STEPS,
    AnyCacheForward,
    EngineShape,
    any_cache_forward_level,
    any_cache_sampled_rows,
    cached_segment_sizes,
    profile_forward_tape,
    sampled_step_tape,
    sampler_cost,
)
from kvgate.memory.allocator import TapeOp, alloc, fits_from_any_cache, footprint, free, most_from_any_cache
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


def test_a_tensor_best_fit_puts_in_a_larger_cached_segment_pins_it() -> None:
    """From an empty cache two 100 MiB tensors need 200 MiB; from a cache of one free 150 MiB
    segment the first takes it (best fit), its 50 MiB rest is too small for the second, which
    needs a new segment: 250 MiB, more than 220."""
    step = [alloc("a", 100 * MiB), alloc("b", 100 * MiB), *free("a", "b")]
    assert footprint(step).need == 200 * MiB
    assert fits_from_any_cache(step, 220 * MiB, [50 * MiB], 3)
    assert not fits_from_any_cache(step, 220 * MiB, [50 * MiB, 150 * MiB], 3)
    assert fits_from_any_cache(step, 220 * MiB, [150 * MiB], 3, expandable_segments=True)


@pytest.mark.parametrize(("geometry", "engine", "capacity"), [(QWEN, QWEN_ENGINE, 616), (LLAMA_70B, TP4_ENGINE, 616)])
def test_every_step_below_the_level_runs_from_every_cache_and_the_next_one_does_not(
    geometry: ModelGeometry, engine: EngineShape, capacity: int
) -> None:
    """The bisection's premise, on the grid it searches: the steps up to the level all run, the
    next one does not."""
    level = any_cache_forward_level(geometry, engine, False, capacity * MiB)
    full = engine.max_num_batched_tokens
    sizes = cached_segment_sizes(geometry, engine)
    grid = [full * k // ANY_CACHE_TOKEN_STEPS for k in range(1, ANY_CACHE_TOKEN_STEPS + 1)]
    assert 0 < level < full
    for tokens in grid:
        step = profile_forward_tape(geometry, engine, tokens, served=True)
        assert fits_from_any_cache(step, capacity * MiB, sizes, ANY_CACHE_SEGMENTS) == (tokens <= level)


def test_more_headroom_never_lowers_the_level() -> None:
    levels = [any_cache_forward_level(QWEN, QWEN_ENGINE, False, c * MiB) for c in range(400, 1001, 40)]
    assert levels == sorted(levels)
    assert levels[0] < QWEN_ENGINE.max_num_batched_tokens == levels[-1]


def test_with_expandable_segments_only_the_steps_own_pages_count() -> None:
    """No segment strands: the level is the largest step whose own live tensors fit."""
    level = any_cache_forward_level(QWEN, QWEN_ENGINE, True, 400 * MiB)
    assert level > any_cache_forward_level(QWEN, QWEN_ENGINE, False, 400 * MiB)
    assert footprint(profile_forward_tape(QWEN, QWEN_ENGINE, level, served=True), True).need <= 400 * MiB


def test_a_smaller_headrooms_level_known_answers_without_a_replay() -> None:
    """The headroom drifts between readings: where a level known for a smaller headroom and as
    many cached sizes or more runs the step, the answer is yes at once; else the level is worked
    out (on the worker thread) and the answer is no until it is known."""
    levels = AnyCacheForward(QWEN, QWEN_ENGINE, False, background=False)
    assert levels(3000, 600 * MiB, 512)  # worked out in the caller's thread (background off)
    known = any_cache_forward_level(QWEN, QWEN_ENGINE, False, 600 * MiB, 512)
    waiting = AnyCacheForward(QWEN, QWEN_ENGINE, False)
    every = len(cached_segment_sizes(QWEN, QWEN_ENGINE))
    waiting._known[(600 * MiB, every)] = known
    assert waiting(known, 805 * MiB, 100)
    assert not waiting._pending
    waiting._pending.add((800 * MiB, every))  # being worked out: the worker is not asked again
    assert not waiting(known + 1, 805 * MiB, 512)
    assert not waiting(1, 590 * MiB, 512)
    assert (584 * MiB, every) in waiting._pending


def _bisected(step_of: Callable[[int], list[TapeOp]], low: int, high: int, capacity: int, sizes: list[int]) -> int:
    """The search `most_from_any_cache` replaced: a bisection of x, every cache played at each probe."""

    def runs(x: int) -> bool:
        return fits_from_any_cache(step_of(x), capacity, sizes, ANY_CACHE_SEGMENTS)

    if runs(high):
        return high
    high -= 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if runs(middle) else (low, middle - 1)
    return low


@pytest.mark.parametrize(("capacity", "tokens"), [(400, 512), (617, 512), (617, 4096), (800, 2048)])
def test_the_per_cache_search_finds_the_bisections_level(capacity: int, tokens: int) -> None:
    """`most_from_any_cache` plays each cache at the level found so far instead of every cache at
    each probe: on held-out H1's engine its rows and tokens are the bisection's, and run from
    every cache."""
    sizes = cached_segment_sizes(QWEN, QWEN_ENGINE)
    most = sampler_cost(QWEN, QWEN_ENGINE).max_sampled_rows

    def rows_step(rows: int) -> list[TapeOp]:
        return sampled_step_tape(QWEN, QWEN_ENGINE, tokens, rows, True)

    rows = any_cache_sampled_rows(QWEN, QWEN_ENGINE, False, capacity * MiB, tokens, True, sizes)
    assert rows == _bisected(rows_step, -1, most, capacity * MiB, sizes)
    assert rows < 0 or fits_from_any_cache(rows_step(rows), capacity * MiB, sizes, ANY_CACHE_SEGMENTS)
    full = QWEN_ENGINE.max_num_batched_tokens

    def forward_step(k: int) -> list[TapeOp]:
        return profile_forward_tape(QWEN, QWEN_ENGINE, max(1, full * k // ANY_CACHE_TOKEN_STEPS), served=True)

    level = any_cache_forward_level(QWEN, QWEN_ENGINE, False, capacity * MiB)
    assert level == full * _bisected(forward_step, 0, ANY_CACHE_TOKEN_STEPS, capacity * MiB, sizes) // (
        ANY_CACHE_TOKEN_STEPS
    )


def test_a_cache_that_ran_above_a_lowered_level_is_played_again_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where one cache lowers the level, the caches that ran the higher one are played again at
    the lower: a cache need not run every smaller step (the 10 MiB cache here fails 8-10, the
    20 MiB one 4-7); the answer runs from every cache."""
    failing = {(10 * MiB,): range(8, 11), (20 * MiB,): range(4, 8)}
    played: list[tuple[tuple[int, ...], int]] = []

    def runs_from(tape: list[TapeOp], capacity: int, cache: tuple[int, ...], expandable: bool) -> bool:
        played.append((cache, tape[0][2]))
        return tape[0][2] not in failing.get(cache, range(0))

    monkeypatch.setattr(allocator, "_runs_from", runs_from)
    level = most_from_any_cache(lambda x: [alloc("t", x)], 0, 10, 100 * MiB, [10 * MiB, 20 * MiB], 1)
    assert level == 3
    assert {((), 3), ((10 * MiB,), 3), ((20 * MiB,), 3)} <= set(played)
