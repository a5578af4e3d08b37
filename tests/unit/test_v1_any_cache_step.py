"""A whole V1 step from whatever cache the steps before it left (kvgate/memory/activation.py
`V1AnyCacheStep`, kvgate/gate/budget.py `Budget._grows_past_v1_any_cache`).

Random engine R13a (bench/results/goodput-session45): Qwen2.5-7B on an A100 80 GB, vLLM 0.31.0 on
Model Runner V1, fp8 KV, 2,048 tokens a step, 128 sequences, the pool vLLM's start-up advises, no
expandable segments. kvgate counted a V1 step's profiled tensors inside the region V1's warm-up
holds; long after a failed cudaMalloc had released the warm-up's blocks the simulator ran out of
memory on a 64-row step (62 chats decoding, two prompts, four rows with penalties, one asking
logprobs): its cache held free segments of 38, 148, 74 and 84 MiB with 53.76 MiB free on the
device, best fit put the sampler's [64, V] tensors in them, and the second bin counts (74.25
MiB) found 73.75 MiB beside the first. The segments below are the record's, to the byte.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from sim_support import runs_out_on

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import Deployment, build_predictor, resolve, static_limits
from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import Ledger
from kvgate.gate.observer import Observers
from kvgate.memory.activation import (
    V1AnyCacheStep,
    V1PenaltyStep,
    any_cache_v1_rows,
    cached_segment_sizes,
)
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

QWEN = model_geometry("qwen2.5-7b-instruct")
POOL = 68_216_155_382  # R13a's --kv-cache-memory-bytes: the pool vLLM's start-up advises
FLAGS = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "128", "--model-runner", "v1"]
FLAGS += ["--kv-cache-dtype", "fp8", "--max-model-len", "32768"]
CACHE = (39_845_888, 155_189_248, 77_594_624, 88_080_384)  # the record's free segments, bytes
FREE = 56_371_200  # 53.76 MiB free on the device
CAPACITY = FREE + sum(CACHE)
LONGEST_PROMPT = 1616  # the batch's longest prompt: the penalties' prompt ids are padded to it
PREFILLS = (89, 433)


def r13a_gpu(cache: tuple[int, ...]) -> tuple[CachingAllocator, StepMemory]:
    """R13a's simulated engine after start-up, its warm-up's blocks released, holding these free
    segments with `CAPACITY` bytes between them and the device's free memory."""
    cfg = SimConfig(
        model="qwen2.5-7b",
        gpu="a100-80gb",
        vllm_version="0.31.0",
        model_runner="v1",
        kv_cache_dtype="fp8",
        max_model_len=32768,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        kv_cache_memory_bytes=POOL,
    )
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm")
    resolved, _ = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    steps, _ = startup.step_memories(resolved)
    alloc.empty_cache()
    device.set_usage("other", device.free() - CAPACITY)
    for block in [alloc.malloc(size) for size in cache]:
        alloc.free(block)
    assert device.free() + sum(cache) == CAPACITY
    return alloc, steps


def step(rows: int) -> StepShape:
    """The record's kind of step with `rows` sampled rows: the two prompts, and chats decoding at
    a seeded random temperature, four of them with penalties and one asking a logprob."""
    decoding = [
        ReqSlice(1, 300, random=True, seeded=True, penalties=i < 4, logprobs=1 if i == 4 else None, top_p_k=i == 4)
        for i in range(rows - len(PREFILLS))
    ]
    prompts = [ReqSlice(tokens, 0, random=True, seeded=True) for tokens in PREFILLS]
    return StepShape((*decoding, *prompts))


def test_the_simulator_runs_the_recorded_step_out_of_memory_from_its_cache_and_not_from_an_empty_one() -> None:
    assert (step(64).num_tokens, step(64).sampled_rows) == (584, 64)
    assert runs_out_on(*r13a_gpu(CACHE), step(64)) == "output_bin_counts"
    assert runs_out_on(*r13a_gpu(()), step(64)) is None


def level_at(capacity: int) -> int:
    engine = build_predictor(r13a_deployment(), QWEN).engine
    prompt = 2048  # the longest prompt rounded up to a power of two, as the budget keys it
    return any_cache_v1_rows(QWEN, engine, capacity, 584, prompt, True, cached_segment_sizes(QWEN, engine))


def test_the_level_from_every_cache_is_below_the_recorded_step_and_the_simulator_runs_it_from_the_record() -> None:
    """The level's rows run from the recorded cache, and from an empty one; the recorded 64 are
    above it. (kvgate before this level charged the step only its unprofiled terms against the
    free memory, counting the sampler's [rows, V] tensors in the warm-up's held bytes.)"""
    level = level_at(CAPACITY)
    assert 32 <= level < 64
    for cache in (CACHE, ()):
        assert runs_out_on(*r13a_gpu(cache), step(level)) is None


def test_a_plain_step_runs_more_rows_than_one_with_penalties_and_logprobs() -> None:
    engine = build_predictor(r13a_deployment(), QWEN).engine
    sizes = cached_segment_sizes(QWEN, engine)
    plain = any_cache_v1_rows(QWEN, engine, CAPACITY, 584, 0, False, sizes)
    assert plain > level_at(CAPACITY)
    assert any_cache_v1_rows(QWEN, engine, CAPACITY + 200 * MiB, 584, 0, False, sizes) >= plain


def r13a_deployment() -> Deployment:
    settings = settings_from_args(build_parser().parse_args(["serve", *FLAGS, "--gpu-memory-bytes", str(80 * GiB)]))
    deployment = resolve(engine_flags(settings), QWEN, None, None, reported_version="0.31.0")
    assert deployment.runtime.runner == "v1"
    return deployment


@pytest.fixture(scope="module")
def r13a_budget() -> tuple[Budget, Predictor]:
    """kvgate's budget for R13a as its live readings leave it: the engine holds the profile region
    (profiled_cap 0), the headroom is what the recorded capacity leaves beside the warm-up's
    bytes, the V1 step level worked out in the caller's thread."""
    deployment = r13a_deployment()
    predictor = build_predictor(deployment, QWEN)
    budget = Budget(**asdict(static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=POOL)))
    levels = V1AnyCacheStep(QWEN, predictor.engine, False, background=False)
    assert levels.released_bytes == 290 * MiB  # 366 MiB cached, less the Triton buffer it keeps
    headroom = CAPACITY - levels.released_bytes
    assert 100 * MiB < headroom < 110 * MiB
    budget.update(
        kv_blocks=None,
        transient_headroom_bytes=headroom,
        profiled_cap_bytes=0,
        v1_any_cache=levels,
        penalty_step=V1PenaltyStep(QWEN, predictor.engine, False, background=False),
    )
    return budget, predictor


def chat(predictor: Predictor, i: int) -> Demand:
    """The record's chats: a seeded random temperature, the first four with a presence penalty,
    the fifth asking a logprob; the first with the batch's longest prompt."""
    body: dict[str, object] = {"prompt": "x", "max_tokens": 128, "temperature": 0.7, "seed": i}
    body |= {"presence_penalty": 0.5} if i < 4 else {"logprobs": 1, "top_p": 0.9} if i == 4 else {}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[11 + i] * (LONGEST_PROMPT if i == 0 else 300)]).demand


def released_life() -> Ledger:
    """The gate's ledger long after a step released the warm-up's blocks."""
    ledger = Ledger()
    ledger.warmup_released = True
    return ledger


def chats_admitted(budget: Budget, predictor: Predictor) -> int:
    ledger = released_life()
    while ledger.in_flight < 128 and budget.shortfall(demand := chat(predictor, ledger.in_flight), ledger) is None:
        ledger.end_prefill(ledger.reserve(demand))
    return ledger.in_flight


def test_kvgate_admits_the_batch_up_to_the_level_and_holds_the_next(r13a_budget) -> None:
    """With the level kvgate admits as many chats as the level's rows (every one decoding: a row
    each), which the simulator runs from the recorded cache; the next waits. Without it, the
    recorded 64 (the sampler's [rows, V] tensors counted in the held region's bytes), which the
    simulator runs out of memory on."""
    budget, predictor = r13a_budget
    admitted = chats_admitted(budget, predictor)
    levels = budget.v1_any_cache
    assert 48 <= admitted <= level_at(CAPACITY) < 64  # the budget's key: the capacity rounded down
    assert runs_out_on(*r13a_gpu(CACHE), step(admitted)) is None
    ledger = released_life()
    for i in range(admitted):
        ledger.end_prefill(ledger.reserve(chat(predictor, i)))
    assert budget.shortfall(chat(predictor, admitted), ledger) == TRANSIENT_BUSY
    budget.update(v1_any_cache=None)
    try:
        assert chats_admitted(budget, predictor) == 64
    finally:
        budget.update(v1_any_cache=levels)
    assert runs_out_on(*r13a_gpu(CACHE), step(64)) == "output_bin_counts"


def prompt(predictor: Predictor, tokens: int) -> Demand:
    spec = parse_request("completions", json.dumps({"prompt": "x", "max_tokens": 16}).encode()).request
    return predictor.predict(spec, [[7] * tokens]).demand


def test_until_a_step_releases_the_warm_up_cache_the_region_is_held_in_its_shapes(r13a_budget) -> None:
    """A decode batch of plain chats runs inside the warm-up's [128, V] blocks and releases
    nothing: the level does not hold it before a release, and the life stays unmarked. R13a's
    first full prefill (its 148 MiB gate_up fits none of the warm-up's 74 MiB blocks) releases
    them: the life is marked, and from then on the level judges the batch."""
    budget, predictor = r13a_budget
    ledger = Ledger()
    for i in range(5, 69):  # 64 chats, none with penalties or logprobs
        demand = chat(predictor, i)
        assert budget.shortfall(demand, ledger) is None
        ledger.end_prefill(ledger.reserve(demand))
    assert not budget.releases_warmup_cache(ledger)
    ledger.reserve(prompt(predictor, 4096))
    assert budget.releases_warmup_cache(ledger)


async def test_the_gate_marks_the_life_when_it_admits_the_step_that_releases_the_warm_up_cache(r13a_budget) -> None:
    budget, predictor = r13a_budget
    gate: Gate[str] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=5.0)
    chats = [await gate.acquire(chat(predictor, i), 0, f"chat-{i}") for i in range(5, 9)]
    assert not gate.ledger.warmup_released
    long = await gate.acquire(prompt(predictor, 4096), 0, "long")
    assert gate.ledger.warmup_released
    for ticket in [*chats, long]:
        ticket.release("completed")
    assert gate.ledger.warmup_released  # for the engine's life: the cache does not come back
    gate.ledger.reset_peak()  # a new life: the warm-up runs again
    assert not gate.ledger.warmup_released
