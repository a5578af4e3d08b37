"""Held-out scenarios: traffic and engines kvgate's queue policy and memory terms were not tuned on.

Kept out of bench/scenarios.py and the README's table on purpose: they check that what kvgate
does in S1-S14 carries over to models, GPUs and traffic mixes it was not looked at with. Each one
must run the unprotected engine out of memory (issue 24's rule for a judged scenario).

    python -m bench --scenarios-from tests/heldout/scenarios.py --skip-overhead --no-profile --out DIR

- H1: Qwen2.5-7B (152k vocabulary) on an A100 80 GB, vLLM 0.32.0 on its own runner (V2), the pool
  as vLLM's start-up advice sizes it. RAG queries (3k-8k tokens, temperature 0.3) among chat at
  temperature 0.8 and, at 10 s, a burst of 480 short extraction calls: every row's logits are
  copied to fp32 (0.58 MiB a row) once one row samples at a temperature other than 0 or 1, which
  V2's greedy profile never did.
- H2: Mistral-7B (32k vocabulary) on an L4 24 GB at --gpu-memory-utilization 0.97, vLLM 0.31.0 on V1, chat with a quarter asking
  top-5 logprobs and an evaluation job scoring passages with `prompt_logprobs: 5` (4k-8k tokens):
  V1 computes the prompt logprobs of a whole chunk (up to 8,192 tokens) over the vocabulary, far beyond
  its profile, while chat decodes beside it.
- H3: DeepSeek-V2-Lite (MLA, 102k vocabulary) on an A100 80 GB, vLLM 0.32.0 (V2), the pool as
  vLLM's advice sizes it: multi-turn contexts of 24k-64k tokens among chat at temperature 0.7,
  and at 12 s a batch of 450 short chats: chunked prefill over a long computed prefix up-projects
  its latent cache (beyond the profile's stand-in) while the batch's rows are copied to fp32.
- H4: Mixtral-8x7B (MoE, 32k vocabulary) on an H200 141 GB, vLLM 0.31.0 on V1, the pool as vLLM's
  advice sizes it: chat (a fifth with a frequency penalty) and at 8 s a self-consistency job of
  32 questions asking n=8 samples with logprobs. The profile peak holds the fused MoE's
  workspace for an 8,192-token step, which the engine keeps (vLLM 0.16 - 0.33), so the advised
  pool leaves about 190 MiB beside it; V1's post-capture warm-up (max_num_seqs rows) re-reserves
  most of the rest of the profile region. Unprotected, the engine takes every request at once
  and runs out at a 35.89 MiB tensor with 21 MiB free (294 rows x 32,000 x 4 B, a sampler
  tensor's size); before session 33 the simulator ran out at a per-call 448 MiB
  `intermediate_cache2`.
- H5: Llama-3.1-8B on an A10 24 GB with an fp8 KV cache, vLLM 0.32.0 (V2), --gpu-memory-utilization
  0.95 and the pool as vLLM's advice sizes it, max_num_seqs 512: RAG queries over 16k-28k tokens
  among chat at temperatures 0 / 0.7 / 1.0 (half with top-p 0.95, unseeded), and at 12 s a
  classification job of 400 short prompts: V2 copies the logits of every row to fp32 once one row
  samples at a temperature other than 0 or 1 (343 rows: 168 MiB), which its greedy profile never did.
- H6: Llama-3-8B on an A100 40 GB at --gpu-memory-utilization 0.92, vLLM 0.32.0 (V2), with
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and --max-logprobs -1: chat at temperature 0.6
  (a third with min-p, a tenth with a logit bias) and an evaluation harness scoring 2k-7k-token
  passages with `prompt_logprobs` 20, a quarter with -1: V2 takes the top-k of each 1,024-row
  sub-chunk of a passage's prompt logprobs; at -1 (k = the vocabulary) the sub-chunk's logits,
  top-k values and int64 indices and their sorted copies hold 2.69 GiB and torch.topk's sort
  scratch asks 2.45 GiB more, where the A100 has about 3 GiB left outside the KV pool.
- H7: Llama-3.1-70B at tensor parallel 4 on H100s, vLLM 0.33.0 (V2), the pool as vLLM's advice
  sizes it (about 620 MiB free a GPU when serving starts): chat at temperature 0.7 with top-p 0.9,
  RAG queries of 8k, 16k and 24k tokens, and at 10 s a burst of 200 calls asking n=2 at
  temperature 1.0 with top-5 logprobs. A document's second 8,192-token chunk runs out of memory
  after its first (the first, from an emptied cache, leaves segments the second's QKV and
  o_proj outputs split), and a 7,000-token prefill step after the burst's decoding steps (their
  fp32 logits and logprobs segments cached) runs out on its SiluAndMul output. Found by the
  lead in session 34, after the simulator stopped keeping 0.33's V2 warm-up cached.
- H8: Llama-3.1-8B on an H100 80 GB, vLLM 0.32.0 (V2), 2,048 tokens a step (at 8,192:
  prompt_lists_8192.py), the pool as vLLM's advice sizes it: chat at 3/s (temperature 0.7) and an evaluation harness (lm-eval's local-completions: plain requests,
  greedy, `max_tokens` 256, a stop string) sending lists of 8-32 few-shot prompts (each list's
  task prefix of 400-900 tokens and a question of 60-200) at 0.5/s, and at 8 s sixteen lists
  within 2 s. vLLM makes one engine request of each prompt (vllm 0.32.0
  entrypoints/openai/completion/serving.py `_create_completion`), so a list puts up to 32 rows
  into the next steps at once, and V2 copies every row's logits to fp32 once a chat row samples
  at a temperature other than 0 or 1: unprotected, the engine runs out on that copy for 458 rows
  (224.08 MiB, 112 MiB free). Session 35, when the simulator began serving lists.
"""

from __future__ import annotations

import random

from bench.scenarios import Scenario, _flags, _sim, _sim_v2
from bench.workloads import Call, chat_call, document_call, lognormal_int, poisson_times, streaming, words
from demo.replay import fully_utilized

QWEN = "qwen2.5-7b"
MISTRAL = "mistral-7b"
DEEPSEEK = "deepseek-v2-lite"
MIXTRAL = "mixtral-8x7b"
LLAMA_31 = "llama-3.1-8b"
LLAMA_3 = "llama-3-8b"
LLAMA_70 = "llama-3.1-70b"


def h1_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 3/s (temperature 0.8), RAG queries (3k-8k tokens, temperature 0.3, 256 out) at
    0.6/s; at 10 s an extraction job sends 480 short calls (temperature 0.8) within 1.5 s."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=QWEN, max_tokens=(128, 256, 512), temperature=0.8)
        for i, t in enumerate(poisson_times(rng, 3.0, d))
    ]
    for t in poisson_times(rng, 0.6, d):
        calls.append(
            document_call(rng, t, rng.choice([3000, 5000, 8000]), "rag query", 256, model=QWEN, temperature=0.3)
        )
    for k in range(max(48, int(480 * scale))):
        c = chat_call(
            rng, 10 * scale + 1.5 * rng.random(), 30_000 + k, model=QWEN, median_prompt=200, max_tokens=(64, 128)
        )
        c.body["temperature"] = 0.8
        calls.append(Call(c.at, c.path, c.body, "extraction"))
    return streaming(calls)


def h2_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s, a quarter asking top-5 logprobs; passages (4k-8k tokens) scored with
    `prompt_logprobs: 5` at 0.6/s."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=MISTRAL, max_tokens=(128, 256, 512))
        for i, t in enumerate(poisson_times(rng, 2.0, d))
    ]
    for c in calls:
        if rng.random() < 0.25:
            c.body.update(logprobs=True, top_logprobs=5)
    for t in poisson_times(rng, 0.6, d):
        n = rng.choice([4000, 6000, 8000])
        calls.append(document_call(rng, t, n, "scored passage", 1, model=MISTRAL, prompt_logprobs=5))
    return streaming(calls)


def h3_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 3/s (temperature 0.7); multi-turn contexts of 24k-64k tokens (temperature 0.7, 256
    out) at 0.25/s; at 12 s a batch job sends 450 short chats (temperature 0.7) within 2 s."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=DEEPSEEK, max_tokens=(128, 256, 512))
        for i, t in enumerate(poisson_times(rng, 3.0, d))
    ]
    for t in poisson_times(rng, 0.25, d):
        n = rng.choice([24000, 32000, 48000, 64000])
        calls.append(document_call(rng, t, n, "long context", 256, model=DEEPSEEK, temperature=0.7))
    for k in range(max(45, int(450 * scale))):
        c = chat_call(
            rng, 12 * scale + 2 * rng.random(), 40_000 + k, model=DEEPSEEK, median_prompt=150, max_tokens=(64, 128)
        )
        calls.append(Call(c.at, c.path, c.body, "batch chat"))
    return streaming(calls)


def h4_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s (temperature 0.8), a fifth with a frequency penalty of 0.3; at 8 s a
    self-consistency job sends 32 questions within 2 s, each asking n=8 samples (64-128 tokens) at
    temperature 0.9 with the chosen token's logprob (`logprobs: true`, top 1) to rank them."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=MIXTRAL, max_tokens=(128, 256, 512), temperature=0.8)
        for i, t in enumerate(poisson_times(rng, 2.0, d))
    ]
    for c in calls:
        if rng.random() < 0.2:
            c.body["frequency_penalty"] = 0.3
    for k in range(max(4, int(32 * scale))):
        c = chat_call(
            rng, 8 * scale + 2 * rng.random(), 60_000 + k, model=MIXTRAL, median_prompt=250, max_tokens=(64, 128)
        )
        c.body.update(n=8, temperature=0.9, logprobs=True, top_logprobs=1)
        calls.append(Call(c.at, c.path, c.body, "n=8 ranked"))
    return streaming(calls)


def h5_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s whose temperature is 0, 0.7 or 1.0 (a third each), half of them with top-p 0.95
    and no seed; RAG queries over 16k-28k tokens of retrieved text (temperature 0.2, 256 out) at
    0.15/s; at 12 s a classification job sends 400 short prompts (temperature 0.7, top-p 0.95, no
    seed, 32-64 tokens out) within 1.5 s."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=LLAMA_31, max_tokens=(64, 128, 256), temperature=rng.choice([0.0, 0.7, 1.0]))
        for i, t in enumerate(poisson_times(rng, 2.0, d))
    ]
    for c in calls:
        if rng.random() < 0.5:
            del c.body["seed"]
            c.body["top_p"] = 0.95
    for t in poisson_times(rng, 0.15, d):
        n = rng.choice([16000, 20000, 24000, 28000])
        calls.append(document_call(rng, t, n, "long rag", 256, model=LLAMA_31, temperature=0.2))
    for k in range(max(40, int(400 * scale))):
        c = chat_call(
            rng, 12 * scale + 1.5 * rng.random(), 70_000 + k, model=LLAMA_31, median_prompt=60, max_tokens=(32, 64)
        )
        del c.body["seed"]
        c.body["top_p"] = 0.95
        calls.append(Call(c.at, c.path, c.body, "classification"))
    return streaming(calls)


def h6_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s (temperature 0.6, a third with `min_p: 0.05`, a tenth with a `logit_bias`); an
    evaluation harness scores passages at 0.5/s: 2k-7k tokens with `prompt_logprobs: 20`, and a
    quarter of them with `prompt_logprobs: -1` (the whole vocabulary per token)."""
    d = 30 * scale
    calls = [
        chat_call(rng, t, i, model=LLAMA_3, max_tokens=(128, 256, 512), temperature=0.6)
        for i, t in enumerate(poisson_times(rng, 2.0, d))
    ]
    for c in calls:
        pick = rng.random()
        if pick < 1 / 3:
            c.body["min_p"] = 0.05
        elif pick < 1 / 3 + 0.1:
            c.body["logit_bias"] = {"1734": -100}
    for t in poisson_times(rng, 0.5, d):
        k = -1 if rng.random() < 0.25 else 20
        n = rng.choice([2000, 3500, 5000, 7000])
        calls.append(document_call(rng, t, n, f"prompt_logprobs {k}", 1, model=LLAMA_3, prompt_logprobs=k))
    return streaming(calls)


def h7_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 4/s (temperature 0.7, top-p 0.9), RAG queries (8k / 16k / 24k tokens, temperature
    0.2, 256 out) at 0.4/s; at 10 s 200 calls asking n=2 at temperature 1.0 with top-5 logprobs
    within two seconds."""
    d = 30 * scale
    calls = []
    for i, t in enumerate(poisson_times(rng, 4.0, d)):
        c = chat_call(rng, t, i, model=LLAMA_70, max_tokens=(128, 256, 512, 1024), temperature=0.7)
        c.body["top_p"] = 0.9
        calls.append(c)
    for t in poisson_times(rng, 0.4, d):
        n = rng.choice([8000, 16000, 24000])
        calls.append(document_call(rng, t, n, "rag query", 256, model=LLAMA_70, temperature=0.2))
    for k in range(max(20, int(200 * scale))):
        c = chat_call(
            rng, 10 * scale + 2 * rng.random(), 40_000 + k, model=LLAMA_70, median_prompt=300, max_tokens=(64, 128)
        )
        c.body.update(n=2, temperature=1.0, logprobs=True, top_logprobs=5)
        calls.append(Call(c.at, c.path, c.body, "n=2 logprobs"))
    return streaming(calls)


def eval_list_call(rng: random.Random, at: float, task: str) -> Call:
    """One lm-eval generate_until batch: 8-32 prompts sharing the task's few-shot prefix."""
    questions = [words(rng, lognormal_int(rng, 110, 0.4, 60, 200)) for _ in range(rng.randint(8, 32))]
    body = {
        "model": LLAMA_31,
        "prompt": [f"{task}\nQuestion: {q}\nAnswer:" for q in questions],
        "max_tokens": 256,
        "temperature": 0.0,
        "stop": ["\n\nQuestion:"],
    }
    return Call(at, "/v1/completions", body, "eval list")


def h8_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 3/s (temperature 0.7); an evaluation job over four tasks' few-shot prefixes:
    lists of 8-32 prompts at 0.5/s, and at 8 s sixteen lists within 2 s (a harness starting
    with 16 requests in flight, lm-eval's `num_concurrent`)."""
    d = 30 * scale
    tasks = [words(rng, rng.randint(400, 900)) for _ in range(4)]
    calls = streaming(
        [
            chat_call(rng, t, i, model=LLAMA_31, max_tokens=(128, 256, 512), temperature=0.7)
            for i, t in enumerate(poisson_times(rng, 3.0, d))
        ]
    )
    calls += [eval_list_call(rng, t, rng.choice(tasks)) for t in poisson_times(rng, 0.5, d)]
    calls += [
        eval_list_call(rng, 8 * scale + 2 * rng.random(), rng.choice(tasks)) for _ in range(max(2, int(16 * scale)))
    ]
    return sorted(calls, key=lambda c: c.at)


SCENARIOS: list[Scenario] = [
    Scenario(
        "H1",
        "RAG and an extraction burst at temperatures V2's greedy profile never saw (Qwen2.5-7B, A100 80 GB)",
        fully_utilized(
            _sim_v2(model=QWEN, gpu="a100-80gb", max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=512)
        ),
        _flags(4096, 512, v1=False),
        h1_traffic,
        30,
        2,  # a burst of 480 streams: at 4 the 2-core machine could not drive it
        caps=[16, 64, 256],
    ),
    Scenario(
        "H2",
        "Prompt logprobs of passages beside chat on an L4 (Mistral-7B, V1)",
        _sim(
            model=MISTRAL,
            gpu="l4-24gb",
            max_model_len=8192,
            max_num_batched_tokens=8192,
            max_num_seqs=128,
            gpu_memory_utilization=0.97,
        ),
        _flags(8192, 128, gpu_memory_utilization="0.97"),
        h2_traffic,
        30,
        4,
        caps=[2, 8, 32],
    ),
    Scenario(
        "H3",
        "Long multi-turn contexts and a chat batch on an MLA model (DeepSeek-V2-Lite, A100 80 GB, V2)",
        fully_utilized(
            _sim_v2(model=DEEPSEEK, gpu="a100-80gb", max_model_len=65536, max_num_batched_tokens=2048, max_num_seqs=512)
        ),
        _flags(2048, 512, v1=False),
        h3_traffic,
        30,
        2,  # a batch of 450 streams beside long prefills: at 4 the 2-core machine could not drive it
        caps=[4, 16, 64],
    ),
    Scenario(
        "H4",
        "n=8 ranked samples with logprobs among penalised chat on an MoE model (Mixtral-8x7B, H200, V1)",
        fully_utilized(
            _sim(model=MIXTRAL, gpu="h200-141gb", max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=512)
        ),
        _flags(8192, 512),
        h4_traffic,
        30,
        2,
        caps=[8, 32, 128],
    ),
    Scenario(
        "H5",
        "Long RAG contexts near the KV pool's size among chat at mixed temperatures (Llama-3.1-8B, A10 24 GB, V2)",
        fully_utilized(
            _sim_v2(
                model=LLAMA_31,
                gpu="a10-24gb",
                max_model_len=32768,
                max_num_batched_tokens=2048,
                max_num_seqs=512,
                gpu_memory_utilization=0.95,
                kv_cache_dtype="fp8",
            )
        ),
        _flags(2048, 512, v1=False, gpu_memory_utilization="0.95", kv_cache_dtype="fp8"),
        h5_traffic,
        30,
        2,
        caps=[4, 16, 64],
    ),
    Scenario(
        "H6",
        "Prompt logprobs (20 and -1) with expandable segments beside min-p chat (Llama-3-8B, A100 40 GB, V2)",
        _sim_v2(
            model=LLAMA_3,
            gpu="a100-40gb",
            max_model_len=8192,
            max_num_batched_tokens=4096,
            max_num_seqs=256,
            max_logprobs=-1,
            gpu_memory_utilization=0.92,
            expandable_segments=True,
        ),
        [*_flags(4096, 256, v1=False, max_logprobs="-1", gpu_memory_utilization="0.92"), "--expandable-segments"],
        h6_traffic,
        30,
        4,
        caps=[2, 8, 32],
    ),
    Scenario(
        "H7",
        "Long RAG and an n=2 logprobs burst on a 70B at tensor parallel 4 (Llama-3.1-70B, 4 x H100 80 GB, vLLM 0.33.0, V2)",
        fully_utilized(
            _sim_v2(
                model=LLAMA_70,
                gpu="h100-80gb",
                tensor_parallel_size=4,
                vllm_version="0.33.0",
                max_model_len=32768,
                max_num_batched_tokens=8192,
                max_num_seqs=256,
            )
        ),
        _flags(8192, 256, v1=False, tensor_parallel_size="4"),
        h7_traffic,
        30,
        2,
        caps=[16, 64, 128],
    ),
    Scenario(
        "H8",
        "An evaluation harness's lists of 8-32 few-shot prompts beside chat (Llama-3.1-8B, H100 80 GB, V2)",
        fully_utilized(
            _sim_v2(
                model=LLAMA_31, gpu="h100-80gb", max_model_len=16384, max_num_batched_tokens=2048, max_num_seqs=1024
            )
        ),
        _flags(2048, 1024, v1=False),
        h8_traffic,
        30,
        2,
        caps=[16, 64, 256],
    ),
]
