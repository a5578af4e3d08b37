"""V1's penalty prompt ids land in the profile region the engine keeps cached (issue 24, S4).

On V1 the engine keeps the blocks of its start-up sampler warm-up cached (vllm 0.32.0
v1/worker/gpu_worker.py `compile_or_warm_up_model`), so kvgate's live transient limit is the ~10 MiB
the pool leaves free, and a penalty row's `[rows, longest prompt]` int64 ids, two copies, charged
there, held S4 to 150-310 running requests. kvgate now replays the penalty step inside that region
(kvgate/memory/activation.py `v1_penalty_step_excess_bytes`) and charges free memory only what
does not fit there. The simulator (kvgate/sim, its own reading of vLLM and PyTorch's allocator)
judges: every mix kvgate lets through, the simulated engine runs, after an earlier step of
another batch and as the batch then shrinks.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import Deployment, build_predictor, resolve, static_limits
from kvgate.gate.budget import Budget
from kvgate.memory.activation import EngineShape, V1PenaltyStep, penalty_prompt_class
from kvgate.memory.ceiling import StepHoldings
from kvgate.memory.sampler import INT64, PROMPT_ID_COPIES
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim import startup
from kvgate.sim.carryover import CrossStepTensors
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import GiB
from support.geometry import model_geometry

LLAMA = model_geometry("llama-3.1-8b-instruct")  # the geometry the simulator's llama-3.1-8b plays
MARGIN = 0.9  # the budget's default transient margin


def s4_deployment(max_model_len: int, runner: str = "v1") -> tuple[Deployment, Predictor]:
    """kvgate's reading of benchmark S4's flags (bench/scenarios.py: V1, 8,192 tokens, 1,024 seqs)."""
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--model-runner", runner]
    flags += ["--max-model-len", str(max_model_len)]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    deployment = resolve(engine_flags(settings), LLAMA, None, None, reported_version="0.31.0")
    return deployment, build_predictor(deployment, LLAMA)


def engine_shape(max_model_len: int) -> EngineShape:
    return s4_deployment(max_model_len)[1].engine


def simulated_engine(max_model_len: int) -> SimpleNamespace:
    """S4's simulated engine just started (vLLM 0.31.0 V1 on an H100, the pool filling the GPU)."""
    from demo.replay import fully_utilized
    from kvgate.sim.config import SimConfig
    from kvgate.sim.model import load_model
    from kvgate.sim.presets import gpu_total_bytes

    cfg = fully_utilized(
        SimConfig(
            model="llama-3.1-8b",
            gpu="h100-80gb",
            vllm_version="0.31.0",
            model_runner="v1",
            max_model_len=max_model_len,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
        )
    )
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm")
    resolved, _ = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    steps, _ = startup.step_memories(resolved)
    return SimpleNamespace(device=device, alloc=alloc, steps=steps, limit=int(device.free() * MARGIN))


@pytest.fixture(scope="module")
def s4() -> SimpleNamespace:
    return simulated_engine(16384)


@pytest.fixture(scope="module")
def long_context() -> SimpleNamespace:
    return simulated_engine(131072)


Batch = list[tuple[int, bool, bool]]  # (prompt tokens, has a penalty, has a seed) per request


def simulator_runs(engine: SimpleNamespace, batches: list[Batch], prefill: int = 2048) -> bool:
    """Whether the simulated engine runs these decoding batches one step each (the first with a
    `prefill`-token chunk beside it), the penalty prompt ids carried across steps by the
    simulator's own kvgate/sim/carryover.py."""
    alloc = copy.deepcopy(engine.alloc)
    carry = CrossStepTensors(alloc, v1=True)
    try:
        for i, batch in enumerate(batches):
            requests = [
                SimpleNamespace(request_id=f"r{j}", sampling=SimpleNamespace(penalties=pen), num_prompt_tokens=p)
                for j, (p, pen, _) in enumerate(batch)
            ]
            carry.start_step(requests)
            rows = tuple(
                ReqSlice(1, p, penalties=pen, top_p_k=True, random=True, seeded=seeded) for p, pen, seeded in batch
            )
            chunk = (ReqSlice(prefill, 0, samples=False),) if i == 0 and prefill else ()
            carry.keep_outputs(run_tape(alloc, engine.steps.plan(StepShape(rows + chunk))))
    except CudaOutOfMemory:
        return False
    return True


def mix(rng: random.Random, rows: int, long_prompts: tuple[int, int] | None) -> Batch:
    """S4's chats (prompts 16-6,000 tokens, median 250, a third with a presence penalty, half
    seeded: a seed sends the batch from FlashInfer to the native path, Triton's buffer and the
    softmax and noise), or with one in twenty prompts drawn from `long_prompts`; the first row
    has a penalty."""
    batch = []
    for _ in range(rows):
        prompt = min(6000, max(16, int(rng.lognormvariate(5.52, 1.0))))
        if long_prompts and rng.random() < 0.05:
            prompt = rng.randint(*long_prompts)
        batch.append((prompt, rng.random() < 1 / 3, rng.random() < 0.5))
    batch[0] = (batch[0][0], True, batch[0][2])
    return batch


def verdicts(engine: SimpleNamespace, shape: EngineShape, seed: int, rows: range, long_prompts=None) -> list:
    """For random mixes: (kvgate lets the penalty step through, main did, the simulator runs it)."""
    rng = random.Random(seed)
    penalty = V1PenaltyStep(LLAMA, shape, False, background=False)
    out = []
    for n in rows:
        earlier = mix(rng, rng.randint(max(1, n // 4), n), long_prompts)
        batch = earlier[: n // 2] + mix(rng, n - n // 2, long_prompts)
        longest = max(p for p, _, _ in batch)
        excess = penalty(n, longest)
        assert excess is not None
        main = PROMPT_ID_COPIES * n * longest * INT64 <= engine.limit  # main's charge, free memory only
        runs = simulator_runs(engine, [earlier, batch, batch[1:], batch[2:]])
        out.append((excess <= engine.limit, main, runs, n, longest))
    return out


def test_every_s4_mix_kvgate_lets_through_runs_and_more_than_main_did(s4) -> None:
    """S4's mixes from 150 to 640 rows: no mix kvgate lets through OOMs the simulator (which runs
    them up to 500 rows, with V1's penalty step as vLLM plays it on CUDA, session 31; 605 when it
    freed the prompt's bin counts early); kvgate lets through those up to 430 rows, where main's
    charge (the prompt ids, twice, against ~9.6 MB) let through only the 185-row one."""
    found = verdicts(s4, engine_shape(16384), 24, range(150, 641, 35))
    assert [v for v in found if v[0] and not v[2]] == []
    gained = [v for v in found if v[0] and not v[1]]
    assert len(gained) >= 5
    assert all(v[2] for v in gained)
    assert max(v[3] for v in gained) >= 400
    assert not any(v[0] for v in found if v[3] >= 500)  # short of the simulator's 500 (535 runs out)


def test_long_prompts_are_not_let_through_where_the_simulator_runs_out(long_context) -> None:
    """With one prompt in twenty of 16,000-131,072 tokens the ids reach 1 MiB a row: the replay
    still admits no mix the simulator cannot run."""
    found = verdicts(long_context, engine_shape(131072), 7, range(40, 601, 40), (16000, 131072))
    assert [v for v in found if v[0] and not v[2]] == []
    assert any(v[0] and not v[1] for v in found)


def test_prompt_classes_are_few_and_never_below_the_prompt() -> None:
    classes = {penalty_prompt_class(p) for p in range(1, 131073)}
    assert len(classes) <= 4 * 9 + 1
    for prompt in (1, 256, 257, 2000, 6000, 16000, 100_000, 131072):
        assert prompt <= penalty_prompt_class(prompt) <= max(256, prompt * 1.19)


class _Held:
    peak_segment_rows = 0

    def __init__(self, step: StepHoldings) -> None:
        self._step = step

    def step(self) -> StepHoldings:
        return self._step


def test_the_budget_charges_free_memory_only_the_replays_excess_once_it_is_known() -> None:
    """S4's live budget (10,653,533 B of headroom, the engine holding the profile region): 400
    decoding rows, one with a penalty, prompts up to 3,000 tokens. Charged their prompt ids in
    full (19.2 MB) they wait; once the replay on the worker thread says the step fits in the
    region, their charge is what else they hold. Until then, the full charge."""
    shape = engine_shape(16384)
    ids = PROMPT_ID_COPIES * 400 * 3000 * INT64
    step = StepHoldings(0, 0, 0, ids + 4096, 0, sampled_rows=400, penalty_bytes=ids, penalty_prompt=3000)
    budget = Budget(transient_headroom_bytes=10_653_533, profiled_cap_bytes=0)
    assert budget.transient_charge(_Held(step)) == ids + 4096
    service = V1PenaltyStep(LLAMA, shape, False)
    budget.update(penalty_step=service)
    assert budget.transient_charge(_Held(step)) == ids + 4096  # not known yet: the full charge
    assert service._worker is not None
    service._worker.shutdown(wait=True)
    assert budget.transient_charge(_Held(step)) == 4096
    assert budget.transient_charge(_Held(step)) <= budget.transient_limit()
    budget.update(profiled_cap_bytes=1 << 30)  # a region the engine emptied: the old charge
    assert budget.transient_charge(_Held(step)) >= ids


@pytest.mark.parametrize(
    ("runner", "expandable", "replayed"), [("v1", False, True), ("v2", False, False), ("v1", True, False)]
)
def test_only_v1_with_fixed_segments_replays_its_penalty_step(runner: str, expandable: bool, replayed: bool) -> None:
    """V2 keeps no prompt ids (its penalty state is preallocated: kvgate/memory/sampler.py); with
    expandable segments the region replay, which places tensors in fixed segments, is not used."""
    deployment, predictor = s4_deployment(16384, runner)
    limits = static_limits(deployment, predictor, None, 80 * GiB, expandable_segments=expandable)
    assert (limits.penalty_step is not None) == replayed
