"""The running maximum of a V2 prompt-logprobs step's peak over step sizes
(kvgate/memory/activation.py `_v2_step_peak_upto`), which the ledger charges a passage beside
others, is worked out a grid cell at a time instead of walking every step (10 - 24 s of CPU on
the event loop at 131,072 - 200,000 batched tokens). It must equal the walk exactly, at every
size, in whatever order the sizes are asked: never less (an OOM), never more (a refusal)."""

from __future__ import annotations

import time

import pytest

from kvgate.memory import activation
from kvgate.memory.activation import EngineShape, _v2_step, _v2_step_peak_upto
from support.geometry import model_geometry


def walk(g: object, e: EngineShape, k: int, rows: int) -> list[int]:
    """The running maximum of `_v2_step`'s peak over every step of 1 to `rows` tokens."""
    peaks = [0]
    for step in range(1, rows + 1):
        peaks.append(max(peaks[-1], _v2_step(g, e, step, k)[2]))  # type: ignore[arg-type]
    return peaks


def jagged_overhead(g: object, e: EngineShape, step: int, k: int) -> int:
    """A stand-in for the allocator replay that jumps up and down between grid points (the
    replay's own values take seconds to compute; the cell logic is what is checked here)."""
    return (step * 7919 % 613) * 1_048_576


GEOMETRIES = [
    ("llama-3-8b", {}),
    ("llama-3-8b", {"vocab_size": 1000}),
    ("llama-3-8b", {"vocab_size": 8000, "torch_dtype": "float32"}),
    ("qwen3-0.6b", {}),
    ("gemma-3-4b-it", {}),
    ("tiny-llama-f32", {}),
]


@pytest.mark.parametrize(("name", "overrides"), GEOMETRIES)
def test_v2_step_peaks_match_the_walk(name: str, overrides: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activation, "v2_prompt_logprobs_overhead_bytes", jagged_overhead)
    monkeypatch.setattr(activation, "_STEP_PEAKS", {})
    g = model_geometry(name, **overrides)
    rows = 3 * 1024 + 77  # three full sub-chunks (the last one after a full one) and a partial
    e = EngineShape(rows, rows, 64, runner="v2", max_logprobs=-1)
    for k in (-1, 0, 1, 64, 4096, 8192):
        expected = walk(g, e, k, rows)
        asked = [*range(rows, 0, -97), *range(1, rows + 1)]  # some large first, then every size
        got = {n: _v2_step_peak_upto(g, e, k, n) for n in asked}
        wrong = [(n, got[n], expected[n]) for n in sorted(got) if got[n] != expected[n]]
        assert not wrong, f"k {k}: (rows, kvgate, walk) {wrong[:5]}"


def test_a_first_charge_on_a_200k_token_engine_takes_milliseconds() -> None:
    """The first passage beside others on a 200,000-token V2 engine: the walk took 24 s of CPU
    (2-core machine, session 29); a cell at a time, ~0.02 s. 1 s leaves room for a loaded machine."""
    g = model_geometry("llama-3-8b")
    e = EngineShape(200_000, 200_000, 256, runner="v2", max_logprobs=20)
    start = time.process_time()
    peak = _v2_step_peak_upto(g, e, 32, 200_000)
    assert time.process_time() - start < 1.0
    assert peak >= _v2_step(g, e, 200_000, 32)[2]
