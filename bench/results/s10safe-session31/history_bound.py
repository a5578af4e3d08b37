"""What a lone V2 `prompt_logprobs: -1` passage step needs of the caching allocator after ANY history,
against what kvgate charges it (S10's engine: Llama-3.1-8B, vLLM 0.32.0, Model Runner V2, 8,192
batched tokens, 1,024 sequences, --max-logprobs -1).

    PYTHONPATH=. python bench/results/s10safe-session31/history_bound.py bound
    PYTHONPATH=. python bench/results/s10safe-session31/history_bound.py histories CAPACITY_MIB COUNT SEED [CHAT_SHARE [expandable]]
    PYTHONPATH=. python bench/results/s10safe-session31/history_bound.py states CAPACITY_MIB COUNT SEED MAX_TOKENS
    PYTHONPATH=. python bench/results/s10safe-session31/history_bound.py chats

`bound`: for each passage size, its need alone (kvgate's replay, kvgate/memory/allocator.py),
kvgate's charge (`Ceiling.transient_need`) and the provable bound of README.md, with the largest
cached segment taken from steps up to that size and from the deployment's largest step.
`histories`: random histories of 2 - 5 lone passages, each one kvgate lets through at that headroom
(charge <= 0.9 x capacity), played one after another on the simulator's allocator
(kvgate/sim/gpu.py) in that capacity: how many run out of memory. With CHAT_SHARE, that share of
the steps is a chat step instead (0 - 300 decoding rows, half the time a prefill of the rest of
the 8,192-token step); with `expandable`, the allocator is vLLM's under
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (added 2026-11-28 by the lead, session 31).
`states`: random sets of cached free segments (sizes of allocations that steps of at most MAX_TOKENS
make, total within the capacity) before one passage step, on kvgate's replay, hill-climbed: the most
the step needs (a lower bound on the worst over histories, if such a state is reachable).
`chats`: what a step of chats alone (decoding rows, a prefill) needs on the simulator's allocator
after earlier lone passages, against the same step on an empty cache.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve
from kvgate.gate.budget import Budget
from kvgate.memory import allocator as a
from kvgate.memory.activation import profile_forward_tape, sampler_phase_tape, v2_prompt_logprobs_tape
from kvgate.memory.geometry import ModelGeometry
from kvgate.openai import parse_request
from kvgate.settings import settings_from_args
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import Block, CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes, model_config
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.sim.tokens import StandInTokenizer, TextModel
from kvgate.units import GiB, MiB

FLAGS = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "1024", "--max-logprobs", "-1"]
MARGIN = 0.1  # kvgate/settings.py transient_safety_margin's default
GRID = 32

geometry = ModelGeometry.from_config(model_config("llama-3.1-8b"))
settings = settings_from_args(build_parser().parse_args(["serve", *FLAGS, "--gpu-memory-bytes", str(80 * GiB)]))
deployment = resolve(engine_flags(settings), geometry, None, None, reported_version="0.32.0")
predictor = build_predictor(deployment, geometry)
engine_shape = predictor.engine


def charge(tokens: int) -> int:
    body = json.dumps({"prompt": "x", "max_tokens": 1, "prompt_logprobs": -1}).encode()
    spec = parse_request("completions", body).request
    demand = predictor.predict(spec, [[5 + i % 1000 for i in range(tokens)]]).demand
    return Budget(profiled_cap_bytes=predictor.profiled_peak_bytes).ceiling().transient_need(demand)


def step_tape(tokens: int) -> list[a.TapeOp]:
    """A lone passage's step: forward pass (final hidden states kept), one sampled row, then the
    prompt logprobs (as v2_prompt_logprobs_overhead_bytes plays them)."""
    forward = profile_forward_tape(geometry, engine_shape, tokens)
    phase = v2_prompt_logprobs_tape(geometry, engine_shape, tokens, -1)
    return [*forward[:-1], *sampler_phase_tape(geometry, engine_shape, 1), *phase, forward[-1]]


def segments_of(tape: Sequence[a.TapeOp]) -> set[int]:
    """The large-pool segment sizes the tape's allocations can leave cached."""
    return {a._segment_size(a._rounded(n), "large") for op, _, n in tape if op == "alloc" and n > a.SMALL_SIZE}


def provable_bound(tape: Sequence[a.TapeOp], largest_segment: int) -> int:
    """README.md's bound: at each malloc, every live large block's segment counted at most
    min(S, block + 1 MiB + 2 x (request - 512)) for a large request (every free block is smaller
    than the request when it goes to cudaMalloc), S for a small one; a live small block its 2 MiB
    segment; plus the new segment."""
    live: dict[str, int] = {}
    worst = 0
    for op, name, nbytes in tape:
        if op == "free":
            del live[name]
            continue
        size = a._rounded(nbytes)
        small = size <= a.SMALL_SIZE
        pinned = 0
        for block in live.values():
            if block <= a.SMALL_SIZE:
                pinned += a.SMALL_BUFFER
            elif small:
                pinned += largest_segment
            else:
                pinned += min(largest_segment, block + a.SMALL_SIZE + 2 * (size - a.MIN_BLOCK))
        worst = max(worst, pinned + a._segment_size(size, "small" if small else "large"))
        live[name] = size
    return worst


def bound() -> None:
    full = max(segments_of(step_tape(engine_shape.max_num_batched_tokens)))
    # the chats' steps: a whole step's forward pass and a sampler phase of every sequence
    batch = [
        *profile_forward_tape(geometry, engine_shape),
        *sampler_phase_tape(geometry, engine_shape, engine_shape.max_num_seqs),
    ]
    print(
        "tokens | needs alone | kvgate charges | bound, S of steps <= tokens | bound, S of the 8,192-token step (MiB)"
    )
    for tokens in (128, 256, 384, 512, 768, 1000, 1500, 2000):
        tape = step_tape(tokens)
        upto = max(*segments_of(batch), *(max(segments_of(step_tape(t))) for t in range(GRID, tokens + 1, GRID)))
        row = (a.footprint(tape).need, charge(tokens), provable_bound(tape, upto), provable_bound(tape, full))
        print(tokens, *(round(v / MiB) for v in row), flush=True)


def make_sim() -> Engine:
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
    model = load_model(cfg.model, cfg.dtype)
    sim = Engine(
        cfg, model, Device(gpu_total_bytes(cfg.gpu)), TextModel(StandInTokenizer(model.vocab), cfg.seed), "sim"
    )
    sim.boot()
    return sim


def chat_step(rng: random.Random) -> tuple[ReqSlice, ...]:
    """Decoding chats and, half the time, one prefill chunk: a step of S10's chat traffic."""
    decoding = rng.randint(1, 300)
    step = [ReqSlice(1, 440, random=True, seeded=True, request_id=f"c{i}") for i in range(decoding)]
    if rng.random() < 0.5:
        step.append(ReqSlice(rng.randint(1, 8192 - decoding), 0, random=True, seeded=True, request_id="q"))
    return tuple(step)


def histories(capacity: int, count: int, seed: int, chat_share: float, expandable: bool = False) -> None:
    charges: dict[int, int] = {}

    def admitted() -> int:
        while True:
            tokens = rng.randint(1, 2048)
            if charges.setdefault(tokens, charge(tokens)) <= (1 - MARGIN) * capacity:
                return tokens

    sim, plans = make_sim(), {}
    rng = random.Random(seed)
    ooms = 0
    for _ in range(count):
        history = [0 if rng.random() < chat_share else admitted() for _ in range(rng.randint(2, 5))]
        alloc = CachingAllocator(Device(capacity), "step", expandable_segments=expandable)
        for i, tokens in enumerate(history):
            if tokens and tokens not in plans:
                req = ReqSlice(tokens, 0, prompt_logprob_tokens=tokens, prompt_logprobs=-1, request_id="p")
                plans[tokens] = sim.steps.plan(StepShape((req,)))
            try:
                run_tape(alloc, plans[tokens] if tokens else sim.steps.plan(StepShape(chat_step(rng))))
            except CudaOutOfMemory:
                ooms += 1
                print("out of memory (0: a chat step):", history[: i + 1], flush=True)
                break
    largest = max(t for t, c in charges.items() if c <= (1 - MARGIN) * capacity)
    print(
        f"capacity {capacity / MiB:.0f} MiB, passages up to {largest} tokens let through: {ooms} of {count} histories ran out"
    )


def need_after(tape: Sequence[a.TapeOp], cached: Sequence[int]) -> int:
    replay = a._Replay(False)
    replay.segments = [a._Segment("large", [a._Block(s)]) for s in cached]
    return replay.play(tape).need


def states(capacity: int, count: int, seed: int, max_tokens: int) -> None:
    sizes = sorted(s for t in range(GRID, max_tokens + 1, GRID) for s in segments_of(step_tape(t)) if s <= capacity)
    rng = random.Random(seed)
    for tokens in (500, 1000, 1500, 2000):
        tape = step_tape(tokens)
        best, cached = a.footprint(tape).need, list[int]()
        for i in range(2 * count):
            if i < count:  # random sets, then hill-climbing from the worst
                trial: list[int] = []
                while (s := rng.choice(sizes)) + sum(trial) <= capacity:
                    trial.append(s)
                    if rng.random() < 0.25:
                        break
            else:
                trial = list(cached)
                move = rng.random()
                if move < 0.4 or not trial:
                    trial.append(rng.choice(sizes))
                elif move < 0.7:
                    trial[rng.randrange(len(trial))] = rng.choice(sizes)
                else:
                    trial.pop(rng.randrange(len(trial)))
                if sum(trial) > capacity:
                    continue
            need = need_after(tape, trial)
            if need >= best:
                best, cached = need, trial
        print(
            f"{tokens} tokens: alone {a.footprint(tape).need / MiB:.0f} MiB, charged {charge(tokens) / MiB:.0f}, "
            f"worst found {best / MiB:.0f} after cached segments {sorted(round(s / MiB) for s in cached)} MiB",
            flush=True,
        )


def step_need(sim: Engine, history: Sequence[int], step: tuple[ReqSlice, ...]) -> int:
    """The most the simulator's allocator holds in segments with a live block at any malloc of
    `step`, after lone passages of `history` tokens (the capacity `step` needs, the cache released
    at a failed cudaMalloc)."""
    alloc = CachingAllocator(Device(400 * GiB), "step")
    for tokens in history:
        req = ReqSlice(tokens, 0, prompt_logprob_tokens=tokens, prompt_logprobs=-1, request_id="p")
        run_tape(alloc, sim.steps.plan(StepShape((req,))))
    worst = 0
    malloc = alloc.malloc

    def watched(nbytes: int, pool: str | None = None) -> Block:
        nonlocal worst
        block = malloc(nbytes, pool)
        worst = max(worst, sum(seg.size for seg in alloc.segments if not seg.fully_free()))
        return block

    alloc.malloc = watched  # type: ignore[method-assign]
    run_tape(alloc, sim.steps.plan(StepShape(step)))
    return worst


def chats() -> None:
    sim = make_sim()
    past = [[1024], [704], [500, 1000], [704, 960], [1000, 1500], [2000], [1500, 2000], [300, 700, 2000]]
    for decoding, prefill in ((200, 0), (1000, 0), (200, 3000), (40, 7000)):
        step = [ReqSlice(1, 440, random=True, seeded=True, request_id=f"c{i}") for i in range(decoding)]
        if prefill:
            step.append(ReqSlice(prefill, 0, random=True, seeded=True, request_id="q"))
        alone = step_need(sim, [], tuple(step))
        needs = {tuple(h): step_need(sim, h, tuple(step)) for h in past}
        worst = max(needs, key=lambda h: needs[h])
        print(
            f"{decoding} decoding rows + a {prefill}-token prefill: alone {alone / MiB:.0f} MiB, "
            f"after passages {list(worst)} {needs[worst] / MiB:.0f} MiB; every history: "
            f"{[round(v / MiB) for v in needs.values()]}",
            flush=True,
        )


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "bound":
        bound()
    elif command == "chats":
        chats()
    elif command == "histories":
        histories(
            int(args[0]) * MiB,
            int(args[1]),
            int(args[2]),
            float(args[3]) if len(args) > 3 else 0.0,
            len(args) > 4 and args[4] == "expandable",
        )
    else:
        states(int(args[0]) * MiB, int(args[1]), int(args[2]), int(args[3]))
