"""S1-S10: a simulated vLLM configuration each, the kvgate flags that match it, and seeded traffic.

Every scenario names the vLLM release and model runner its simulator plays (`engine`). S2-S7
were built on the V1 runner with the sort-path sampler the simulator first played, so they play
V1 of a release before 0.32 (kvgate/sim/flavor.py); S3's graphs outside the budget are vLLM < 0.21;
S5's prompt logprobs over a whole chunk exist only on V1. S1 and S8-S10 play vLLM 0.32.0 with
the runner its own rule picks (V2 for their models), where V2 itself runs out: MLA's context
up-projection (S1), the fp32 logits of a temperature > 0 batch its greedy profile never saw
(S8), 1 + k sampled rows per request under speculative decoding (S9), and `prompt_logprobs: -1`
on a server that allows it (S10); S11 plays 0.32.0's V2 prompt logprobs (k = 5 and -1).

Times in the traffic are simulated seconds; the harness sends each call at `at / speedup` wall
seconds. `scale` shrinks the traffic for `--quick` and the smoke test (fewer arrivals, shorter
window; the same mix).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.workloads import Call, chat_call, document_call, image_chat_call, poisson_times, streaming
from demo.replay import fully_utilized
from kvgate.sim.config import CoTenant, SimConfig
from kvgate.sim.flavor import Flavor
from kvgate.sim.model import load_model
from kvgate.units import GiB

SYSTEM_PROMPTS = [
    "You are a helpful assistant for the support desk of a large retailer. " * 40,
    "You are a careful code reviewer. Answer with short and precise remarks. " * 55,
    "You translate between English and French, keeping the tone of the source. " * 30,
]


@dataclass
class Scenario:
    key: str
    title: str
    sim: SimConfig
    kvgate_flags: list[str]
    traffic: Callable[[random.Random, float], list[Call]]
    duration_s: float  # simulated seconds of arrivals (at scale 1)
    speedup: float
    # The static-cap sweep's first values (one refinement follows): sized to the scenario's
    # concurrency, since a cap far below it only times out for the whole drain.
    caps: list[int] = field(default_factory=lambda: [4, 16, 64])
    note: str = ""

    @property
    def engine(self) -> str:
        """The vLLM release and model runner the simulator plays, e.g. "vLLM 0.31.0, V1"."""
        runner = Flavor.of(self.sim, load_model(self.sim.model, self.sim.dtype)).runner
        return f"vLLM {self.sim.vllm_version}, {runner.upper()}"


def _chat_stream(rng: random.Random, rate: float, duration: float, **kw) -> list[Call]:
    return [chat_call(rng, t, i, **kw) for i, t in enumerate(poisson_times(rng, rate, duration))]


def _with_logprobs(rng: random.Random, calls: list[Call], share: float) -> None:
    """OpenAI clients asking for token logprobs (raw logprobs B x V fp32: never profiled)."""
    for c in calls:
        if rng.random() < share:
            c.body.update(logprobs=True, top_logprobs=5)


def chat_with_long_prompts(
    rng: random.Random, duration: float, chat_rate: float, long_rate: float, lengths: list[int]
) -> list[Call]:
    """Chat (a fifth asking for top-5 logprobs) with long prompts of `lengths` tokens mixed in."""
    calls = _chat_stream(rng, chat_rate, duration)
    _with_logprobs(rng, calls, 0.2)
    for t in poisson_times(rng, long_rate, duration):
        calls.append(document_call(rng, t, rng.choice(lengths), "long prompt"))
    return streaming(calls)


# ----- S1 ----------------------------------------------------------------------------------------
DEEPSEEK = "deepseek-v2-lite"


def s1_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s plus long documents (16k-120k tokens, summarisation) at 0.25/s, on a
    DeepSeek-V2-Lite-shaped MLA model."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d, model=DEEPSEEK)
    for t in poisson_times(rng, 0.25, d):
        n = rng.choice([16000, 32000, 48000, 64000, 96000, 120000])
        calls.append(document_call(rng, t, n, "long document", max_tokens=256, model=DEEPSEEK))
    return streaming(calls)


# ----- S2 ----------------------------------------------------------------------------------------
def s2_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s; at 10 s a burst of 16 long prompts (6k-16k tokens) within one second."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d)
    burst = max(4, int(16 * scale))
    for _k in range(burst):
        calls.append(
            document_call(
                rng, 10 * scale + rng.random(), rng.choice([6000, 8000, 12000, 16000]), "burst prompt", max_tokens=256
            )
        )
    return streaming(calls)


# ----- S3 ----------------------------------------------------------------------------------------
def s3_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Busy chat (3/s), a fifth asking for top-5 logprobs, with long prompts (2k-8k tokens)
    at 0.5/s."""
    return chat_with_long_prompts(rng, 30 * scale, 3.0, 0.5, [2000, 4000, 8000])


# ----- S4 ----------------------------------------------------------------------------------------
def s4_traffic(rng: random.Random, scale: float) -> list[Call]:
    """A spike of mixed chat: 300 requests/s for 5 s, prompts 16-6k tokens (median 250), 16-256
    output tokens, top-p 0.9, a third with a presence penalty (penalties' prompt ids held across
    steps)."""
    calls = []
    for i, t in enumerate(poisson_times(rng, 300.0, 5 * scale)):
        extra = {"presence_penalty": 0.5} if rng.random() < 1 / 3 else {}
        calls.append(
            chat_call(rng, t, i, median_prompt=250, max_prompt=6000, max_tokens=(16, 64, 128, 256), top_p=0.9, **extra)
        )
    return streaming(calls)


# ----- S5 ----------------------------------------------------------------------------------------
def s5_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s; an evaluation job scores long prompts (prompt_logprobs, 2k-8k) at 0.3/s."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d)
    for t in poisson_times(rng, 0.3, d):
        calls.append(
            document_call(rng, t, rng.choice([2000, 4000, 8000]), "scored prompt", max_tokens=1, prompt_logprobs=1)
        )
    return streaming(calls)


# ----- S6 ----------------------------------------------------------------------------------------
# S6's three trainers (and bench/cotenant_race.py's): sized against S6's engine at start-up (SCENARIOS).
TRAINER_BYTES = int(2.6 * GiB)


def s6_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2.5/s (a fifth with top-5 logprobs), long prompts (4k-8k) at 0.4/s, beside
    co-tenants that took their memory in the first second."""
    return chat_with_long_prompts(rng, 30 * scale, 2.5, 0.4, [4000, 6000, 8000])


# ----- S7 ----------------------------------------------------------------------------------------
def s7_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 4/s, each with one of three long shared system prompts (~500-700 tokens)."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, system=rng.choice(SYSTEM_PROMPTS), median_prompt=300, max_tokens=(256, 512, 1024, 2048))
        for i, t in enumerate(poisson_times(rng, 4.0, d))
    ]
    return streaming(calls)


# ----- S8 ----------------------------------------------------------------------------------------
QWEN = "qwen2.5-7b"


def s8_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s (temperature 0.7) and greedy classification calls at 2/s; at 10 s a
    self-consistency job sends 40 questions (200-600 tokens) within two seconds, each asking
    n=16 samples at temperature 1.0 (640 sequences sampling at once)."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d, model=QWEN)
    for i, t in enumerate(poisson_times(rng, 2.0, d)):
        c = chat_call(rng, t, 20_000 + i, median_prompt=300, max_tokens=(8, 16), model=QWEN, temperature=0.0)
        calls.append(Call(c.at, c.path, c.body, "greedy label"))
    for i in range(max(4, int(40 * scale))):
        c = chat_call(
            rng,
            10 * scale + 2 * rng.random(),
            10_000 + i,
            median_prompt=350,
            max_prompt=600,
            max_tokens=(192, 256),
            model=QWEN,
        )
        c.body.update(n=16, temperature=1.0)
        calls.append(Call(c.at, c.path, c.body, "n=16 samples"))
    return streaming(calls)


# ----- S9 ----------------------------------------------------------------------------------------
NGRAM_5 = {"method": "ngram", "num_speculative_tokens": 5}


def s9_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Busy chat at 6/s (temperature 0.7, 128-512 tokens) on a server verifying 5 n-gram draft
    tokens per decoding request."""
    return streaming(_chat_stream(rng, 6.0, 30 * scale, max_tokens=(128, 256, 512)))


# ----- S10 ---------------------------------------------------------------------------------------
def s10_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s; an evaluation harness scores passages (500-4,000 tokens) with
    `prompt_logprobs: -1`, the whole vocabulary per prompt token, at 0.4/s."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d)
    for t in poisson_times(rng, 0.4, d):
        n = rng.choice([500, 1000, 1500, 2000, 3000, 4000])
        calls.append(document_call(rng, t, n, "scored passage", max_tokens=1, prompt_logprobs=-1))
    return streaming(calls)


# ----- S11 ---------------------------------------------------------------------------------------
def s11_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s; an evaluation harness scores passages at 0.6/s: a half with `prompt_logprobs: 5`
    (1,000-4,000 tokens), a third with `-1` on passages that fit one 2,048-token step (300-1,500),
    the rest with `-1` on passages spanning two or three steps (3,000-6,000), whose earlier steps'
    whole-vocabulary results Model Runner V2 keeps on the GPU until the last one."""
    d = 30 * scale
    calls = _chat_stream(rng, 2.0, d)
    for t in poisson_times(rng, 0.6, d):
        pick = rng.random()
        if pick < 0.5:
            n, k = rng.choice([1000, 2000, 3000, 4000]), 5
        elif pick < 0.83:
            n, k = rng.choice([300, 600, 1000, 1500]), -1
        else:
            n, k = rng.choice([3000, 4500, 6000]), -1
        calls.append(document_call(rng, t, n, f"prompt_logprobs {k}", max_tokens=1, prompt_logprobs=k))
    return streaming(calls)


# ----- S12, S13 -----------------------------------------------------------------------------------
def hol_traffic(long_extra: dict[str, Any]) -> Callable[[random.Random, float], list[Call]]:
    """Head-of-line blocking on an H100: chat at 3/s at OpenAI's default temperature 1.0; long
    documents (12k-24k tokens, 1,024 output tokens) at 0.2/s with `long_extra`, which changes what
    every sampling step of the whole batch allocates while one of them decodes; at 8 s a batch job
    sends 400 short chats (prompts median 120, 128-256 output tokens) within two seconds."""

    def traffic(rng: random.Random, scale: float) -> list[Call]:
        d = 20 * scale
        calls = [
            chat_call(rng, t, i, median_prompt=200, max_prompt=2000, max_tokens=(256, 512, 1024), temperature=1.0)
            for i, t in enumerate(poisson_times(rng, 3.0, d))
        ]
        for k in range(max(40, int(400 * scale))):
            c = chat_call(
                rng, 8 * scale + 2 * rng.random(), 50_000 + k, median_prompt=120, max_prompt=600, max_tokens=(128, 256)
            )
            c.body["temperature"] = 1.0
            calls.append(Call(c.at, c.path, c.body, "batch chat"))
        for t in poisson_times(rng, 0.2, d):
            n = rng.choice([12000, 16000, 24000])
            calls.append(document_call(rng, t, n, "long document", max_tokens=1024, **long_extra))
        return streaming(calls)

    traffic.__doc__ = (hol_traffic.__doc__ or "").replace("`long_extra`", json.dumps(long_extra))
    return traffic


# ----- S14 ---------------------------------------------------------------------------------------
QWEN_VL = "qwen2.5-vl-7b"
# Photo sizes (width, height): 972 to 3,888 image tokens each with Qwen2.5-VL's preprocessor.
PHOTOS = [(1024, 768), (1344, 1008), (1600, 1200), (2016, 1512)]


def s14_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Text chat at 1/s and single-image questions at 0.5/s; at 10 s and at 20 s an album of 16
    photos of 2,016 x 1,512 (3,888 image tokens each) uploaded at once (within 0.2 s)."""
    d = 30 * scale
    calls = _chat_stream(rng, 1.0, d, model=QWEN_VL, max_tokens=(64, 128, 256))
    for i, t in enumerate(poisson_times(rng, 0.5, d)):
        calls.append(image_chat_call(rng, t, 1000 + i, rng.choice(PHOTOS), QWEN_VL))
    for start in (10 * scale, 20 * scale):
        for _ in range(max(4, int(16 * scale))):
            at = start + 0.2 * rng.random()
            calls.append(image_chat_call(rng, at, 2000 + len(calls), (2016, 1512), QWEN_VL, "album photo"))
    return streaming(calls)


def _flags(mnbt: int, seqs: int, v1: bool = True, **extra: str) -> list[str]:
    # A V1 simulator (_sim) plays VLLM_USE_V2_MODEL_RUNNER=0; kvgate is told so, as the operator
    # would tell it (vLLM's /version does not say which runner runs). On vLLM 0.32.0's own choice
    # (_sim_v2) kvgate applies vLLM's rule to the version the backend reports.
    out = ["--max-num-batched-tokens", str(mnbt), "--max-num-seqs", str(seqs)]
    out += ["--model-runner", "v1"] if v1 else []
    for k, v in extra.items():
        out += [f"--{k.replace('_', '-')}", v]
    return out


def _sim(**kw) -> SimConfig:
    base = dict(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        restart_seconds=60.0,
        metrics_clock="sim",
        vllm_version="0.31.0",
        model_runner="v1",
    )
    return SimConfig(**{**base, **kw})


def _sim_v2(**kw) -> SimConfig:
    """vLLM 0.32.0 as users get it: the runner its own rule picks on CUDA (V2 for these models)."""
    return _sim(**{"vllm_version": "0.32.0", "model_runner": "auto", **kw})


SCENARIOS: list[Scenario] = [
    # vLLM's own advice at start-up ("--kv-cache-memory=... to fully utilize gpu memory") leaves
    # the profile's peak and a 150 MiB buffer: the context up-projection beyond the profile's
    # [W, heads, nope + v] stand-in does not fit in it.
    Scenario(
        "S1",
        "Chunked prefill over long prefixes, MLA context up-projection (DeepSeek-V2-Lite)",
        fully_utilized(_sim_v2(model=DEEPSEEK, max_model_len=131072, max_num_batched_tokens=2048, max_num_seqs=256)),
        _flags(2048, 256, v1=False),
        s1_traffic,
        30,
        4,
    ),
    Scenario(
        "S2",
        "max_num_batched_tokens=200000, max_num_seqs=200, a burst of long prompts",
        _sim(max_model_len=32768, max_num_batched_tokens=200000, max_num_seqs=200),
        _flags(200000, 200),
        s2_traffic,
        30,
        4,
    ),
    # 0.985, not 0.99: with the CUDA context outside the budget (vLLM >= 0.7) 0.99 leaves the
    # 670 MiB of graphs no room and the engine dies in its start-up warm-up (failure mode 4).
    Scenario(
        "S3",
        "gpu_memory_utilization 0.985, CUDA graphs outside the budget (vLLM < 0.21)",
        _sim(
            max_model_len=16384, gpu_memory_utilization=0.985, cudagraph_memory_in_budget=False, vllm_version="0.20.0"
        ),
        _flags(8192, 1024, gpu_memory_utilization="0.985"),
        s3_traffic,
        30,
        4,
    ),
    Scenario(
        "S4",
        "Allocator fragmentation under mixed high-concurrency batches",
        fully_utilized(_sim(max_model_len=16384)),
        _flags(8192, 1024),
        s4_traffic,
        5,
        1,
        caps=[64, 256],
    ),
    Scenario(
        "S5",
        "prompt_logprobs on long prompts mixed into chat",
        _sim(max_model_len=16384, gpu_memory_utilization=0.95, max_num_seqs=256),
        _flags(8192, 256, gpu_memory_utilization="0.95"),
        s5_traffic,
        30,
        4,
    ),
    # This engine (vLLM 0.32.0, V2) leaves 8.17 GiB of the GPU free after start-up (its 0.79 GiB
    # profile region, emptied after graph capture, and the 10 % outside the utilization envelope
    # less the graphs). Three trainers take 7.8 GiB of it in the first simulated second, leaving
    # 0.37 GiB: less than an 8k-token prefill's MLP. They come before the traffic because a
    # co-tenant only takes free memory: once the engine's allocator has cached a full step
    # (expandable segments keep freed pages mapped, as PyTorch does), a trainer can no longer
    # take it. Until session 43 S6 ran V1, whose warm-up keeps its region cached (a co-tenant
    # cannot take it), on a simulator that unmapped freed pages at once, which hid that.
    Scenario(
        "S6",
        "A co-tenant process growing on the same GPU",
        _sim_v2(
            max_model_len=16384,
            expandable_segments=True,
            cotenants=[
                CoTenant("trainer-1", TRAINER_BYTES, 0.0),
                CoTenant("trainer-2", TRAINER_BYTES, 0.5),
                CoTenant("trainer-3", TRAINER_BYTES, 1.0),
            ],
        ),
        # the operator who set PYTORCH_CUDA_ALLOC_CONF on vLLM tells kvgate so
        [*_flags(8192, 1024, v1=False), "--expandable-segments"],
        s6_traffic,
        30,
        4,
    ),
    Scenario(
        "S7",
        "KV-bound chat with shared system prompts (preemption, not OOM)",
        _sim(gpu="l4-24gb", max_model_len=8192),
        _flags(2048, 256),
        s7_traffic,
        30,
        4,
    ),
    Scenario(
        "S8",
        "A temperature > 0 batch whose fp32 logits V2's greedy profile never saw (n=16 sampling)",
        fully_utilized(_sim_v2(model=QWEN, max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=1024)),
        _flags(2048, 1024, v1=False),
        s8_traffic,
        30,
        2,  # 640 sequences at once: at 4 this 2-core machine could not drive them
    ),
    Scenario(
        "S9",
        "Speculative decoding (n-gram, 5 draft tokens) with many running requests",
        fully_utilized(
            _sim_v2(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, speculative_config=NGRAM_5)
        ),
        _flags(2048, 256, v1=False, speculative_config=json.dumps(NGRAM_5)),
        s9_traffic,
        30,
        4,
    ),
    Scenario(
        "S10",
        "prompt_logprobs: -1 from an evaluation harness, on a server started with --max-logprobs -1",
        _sim_v2(max_model_len=16384, max_logprobs=-1),
        _flags(8192, 1024, v1=False, max_logprobs="-1"),
        s10_traffic,
        30,
        4,
    ),
    # Issue #27: V2 prompt logprobs as vLLM 0.32.0's code runs them (v1/worker/gpu/sample/
    # prompt_logprob.py): two 1,024-row sub-chunks of logits over the whole step, and with -1 the
    # earlier steps' results kept and concatenated again at the last. 15 % of the H100 lies outside
    # the budget: enough for k=5 and for a one-step -1 passage, not for -1 passages over several
    # steps, nor for several -1 passages held at once.
    # Issue 24: a few long requests among many short ones, where the long ones change what the
    # whole batch's sampling step allocates, beyond the start-up profile: on V1 (vLLM 0.31.0) a
    # document asking `logprobs` makes the sampler compute the raw logprobs of every row, B x V
    # fp32 (v1/sample/sampler.py `Sampler.forward`); on V2 (0.32.0's own choice) a document at
    # temperature 0.7 makes it copy every row's logits to fp32 (v1/worker/gpu/sample/states.py
    # `SamplingStates.add_request`), which the greedy profile never did. With the batch job's
    # 400 chats decoding beside a document, the unprotected engine runs out (about 300 rows);
    # without the documents' extra it survives (bench/results/goodput-issue24/README.md).
    Scenario(
        "S12",
        "Head-of-line blocking: long documents asking logprobs among a burst of short chats (V1)",
        fully_utilized(_sim(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=512)),
        _flags(2048, 512),
        hol_traffic({"logprobs": 5, "temperature": 1.0}),
        20,
        2,
        caps=[64, 512],
    ),
    Scenario(
        "S13",
        "Head-of-line blocking: long documents at temperature 0.7 among a burst of short chats (V2)",
        fully_utilized(_sim_v2(max_model_len=32768, max_num_batched_tokens=2048, max_num_seqs=512)),
        _flags(2048, 512, v1=False),
        hol_traffic({"temperature": 0.7}),
        20,
        2,
        caps=[64, 512],
    ),
    Scenario(
        "S11",
        "prompt_logprobs 5 and -1 on Model Runner V2 (two sub-chunks, -1 kept across steps)",
        _sim_v2(
            max_model_len=16384,
            max_num_batched_tokens=2048,
            max_num_seqs=256,
            max_logprobs=-1,
            gpu_memory_utilization=0.85,
        ),
        _flags(2048, 256, v1=False, max_logprobs="-1", gpu_memory_utilization="0.85"),
        s11_traffic,
        30,
        4,
    ),
    # Issue 23: Model Runner V2 of vLLM 0.25.0 - 0.27 profiles the decoder alone (no encoder call,
    # no encoder cache held), and the KV pool is sized as vLLM's own start-up advice says: the
    # vision tower of a step of several photos, and their cached embeddings, run out of memory.
    # Expandable segments: what runs out is the encoder's memory, not a fragmented cache.
    Scenario(
        "S14",
        "Image bursts on Qwen2.5-VL-7B, Model Runner V2 of vLLM 0.25.0 (start-up profile without the encoder)",
        fully_utilized(
            _sim(
                model=QWEN_VL,
                vllm_version="0.25.0",
                model_runner="auto",
                max_model_len=32768,
                max_num_batched_tokens=8192,
                max_num_seqs=256,
                expandable_segments=True,
            )
        ),
        [*_flags(8192, 256, v1=False), "--expandable-segments"],
        s14_traffic,
        30,
        4,
        caps=[2, 4, 16],
    ),
]
