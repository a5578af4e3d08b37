"""Differential check of Model Runner V2's prompt logprobs beside other requests (benchmark S10's
engine: vLLM 0.32.0, Llama-3.1-8B, `--max-logprobs -1`, 8,192 batched tokens, 1,024 sequences).

V2 scores every token of the step (vllm 0.32.0 v1/worker/gpu/sample/prompt_logprob.py
`compute_prompt_logprobs`), so a passage asking `prompt_logprobs: -1` costs more beside other
requests, but only for the tokens they can put in its step: a decoding chat one, a prefilling one
its prompt. The simulator's step (kvgate/sim/step_memory.py, the judge) is played on an empty
allocator and compared with what kvgate charges for the same requests (their Demands from the
Predictor, summed in a Ledger, charged by the Budget as on a V2 fixed pool): never less, and a
passage beside decoding chats is not charged a whole 8,192-token step (until 2026-11-28 it was:
~30 GiB, which never fit, so it waited for every chat to end and the chats behind it waited too).
"""

from __future__ import annotations

import itertools
import json

import pytest
from sim_support import make_engine

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import _STEP_PEAKS, profile_forward_bytes, v2_charged_k
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request
from kvgate.predict import Predictor
from kvgate.settings import settings_from_args
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import GiB, MiB
from support.geometry import model_geometry

CHAT = {"temperature": 0.7, "seed": 1, "max_tokens": 256}  # bench/workloads.py chat_call
CHAT_PROMPT = 400
ROUNDING = 2 * MiB  # the caching allocator's segment rounding, which kvgate's terms leave out
POOL = 27784  # S10's KV blocks (vLLM's cache_config_info on its H100): nobody is preempted here


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        vllm_version="0.32.0",
        model_runner="auto",
        max_model_len=16384,
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        max_logprobs=-1,
    )
    engine = make_engine(cfg)
    assert engine.resolved.flavor.v2
    return engine


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--max-logprobs", "-1"]
    settings = settings_from_args(build_parser().parse_args(["serve", *flags, "--gpu-memory-bytes", str(80 * GiB)]))
    geometry = model_geometry("llama-3-8b")
    deployment = resolve(engine_flags(settings), geometry, None, None, reported_version="0.32.0")
    assert deployment.runtime.runner == "v2"
    return build_predictor(deployment, geometry)


def sim_peak(engine: Engine, reqs: list[ReqSlice]) -> int:
    alloc = CachingAllocator(Device(400 * GiB), "step")
    run_tape(alloc, engine.steps.plan(StepShape(tuple(reqs))))
    return alloc.peak_allocated


def demand(predictor: Predictor, body: dict, tokens: int, first: int = 5) -> Demand:
    spec = parse_request("completions", json.dumps({"prompt": "x", **body}).encode()).request
    return predictor.predict(spec, [[first + i % 1000 for i in range(tokens)]]).demand


def charge(predictor: Predictor, ledger: Ledger) -> int:
    peak = predictor.profiled_peak_bytes
    forward = profile_forward_bytes(predictor.layout.geometry, predictor.engine)
    budget = Budget(
        profiled_cap_bytes=peak,
        profiled_peak_bytes=peak,
        profiled_forward_bytes=forward,
        forward_bytes_per_token=-(-forward // predictor.engine.max_num_batched_tokens),
    )
    return budget.transient_charge(ledger)


def decoding(n: int) -> list[ReqSlice]:
    return [ReqSlice(1, CHAT_PROMPT + 40, random=True, seeded=True, request_id=f"c{i}") for i in range(n)]


def passage(tokens: int) -> ReqSlice:
    return ReqSlice(tokens, 0, prompt_logprob_tokens=tokens, prompt_logprobs=-1, request_id="p")


@pytest.mark.parametrize("chats", [1, 40, 200])
@pytest.mark.parametrize("tokens", [500, 1000, 2000, 3000])
def test_a_passage_beside_decoding_chats_is_charged_its_step_not_a_full_one(
    engine: Engine, predictor: Predictor, chats: int, tokens: int
) -> None:
    """Chats decoding, then a passage asking the whole vocabulary per prompt token: its step
    holds its prompt and one token a chat. Charged at least what the simulator's step takes, and
    within a quarter of the capacity its allocator needs for it (the running maximum over smaller
    steps, CUDA's topk scratch, the segments replayed after other steps)."""
    ledger = Ledger(pool=lambda: POOL)
    for i in range(chats):
        ledger.end_prefill(ledger.reserve(demand(predictor, CHAT, CHAT_PROMPT, first=11 + i)))
    ledger.reserve(demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, tokens))
    taken = sim_peak(engine, [*decoding(chats), passage(tokens)])
    charged = charge(predictor, ledger)
    assert charged + ROUNDING >= taken, f"kvgate {charged / MiB:.0f} MiB < simulator {taken / MiB:.0f} MiB"
    needed = capacity_needed(engine, [[*decoding(chats), passage(tokens)]])
    assert charged <= 1.25 * needed, f"kvgate {charged / MiB:.0f} MiB for a step needing {needed / MiB:.0f} MiB"


@pytest.mark.parametrize("joining", [300, 3000, 7000])
def test_a_request_that_joins_a_passages_prefill_makes_its_step_larger(
    engine: Engine, predictor: Predictor, joining: int
) -> None:
    """A passage admitted beside 40 decoding chats, then a chat whose prompt may be scheduled in
    the passage's step: another prefill beside the passage is charged as a full step (on the
    simulator's allocator it fragments the segments beyond the step's allocated bytes, see
    Ledger._extra_of), never less than the simulator's step, and kept after the chat leaves."""
    ledger = Ledger(pool=lambda: POOL)
    for i in range(40):
        ledger.end_prefill(ledger.reserve(demand(predictor, CHAT, CHAT_PROMPT, first=11 + i)))
    ledger.reserve(demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, 1000))
    before = charge(predictor, ledger)
    chat = ledger.reserve(demand(predictor, CHAT, joining, first=2000))
    chunk = min(joining, 8192 - 40 - 1000)
    taken = sim_peak(engine, [*decoding(40), passage(1000), ReqSlice(chunk, joining - chunk, random=True, seeded=True)])
    charged = charge(predictor, ledger)
    assert charged + ROUNDING >= taken, f"kvgate {charged / MiB:.0f} MiB < simulator {taken / MiB:.0f} MiB"
    # the chat leaving does not give back what the passage's steps took beside it (cut over
    # several steps, the earlier steps' results stay until its last one)
    ledger.release(chat)
    assert charge(predictor, ledger) > before


@pytest.mark.parametrize("pool", [None, 1000])
def test_where_vllm_may_preempt_a_chat_the_passage_is_charged_full_steps(
    predictor: Predictor, pool: int | None
) -> None:
    """A preempted request resumes by prefilling its prompt and outputs again, in a step that may
    hold the passage: where the chats at their max_tokens could outgrow the pool (40 x 41 blocks
    in a pool of 1,000: kvgate overcommits the pool, kvgate/telemetry/calibration.py, or reserves
    learned output lengths), or the pool is unknown, a decoding chat is not taken as one token,
    and the passage is charged a full 8,192-token step, as beside a request whose tokens are
    unknown."""
    ledger, known = Ledger(pool=lambda: pool), Ledger(pool=lambda: POOL)
    for i in range(40):
        chat = demand(predictor, CHAT, CHAT_PROMPT, first=11 + i)
        ledger.end_prefill(ledger.reserve(chat))
        known.end_prefill(known.reserve(chat))
    scored = demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, 500)
    unknown = Demand(CHAT_PROMPT, 256, (), 30, 0)  # a request that says nothing of its tokens a step
    full = Ledger(pool=lambda: POOL)
    full.reserve(unknown)
    full_step = full.transient_bytes_with(scored) - full.transient_bytes
    assert ledger.transient_bytes_with(scored) - ledger.transient_bytes >= full_step
    assert known.transient_bytes_with(scored) - known.transient_bytes < full_step / 4


def capacity_needed(engine: Engine, steps: list[list[ReqSlice]], expandable_segments: bool = False) -> int:
    """The least device capacity (to 8 MiB) in which the simulator's caching allocator plays the
    steps one after the other: beyond the allocated peak, what its segments strand (with
    `expandable_segments`, vLLM run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."""

    def fits(capacity: int) -> bool:
        alloc = CachingAllocator(Device(capacity), "step", expandable_segments=expandable_segments)
        try:
            for reqs in steps:
                run_tape(alloc, engine.steps.plan(StepShape(tuple(reqs))))
        except CudaOutOfMemory:
            return False
        return True

    low, high = 0, 64 * GiB
    while high - low > 8 * MiB:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


@pytest.mark.parametrize(
    ("tokens", "chats", "prefill", "earlier"),
    [
        (500, 0, 0, 3000),
        (1000, 1, 0, 7000),
        (1500, 40, 0, 1200),
        (2000, 0, 0, 5000),
        (2000, 40, 0, 300),
        (2458, 0, 0, 6000),
        (3000, 200, 0, 8000),
        (3882, 40, 0, 2000),
        (5000, 1, 0, 4000),
        (2000, 40, 700, 2500),
        (1000, 40, 1500, 6500),
    ],
)
def test_a_passages_step_is_charged_what_the_allocator_needs_not_only_its_allocated_peak(
    engine: Engine, predictor: Predictor, tokens: int, chats: int, prefill: int, earlier: int
) -> None:
    """The step's prompt-logprobs tensors split the forward pass's cached segments and each
    other's, so the simulator's allocator needs more device capacity than their allocated peak
    (a 2,000-token passage alone: 7,674 MiB for 6,533 allocated, which kvgate charged until
    2026-11-28): after an earlier step of another size, kvgate's charge covers the capacity, and
    is not far above it where the passage's step holds only decoding rows beside it."""
    ledger = Ledger(pool=lambda: POOL)
    for i in range(chats):
        ledger.end_prefill(ledger.reserve(demand(predictor, CHAT, CHAT_PROMPT, first=11 + i)))
    beside = decoding(chats)
    if prefill:
        ledger.reserve(demand(predictor, CHAT, prefill, first=3000))
        beside.append(ReqSlice(prefill, 0, random=True, seeded=True))
    ledger.reserve(demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, tokens))
    before = [ReqSlice(earlier, 0, random=True, seeded=True)]
    needed = capacity_needed(engine, [before, [*beside, passage(tokens)]])
    charged = charge(predictor, ledger)
    assert charged >= needed, f"kvgate {charged / MiB:.0f} MiB < the allocator's {needed / MiB:.0f} MiB"
    if not prefill:  # another prefill beside the passage is charged a full step
        assert charged <= 1.25 * needed, f"kvgate {charged / MiB:.0f} MiB for {needed / MiB:.0f} MiB"


def test_a_client_choosing_a_new_k_each_request_meets_a_bounded_set_of_charges(
    engine: Engine, predictor: Predictor
) -> None:
    """The replays and running maxima behind these charges are memoised per k: a client sending
    every k from 0 to 6,000 beside chats is charged as at most 14 k (`v2_charged_k`: powers of
    two up to 4,096, the whole vocabulary above), so kvgate's memo holds at most that many lists
    of step peaks for the deployment, and a charge is at least the simulator's step for the k
    asked."""
    for k in (0, 1, 3, 5, 20, 100, 1000, 4096):
        assert k <= v2_charged_k(k) <= max(1, 2 * k)
    assert v2_charged_k(4097) == v2_charged_k(6000) == v2_charged_k(-1) == -1
    for k in [*range(0, 6001, 7), 4096, 4097]:
        shared = demand(predictor, {"max_tokens": 1, "prompt_logprobs": k}, 600).shared_step
        assert shared is not None
        shared.bytes(40)
    keys = {key[2] for key in _STEP_PEAKS if key[:2] == (predictor.layout.geometry, predictor.engine)}
    assert keys <= {-1, 0, 1, *(1 << n for n in range(1, 13))}
    for k in (3, 100, 5000):
        ledger = Ledger(pool=lambda: POOL)
        for i in range(3):
            ledger.end_prefill(ledger.reserve(demand(predictor, {**CHAT, "seed": i}, CHAT_PROMPT)))
        ledger.reserve(demand(predictor, {"max_tokens": 1, "prompt_logprobs": k}, 640))
        prompt = ReqSlice(640, 0, prompt_logprob_tokens=640, prompt_logprobs=k, request_id="p")
        assert charge(predictor, ledger) >= sim_peak(engine, [prompt, *decoding(3)]) - ROUNDING


@pytest.mark.xfail(
    strict=True,
    reason="a known under-charge, open (docs/limitations.md): v2_prompt_logprobs_overhead_bytes "
    "replays one earlier forward step, not earlier passages' "
    "prompt-logprobs phases, whose large segments strand more; replaying one "
    "earlier passage would cover this history but not two (the sweep below); the remedy until "
    "then is vLLM with expandable segments, under which the sweep holds",
)
def test_a_passage_alone_is_charged_what_the_allocator_needs_after_earlier_passages(
    engine: Engine, predictor: Predictor
) -> None:
    """S10's 2,000-token passage alone after a 500- and a 1,000-token passage's steps: the
    simulator's allocator needs 8,160 MiB, kvgate charges 8,140. Only the 10 % transient margin
    covers the gap (session 29: with the margin taken off its GPU-measured terms, S10's kvgate arm
    admitted such a passage after such passages and the simulator ran out of memory, 2.07 GiB
    reserved but unallocated)."""
    scored = demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, 2000)
    charged = Budget(profiled_cap_bytes=predictor.profiled_peak_bytes).ceiling().transient_need(scored)
    needed = capacity_needed(engine, [[passage(500)], [passage(1000)], [passage(2000)]])
    assert charged >= needed, f"kvgate {charged / MiB:.0f} MiB < the allocator's {needed / MiB:.0f} MiB"


TRANSIENT_MARGIN = 0.1  # kvgate/settings.py transient_safety_margin's default


@pytest.mark.xfail(
    strict=True,
    reason="a known under-charge, open (docs/limitations.md): kvgate's charge is not yet a bound on "
    "what the caching allocator needs after earlier passages: after 704- and 960-token passages a "
    "1,000-token passage needs 7,928 MiB, kvgate charges 5,503; the remedy until then is vLLM "
    "with expandable segments, under which this sweep holds (the test below)",
)
def test_passages_one_after_another_never_need_more_than_kvgate_lets_through(
    engine: Engine, predictor: Predictor
) -> None:
    """Passages asking `prompt_logprobs: -1` served alone one after another, up to three, of
    500 - 1,500 tokens in every order: kvgate lets each through where its charge is within the
    headroom less the 10 % margin, so every history whose largest charge is within that must run
    on the simulator's allocator in that headroom. The state a step meets is the cached free
    segments the earlier steps left (every step frees what it made), and which sizes strand
    depends on the earlier passages' sub-chunk rows, so histories of several passages of sizes
    between kvgate's replayed grid need more than its charge."""
    assert not passages_over_their_headroom(engine, predictor, expandable_segments=False)


def passages_over_their_headroom(engine: Engine, predictor: Predictor, expandable_segments: bool) -> list[str]:
    """Histories of up to three lone passages (500 - 1,500 tokens, every order) that need more
    device capacity than the largest of their charges over the 10 % margin."""
    sizes = [500, 704, 960, 1000, 1500]
    charged = {
        tokens: Budget(profiled_cap_bytes=predictor.profiled_peak_bytes)
        .ceiling()
        .transient_need(demand(predictor, {"max_tokens": 1, "prompt_logprobs": -1}, tokens))
        for tokens in sizes
    }
    over = []
    for length in (1, 2, 3):
        for history in itertools.product(sizes, repeat=length):
            headroom = max(charged[t] for t in history) / (1 - TRANSIENT_MARGIN)
            needed = capacity_needed(engine, [[passage(t)] for t in history], expandable_segments)
            if needed > headroom:
                over.append(f"{history}: {needed / MiB:.0f} MiB > {headroom / MiB:.0f}")
    return over


def test_with_expandable_segments_no_history_of_passages_needs_more_than_kvgate_lets_through(
    engine: Engine, predictor: Predictor
) -> None:
    """The documented remedy for the under-charge above (docs/limitations.md, docs/deploy.md): vLLM
    run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True maps freed pages again where they are
    needed (PyTorch's `ExpandableSegment`), so no earlier passage strands memory a later one cannot
    use: every history of the sweep runs within the headroom kvgate lets each passage through at."""
    over = passages_over_their_headroom(engine, predictor, expandable_segments=True)
    assert not over, "; ".join(over)


@pytest.mark.parametrize("expandable_segments", [False, True])
@pytest.mark.parametrize("history", [[1024], [704, 960], [300, 700, 2000]])
@pytest.mark.parametrize(("rows", "prefill"), [(200, 0), (1000, 0), (200, 3000), (40, 7000)])
def test_a_chat_step_after_passages_fits_wherever_the_passages_and_the_chats_fit_alone(
    engine: Engine, history: list[int], rows: int, prefill: int, expandable_segments: bool
) -> None:
    """Cached segments that passages leave strand under a later chats' step too: 40 decoding rows
    beside a 7,000-token prefill hold up to 1,508 MiB of segments with a live block after a
    1,024-token passage against 722 on a fresh allocator (bench/results/s10safe-session31
    `history_bound.py chats`), which kvgate's charge for chat steps does not replay. That stays
    harmless while the headroom is the one the passages ran in: a failed cudaMalloc releases every
    wholly free segment, so in any capacity where the passages ran and the chats run on a fresh
    allocator they run after the passages (to the search's 8 MiB). A headroom that shrinks after
    the passages (a co-tenant) is not covered."""
    chats = [*decoding(rows), *([ReqSlice(prefill, 0, random=True, seeded=True, request_id="q")] if prefill else [])]
    passages = [[passage(tokens)] for tokens in history]
    each = max(
        capacity_needed(engine, passages, expandable_segments),
        capacity_needed(engine, [chats], expandable_segments),
    )
    after = capacity_needed(engine, [*passages, chats], expandable_segments)
    assert after <= each + 8 * MiB, f"{after / MiB:.0f} MiB after the passages, {each / MiB:.0f} MiB each alone"
