"""Scenarios nobody picked: engines and traffic drawn at random, for hunting out-of-memory
crashes behind kvgate on configurations its memory terms were never looked at with.

S1-S14 and the held-out set (tests/heldout/scenarios.py) are hand-made: each was built around
one way vLLM runs out of memory, and kvgate's terms were checked against them. The judge of
"vLLM never dies of OOM behind it" is traffic and engines no one chose, so this module draws
them: `scenario(index)` is a pure function of its index (model, GPU, release, runner, pool,
scheduler limits, allocator settings and a mix of traffic), the same on every machine.

    python -m bench.repeat_arm R7 --scenarios-from bench/random_scenarios.py --arm kvgate
    python -m bench.repeat_arm R7 --scenarios-from bench/random_scenarios.py --arm none
    python -m bench --scenarios-from bench/random_scenarios.py --skip-overhead --no-profile --out DIR

`SCENARIOS` holds R0 - R{COUNT - 1}, then `R{i}a`: each of them whose pool was not already the
one vLLM's start-up advises, at that pool (the least headroom), where the engine starts with it;
`KVGATE_RANDOM_SCENARIOS=N` asks for another count. Each engine is started once while it is
drawn (the simulator's start-up, no server): a draw whose model does not fit its GPU, or that
vLLM would refuse to start, is drawn again from the next sub-seed, so every scenario serves. Nothing here says whether the unprotected engine runs out of
memory: `--arm none` tells, and a scenario it survives still checks kvgate's half of the promise
that costs throughput (never refusing what vLLM serves).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from typing import Any, NamedTuple

from bench.scenarios import Scenario, _flags, _sim
from bench.workloads import Call, chat_call, document_call, lognormal_int, poisson_times, streaming, words
from demo.replay import fully_utilized, start_on_empty_gpu
from kvgate.sim import startup
from kvgate.sim.config import SimConfig

COUNT = 40
DURATION_S = 30.0


class ModelChoice(NamedTuple):
    """A simulator preset and the GPUs (with a tensor-parallel size) whose memory holds it (a
    named tuple: `--scenarios-from` loads this file without registering it as a module, where a
    dataclass cannot resolve its annotations)."""

    name: str
    gpus: tuple[tuple[str, int], ...]
    max_len: int  # the longest context drawn for it (its max_position_embeddings or less)


MODELS = (
    ModelChoice("llama-3.1-8b", (("l4-24gb", 1), ("a10-24gb", 1), ("a100-40gb", 1), ("h100-80gb", 1)), 32768),
    ModelChoice("llama-3-8b", (("l4-24gb", 1), ("a100-40gb", 1), ("h100-80gb", 1)), 8192),
    ModelChoice("mistral-7b", (("l4-24gb", 1), ("a10-24gb", 1), ("a100-80gb", 1)), 32768),
    ModelChoice("qwen2.5-7b", (("l4-24gb", 1), ("a100-40gb", 1), ("a100-80gb", 1), ("h100-80gb", 1)), 32768),
    ModelChoice("deepseek-v2-lite", (("a100-40gb", 1), ("a100-80gb", 1), ("h100-80gb", 1)), 32768),
    ModelChoice("mixtral-8x7b", (("h200-141gb", 1), ("h100-80gb", 2), ("a100-80gb", 2)), 32768),
    ModelChoice("llama-3.1-70b", (("h100-80gb", 2), ("h100-80gb", 4), ("a100-80gb", 4), ("h200-141gb", 2)), 32768),
)
# (release, runner): V1 before 0.29; 0.29.0 - 0.33.0 on the runner vLLM's own rule picks, or V1
# as an operator sets VLLM_USE_V2_MODEL_RUNNER=0 (kvgate is told with --model-runner v1).
ENGINES = (
    ("0.25.0", "v1"),
    ("0.28.0", "v1"),
    ("0.31.0", "v1"),
    ("0.31.0", "auto"),
    ("0.32.0", "auto"),
    ("0.32.0", "auto"),
    ("0.32.0", "v1"),
    ("0.33.0", "auto"),
)


def _engine(rng: random.Random) -> tuple[SimConfig, list[str], ModelChoice]:
    """One engine as an operator might start it, and the flags kvgate is given to match it."""
    model = rng.choice(MODELS)
    gpu, tp = rng.choice(model.gpus)
    version, runner = rng.choice(ENGINES)
    mnbt = rng.choice((2048, 4096, 8192))
    seqs = rng.choice((128, 256, 512, 1024))
    max_len = rng.choice([n for n in (8192, 16384, 32768) if n <= model.max_len])
    fields: dict[str, Any] = dict(
        model=model.name,
        gpu=gpu,
        tensor_parallel_size=tp,
        vllm_version=version,
        model_runner=runner,
        max_model_len=max_len,
        max_num_batched_tokens=mnbt,
        max_num_seqs=seqs,
    )
    extra: dict[str, str] = {}
    if tp > 1:
        extra["tensor_parallel_size"] = str(tp)
    if rng.random() < 0.2:
        fields["kv_cache_dtype"] = extra["kv_cache_dtype"] = "fp8"
    if rng.random() < 0.3:
        utilization = rng.choice((0.85, 0.92, 0.95))
        fields["gpu_memory_utilization"] = utilization
        extra["gpu_memory_utilization"] = str(utilization)
    if rng.random() < 0.15:
        fields["max_logprobs"] = -1
        extra["max_logprobs"] = "-1"
    if version in ("0.32.0", "0.33.0") and runner == "auto" and model.name.startswith("llama") and rng.random() < 0.15:
        spec = {"method": "ngram", "num_speculative_tokens": rng.choice((3, 5))}
        fields["speculative_config"] = spec
        extra["speculative_config"] = json.dumps(spec)
    expandable = rng.random() < 0.15
    fields["expandable_segments"] = expandable
    cfg = _sim(**fields)
    if "gpu_memory_utilization" not in fields and rng.random() < 0.7:
        cfg = fully_utilized(cfg)  # the pool vLLM's start-up advice sizes: the least headroom
    flags = _flags(mnbt, seqs, v1=runner == "v1", **extra)
    if expandable:
        flags.append("--expandable-segments")
    return cfg, flags, model


def _chats(rng: random.Random, model: str, d: float, rate: float) -> list[Call]:
    """Chat at `rate`/s with sampling settings users mix: temperatures, top-p, min-p, penalties,
    logprobs, seeds or none."""
    calls = []
    temperatures = rng.sample([0.0, 0.3, 0.7, 0.8, 1.0], 2)
    penalty_share, logprob_share = rng.choice((0.0, 0.1, 0.3)), rng.choice((0.0, 0.1, 0.3))
    for i, t in enumerate(poisson_times(rng, rate, d)):
        c = chat_call(
            rng, t, i, model=model, max_tokens=(64, 128, 256, 512, 1024), temperature=rng.choice(temperatures)
        )
        if rng.random() < 0.3:
            c.body["top_p"] = 0.9
        if rng.random() < 0.1:
            c.body["min_p"] = 0.05
        if rng.random() < penalty_share:
            c.body[rng.choice(("frequency_penalty", "presence_penalty", "repetition_penalty"))] = 0.5
        if rng.random() < logprob_share:
            c.body.update(logprobs=True, top_logprobs=rng.choice((1, 5, 20)))
        if rng.random() < 0.5:
            del c.body["seed"]
        calls.append(c)
    return calls


def _long_prompts(rng: random.Random, model: str, d: float, max_len: int) -> list[Call]:
    """RAG queries or documents up to most of the context, a few a minute to one a second."""
    lengths = [n for n in (2000, 4000, 8000, 12000, 16000, 24000, 30000) if n + 300 <= max_len]
    rate = rng.choice((0.1, 0.25, 0.5))
    temperature = rng.choice((0.0, 0.2, 0.7))
    return [
        document_call(
            rng, t, rng.choice(lengths), "long prompt", rng.choice((1, 64, 256)), model=model, temperature=temperature
        )
        for t in poisson_times(rng, rate, d)
    ]


def _burst(rng: random.Random, model: str, d: float) -> list[Call]:
    """A batch job's burst of short calls within two seconds: many rows sampled at once, with n
    samples each, at a temperature, some with logprobs."""
    n = rng.choice((1, 1, 2, 4, 8, 16))
    count = rng.randint(20, max(20, min(500, 640 // n)))
    start = rng.uniform(0.2, 0.6) * d
    temperature = rng.choice((0.7, 0.9, 1.0))
    logprobs = rng.random() < 0.3
    calls = []
    for k in range(count):
        c = chat_call(
            rng,
            start + 2 * rng.random(),
            50_000 + k,
            model=model,
            median_prompt=rng.choice((60, 200, 400)),
            max_tokens=(32, 64, 128),
        )
        c.body.update(n=n, temperature=temperature)
        if logprobs:
            c.body.update(logprobs=True, top_logprobs=rng.choice((1, 5)))
        calls.append(Call(c.at, c.path, c.body, f"burst n={n}"))
    return calls


def _scored(rng: random.Random, model: str, d: float, max_len: int, max_logprobs: int) -> list[Call]:
    """An evaluation harness scoring passages with prompt logprobs."""
    ks = [1, 5, 20] + ([-1] if max_logprobs == -1 else [])
    k = rng.choice(ks)
    lengths = [n for n in (1000, 2000, 4000, 8000) if n + 16 <= max_len]
    return [
        document_call(rng, t, rng.choice(lengths), f"prompt_logprobs {k}", 1, model=model, prompt_logprobs=k)
        for t in poisson_times(rng, rng.choice((0.2, 0.5)), d)
    ]


def _prompt_lists(rng: random.Random, model: str, d: float) -> list[Call]:
    """lm-eval style lists of 4-32 few-shot prompts sharing a task prefix, greedy, with a stop."""
    tasks = [words(rng, rng.randint(200, 900)) for _ in range(3)]
    calls = []
    for t in poisson_times(rng, rng.choice((0.3, 0.5)), d):
        questions = [words(rng, lognormal_int(rng, 110, 0.4, 30, 300)) for _ in range(rng.randint(4, 32))]
        task = rng.choice(tasks)
        body = {
            "model": model,
            "prompt": [f"{task}\nQuestion: {q}\nAnswer:" for q in questions],
            "max_tokens": rng.choice((32, 128, 256)),
            "temperature": 0.0,
            "stop": ["\n\nQuestion:"],
        }
        calls.append(Call(t, "/v1/completions", body, "prompt list"))
    return calls


def _traffic(seed: int, model: str, max_len: int, max_logprobs: int) -> Any:
    """The scenario's traffic function: chat always, and two or three other parts drawn once
    (from `seed`), their calls drawn from the harness's own generator at each run."""
    shape = random.Random(seed)
    chat_rate = shape.choice((1.0, 2.0, 3.0, 4.0))
    parts = shape.sample(("long", "burst", "scored", "lists"), shape.randint(1, 3))
    streamed = shape.random() < 0.8

    def traffic(rng: random.Random, scale: float) -> list[Call]:
        d = DURATION_S * scale
        calls = _chats(rng, model, d, chat_rate)
        if "long" in parts:
            calls += _long_prompts(rng, model, d, max_len)
        if "burst" in parts:
            calls += _burst(rng, model, d)
        if "scored" in parts:
            calls += _scored(rng, model, d, max_len, max_logprobs)
        if "lists" in parts:
            calls += _prompt_lists(rng, model, d)
        if streamed:
            # Lists of prompts stream too (every choice's events on one stream), as a client
            # that streams everything sends them.
            return streaming(calls)
        return sorted(calls, key=lambda c: c.at)

    traffic.__doc__ = f"chat at {chat_rate}/s with {', '.join(parts)}; {'streamed' if streamed else 'not streamed'}"
    return traffic


def scenario(index: int) -> Scenario:
    """Random scenario `R{index}`: the same for the same index everywhere."""
    for attempt in range(50):
        rng = random.Random(f"kvgate-random-scenario-{index}-{attempt}")
        try:
            cfg, flags, model = _engine(rng)
            start_on_empty_gpu(cfg)
        except startup.StartupError:
            continue
        cfg = replace(cfg, restart_seconds=60.0, metrics_clock="sim")
        traffic = _traffic(rng.randrange(2**32), model.name, cfg.max_model_len or model.max_len, cfg.max_logprobs)
        title = (
            f"{model.name} on {cfg.tensor_parallel_size} x {cfg.gpu}, vLLM {cfg.vllm_version} ({cfg.model_runner}), "
            f"{cfg.max_num_batched_tokens} tokens a step, {cfg.max_num_seqs} seqs: {traffic.__doc__}"
        )
        return Scenario(f"R{index}", title, cfg, flags, traffic, DURATION_S, 2, caps=[8, 32, 128])
    raise RuntimeError(f"no engine of random scenario {index} starts in 50 draws")


def at_advised_pool(scenario: Scenario) -> Scenario | None:
    """`scenario` with the KV pool vLLM's start-up log advises ("--kv-cache-memory=... to fully
    utilize gpu memory"): the least transient headroom an operator is told to run with, where a
    charge kvgate under-counts shows first. None where the engine does not start with it (the
    advice leaves 150 MiB; V1's graphs and sampler warm-up after the pool can need more)."""
    try:
        sim = fully_utilized(scenario.sim)
        start_on_empty_gpu(sim)
    except startup.StartupError:
        return None
    return replace(
        scenario, key=f"{scenario.key}a", title=f"{scenario.title} (the pool vLLM's start-up advises)", sim=sim
    )


_DRAWN = [scenario(i) for i in range(int(os.environ.get("KVGATE_RANDOM_SCENARIOS", COUNT)))]
# R0 - R{COUNT - 1}, then R{i}a for each whose pool was not already the advised one.
SCENARIOS: list[Scenario] = _DRAWN + [
    advised for s in _DRAWN if s.sim.kv_cache_memory_bytes is None and (advised := at_advised_pool(s)) is not None
]
