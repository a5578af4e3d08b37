"""A cached segment is the size of a tensor some earlier step made (issue 24, benchmark S13).

Benchmark S13's engine (Llama-3.1-8B, vLLM 0.32.0 Model Runner V2, 2,048 tokens a step, 512
sequences, the pool vLLM's start-up advice sizes: 296 MiB of headroom as kvgate reads it) makes
no forward tensor above 112 MiB (`gate_up` at 2,048 tokens); only a sampler phase's logits and
their fp32 copy, at 256 rows or more, make larger ones. From every cache of segments the steps of
up to 256 sampled rows can leave, a whole 2,048-token step runs; from some caches with a segment
the fp32 copy of about 300 rows leaves, it does not, and the simulator's own allocator
(kvgate/sim/gpu.py) agrees on both. So kvgate weighs a step beside others against the caches the
steps of this engine life can have left (`Ledger.peak_segment_rows`), not against every size up to
the fp32 copy of max_num_seqs rows, which kept S13's long documents waiting.
"""

from __future__ import annotations

import copy
import json
import random
import threading
from collections.abc import Callable

import pytest
from sim_support import played, started_s13
from sim_support import prefill_beside as step

from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import (
    ANY_CACHE_SEGMENTS,
    AnyCacheForward,
    AnyCacheSampler,
    EngineShape,
    any_cache_forward_level,
    cached_segment_sizes,
    cached_sizes_count,
    profile_forward_tape,
)
from kvgate.memory.allocator import fits_from_any_cache
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.presets import model_config
from kvgate.sim.step_memory import StepMemory, StepShape
from kvgate.units import GiB, MiB
from support.served_budget import served_v2_budget, v2_budget

LLAMA_8B = ModelGeometry.from_config(model_config("llama-3.1-8b"))
S13_ENGINE = EngineShape(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=512, runner="v2")
HEADROOM = 296 * MiB
StepPicker = Callable[[random.Random], StepShape]  # one step of a random walk


def test_fewer_sampled_rows_leave_a_prefix_of_the_sizes_and_never_lower_the_level() -> None:
    """What `AnyCacheForward` relies on to answer from a level known for more rows."""
    everything = cached_segment_sizes(LLAMA_8B, S13_ENGINE)
    levels = []
    for rows in range(0, 513, 64):
        sizes = cached_segment_sizes(LLAMA_8B, S13_ENGINE, rows)
        assert sizes == everything[: len(sizes)]
        levels.append(any_cache_forward_level(LLAMA_8B, S13_ENGINE, False, HEADROOM, rows))
    assert levels == sorted(levels, reverse=True)
    assert cached_sizes_count(LLAMA_8B, S13_ENGINE, 0) == cached_sizes_count(LLAMA_8B, S13_ENGINE, 224) == 14
    assert cached_sizes_count(LLAMA_8B, S13_ENGINE, 257) == 16
    assert cached_sizes_count(LLAMA_8B, S13_ENGINE, 9999) == len(everything) == 32
    levels = AnyCacheForward(LLAMA_8B, S13_ENGINE, False, background=False)
    assert levels(2048, HEADROOM, 200)  # worked out: 2,048 from the 14 sizes
    assert list(levels._known) == [(HEADROOM, 14)]
    assert levels(2048, HEADROOM + 5 * MiB, 0)  # answered by the level known for 14 sizes
    assert not levels(2048, HEADROOM, 300)
    assert list(levels._known) == [(HEADROOM, 14), (HEADROOM, 19)]


def test_s13s_whole_step_runs_from_every_cache_until_a_sampler_phase_makes_a_larger_segment() -> None:
    """Every cache of kvgate's grid that runs the 2,048-token step out holds a segment larger than
    128 MiB, which only the fp32 copy of more than 256 sampled rows makes."""
    step = profile_forward_tape(LLAMA_8B, S13_ENGINE, 2048, served=True)
    assert max(nbytes for op, _, nbytes in step if op == "alloc") == 112 * MiB
    sizes = cached_segment_sizes(LLAMA_8B, S13_ENGINE)
    assert fits_from_any_cache(step, HEADROOM, [s for s in sizes if s <= 128 * MiB], ANY_CACHE_SEGMENTS)
    assert not fits_from_any_cache(step, HEADROOM, sizes, ANY_CACHE_SEGMENTS)
    assert not fits_from_any_cache(step, HEADROOM, [88 * MiB, 160 * MiB], 2)
    assert any_cache_forward_level(LLAMA_8B, S13_ENGINE, False, HEADROOM, 256) == 2048
    assert any_cache_forward_level(LLAMA_8B, S13_ENGINE, False, HEADROOM, 272) < 2048
    assert any_cache_forward_level(LLAMA_8B, S13_ENGINE, False, HEADROOM) == 1728  # every row count


@pytest.fixture(scope="module")
def s13_gpu() -> tuple[Device, CachingAllocator, StepMemory]:
    """S13's simulated engine just started, its free memory the headroom kvgate reads."""
    return started_s13(HEADROOM)


def test_the_simulator_runs_s13s_whole_step_out_only_after_a_sampler_phase_of_more_rows(s13_gpu) -> None:
    """After a 1,472-token prefill beside 296 decoding rows whose logits are copied to fp32 (a
    146 MiB segment), the next step's 2,048 tokens beside the same rows run out of memory on
    SiluAndMul's output. After random histories of steps sampling at most 256 rows (a seeded
    search over prefills of any size and copied or plain logits) the whole step always runs."""
    _, alloc, steps = copy.deepcopy(s13_gpu)
    assert played(alloc, steps, step(1472, 296, copied=True))
    assert not played(alloc, steps, step(2048 - 296, 296, copied=False))

    def pick(rng: random.Random) -> StepShape:
        rows = rng.choice([0, rng.randint(1, 64), rng.randint(1, 256)])
        return step(rng.randint(0 if rows else 1, 2048 - rows), rows, copied=rng.random() < 0.8)

    assert whole_step_runs_after_walks(s13_gpu, random.Random(36), 60, pick) > 300


def whole_step_runs_after_walks(
    s13_gpu: tuple[Device, CachingAllocator, StepMemory], rng: random.Random, walks: int, pick: StepPicker
) -> int:
    """Random walks of six steps each from S13's started engine, the steps `pick` draws (one that
    runs out of memory is no history); from every state reached the whole 2,048-token step runs.
    How many states were checked."""
    histories = 0
    for _ in range(walks):
        _device, alloc, steps = copy.deepcopy(s13_gpu)
        for _ in range(6):
            trial = copy.deepcopy(alloc)
            if not played(trial, steps, pick(rng)):
                continue
            alloc, histories = trial, histories + 1
            assert played(copy.deepcopy(alloc), steps, step(2047, 1, copied=False))
    return histories


def s13_budget() -> tuple[Budget, Predictor]:
    """kvgate's budget for S13 as its live readings set it once it has served large steps."""
    return served_v2_budget(LLAMA_8B, ["--max-num-batched-tokens", "2048", "--max-num-seqs", "512"], HEADROOM)


def demand(predictor: Predictor, prompt_tokens: int, temperature: float, max_tokens: int) -> Demand:
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": temperature}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[7] * prompt_tokens]).demand


def test_a_document_beside_chats_waits_only_once_this_engine_life_copied_more_rows() -> None:
    """S13's head of line: a 12,000-token document (temperature 0.7) asks in beside 40 decoding
    chats. Its first chunk makes a whole 2,048-token step. While no step of this engine life has
    copied more than 256 rows' logits to fp32 it is admitted; once a burst put 300 rows in one step
    beside a row that needs processing, their fp32 copy may be cached, and it waits, until a new
    engine life starts from an empty cache."""
    budget, predictor = s13_budget()
    ledger = Ledger()
    chats = [ledger.reserve(demand(predictor, 200, 0.7, 256)) for _ in range(300)]
    for reservation in chats:
        ledger.end_prefill(reservation)
    assert ledger.peak_segment_rows == 300
    for reservation in chats[40:]:
        ledger.release(reservation)
    document = demand(predictor, 12000, 0.7, 1024)
    assert budget.shortfall(document, ledger) == TRANSIENT_BUSY
    ledger.reset_peak()  # the engine restarted: its cache is empty, the 40 chats' rows count
    assert ledger.peak_segment_rows == 40
    assert budget.shortfall(document, ledger) is None


def test_a_burst_that_copies_nothing_does_not_keep_the_document_waiting() -> None:
    """S13's burst is 400 chats at temperature 1.0: Model Runner V2 copies none of their logits to
    fp32, so the largest tensor of a 300-row step is its bf16 logits, the size of the fp32 copy of
    150 rows (`SamplerCost.segment_rows`). The document beside the 40 chats left goes in, as it
    does beside chats that never passed 256 rows (the simulator's histories below agree)."""
    budget, predictor = s13_budget()
    ledger = Ledger()
    chats = [ledger.reserve(demand(predictor, 200, 1.0, 256)) for _ in range(300)]
    for reservation in chats:
        ledger.end_prefill(reservation)
    assert ledger.step().sampled_rows == 300
    assert not ledger.step().copies_logits
    assert ledger.peak_segment_rows == 150
    for reservation in chats[40:]:
        ledger.release(reservation)
    assert budget.shortfall(demand(predictor, 12000, 0.7, 1024), ledger) is None


def test_the_simulator_runs_s13s_whole_step_after_any_burst_that_copies_nothing(s13_gpu) -> None:
    """Random histories of S13's steps: up to max_num_seqs (512) decoding rows whose logits are not
    copied (bf16 logits of at most 125 MiB), or up to 256 copied ones, beside prefills of any size.
    After each, the whole 2,048-token step runs, as kvgate's mark of 256 copying rows at most says."""

    def pick(rng: random.Random) -> StepShape:
        copied = rng.random() < 0.3
        rows = rng.choice([0, rng.randint(1, 256 if copied else 512), 256 if copied else 512])
        return step(rng.randint(0 if rows else 1, max(1, 2048 - rows)), rows, copied=copied)

    assert whole_step_runs_after_walks(s13_gpu, random.Random(37), 40, pick) > 150


class LevelByRows:
    """A step level that runs 2,048 tokens from the caches of steps sampling up to 256 rows and
    1,728 beyond: S13's levels at 296 MiB, where the charge beside a document's whole step stops
    short of 257 rows; this keeps the charge out of the way to test the rule itself."""

    def __call__(self, tokens: int, capacity: int, rows: int) -> bool:
        return tokens <= (2048 if rows <= 256 else 1728)

    def more_caches(self, rows: int, than: int) -> bool:
        return rows > 256 >= than

    def prepare(self, capacity: int) -> None:
        """Known at once: nothing to start."""


def test_beside_a_whole_step_a_chat_that_samples_more_rows_than_ever_waits() -> None:
    """The document's chunks make whole 2,048-token steps: a chat asking in leaves the step no
    larger, which was enough to admit it. But a step sampling more rows than any before it may
    leave a larger segment cached for the document's next chunk (the simulator's 296-row history
    above), so a chat that takes the rows past the engine life's mark waits while the whole step
    does not run from the larger caches; within the mark it goes in."""
    budget, predictor = s13_budget()
    budget.update(
        any_cache_forward=LevelByRows(), transient_headroom_bytes=4 * GiB, max_transient_headroom_bytes=4 * GiB
    )
    ledger = Ledger()
    earlier = [ledger.reserve(demand(predictor, 200, 0.7, 256)) for _ in range(300)]
    for reservation in earlier:
        ledger.end_prefill(reservation)
    for reservation in earlier[:45]:
        ledger.release(reservation)
    ledger.reserve(demand(predictor, 12000, 0.7, 1024))
    assert ledger.peak_segment_rows == 300
    assert ledger.step().sampled_rows == 256
    chat = demand(predictor, 200, 1.0, 256)
    assert budget.shortfall(chat, ledger) is None  # 257 rows: within the mark, the step no larger
    ledger.reset_peak()  # a new engine life: no step has sampled more than these 256 rows
    assert budget.shortfall(chat, ledger) == TRANSIENT_BUSY


def test_a_headroom_read_starts_its_step_level_before_any_request_asks() -> None:
    """Until a step level is known the answer beside others is no: at an engine life's first
    reading every request behind the first waited for the worker thread's replay (benchmark S10's
    TTFT tail). The level a one-row request asks is started as the headroom is read; a higher
    headroom read later starts none, since the level already known answers it."""
    budget, predictor = v2_budget(
        LLAMA_8B, ["--max-num-batched-tokens", "2048", "--max-num-seqs", "512"], "0.32.0", 60 * GiB
    )
    levels = AnyCacheForward(LLAMA_8B, predictor.engine, False)
    known = threading.Event()
    levels.when_known(known.set)
    budget.update(any_cache_forward=levels)
    assert not levels._pending  # no headroom read yet
    budget.update(
        transient_headroom_bytes=HEADROOM,
        max_transient_headroom_bytes=HEADROOM,
        profiled_cap_bytes=predictor.profiled_peak_bytes,
        held_region_bytes=predictor.profiled_peak_bytes,
    )
    assert known.wait(120)
    sampler = budget.any_cache_sampler  # the whole step's level, for a full step that copies
    assert isinstance(sampler, AnyCacheSampler)
    assert {*sampler._known, *sampler._pending} == {sampler._key(2048, True, HEADROOM, 1)}
    one_row = levels._key(HEADROOM, 1)
    assert levels._known[one_row] == any_cache_forward_level(LLAMA_8B, predictor.engine, False, one_row[0], 1)
    budget.update(transient_headroom_bytes=HEADROOM - 64 * MiB)
    assert list(levels._known) == [one_row]
    assert levels._pending == {one_row}
