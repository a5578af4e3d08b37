"""A V1 step from the cache V1's post-capture warm-up leaves (kvgate/memory/activation.py
`V1WarmupForward`, kvgate/gate/budget.py `Budget._strands_warmup_cache`).

Random engine R112 (bench/results/goodput-session44): Mistral-7B on an A100 80 GB, vLLM 0.28.0 on
Model Runner V1, 8,192 tokens a step, 1,024 sequences, a fixed pool leaving about 343 MiB free, no
expandable segments. kvgate counted the first 16,000-token prompt's profiled tensors inside the
region the warm-up holds; the engine holds it in the warm-up's shapes, and the first 8,192-token
chunk ran the simulator out of memory.
"""

from __future__ import annotations

import pytest
from sim_support import make_engine

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import Deployment, build_predictor, resolve, static_limits
from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import V1WarmupForward, profile_forward_bytes
from kvgate.memory.demand import Demand
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import GiB
from support.geometry import model_geometry

MISTRAL = model_geometry("mistral-7b-v0.1")
POOL = 68_091_427_062  # R112's drawn --kv-cache-memory-bytes


def r112_engine() -> Engine:
    """R112's simulated engine, booted: warmed up, its cache the warm-up's."""
    return make_engine(
        SimConfig(
            model="mistral-7b",
            gpu="a100-80gb",
            vllm_version="0.28.0",
            model_runner="v1",
            metrics_clock="sim",
            max_model_len=16384,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            kv_cache_memory_bytes=POOL,
        )
    )


def first_step_runs(tokens: int) -> bool:
    """Whether the simulator runs a first step of `tokens` prompt tokens on R112's fresh engine."""
    engine = r112_engine()
    try:
        for block in run_tape(engine.alloc, engine.steps.plan(StepShape((ReqSlice(tokens, 0),))), engine.carry.held):
            engine.alloc.free(block)
    except CudaOutOfMemory:
        return False
    return True


def r112_deployment() -> Deployment:
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--model-runner", "v1"]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags]))
    deployment = resolve(engine_flags(settings), MISTRAL, None, None, reported_version="0.28.0")
    assert deployment.runtime.runner == "v1"
    return deployment


def r112_predictor() -> Predictor:
    return build_predictor(r112_deployment(), MISTRAL)


def test_the_simulator_runs_r112s_full_first_step_out_of_memory_and_a_half_one_not() -> None:
    """The judge: the 8,192-token chunk's residual and hidden states split the warm-up's blocks,
    its gate_up's failed cudaMalloc releases the rest, and its SiluAndMul output finds no room; a
    4,096-token step's tensors fit."""
    assert not first_step_runs(8192)
    assert first_step_runs(4096)


def test_kvgates_replay_from_the_warm_up_cache_agrees_with_the_simulator() -> None:
    engine = r112_engine()
    free = engine.device.free()
    predictor = r112_predictor()
    replay = V1WarmupForward(MISTRAL, predictor.engine, expandable_segments=False)
    assert not replay(8192, free)
    assert replay(4096, free)
    # with room for the step beside the warm-up's blocks it runs
    assert replay(8192, free + GiB)
    # expandable segments strand nothing: kvgate sets no such replay then (engine_config.py)
    limits = static_limits(
        r112_deployment(), predictor, None, 80 * GiB, kv_cache_memory_bytes=POOL, expandable_segments=True
    )
    assert limits.warmup_forward is None


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_v1_step_that_the_warm_up_cache_strands_waits_alone_and_beside_others(in_flight: bool) -> None:
    """R112's 16,000-token prompt: its first chunk is a full 8,192-token step. Before, the budget
    let it in (its profiled tensors counted inside the held region); now it waits whether or not
    other requests are in flight. A 4,096-token prompt goes in."""
    engine = r112_engine()
    predictor = r112_predictor()
    forward = profile_forward_bytes(MISTRAL, predictor.engine)
    budget = Budget(
        kv_blocks=100_000,
        transient_headroom_bytes=engine.device.free(),
        forward_bytes_per_token=-(-forward // 8192),
        profiled_forward_bytes=forward,
        warmup_forward=V1WarmupForward(MISTRAL, predictor.engine, expandable_segments=False),
    )
    per_token = budget.forward_bytes_per_token
    ledger = Ledger()
    if in_flight:
        chat = Demand(
            prompt_tokens=100, max_new_tokens=64, shared_block_hashes=(), private_blocks=8, transient_prefill_bytes=0
        )
        ledger.reserve(chat)

    def prompt(tokens: int) -> Demand:
        return Demand(
            prompt_tokens=tokens,
            max_new_tokens=16,
            shared_block_hashes=(),
            private_blocks=tokens // 16 + 1,
            transient_prefill_bytes=0,
            profiled_prefill_bytes=min(tokens, 8192) * per_token,
        )

    assert budget.shortfall(prompt(16000), ledger) == TRANSIENT_BUSY
    assert budget.shortfall(prompt(4000), ledger) is None
    assert (
        Budget(kv_blocks=100_000, transient_headroom_bytes=engine.device.free()).shortfall(prompt(16000), ledger)
        is None
    )
