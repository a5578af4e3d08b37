"""Beside other requests, a served MLA step is charged what the caching allocator's replay of
served steps says it needs, not the profile step's blanket share (issue 24, benchmark S1).

kvgate/memory/activation.py `shared_forward_level` replays served steps (their MLA
up-projections, no profile dummy) in the live headroom after any one earlier served step; where a
step's forward pass is at or below that level the budget charges its allocated bytes
(kvgate/gate/budget.py `Budget.shared_step_fits`), else the profile's share as before. The
simulator (kvgate/sim/gpu.py and kvgate/sim/step_memory.py, written apart from kvgate's replay)
judges: on S1's simulated engine (DeepSeek-V2-Lite, MLA, vLLM 0.32.0 Model Runner V2, 2,048-token
steps, the pool vLLM's start-up advice sizes), random sequences of mixed steps never run out of
memory where kvgate charges a step its allocated bytes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from dataclasses import asdict

import pytest

from bench.scenarios import SCENARIOS
from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve, static_limits
from kvgate.errors import TransientNeverFits
from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import Ledger
from kvgate.gate.observer import Observers
from kvgate.memory.activation import SharedForward, level_capacity, profile_forward_tape, profile_peak_bytes
from kvgate.memory.allocator import fits_after_any
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim import startup
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape, run_tape
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

S1 = next(s for s in SCENARIOS if s.key == "S1")
T = S1.sim.max_num_batched_tokens
DEEPSEEK = model_geometry("deepseek-v2-lite")

GPU = tuple[Device, CachingAllocator, StepMemory]


@pytest.fixture(scope="module")
def s1_gpu() -> GPU:
    """S1's simulated engine just started: its device, allocator and step tapes."""
    cfg = S1.sim
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm")
    resolved, _ = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    return device, alloc, startup.step_memories(resolved)[0]


def s1_budget(headroom: int) -> tuple[Budget, Predictor]:
    """kvgate's budget for S1 as its live readings set it: `headroom` of transient memory, the
    whole profile region out of free memory (V2, fixed pool)."""
    flags = ["--max-num-batched-tokens", str(T), "--max-num-seqs", "256", "--max-model-len", "131072"]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    deployment = resolve(engine_flags(settings), DEEPSEEK, None, None, reported_version="0.32.0")
    predictor = build_predictor(deployment, DEEPSEEK)
    budget = Budget(**asdict(static_limits(deployment, predictor, None, 80 * GiB, kv_cache_memory_bytes=40 * GiB)))
    budget.update(
        transient_headroom_bytes=headroom,
        max_transient_headroom_bytes=headroom,
        profiled_cap_bytes=profile_peak_bytes(DEEPSEEK, predictor.engine),
        # the level worked out at once, not on kvgate's worker thread
        shared_forward=SharedForward(DEEPSEEK, predictor.engine, False, background=False),
    )
    return budget, predictor


def document(predictor: Predictor, prompt_tokens: int) -> Demand:
    """A summarisation request of `prompt_tokens` tokens, as S1 sends them."""
    body = {"prompt": "x", "max_tokens": 256, "temperature": 0.7}
    spec = parse_request("completions", json.dumps(body).encode()).request
    return predictor.predict(spec, [[7] * prompt_tokens]).demand


def decoding(predictor: Predictor, ledger: Ledger, *prompts: int) -> None:
    """Chats admitted whose first token is out: they decode in every step."""
    for prompt in prompts:
        ledger.end_prefill(ledger.reserve(document(predictor, prompt)))


def test_a_document_beside_decoding_chats_is_charged_its_allocated_bytes(s1_gpu: GPU) -> None:
    """S1's 16,000-token document beside four decoding chats: the profile's share (0.9 of its
    forward pass) put it over the limit, so it waited for an idle engine; the served steps'
    replay says a forward pass of its bytes runs in the 586 MiB headroom after any one earlier
    step, and it is admitted at its allocated bytes. A 32,000-token document still is not: its
    last chunk (493 MiB allocated) runs out of memory in the simulator after a 1,024-token step
    over 16,384 tokens of context, whose segments the new step's smaller tensors split."""
    device = s1_gpu[0]
    headroom = device.free()
    assert headroom // MiB == 586
    budget, predictor = s1_budget(headroom)
    ledger = Ledger()
    decoding(predictor, ledger, 600, 300, 1200, 800)
    doc = document(predictor, 16000)
    step = ledger.step_with(doc)
    assert budget.shared_step_fits(step)
    assert budget.shortfall(doc, ledger) is None
    shared = budget._step_charge(step, True, True)
    blanket = budget._step_charge(step, True, False)
    assert shared < budget.transient_limit() < blanket
    ledger.reserve(doc)
    assert budget.transient_charge(ledger) == shared  # what /kvgate/explain and the gauge report
    budget.update(shared_forward=None)  # kvgate before: the profile's share beside others
    assert budget.transient_charge(ledger) == blanket

    budget, _ = s1_budget(headroom)
    assert budget.shortfall(document(predictor, 32000), ledger) == TRANSIENT_BUSY
    assert not runs(s1_gpu, [StepShape((prefill(1024, 16384),))], StepShape((prefill(T, 32000 - T),)))
    assert runs(s1_gpu, [], StepShape((prefill(T, 32000 - T),)))


def prefill(new: int, context: int) -> ReqSlice:
    return ReqSlice(new, context, samples=False)


def runs(s1_gpu: GPU, history: list[StepShape], final: StepShape) -> bool | None:
    """Whether the simulator runs `final` after `history` (a fresh copy of the engine each call);
    None where the history itself runs out of memory."""
    _, alloc, steps = copy.deepcopy(s1_gpu)
    try:
        for shape in history:
            run_tape(alloc, steps.plan(shape))
    except CudaOutOfMemory:
        return None
    try:
        run_tape(alloc, steps.plan(final))
    except CudaOutOfMemory:
        return False
    return True


def chunks(prompt: int, after: int = 0) -> list[tuple[int, int]]:
    """A prompt's prefill steps alone on the engine, (new tokens, computed context), from a
    computed context of `after`: vllm 0.32.0 v1/core/sched/scheduler.py `Scheduler.schedule`
    gives a running request at most the step's `token_budget` (max_num_batched_tokens) of new
    tokens, so every step of a long prompt is a whole budget but its last."""
    steps, done = [], after
    while done < prompt:
        new = min(T, prompt - done)
        steps.append((new, done))
        done += new
    return steps


def simulator_runs_out(s1_gpu: GPU, steps: list[tuple[int, int]]) -> int | None:
    """The first of `steps` (one prefill each) that runs out of memory on the simulator's
    allocator in S1's headroom, played in order on a fresh copy of the engine; None: all run."""
    _, alloc, memory = copy.deepcopy(s1_gpu)
    for i, (new, context) in enumerate(steps):
        try:
            run_tape(alloc, memory.plan(StepShape((prefill(new, context),))))
        except CudaOutOfMemory:
            return i
    return None


def kvgate_runs_out(steps: list[tuple[int, int]], capacity: int) -> int | None:
    """The same question to kvgate's replay of served MLA steps (kvgate/memory/allocator.py
    `fits_after_any` after the steps before, `profile_forward_tape` with `mla_context`)."""
    engine = s1_budget(capacity)[1].engine
    tapes = [profile_forward_tape(DEEPSEEK, engine, new, served=True, mla_context=c) for new, c in steps]
    for i, tape in enumerate(tapes):
        if not fits_after_any(tape, [tapes[:i]], capacity):
            return i
    return None


def test_whether_a_document_runs_depends_on_the_allocator_history_not_on_the_requests_in_flight(
    s1_gpu: GPU,
) -> None:
    """Why S1's 32,000-token documents still wait for an idle engine, and why a replay of only the
    steps the in-flight requests can make would be unsafe (issue 24): the caching allocator keeps
    the segments of requests long finished. On the simulator's allocator in S1's 586 MiB a
    32,000-token document runs alone on a fresh engine and after a whole 16,000-token document,
    but one of its own whole chunks runs out after that document's last chunk alone (the cache
    released before it, as a failed cudaMalloc does), and after a 1,792-token step over 16,384
    tokens where a 2,048-token one is harmless. A 48,000-token one runs out alone (kvgate refuses
    it as never fitting). kvgate's replay finds the same in each case."""
    capacity = s1_gpu[0].free()
    last_of_16k = chunks(16000)[-1:]
    cases = {
        "alone": (chunks(32000), False),
        "after a whole 16k document": (chunks(16000) + chunks(32000), False),
        "after the 16k document's last chunk": (last_of_16k + chunks(32000), True),
        "after 2,048 tokens over 16,384": ([(2048, 16384), *chunks(32000)], False),
        "after 1,792 tokens over 16,384": ([(1792, 16384), *chunks(32000)], True),
        "48k alone": (chunks(48000), True),
    }
    for name, (steps, runs_out) in cases.items():
        sim_out, kv_out = simulator_runs_out(s1_gpu, steps), kvgate_runs_out(steps, capacity)
        for out in (sim_out, kv_out):
            assert (out is not None) == runs_out, name
            # where it runs out, in one of the document's own whole chunks over 22,528 tokens or more
            assert out is None or (steps[out][0] == T and steps[out][1] >= 22528), name


def test_whole_requests_one_after_another_run_on_the_simulator(s1_gpu: GPU) -> None:
    """Random serial runs of whole S1 requests (16,000 and 32,000-token documents and chats) from
    a fresh engine run on the simulator and on kvgate's replay; kvgate's replay is more cautious
    than the simulator after a whole 32,000-token document: it runs the next one out in a whole
    chunk over 28,672 tokens. Other serial histories do run the document out (one whole
    13,312-token request before it: `test_a_lone_document_is_judged_by_the_served_steps_replay_as_beside_others`)."""
    capacity = s1_gpu[0].free()
    rng = random.Random(29)
    for _ in range(4):
        steps = [step for _ in range(8) for step in chunks(rng.choice([16000, 32000, 500, 1500, 2000]))]
        assert simulator_runs_out(s1_gpu, steps) is None, steps
        assert kvgate_runs_out(steps, capacity) is None, steps
    two = chunks(32000) * 2
    assert simulator_runs_out(s1_gpu, two) is None
    out = kvgate_runs_out(two, capacity)
    assert out is not None
    assert two[out] == (T, 28672)


DOCUMENTS = [16000, 32000, 48000, 64000, 96000, 120000]


def random_step(rng: random.Random) -> StepShape:
    """A step S1's traffic makes: up to two prefills of some new tokens over some computed
    context (a document's chunk, a chat's prompt) and decoding rows, at most T tokens."""
    budget, reqs = T, []
    for _ in range(rng.randint(1, 2)):
        new = rng.randint(2, budget)
        context = rng.choice([0, 0, rng.randint(1, 120000)])
        reqs.append(prefill(new, context))
        budget -= new
        if budget < 2:
            break
    reqs += [ReqSlice(1, rng.randint(1, 4096), samples=False) for _ in range(rng.randint(0, min(8, budget)))]
    return StepShape(tuple(reqs))


def test_the_simulator_runs_every_step_kvgate_charges_its_allocated_bytes(s1_gpu: GPU) -> None:
    """Random sets of open requests (a document of S1's sizes or any length, chats, decoding
    rows), each played as the last step of its longest prompt, beside a piece of another's, after
    one to three random earlier steps on the simulator's allocator in S1's headroom (histories
    that themselves run out of memory are drawn again): wherever the budget charges the step its
    allocated bytes (`shared_step_fits`), the simulator runs it. Both verdicts occur."""
    device, _, _ = s1_gpu
    budget, predictor = s1_budget(device.free())
    rng = random.Random(24)
    ran = charged_share = 0
    for _ in range(200):
        prompts = [rng.choice([*DOCUMENTS, rng.randint(2, 40000)])]
        prompts += [rng.randint(2, 1500) for _ in range(rng.randint(0, 2))]
        ledger = Ledger()
        for prompt in prompts:
            ledger.reserve(document(predictor, prompt))
        decoding(predictor, ledger, *[rng.randint(100, 1500) for _ in range(rng.randint(0, 4))])
        if not budget.shared_step_fits(ledger.step()):
            charged_share += 1
            continue
        longest = max(prompts)
        new = rng.randint(max(2, min(longest, T) // 2), min(longest, T))
        rest = T - new
        others = [prefill(min(p, rest), 0) for p in prompts[1:] if rest >= 2][:1]
        final = StepShape((prefill(new, longest - new), *others))
        for _ in range(10):
            history = [random_step(rng) for _ in range(rng.randint(1, 3))]
            verdict = runs(s1_gpu, history, final)
            if verdict is not None:
                break
        assert verdict is not False, (prompts, history, final)
        ran += verdict is True
    assert ran >= 40
    assert charged_share >= 40


def test_the_level_is_worked_out_off_the_event_loop_and_cautious_until_known() -> None:
    """The replay takes up to seconds of CPU: kvgate's budget asks a SharedForward that works it
    out on a worker thread and answers no (the profile's share) until it is known; headroom
    readings a few per cent apart share one level, rounded down."""
    _, predictor = s1_budget(592 * MiB)
    shared = SharedForward(DEEPSEEK, predictor.engine, False)
    small = 8 * MiB
    assert shared(small, 592 * MiB) is False  # not known yet: the cautious answer, at once
    assert shared._worker is not None
    shared._worker.submit(lambda: None).result(timeout=60)  # the one worker has finished the level
    assert shared(small, 592 * MiB) is True
    assert shared(small, 595 * MiB) is True  # the same rung of the grid: no second replay
    assert len(shared._known) == 1
    for capacity in (9 * MiB, 592 * MiB, 80 * GiB, 80 * GiB + 1):
        rung = level_capacity(capacity)
        assert 0.977 * capacity <= rung <= capacity
    assert level_capacity(MiB) == 0


def test_a_headroom_read_starts_its_level_before_any_request_asks() -> None:
    """The level of the headroom just read is worked out at once on the worker thread, so the
    first requests of an engine life do not wait for it (kvgate/gate/budget.py
    `_prepare_step_levels`)."""
    budget, predictor = s1_budget(592 * MiB)
    shared = SharedForward(DEEPSEEK, predictor.engine, False)
    budget.update(shared_forward=shared)
    assert not shared._known
    assert shared._worker is not None
    budget.update(transient_headroom_bytes=600 * MiB)
    shared._worker.submit(lambda: None).result(timeout=60)  # the one worker has finished the level
    assert list(shared._known) == [level_capacity(600 * MiB)]


async def test_a_request_waiting_on_the_level_is_admitted_once_it_is_known() -> None:
    """S1's 16,000-token document beside four decoding chats waits while the level of its
    headroom is being worked out (the cautious answer); when the worker thread has it, the gate
    weighs its queue again at once: the document is admitted with no release or arrival."""
    budget, predictor = s1_budget(592 * MiB)
    shared = SharedForward(DEEPSEEK, predictor.engine, False)
    budget.update(shared_forward=shared)
    gate: Gate[None] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=120.0)
    shared.when_known(gate.changed_from_thread)
    decoding(predictor, gate.ledger, 600, 300, 1200, 800)
    waiting = asyncio.ensure_future(gate.acquire(document(predictor, 16000), 0, "t"))
    await asyncio.sleep(0)
    assert gate.waiting == 1  # queued on the cautious charge, the level not known yet
    ticket = await asyncio.wait_for(waiting, 60)
    assert ticket.queue_wait_s > 0
    assert gate.waiting == 0
    assert shared._known  # admitted on the level now known, nothing else happened meanwhile


def whole_request(prompt: int, decodes: int) -> list[ReqSlice]:
    """One request alone on the engine: its prefill chunks (`chunks`), the last sampling its first
    token, then `decodes` decode steps."""
    steps = [ReqSlice(new, done, samples=new + done == prompt) for new, done in chunks(prompt)]
    return steps + [ReqSlice(1, prompt + i) for i in range(decodes)]


def test_a_lone_document_is_judged_by_the_served_steps_replay_as_beside_others(s1_gpu: GPU) -> None:
    """An idle engine keeps its cache, so a request alone meets the segments the last requests'
    MLA steps left, up-projections included (vllm 0.32.0 model_executor/layers/attention/
    mla_attention.py `forward_mha`, `_compute_prefill_context`). On the simulator's allocator in
    S1's 586 MiB a 32,000-token document runs on a fresh engine but runs out of memory in its
    chunk over 28,672 tokens after one whole 13,312-token request served alone before it. kvgate
    judged a request alone by a replay of plain steps without those tensors and admitted the
    document; it now judges it by the served steps' replay, as beside others: not at 586 MiB,
    refused at once as never fitting (it waited for an idle engine before). A 16,000-token
    document alone is still admitted, and runs on the simulator after that request."""
    _, alloc, memory = copy.deepcopy(s1_gpu)
    for part in whole_request(13312, 3):
        run_tape(alloc, memory.plan(StepShape((part,))))
    document_steps = whole_request(32000, 0)
    for part in document_steps[:14]:
        run_tape(alloc, memory.plan(StepShape((part,))))
    assert (document_steps[14].num_new_tokens, document_steps[14].num_context) == (T, 28672)
    with pytest.raises(CudaOutOfMemory):
        run_tape(alloc, memory.plan(StepShape((document_steps[14],))))
    assert simulator_runs_out(s1_gpu, chunks(32000)) is None

    _, alloc, memory = copy.deepcopy(s1_gpu)
    for part in whole_request(13312, 3) + whole_request(16000, 3):
        run_tape(alloc, memory.plan(StepShape((part,))))

    budget, predictor = s1_budget(s1_gpu[0].free())
    assert budget.shortfall(document(predictor, 16000), Ledger()) is None
    assert budget.shortfall(document(predictor, 32000), Ledger()) == TRANSIENT_BUSY
    body = {"prompt": "x", "max_tokens": 256, "temperature": 0.7}
    spec = parse_request("completions", json.dumps(body).encode()).request
    with pytest.raises(TransientNeverFits):
        predictor.check_fits_ever(predictor.predict(spec, [[7] * 32000]), budget.ceiling())
    predictor.check_fits_ever(predictor.predict(spec, [[7] * 16000]), budget.ceiling())


def test_what_kvgate_admits_alone_runs_after_any_one_whole_request_and_what_it_refuses_may_not(
    s1_gpu: GPU,
) -> None:
    """The lone line the served steps' replay draws in S1's 586 MiB, against the simulator: a
    20,000-token document, admitted alone, runs after any one whole request of 512 - 32,768
    tokens (every 512) served alone before it; a 24,000-token one, refused as never fitting,
    runs on a fresh engine but runs out after a whole 20,992, 21,504, 23,040 or 23,552-token request."""
    budget, predictor = s1_budget(s1_gpu[0].free())
    verdicts = {}
    for size in (20000, 24000):
        admitted = budget.shortfall(document(predictor, size), Ledger()) is None
        fresh = whole_request(size, 0)
        breaking = []
        for earlier in range(512, 33000, 512):
            history = whole_request(earlier, 1)
            _, alloc, memory = copy.deepcopy(s1_gpu)
            try:
                for part in history + fresh:
                    run_tape(alloc, memory.plan(StepShape((part,))))
            except CudaOutOfMemory:
                breaking.append(earlier)
        verdicts[size] = (admitted, breaking)
        assert simulator_runs_out(s1_gpu, chunks(size)) is None
    assert verdicts == {20000: (True, []), 24000: (False, [20992, 21504, 23040, 23552])}


async def test_a_request_alone_is_admitted_once_the_replay_is_worked_out(s1_gpu: GPU) -> None:
    """kvgate works the served steps' replay out on a worker thread and, until it knows the
    headroom's level, charges the profile's share: a 16,000-token document alone waits. Alone
    no release or first token comes to re-check it, so the replay's end does: the document is
    admitted within seconds, long before its queue deadline."""
    budget, predictor = s1_budget(s1_gpu[0].free())
    shared = SharedForward(DEEPSEEK, predictor.engine, False)
    budget.update(shared_forward=shared)
    gate: Gate[None] = Gate(budget, Observers(), max_queue=8, max_queue_wait_s=600.0)
    shared.when_known(gate.changed_from_thread)
    doc = document(predictor, 16000)
    assert budget.shortfall(doc, Ledger()) == TRANSIENT_BUSY  # the level not known yet
    ticket = await asyncio.wait_for(gate.acquire(doc, 0, "a"), 60)
    assert ticket.queue_wait_s < 60
    ticket.release("completed", 256)
