"""Helpers for the simulator tests: drive an engine without HTTP, as fast as it will go."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.request import Request, Sampling
from kvgate.sim.step_memory import ReqSlice, StepMemory, StepShape, run_tape
from kvgate.sim.tokens import StandInTokenizer, TextModel
from kvgate.sim.vision import Item


@dataclass
class Job:
    """`count` requests of `prompt_len` tokens, each fanned out `n` ways."""

    prompt_len: int
    sampling: Sampling
    count: int = 1
    n: int = 1
    shared_prefix: int = 0
    image: int = 0  # the image tokens of one image at the prompt's start (a vision model's)


@dataclass
class Outcome:
    engine: Engine
    finished: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    steps: int = 0

    @property
    def oom(self) -> str | None:
        return self.engine.ooms[0] if self.engine.ooms else None


def make_engine(cfg: SimConfig) -> Engine:
    model = load_model(cfg.model, cfg.dtype)
    engine = Engine(
        cfg, model, Device(gpu_total_bytes(cfg.gpu)), TextModel(StandInTokenizer(model.vocab), cfg.seed), "sim"
    )
    engine.boot()
    return engine


def started(**config: object) -> tuple[Device, CachingAllocator, StepMemory]:
    """A simulated engine just started with the pool vLLM's start-up advice sizes (vLLM's own
    runner choice): its device, allocator and step tapes."""
    from demo.replay import fully_utilized

    cfg = fully_utilized(SimConfig(model_runner="auto", **config))
    device = Device(gpu_total_bytes(cfg.gpu))
    alloc = CachingAllocator(device, "vllm")
    resolved, _ = startup.start(cfg, load_model(cfg.model, cfg.dtype), device, alloc)
    steps, _ = startup.step_memories(resolved)
    return device, alloc, steps


S9_DRAFTS = 5  # benchmark S9's n-gram speculative decoding: draft tokens a step


def started_s13(free_bytes: int) -> tuple[Device, CachingAllocator, StepMemory]:
    """Benchmark S13's simulated engine just started (Llama-3.1-8B on an H100, vLLM 0.32.0 Model
    Runner V2, 2,048 tokens a step, 512 sequences), `free_bytes` left free on its GPU."""
    return _started_llama_8b(free_bytes, max_model_len=32768, max_num_seqs=512)


def started_s9(free_bytes: int) -> tuple[Device, CachingAllocator, StepMemory]:
    """Benchmark S9's simulated engine just started (S13's, with 256 sequences and n-gram
    speculative decoding of 5 draft tokens), `free_bytes` left free on its GPU."""
    return _started_llama_8b(
        free_bytes,
        max_model_len=8192,
        max_num_seqs=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": S9_DRAFTS},
    )


def _started_llama_8b(free_bytes: int, **config: object) -> tuple[Device, CachingAllocator, StepMemory]:
    """Llama-3.1-8B on an H100 under vLLM 0.32.0, 2,048 tokens a step, `free_bytes` left free."""
    device, alloc, steps = started(
        model="llama-3.1-8b", gpu="h100-80gb", vllm_version="0.32.0", max_num_batched_tokens=2048, **config
    )
    device.set_usage("other", device.free() - free_bytes)
    return device, alloc, steps


def prefill_beside(prefill: int, rows: int, copied: bool, drafts: int = 0) -> StepShape:
    """A step of a `prefill`-token chunk (none if 0) beside `rows` decoding requests at a random
    temperature, each verifying `drafts` draft tokens (1 + `drafts` tokens and logits rows);
    `copied`: one of them needs logits processing (a temperature other than 1.0), so Model
    Runner V2 copies the whole batch's logits to fp32."""
    decoding = tuple(
        ReqSlice(1 + drafts, 300, random=True, draft_tokens=drafts, processes=copied and i == 0) for i in range(rows)
    )
    return StepShape(((ReqSlice(prefill, 0, samples=False),) if prefill else ()) + decoding)


def played(alloc: CachingAllocator, steps: StepMemory, shape: StepShape) -> bool:
    """Whether `shape` runs on `alloc` (its retained outputs then freed, as the next step does)."""
    try:
        for block in run_tape(alloc, steps.plan(shape)):
            alloc.free(block)
    except CudaOutOfMemory:
        return False
    return True


def runs_out_on(alloc: CachingAllocator, steps: StepMemory, shape: StepShape) -> str | None:
    """The tensor the step runs out of memory on, or None if it runs (its blocks then freed)."""
    live = {}
    for op, name, nbytes in steps.plan(shape):
        if op == "alloc":
            try:
                live[name] = alloc.malloc(nbytes)
            except CudaOutOfMemory:
                return name
        elif op == "free" and name in live:
            alloc.free(live.pop(name))
        elif op == "rename" and name in live:
            live["hidden"] = live.pop(name)
    for block in live.values():
        alloc.free(block)
    return None


def sim_runs_after(
    alloc: CachingAllocator, engine: Engine, earlier: StepShape, step: StepShape, free_retained: bool
) -> bool:
    """Whether `step` runs on `alloc` after `earlier` ran on it, the earlier step's retained
    outputs freed first where `free_retained` (the engine frees them when the next step starts).
    An earlier step that cannot run in this memory is no history: True."""
    try:
        out = run_tape(alloc, engine.steps.plan(earlier))
    except CudaOutOfMemory:
        return True
    for block in out if free_retained else ():
        alloc.free(block)
    try:
        run_tape(alloc, engine.steps.plan(step))
    except CudaOutOfMemory:
        return False
    return True


def prompt(i: int, length: int, shared: int = 0) -> list[int]:
    """Distinct token ids per request, the first `shared` common to all."""
    return [7 + (j % 1000) for j in range(shared)] + [10_000 + (i * 7919 + j) % 100_000 for j in range(length - shared)]


async def _play(
    engine: Engine, jobs: list[Job], max_steps: int, cotenant_after_steps: tuple[int, int] | None
) -> Outcome:
    out = Outcome(engine)

    def sink(kind: str, data: object) -> None:
        if kind == "finish":
            out.finished[str(data)] = out.finished.get(str(data), 0) + 1
        elif kind == "error":
            out.errors += 1

    k = 0
    for job in jobs:
        for _ in range(job.count):
            ids = prompt(k, job.prompt_len, job.shared_prefix)
            items = []
            if job.image:
                assert engine.model.vision is not None
                ids[4 : 4 + job.image] = [engine.model.vision.image_token_id] * job.image
                items = [Item(4, job.image)]
            for j in range(job.n):
                engine.add(
                    Request(
                        f"r{k}-{j}", list(ids), job.sampling, 0.0, sink=sink, stream_seed=k * 31 + j, mm_items=items
                    )
                )
            k += 1
    while engine.ready and engine.scheduler.has_work() and out.steps < max_steps:
        if cotenant_after_steps and out.steps == cotenant_after_steps[0]:
            engine.cotenant_override["cotenant"] = cotenant_after_steps[1]
            engine.apply_cotenants()
        await engine.step()
        out.steps += 1
    return out


def play(
    cfg: SimConfig,
    jobs: list[Job],
    max_steps: int = 5000,
    cotenant_after_steps: tuple[int, int] | None = None,
    keep_speedup: bool = False,
) -> Outcome:
    """Boot an engine for `cfg`, submit every job at once, step until done or dead (at full
    speed unless `keep_speedup`)."""
    if not keep_speedup:
        cfg.speedup = 1e9
    engine = make_engine(cfg)
    return asyncio.run(_play(engine, jobs, max_steps, cotenant_after_steps))
