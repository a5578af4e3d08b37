"""Differential check of speculative decoding on Model Runner V2 (benchmark S9's engine: vLLM
0.32.0, Llama-3.1-8B, n-gram with 5 draft tokens, 2,048 batched tokens, 256 sequences).

For one in-flight set at a time, the simulator's step (kvgate/sim/step_memory.py, the judge) is
played on an empty allocator and its tensor peak compared with what kvgate charges for the same
requests: their Demands from the Predictor, summed in a Ledger, charged by the Budget as on a V2
fixed pool (every profiled byte comes out of free memory, kvgate/telemetry/headroom.py). kvgate may
charge more (it does not know a request's top-k/top-p, so it keeps Triton's cached buffer for a
random batch) but never less.
"""

from __future__ import annotations

import copy
import json

import pytest
from sim_support import make_engine, sim_runs_after

from bench.scenarios import SCENARIOS
from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import Deployment, build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import profile_forward_bytes, profile_forward_tape, sampler_phase_tape
from kvgate.memory.allocator import TapeOp, fits_after_any
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

NGRAM_5 = {"method": "ngram", "num_speculative_tokens": 5}
K = 5
PROMPT = 400
V = 128256
TRITON_BUFFER_BOUND = 192 * V * 4  # kvgate's bound on Triton's cached [rows, V] fp32 buffer
# The caching allocator rounds a large tensor up to its 2 MiB segment when less than 1 MiB would
# be left (kvgate/sim/gpu.py `_split`): the simulator's peak counts that, kvgate's terms (and the
# budget's margin) do not.
ROUNDING = 2 * MiB


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        vllm_version="0.32.0",
        model_runner="auto",
        max_model_len=8192,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        speculative_config=NGRAM_5,
    )
    engine = make_engine(cfg)
    assert engine.resolved.flavor.v2  # vLLM 0.32.0 runs n-gram drafts on V2 by its own rule
    return engine


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    flags = ["--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--speculative-config", json.dumps(NGRAM_5)]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    deployment = resolve(engine_flags(settings), model_geometry("llama-3-8b"), None, None, reported_version="0.32.0")
    assert deployment.runtime.runner == "v2"
    assert deployment.runtime.sampler_backend == "flashinfer"
    return deployment


@pytest.fixture(scope="module")
def predictor(deployment: Deployment) -> Predictor:
    return build_predictor(deployment, model_geometry("llama-3-8b"))


def sim_peak(engine: Engine, reqs: list[ReqSlice]) -> int:
    alloc = CachingAllocator(Device(400 * GiB), "step")
    run_tape(alloc, engine.steps.plan(StepShape(tuple(reqs))))
    return alloc.peak_allocated


def kvgate_charge(predictor: Predictor, decoding: list[dict], prefill: dict | None = None) -> int:
    ledger = Ledger()
    for i, body in enumerate(decoding):
        spec = parse_request("completions", json.dumps({"prompt": "x", "max_tokens": 256, **body}).encode()).request
        ledger.end_prefill(ledger.reserve(predictor.predict(spec, [[11 + i] * PROMPT]).demand))
    if prefill is not None:
        spec = parse_request("completions", json.dumps({"prompt": "x", "max_tokens": 256, **prefill}).encode()).request
        ledger.reserve(predictor.predict(spec, [[5] * prefill["tokens"]]).demand)
    peak = predictor.profiled_peak_bytes
    forward = profile_forward_bytes(predictor.layout.geometry, predictor.engine)
    per_token = -(-forward // predictor.engine.max_num_batched_tokens)
    budget = Budget(
        profiled_cap_bytes=peak,
        profiled_peak_bytes=peak,
        profiled_forward_bytes=forward,
        forward_bytes_per_token=per_token,
    )
    return budget.transient_charge(ledger)


def decoding_slice(body: dict) -> ReqSlice:
    return ReqSlice(
        1 + K,
        PROMPT + 40,
        random=body.get("temperature", 1.0) > 0,
        top_p_k="top_p" in body,
        seeded="seed" in body,
        draft_tokens=K,
    )


S9_CHAT = {"temperature": 0.7, "seed": 1}  # bench/workloads.py chat_call: seeded, no top-p
TOP_P = {"temperature": 0.8, "top_p": 0.9}  # unseeded top-p: FlashInfer's case on Sampler.sample
GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize("n", [1, 8, 32, 64, 128, 256])
@pytest.mark.parametrize("body", [S9_CHAT, TOP_P, GREEDY], ids=["seeded", "top_p", "greedy"])
def test_a_decode_step_is_never_charged_less_than_it_takes(
    engine: Engine, predictor: Predictor, n: int, body: dict
) -> None:
    """Every decoding request verifies 1 + 5 rows through the RejectionSampler: bf16 logits and
    (random rows) their fp32 copy, Triton in place for top-p, and the step's hidden states (the
    simulator keeps the step's [T, H] through the sampler; kvgate charges V2's gathered
    `sample_hidden_states`, as many rows)."""
    taken = sim_peak(engine, [decoding_slice(body)] * n)
    charged = kvgate_charge(predictor, [body] * n)
    assert charged + ROUNDING >= taken, (
        f"{n} requests: kvgate {charged / MiB:.1f} MiB < simulator {taken / MiB:.1f} MiB"
    )
    # over-charge: only Triton's buffer (which these batches may never make) and rounding
    assert charged - taken <= TRITON_BUFFER_BOUND + ROUNDING


@pytest.mark.parametrize(("n", "prefill"), [(8, 2000), (32, 1500), (64, 1000), (200, 600)])
def test_a_mixed_step_is_never_charged_less_than_it_takes(
    engine: Engine, predictor: Predictor, n: int, prefill: int
) -> None:
    """Decodes with a prefill chunk filling the step's 2,048 tokens, half the decodes greedy."""
    bodies = [S9_CHAT if i % 2 else GREEDY for i in range(n)]
    chunk = min(prefill, 2048 - n * (1 + K))
    reqs = [decoding_slice(b) for b in bodies] + [ReqSlice(chunk, prefill - chunk, random=True, seeded=True)]
    taken = sim_peak(engine, reqs)
    charged = kvgate_charge(predictor, bodies, {"tokens": prefill, **S9_CHAT})
    assert charged + ROUNDING >= taken, f"kvgate {charged / MiB:.1f} MiB < simulator {taken / MiB:.1f} MiB"


@pytest.mark.parametrize(("n", "prefill"), [(64, 1000), (100, 1400), (200, 600)])
def test_a_mixed_step_holds_the_prefills_hidden_states_into_the_sampler_not_its_residual(
    engine: Engine, predictor: Predictor, n: int, prefill: int
) -> None:
    """Where the sampler phase is the step's larger one (many decodes verifying 1 + 5 rows beside
    a prefill), the prefill's final hidden states are alive when the logits are made, its residual
    is not (vllm 0.32.0 model_executor/models/llama.py `LlamaModel.forward` returns the hidden
    states alone; the simulator frees the residual before the sampler). kvgate then charges the
    step no more than it takes, beyond rounding, than the K draft rows it also counts for the
    prefilling request (bf16 logits and their fp32 copy; the simulator samples one row there).
    Until session 28 it charged the residual too: 7.8 MiB over for a 1,000-token prefill."""
    bodies = [S9_CHAT] * n
    reqs = [decoding_slice(b) for b in bodies] + [ReqSlice(prefill, 0, random=True, seeded=True)]
    taken = sim_peak(engine, reqs)
    charged = kvgate_charge(predictor, bodies, {"tokens": prefill, **S9_CHAT})
    assert taken <= charged + ROUNDING
    assert charged - taken <= K * V * (2 + 4) + ROUNDING, (
        f"kvgate {charged / MiB:.1f} MiB, simulator {taken / MiB:.1f} MiB"
    )


@pytest.fixture(scope="module")
def s9_capacity() -> int:
    """The transient memory benchmark S9's engine has after start-up (its KV pool sized by vLLM's
    "fully utilize" advice): the simulator's free GPU memory, which kvgate reads as its headroom."""
    cfg = next(s for s in SCENARIOS if s.key == "S9").sim
    return make_engine(cfg).device.free()


def chats_admitted(predictor: Predictor, budget: Budget, prefill: int) -> int:
    """How many decoding 600-token chats kvgate admits beside one open prefill of `prefill` tokens."""
    ledger = Ledger()

    def demand(tokens: int, i: int) -> Demand:
        body = {"prompt": "x", "max_tokens": 256, **S9_CHAT, "seed": i}
        return predictor.predict(
            parse_request("completions", json.dumps(body).encode()).request, [[11 + i] * tokens]
        ).demand

    if prefill:
        ledger.reserve(demand(prefill, 999))
    n = 0
    while budget.shortfall(d := demand(600, n), ledger) is None:
        ledger.end_prefill(ledger.reserve(d))
        n += 1
    return n


def sim_fits_after(engine: Engine, capacity: int, earlier: StepShape, step: StepShape) -> bool:
    """Whether `step` runs in `capacity` bytes after `earlier` ran in it (the simulator's allocator)."""
    return sim_runs_after(CachingAllocator(Device(capacity), "step"), engine, earlier, step, free_retained=False)


@pytest.fixture(scope="module")
def s9_budget(deployment: Deployment, predictor: Predictor, s9_capacity: int) -> Budget:
    """S9's live budget as kvgate's readings learned it in an S9 run (see the test below)."""
    limits = static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=67131543389)
    return Budget(
        transient_headroom_bytes=s9_capacity,
        profiled_peak_bytes=limits.profiled_peak_bytes,
        profiled_cap_bytes=limits.profiled_peak_bytes,
        segment_overhead=limits.segment_overhead,
        held_region_bytes=193138688,
        profiled_forward_bytes=limits.profiled_forward_bytes,
        forward_bytes_per_token=limits.forward_bytes_per_token,
        profiled_hidden_bytes=limits.profiled_hidden_bytes,
        sampler_phase_overhead=limits.sampler_phase_overhead,
        lone_forward=limits.lone_forward,
    )


@pytest.mark.parametrize("prefill", [0, 450, 500, 1000, 1500])
def test_what_kvgate_admits_on_s9s_live_budget_fits_the_simulator_after_an_earlier_step(
    engine: Engine, predictor: Predictor, s9_budget: Budget, s9_capacity: int, prefill: int
) -> None:
    """S9's live budget (the engine's free memory, the whole profile region out of it, 184.2 MiB of
    it held by the engine's allocator, as kvgate's readings learned in an S9 run): the decoding
    chats kvgate admits beside an open prefill run in the simulator after any one earlier step,
    of prefill chunks alone or of the same decoders beside a prefill of another size (every 256
    tokens of the step). Until session 28 the sampler phase's replay played only the first kind:
    kvgate admitted 44 chats beside a 500-token prefill, which OOM the simulator after a
    1,280-token step of the same batch (the earlier fp32 copy's segment split by the next forward
    pass)."""
    n = chats_admitted(predictor, s9_budget, prefill)
    assert n >= 20  # the state is a busy batch, not an empty one
    chunk = min(prefill, 2048 - n * (1 + K))
    decoders = [decoding_slice(S9_CHAT)] * n
    step = StepShape(tuple(decoders + ([ReqSlice(chunk, 0, random=True, seeded=True)] if chunk else [])))
    for tokens in range(256, 2049, 256):
        other = ReqSlice(max(1, tokens - n * (1 + K)), 0, random=True, seeded=True)
        for earlier in (StepShape((ReqSlice(tokens, 0, samples=False),)), StepShape(tuple([*decoders, other]))):
            assert sim_fits_after(engine, s9_capacity, earlier, step), (
                f"{n} chats, prefill {prefill}, after {tokens} tokens"
            )


@pytest.mark.parametrize("prefill", [300, 450, 500, 550, 1000])
def test_every_batch_smaller_than_what_kvgate_admits_on_s9s_live_budget_fits_the_simulator_too(
    engine: Engine, predictor: Predictor, s9_budget: Budget, s9_capacity: int, prefill: int
) -> None:
    """Whether a batch runs after an earlier step is not monotone in its size: beside a 500-token
    prefill the simulator runs 39, 40, 41, 45 and 46 decoding chats after a 1,280-token step of
    the same batch, but not 42-44 (the fp32 copy's segment split by the next forward pass). kvgate
    admits every count up to its own, so each must run, not only the largest. (Session 30: the
    sampler phase's replay without its earlier same-batch steps shorter than the batch's rows,
    which no engine can form, admitted 46 beside 500 tokens and so 42-44; reverted.)"""
    n = chats_admitted(predictor, s9_budget, prefill)
    for count in range(max(1, n - 12), n + 1):
        chunk = min(prefill, 2048 - count * (1 + K))
        decoders = [decoding_slice(S9_CHAT)] * count
        step = StepShape(tuple([*decoders, ReqSlice(chunk, 0, random=True, seeded=True)]))
        for tokens in range(256, 2049, 256):
            other = ReqSlice(max(1, tokens - count * (1 + K)), 0, random=True, seeded=True)
            for earlier in (StepShape((ReqSlice(tokens, 0, samples=False),)), StepShape((*decoders, other))):
                assert sim_fits_after(engine, s9_capacity, earlier, step), (
                    f"{count} of {n} chats, prefill {prefill}, after {tokens} tokens"
                )


def kvgate_step_tape(predictor: Predictor, tokens: int, rows: int) -> list[TapeOp]:
    """kvgate's replay of a step of `tokens` tokens sampling `rows` rows: the forward pass with its
    final hidden states kept, then the sampler phase (kvgate/memory/activation.py)."""
    g, e = predictor.layout.geometry, predictor.engine
    forward = profile_forward_tape(g, e, tokens)
    return [*forward[:-1], *sampler_phase_tape(g, e, rows), forward[-1]]


@pytest.fixture(scope="module")
def s9_engine() -> Engine:
    return make_engine(next(s for s in SCENARIOS if s.key == "S9").sim)


@pytest.mark.parametrize("prefill", [500, 1500])
def test_kvgates_replay_of_a_step_after_one_earlier_step_agrees_with_the_simulator_on_s9(
    predictor: Predictor, s9_engine: Engine, prefill: int
) -> None:
    """Whether n decoding chats beside a prefill run after any one earlier step (every 128 tokens:
    a forward pass alone, or the same chats beside another chunk), by kvgate's own replay in S9's
    free memory from an empty cache and by the simulator on S9's allocator as start-up left it:
    the same verdict at every count, the holes included (beside 500 tokens 42-44 chats do not
    run after a 1,280-token step of the same batch, 45-46 do). Session 31: any level of rows
    kvgate admits up to by its own replay rests on this."""
    capacity = s9_engine.device.free()
    g, e = predictor.layout.geometry, predictor.engine
    verdicts = set()
    for n in range(30, 50):
        chunk = min(prefill, 2048 - n * (1 + K))
        decoders = [decoding_slice(S9_CHAT)] * n
        step = StepShape((*decoders, ReqSlice(chunk, 0, random=True, seeded=True)))
        rows = n * (1 + K) + 1
        sim, earlier_tapes = True, []
        for tokens in range(128, 2049, 128):
            other = max(1, tokens - n * (1 + K))
            earlier = (StepShape((ReqSlice(tokens, 0, samples=False),)), StepShape((*decoders, ReqSlice(other, 0))))
            sim = sim and all(
                sim_runs_after(copy.deepcopy(s9_engine.alloc), s9_engine, h, step, free_retained=True) for h in earlier
            )
            earlier_tapes += [
                [profile_forward_tape(g, e, tokens)],
                [kvgate_step_tape(predictor, other + rows - 1, rows)],
            ]
        kvgate = fits_after_any(kvgate_step_tape(predictor, chunk + n * (1 + K), rows), earlier_tapes, capacity)
        assert kvgate == sim, f"{n} chats beside {prefill} tokens: kvgate {kvgate}, simulator {sim}"
        verdicts.add(sim)
    assert verdicts == {True, False}  # the counts span where the batch stops fitting


@pytest.mark.parametrize("prefill", [0, 500, 1000, 1500])
def test_what_kvgate_admits_on_s9s_live_budget_fits_the_simulator_after_a_step_before_chats_joined(
    engine: Engine, predictor: Predictor, s9_budget: Budget, s9_capacity: int, prefill: int
) -> None:
    """Requests join a batch from one step to the next: every count of decoding chats kvgate
    admits beside an open prefill runs in the simulator after an earlier step of one to four
    chats fewer beside a prefill of another size (every 256 tokens of the step), whose fp32 copy
    of fewer rows leaves a segment this step's logits fit and its copy does not
    (kvgate/memory/activation.py `sampler_phase_overhead_bytes`, session 36)."""
    n = chats_admitted(predictor, s9_budget, prefill)
    for count in range(max(1, n - 12), n + 1):
        chunk = min(prefill, 2048 - count * (1 + K))
        step = StepShape(
            tuple([decoding_slice(S9_CHAT)] * count + ([ReqSlice(chunk, 0, random=True, seeded=True)] if chunk else []))
        )
        for fewer in range(1, 5):
            decoders = [decoding_slice(S9_CHAT)] * (count - fewer)
            for tokens in range(256, 2049, 256):
                other = ReqSlice(max(1, tokens - (count - fewer) * (1 + K)), 0, random=True, seeded=True)
                earlier = StepShape((*decoders, other))
                assert sim_fits_after(engine, s9_capacity, earlier, step), (
                    f"{count} of {n} chats, prefill {prefill}, after {count - fewer} chats beside {tokens} tokens"
                )
