"""Benchmark S8's burst (forty n = 16 streams at temperature 1.0 within two seconds, beside chats at
temperature 0.7 and greedy labels) on S8's engine: Qwen2.5-7B, vLLM 0.32.0 Model Runner V2, 2,048
batched tokens, the KV pool vLLM's start-up advice sizes. kvgate's budget is the one its live
readings set there: the engine's free memory as headroom (414 MiB), the whole profile region out
of it (V2 on a fixed pool), the margin of 10 %, no relaxation learned yet.

V2 copies the whole batch's logits to fp32 as soon as one row needs logits processing (vllm
0.32.0 v1/worker/gpu/sample/sampler.py `apply_sampling_params`; v1/worker/gpu/sample/states.py
`SamplingStates.add_request`: a random row whose temperature is not 1.0), so one decoding chat
makes the 16 rows of every n = 16 stream cost 4 B a logit more. That, not the queue's order,
caps how many of the forty run at once while chats are served (docs/limitations.md, "Who forms
the TTFT tail in S8, S9 and S10").
"""

from __future__ import annotations

import copy
import json
import pathlib
import tempfile

import pytest
from sim_support import make_engine, sim_runs_after

from bench.scenarios import SCENARIOS
from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import AnyCacheForward, AnyCacheSampler
from kvgate.memory.demand import Demand
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.engine import Engine
from kvgate.sim.presets import gpu_total_bytes, write_model_folder
from kvgate.sim.step_memory import ReqSlice, StepShape

S8 = next(s for s in SCENARIOS if s.key == "S8")
CHAT = {"temperature": 0.7, "seed": 1, "max_tokens": 256}  # bench/workloads.py chat_call
N16 = {"n": 16, "temperature": 1.0, "max_tokens": 256}
GREEDY = {"temperature": 0.0, "max_tokens": 16}
PROMPT = 400  # an n = 16 question's prompt (bench/scenarios.py s8_traffic: 200-600 tokens)


@pytest.fixture(scope="module")
def s8() -> tuple[Engine, Budget, Predictor]:
    """S8's simulated engine just started, and kvgate's budget on its free memory."""
    return _s8(levels=False)


@pytest.fixture(scope="module")
def s8_levels() -> tuple[Engine, Budget, Predictor]:
    """As `s8`, with the any-cache levels kvgate's budget has in the benchmark, worked out at once."""
    return _s8(levels=True)


def _s8(levels: bool) -> tuple[Engine, Budget, Predictor]:
    cfg = S8.sim
    engine = make_engine(cfg)
    total = gpu_total_bytes(cfg.gpu)
    args = ["serve", "--max-num-batched-tokens", "2048", "--max-num-seqs", "1024", "--gpu-memory-bytes", str(total)]
    folder = pathlib.Path(write_model_folder(cfg.model, pathlib.Path(tempfile.mkdtemp()) / cfg.model))
    geometry = ModelGeometry.from_config(json.loads((folder / "config.json").read_text()))
    settings = settings_from_args(build_parser().parse_args(args))
    deployment = resolve(engine_flags(settings), geometry, None, None, reported_version="0.32.0")
    assert deployment.runtime.runner == "v2"
    predictor = build_predictor(deployment, geometry)
    limits = static_limits(deployment, predictor, None, total, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes)
    headroom = engine.device.free()
    budget = Budget(
        kv_blocks=limits.kv_blocks,
        transient_headroom_bytes=headroom,
        max_transient_headroom_bytes=headroom,
        profiled_peak_bytes=limits.profiled_peak_bytes,
        profiled_cap_bytes=limits.profiled_peak_bytes,
        segment_overhead=limits.segment_overhead,
        profiled_forward_bytes=limits.profiled_forward_bytes,
        forward_bytes_per_token=limits.forward_bytes_per_token,
        profiled_hidden_bytes=limits.profiled_hidden_bytes,
        sampler_phase_overhead=limits.sampler_phase_overhead,
        lone_forward=limits.lone_forward,
    )
    if levels:
        g, e = predictor.layout.geometry, predictor.engine
        budget.update(
            any_cache_forward=AnyCacheForward(g, e, False, background=False),
            any_cache_sampler=AnyCacheSampler(g, e, False, background=False),
        )
    return engine, budget, predictor


def _demand(predictor: Predictor, body: dict, prompt: int, i: int) -> Demand:
    spec = parse_request("completions", json.dumps({"prompt": "x", "stream": True, **body}).encode()).request
    return predictor.predict(spec, [[11 + i] * prompt]).demand


def _beside(predictor: Predictor, chats: int, labels: int) -> Ledger:
    """Decoding chats and greedy labels (their first tokens shown)."""
    ledger = Ledger()
    for i in range(chats):
        ledger.end_prefill(ledger.reserve(_demand(predictor, CHAT, 300, 1000 + i)))
    for i in range(labels):
        ledger.end_prefill(ledger.reserve(_demand(predictor, GREEDY, 300, 2000 + i)))
    return ledger


def _streams_admitted(s8: tuple[Engine, Budget, Predictor], chats: int, relieved: bool, most: int = 40) -> int:
    """n = 16 streams admitted one after another beside `chats` decoding chats and 4 labels; each
    a plain candidate (its first token is one of 16), relieved by vLLM's count once all its
    children's first tokens are in it (`relieved`) or never."""
    _, budget, predictor = s8
    ledger = _beside(predictor, chats, 4)
    n = 0
    while n < most and budget.shortfall(d := _demand(predictor, N16, PROMPT, 3000 + n), ledger) is None:
        ledger.mark_plain(ledger.reserve(d))
        n += 1
        if relieved:
            ledger.plain.set_finished(16 * n)
    return n


def test_decoding_chats_halve_how_many_n16_streams_kvgate_runs_at_once(s8) -> None:
    """With no chat in flight all forty streams fit, their prefills still open (no row needs
    processing: no fp32 copy); beside five decoding chats 13 (prefills open: vLLM's count has not
    relieved them) to 18 (relieved). So in S8 the burst goes in two or three waves while chats are
    served, the later ones waiting for the earlier ones' 192-256 output tokens (session 35's arms:
    the n = 16 streams' TTFT p99 is the second wave's)."""
    assert _streams_admitted(s8, chats=0, relieved=False) == 40
    assert _streams_admitted(s8, chats=5, relieved=False) == 13
    assert _streams_admitted(s8, chats=5, relieved=True) == 18


def test_with_the_any_cache_levels_the_streams_beside_chats_are_judged_by_the_whole_step(s8_levels) -> None:
    """kvgate's budget in the benchmark (session 39): the first wave is bounded by the whole step
    from every cache (35 of 40 with no chat), and beside five chats the sampler phase that runs
    from every cache is charged no segment overhead: 16 streams whether vLLM's count relieved the
    earlier ones or not (13 and 18 on the charge alone)."""
    assert _streams_admitted(s8_levels, chats=0, relieved=False) == 35
    assert _streams_admitted(s8_levels, chats=5, relieved=False) == 16
    assert _streams_admitted(s8_levels, chats=5, relieved=True) == 16


def _runs_after(engine: Engine, earlier: StepShape, step: StepShape) -> bool:
    """Whether `step` runs on the engine's own allocator (as start-up left it) after `earlier`,
    whose retained outputs are freed when the next step starts (kvgate/sim/carryover.py)."""
    _, alloc = copy.deepcopy((engine.device, engine.alloc))
    return sim_runs_after(alloc, engine, earlier, step, free_retained=True)


@pytest.mark.parametrize(("budget_fixture", "most"), [("s8", 18), ("s8_levels", 16)])
def test_every_n16_stream_kvgate_admits_beside_chats_runs_after_a_chats_prefill_step(
    budget_fixture: str, most: int, request: pytest.FixtureRequest
) -> None:
    """Beside 5 decoding chats, 4 labels and the n = 16 streams already decoding (vLLM's count
    relieved them), each stream kvgate admits has a first step that prefills its 16 children
    beside the decoding rows: the first computes its 400 prompt tokens, the other 15 hit the blocks
    it cached when it was scheduled and compute the last 16 (the simulator's scheduler,
    kvgate/sim/scheduler.py, as vLLM's caches blocks at allocation), and all 16 sample. That step
    must run on the simulator after an earlier step of the same decoders beside a chat's prefill
    of any size (every 64 tokens), whose one chat row makes V2 copy the whole batch's logits to
    fp32 too. Session 35's charge admitted a 21st stream beside 20; after an 823-token chat
    prefill (330 rows) its step (345 rows) put its 100.1 MiB of logits in the earlier copy's 192
    MiB segment and ran out placing its own 200.1 MiB copy (kvgate/memory/activation.py
    `sampler_phase_overhead_bytes`: the earlier step of fewer rows). With the any-cache levels
    (session 39) the sampler phase is charged no segment overhead where the whole step runs from
    every cache, and the whole step is judged from every cache: 16."""
    engine, budget, predictor = request.getfixturevalue(budget_fixture)
    ledger = _beside(predictor, 5, 4)
    decoders = [ReqSlice(1, 440, random=True, seeded=True)] * 5 + [ReqSlice(1, 310)] * 4
    cached = (PROMPT - 1) // 16 * 16  # whole blocks, the last token always computed
    children = [ReqSlice(PROMPT, 0, random=True, processes=False)]
    children += [ReqSlice(PROMPT - cached, cached, random=True, processes=False)] * 15
    admitted = 0
    while budget.shortfall(newcomer := _demand(predictor, N16, PROMPT, 3000 + admitted), ledger) is None:
        streams = [ReqSlice(1, PROMPT + 40, random=True, processes=False)] * (16 * admitted)
        step = StepShape((*decoders, *streams, *children))
        for prefill in range(64, 2049, 64):
            earlier = StepShape((*decoders, *streams, ReqSlice(prefill, 0, random=True, seeded=True)))
            assert _runs_after(engine, earlier, step), f"stream {admitted + 1} after a {prefill}-token chat prefill"
        ledger.mark_plain(ledger.reserve(newcomer))
        admitted += 1
        ledger.plain.set_finished(16 * admitted)
    assert admitted == most
