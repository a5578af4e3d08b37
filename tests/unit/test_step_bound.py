"""The ledger's step bound: open prefills' profiled forward terms are summed, each sized for a
whole chunk, but one vLLM step computes at most max_num_batched_tokens tokens (vLLM 0.32.0
v1/core/sched/scheduler.py `schedule`'s token budget), so the ledger charges the sum at most
the forward pass of one full step plus the prefills' MLA context parts, which do add up in one
step (kvgate/memory/activation.py StepForwardBound). Checked against the simulator's own step
tapes (kvgate/sim/step_memory.py, an independent reading of vLLM): whatever way the open
prefills share a step of max_num_batched_tokens tokens, the ledger's forward charge is never
below what that step allocates."""

from __future__ import annotations

import json
import random

import pytest

from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import EngineShape, SamplingShape, mla_prompt_upproject_bytes, profile_forward_bytes
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.predict import Predictor, TransientSplit
from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape, run_tape
from kvgate.units import MiB
from support.geometry import layout

T = 2048  # max_num_batched_tokens of benchmark S1 and S13

# (sim preset, kvgate geometry, attention backend, runner, the longest prompt drawn): S1's
# DeepSeek-V2-Lite with MLA on both runners, and a dense Llama 3.1 8B (S13's model).
DEPLOYMENTS = [
    ("deepseek-v2-lite", "deepseek-v2-lite", "mla", "v2", 62 * 1024),
    ("deepseek-v2-lite", "deepseek-v2-lite", "mla", "v1", 62 * 1024),
    ("llama-3.1-8b", "llama-3.1-8b-instruct", "flash-attn", "v2", 30 * 1024),
]


def _simulator(model: str, backend: str, runner: str) -> StepMemory:
    cfg = SimConfig(
        model=model,
        gpu="h100-80gb",
        max_model_len=131072 if backend == "mla" else 32768,
        max_num_batched_tokens=T,
        attention_backend=backend,  # type: ignore[arg-type]
        model_runner=runner,  # type: ignore[arg-type]
    )
    dev = Device(gpu_total_bytes(cfg.gpu))
    resolved, _ = startup.start(cfg, load_model(cfg.model), dev, CachingAllocator(dev, "vllm"))
    return startup.step_memories(resolved)[0]


def _predictor(geometry: str, backend: str, runner: str) -> Predictor:
    max_model_len = 131072 if backend == "mla" else 32768
    engine = EngineShape(max_model_len, T, 256, attention_backend=backend, block_size=64, runner=runner)
    return Predictor(layout(geometry), engine, True, 1 << 40)


def _demand(predictor: Predictor, prompt: int) -> Demand:
    """The demand the predictor makes of a `prompt`-token chat (its memory terms only)."""
    _, split = predictor.transient(prompt, SamplingShape())
    assert isinstance(split, TransientSplit)
    g, e = predictor.layout.geometry, predictor.engine
    return Demand(
        prompt_tokens=prompt,
        max_new_tokens=1,
        shared_block_hashes=(),
        private_blocks=0,
        transient_prefill_bytes=split.prefill,
        profiled_prefill_bytes=split.profiled_prefill,
        profiled_residual_bytes=split.profiled_residual,
        upproject_bytes=mla_prompt_upproject_bytes(g, e, prompt) if predictor.step_bound else 0,
        step_bound=predictor.step_bound,
    )


# The simulator allocates a step's input ids and positions (12 B a token) on its tape; vLLM keeps
# them in buffers made once at start-up (0.32.0 v1/worker/gpu_model_runner.py `_make_buffer`,
# v1/worker/gpu/input_batch.py InputBuffers), which no transient term counts.
PERSISTENT = {"input_ids", "positions"}


def _sim_peak(steps: StepMemory, reqs: list[ReqSlice]) -> int:
    alloc = CachingAllocator(Device(1 << 44), "vllm")
    tape = [op for op in steps.plan(StepShape(tuple(reqs))) if op[1] not in PERSISTENT]
    run_tape(alloc, tape)
    return alloc.peak_allocated


def _forward_charge(ledger: Ledger, predictor: Predictor) -> int:
    """The ledger's forward phase as the budget charges it (kvgate/memory/ceiling.py
    step_charge): its unprofiled prefill terms and its profiled forward terms, at most the
    profile's forward pass."""
    step = ledger.step()
    cap = profile_forward_bytes(predictor.layout.geometry, predictor.engine)
    return min(step.forward_profiled, cap) + step.unprofiled


def _shares(rng: random.Random, prompts: list[int]) -> list[ReqSlice]:
    """One step of at most T tokens that these open prefills share: each gets some of its prompt
    (at least 2 tokens, the simulator's prefill) after as much computed context as the rest of its
    prompt leaves (its last piece: the most context for that many tokens); what is left of the
    budget goes to decoding rows."""
    budget, reqs = T, []
    for prompt in rng.sample(prompts, len(prompts)):
        if budget < 2:
            break
        new = rng.randint(2, min(prompt, budget))
        reqs.append(ReqSlice(new, prompt - new, samples=False))
        budget -= new
    reqs += [ReqSlice(1, rng.randint(1, 4096), samples=False) for _ in range(budget)]
    return reqs


@pytest.mark.parametrize(("model", "geometry", "backend", "runner", "longest"), DEPLOYMENTS)
def test_the_ledger_never_charges_a_shared_step_less_than_the_simulator_plays(
    model: str, geometry: str, backend: str, runner: str, longest: int
) -> None:
    """Random sets of open prefills (a few long documents and chats), each set played as several
    random ways of sharing one step of T tokens: the simulator's allocated peak of that step is
    never above the ledger's forward charge for the set."""
    steps, predictor = _simulator(model, backend, runner), _predictor(geometry, backend, runner)
    rng = random.Random(24)
    for _ in range(25):
        prompts = [rng.randint(2, longest) for _ in range(rng.randint(1, 2))]
        prompts += [rng.randint(2, 1500) for _ in range(rng.randint(0, 4))]
        ledger = Ledger()
        for prompt in prompts:
            ledger.reserve(_demand(predictor, prompt))
        charge = _forward_charge(ledger, predictor)
        for _ in range(6):
            reqs = _shares(rng, prompts)
            sim = _sim_peak(steps, reqs)
            assert sim <= charge, (prompts, [(r.num_new_tokens, r.num_context) for r in reqs], sim / MiB, charge / MiB)


def test_a_document_and_a_chat_are_charged_one_step_not_two_chunks() -> None:
    """S1's example (DeepSeek-V2-Lite, MLA, V2): a 32,000-token document and a 700-token chat.
    Summed, their profiled forward terms are 553 MiB (the document's 502.4 sized for a whole
    2,048-token chunk, the chat's 50.6 for its 700 tokens beside it), which the old ledger
    charged; a step vLLM runs with both holds 2,048 tokens, the chat's in place of some of the
    document's, so hidden states, MoE and the layer's own tensors are one step's: the ledger now
    charges 520.1 MiB (the two prompts' up-projections still add up: the document's last small
    piece can run after all but two of its tokens beside the whole chat), and still no less than
    the simulator's tape of any way the two share a step."""
    predictor = _predictor("deepseek-v2-lite", "mla", "v2")
    document, chat = _demand(predictor, 32000), _demand(predictor, 700)
    summed = document.profiled_prefill_bytes + chat.profiled_prefill_bytes
    assert 552 * MiB < summed < 554 * MiB  # what the ledger charged before the bound

    ledger = Ledger()
    ledger.reserve(document)
    alone = _forward_charge(ledger, predictor)
    ledger.reserve(chat)
    both = _forward_charge(ledger, predictor)
    assert alone < both < summed - 30 * MiB
    assert 520 * MiB < both < 521 * MiB

    steps = _simulator("deepseek-v2-lite", "mla", "v2")
    played = [_sim_peak(steps, [ReqSlice(T, 32000 - T, samples=False)])]
    for chat_new in (2, 100, 348, 699, 700):
        for doc_new in (2, 500, 1000, T - chat_new):
            decodes = [ReqSlice(1, 100, samples=False)] * (T - chat_new - doc_new)
            doc = ReqSlice(doc_new, 32000 - doc_new, samples=False)
            played.append(_sim_peak(steps, [doc, ReqSlice(chat_new, 700 - chat_new, samples=False), *decodes]))
    assert 498 * MiB < max(played) <= both


def test_contexts_of_open_prefills_add_up_beyond_the_profile() -> None:
    """Two documents with computed context in one step up-project both contexts in the same
    workspace pass (vLLM 0.32.0 mla_attention.py build_mla_chunked_context_metadata): the bound
    adds their context parts, and what exceeds the profile's forward pass is charged as
    unprofiled (out of free memory) rather than capped away."""
    predictor = _predictor("deepseek-v2-lite", "mla", "v2")
    bound = predictor.step_bound
    assert bound is not None
    ledger = Ledger()
    for prompt in (32 * 1024, 16 * 1024):
        ledger.reserve(_demand(predictor, prompt))
    step = ledger.step()
    assert step.forward_profiled == bound.profile_forward_bytes  # the old charge, all of it
    assert step.unprofiled > 0
    steps = _simulator("deepseek-v2-lite", "mla", "v2")
    sim = _sim_peak(steps, [ReqSlice(1024, 32 * 1024 - 1024, samples=False), ReqSlice(1024, 15 * 1024, samples=False)])
    assert sim > bound.profile_forward_bytes  # the old cap charged less than this step holds
    assert sim <= step.forward_profiled + step.unprofiled


def test_dense_models_keep_the_profile_cap() -> None:
    """Without MLA every profiled forward term grows with the step's tokens and the budget caps
    their sum at the profile's forward pass (kvgate/memory/ceiling.py step_charge): no bound is
    added and the ledger sums as before."""
    predictor = _predictor("llama-3.1-8b-instruct", "flash-attn", "v2")
    assert predictor.step_bound is None
    ledger = Ledger()
    demands = [_demand(predictor, p) for p in (9000, 700, 300)]
    for d in demands:
        ledger.reserve(d)
    assert ledger.step().forward_profiled == sum(d.profiled_prefill_bytes for d in demands)


def test_the_predictor_hands_the_ledger_each_prompts_up_projection_and_the_bound() -> None:
    """What the tests above build by hand is what Predictor.predict puts in a request's demand:
    its profiled forward terms, its prompt's up-projection (n samples are n engine requests whose
    prefills may share a step: n times it) and the deployment's step bound."""
    predictor = _predictor("deepseek-v2-lite", "mla", "v2")
    tokens = [list(range(5000))]
    for n in (1, 3):
        raw = json.dumps({"model": "m", "max_tokens": 5, "n": n, "prompt": tokens[0]}).encode()
        demand = predictor.predict(parse_request("completions", raw).request, tokens).demand
        by_hand = _demand(predictor, 5000)
        assert demand.step_bound == by_hand.step_bound == predictor.step_bound
        assert demand.upproject_bytes == n * by_hand.upproject_bytes == n * 5000 * 16 * (256 + 192) * 2
        assert demand.profiled_prefill_bytes == by_hand.profiled_prefill_bytes  # once a prompt, as before
