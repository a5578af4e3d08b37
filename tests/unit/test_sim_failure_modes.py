"""Each failure mode of docs/sources.md#failure-modes as an OOM, and the same workload surviving
under a safe configuration. The engine is driven without HTTP at full speed."""

from __future__ import annotations

import random
import re

import pytest
from sim_support import Job, make_engine, play

from kvgate.sim.config import SimConfig
from kvgate.sim.request import Sampling
from kvgate.sim.startup import REDUNDANCY_BUFFER, StartupError
from kvgate.units import GiB, MiB

SHORT = Sampling(max_tokens=8)


def _fully_utilized_kv(cfg: SimConfig, margin: int) -> int:
    """The `--kv-cache-memory-bytes` vLLM suggests "to fully utilize gpu memory", with `margin`
    instead of its 150 MiB buffer."""
    return make_engine(cfg).report.kv_to_fully_utilize(margin)


def _assert_oom(outcome) -> None:
    assert outcome.oom
    assert "CUDA out of memory. Tried to allocate" in outcome.oom
    assert outcome.engine.state == "dead"
    assert outcome.errors > 0
    assert not outcome.finished


def _assert_survives(outcome, count: int) -> None:
    assert outcome.oom is None, outcome.oom
    assert sum(outcome.finished.values()) == count
    assert outcome.errors == 0


def _long_context(backend: str) -> SimConfig:
    return SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        max_model_len=65536,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        attention_backend=backend,
    )


@pytest.mark.parametrize("materializing", ["materializing-eager", "materializing"])  # its current and old name
def test_1_chunked_prefill_over_long_context_materializing_backend(materializing: str) -> None:
    """Later chunks attend over the whole prefix: heads x chunk x context fp32 scores."""
    _assert_oom(play(_long_context(materializing), [Job(60000, SHORT)]))
    _assert_survives(play(_long_context("flash-attn"), [Job(60000, SHORT)]), 1)


def test_1_chunked_prefill_over_long_context_mla() -> None:
    """MLA up-projects each chunked-prefill workspace pass of context (DeepSeek-V2-Lite): with
    vLLM 0.32's 64k-token workspace, 64k x 16 heads x (2 x 128 + 128 + 64) x 2 B = 0.88 GiB that
    the profile (no attention metadata) never saw; 1 % of an H100 is too little for it."""

    def cfg(util: float) -> SimConfig:
        return SimConfig(
            model="deepseek-v2-lite",
            gpu="h100-80gb",
            gpu_memory_utilization=util,
            max_num_seqs=128,
            max_model_len=163840,
            max_num_batched_tokens=2048,
        )

    outcome = play(cfg(0.99), [Job(150000, SHORT)])
    _assert_oom(outcome)
    assert outcome.steps > 1  # the first chunks (little context) passed
    _assert_survives(play(cfg(0.9), [Job(150000, SHORT)]), 1)


def test_2_prompt_logprobs() -> None:
    """V1 only: n x V x (2 + 4) bytes for the prompt tokens of a whole chunk, never profiled
    (V2 computes them 1,024 rows at a time)."""

    def cfg(mnbt: int) -> SimConfig:
        return SimConfig(
            model="llama-3.1-8b",
            gpu="h100-80gb",
            gpu_memory_utilization=0.95,
            max_model_len=16384,
            max_num_seqs=256,
            max_num_batched_tokens=mnbt,
            model_runner="v1",
        )

    job = [Job(8000, Sampling(max_tokens=4, prompt_logprobs=1))]
    _assert_oom(play(cfg(8192), job))
    _assert_survives(play(cfg(2048), job), 1)


def test_3_huge_max_num_batched_tokens_dies_instead_of_lowering_concurrency() -> None:
    """The profile materialises tokens x intermediate at once and dies at start-up."""

    def cfg(mnbt: int) -> SimConfig:
        return SimConfig(model="llama-3.1-8b", gpu="l4-24gb", max_model_len=8192, max_num_batched_tokens=mnbt)

    with pytest.raises(StartupError, match=r"CUDA out of memory. Tried to allocate 1.75 GiB"):
        play(cfg(65536), [Job(8000, SHORT, count=4)])
    _assert_survives(play(cfg(8192), [Job(8000, SHORT, count=4)]), 4)


def test_4_cuda_graphs_outside_the_budget() -> None:
    """Before v0.20 graphs came on top of total x utilization: at 0.98 of an A100-40GB (0.99
    no longer passes the start-up check once the CUDA context sits outside the budget) the
    670 MiB of graphs leave V1's sampler warm-up no room (vLLM 0.19)."""

    def cfg(in_budget: bool) -> SimConfig:
        return SimConfig(
            model="llama-3.1-8b",
            gpu="a100-40gb",
            gpu_memory_utilization=0.98,
            max_model_len=8192,
            max_num_batched_tokens=8192,
            cudagraph_memory_in_budget=in_budget,
            vllm_version="0.19.0",
        )

    with pytest.raises(StartupError, match="CUDA out of memory") as exc:
        play(cfg(False), [Job(8000, SHORT, count=2)])
    assert "670.00 MiB allocated in private pools (e.g., CUDA Graphs)" in str(exc.value)
    _assert_survives(play(cfg(True), [Job(8000, SHORT, count=2)]), 2)


def _mib(message: str, around: str) -> float:
    """The size in PyTorch's OOM message where `around` has `{}`, in MiB."""
    match = re.search(around.format(r"([\d.]+) (MiB|GiB)"), message)
    assert match, (around, message)
    return float(match[1]) * (1024 if match[2] == "GiB" else 1)


def _chat_burst(seed: int, count: int) -> list[Job]:
    """Chat prompts of 16 to 6000 tokens (log-normal, median ~250), top-p sampling, a third
    with a presence penalty, 16 to 256 output tokens: enough requests that vLLM keeps about
    max_num_seqs running and the number of rows sampled changes from step to step."""
    rng = random.Random(seed)
    return [
        Job(
            min(6000, max(16, int(rng.lognormvariate(5.5, 1.0)))),
            Sampling(max_tokens=rng.choice((16, 64, 128, 256)), top_p=0.9, penalties=rng.random() < 1 / 3),
        )
        for _ in range(count)
    ]


def test_5_allocator_fragmentation_under_mixed_high_concurrency_batches() -> None:
    """V1 with the sort-path sampler: vLLM 0.16.0, the last release that sorts every batch (from
    0.17 Triton masks batches of 8 rows or more in place, kvgate/sim/flavor.py); the same traffic on
    0.31.0 OOMs too, but without the stranded-cache signature. Steps sampling ~900-1024 rows cut
    the sampler warm-up's 1024-row segments, and the
    segments the allocator adds after each failed best fit, for tensors of other sizes; the
    remainders (over 1 MiB, so split off) and the penalties' prompt ids held from one batch
    change to the next sit in segments that also hold live tensors and are never given back.
    With vLLM's own 150 MiB buffer a step then needs a block no free space can hold whole,
    although the free bytes add up to more than it asks (docs/sources.md
    fragmentation-buffer-pr.txt). Expandable segments strand nothing: the same traffic
    completes in the same KV budget."""
    base = dict(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=16384, vllm_version="0.16.0", model_runner="v1")
    kv = _fully_utilized_kv(SimConfig(**base), REDUNDANCY_BUFFER)
    jobs = _chat_burst(seed=0, count=1500)
    outcome = play(SimConfig(**base, kv_cache_memory_bytes=kv), jobs)
    msg = outcome.oom
    assert msg
    assert outcome.engine.state == "dead"
    assert outcome.steps > 20  # not a start-up or first-step shortfall: it builds up
    assert outcome.errors == len(jobs) - sum(outcome.finished.values())  # all in flight fail
    tried = _mib(msg, "Tried to allocate {}")
    stranded = _mib(msg, "{} is reserved by PyTorch but unallocated")
    assert stranded > tried, msg  # the seed's signature: more cached than asked, none usable
    survived = play(SimConfig(**base, kv_cache_memory_bytes=kv, expandable_segments=True), jobs)
    _assert_survives(survived, len(jobs))


def test_6_sampling_fan_out_with_logprobs_and_penalties() -> None:
    """1024 rows of logprobs + penalties over a 152k vocabulary, with the KV pool sized by
    vLLM's "fully utilize" suggestion; 256 rows fit in the same pool."""
    base = dict(model="qwen2.5-7b", gpu="h100-80gb", max_model_len=4096)
    kv = _fully_utilized_kv(SimConfig(**base, max_num_seqs=1024), 256 * MiB)
    job = [Job(200, Sampling(max_tokens=16, logprobs=20, penalties=True, top_p=0.9), count=256, n=4)]
    _assert_oom(play(SimConfig(**base, max_num_seqs=1024, kv_cache_memory_bytes=kv), job))
    _assert_survives(play(SimConfig(**base, max_num_seqs=256, kv_cache_memory_bytes=kv), job), 1024)


def test_7_co_tenant_takes_the_headroom() -> None:
    """Another process takes memory after start-up, while only the sampler warm-up is cached:
    the first full prefill step finds neither cache nor free memory for its MLP."""

    def cfg(util: float) -> SimConfig:
        return SimConfig(
            model="llama-3.1-8b", gpu="h100-80gb", gpu_memory_utilization=util, max_model_len=8192, max_num_seqs=64
        )

    job = [Job(8000, SHORT, count=4)]
    cotenant = (0, int(7.75 * GiB))
    outcome = play(cfg(0.9), job, cotenant_after_steps=cotenant)
    _assert_oom(outcome)
    assert "Process cotenant has 7.75 GiB memory in use" in outcome.oom
    _assert_survives(play(cfg(0.8), job, cotenant_after_steps=cotenant), 4)


def test_7_co_tenant_present_at_start_up_is_refused() -> None:
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", cotenants=[], max_model_len=8192)
    engine = make_engine(cfg)
    engine.device.set_usage("cotenant", 20 * GiB)
    with pytest.raises(StartupError, match="on startup is less than desired GPU memory"):
        engine.boot()


# ----- Model Runner V2 (vLLM 0.32's default) running out by itself ---------------------------
def test_v2_temperature_batch_whose_fp32_logits_the_greedy_profile_never_saw() -> None:
    """V2 profiles its sampler greedily up to 0.32 (bf16 logits only); 1,024 decoding rows at
    temperature 0.7 need an fp32 copy besides, 1024 x 152,064 x 4 B = 0.58 GiB, more than the
    2,048-token profile's peak and vLLM's 150 MiB "fully utilize" buffer leave. Greedy rows fit,
    and so do rows at temperature 1.0 with no top-k/top-p: they need no processing
    (gpu/sample/states.py:67-72), so no copy."""
    base = dict(model="qwen2.5-7b", gpu="h100-80gb", max_model_len=4096, max_num_seqs=1024, max_num_batched_tokens=2048)
    kv = _fully_utilized_kv(SimConfig(**base), REDUNDANCY_BUFFER)
    cfg = SimConfig(**base, kv_cache_memory_bytes=kv)
    assert make_engine(cfg).resolved.flavor.runner == "v2"
    hot = [Job(64, Sampling(max_tokens=128, temperature=0.7), count=1024)]
    greedy = [Job(64, Sampling(max_tokens=128, temperature=0.0), count=1024)]
    plain = [Job(64, Sampling(max_tokens=128, temperature=1.0), count=1024)]
    _assert_oom(play(cfg, hot))
    _assert_survives(play(SimConfig(**base, kv_cache_memory_bytes=kv), greedy), 1024)
    _assert_survives(play(SimConfig(**base, kv_cache_memory_bytes=kv), plain), 1024)


def test_v2_prompt_logprobs_minus_one_on_a_server_that_allows_it() -> None:
    """`prompt_logprobs: -1` (vLLM accepts it only with `--max-logprobs -1`): V2 keeps fp32
    scores and int64 ids for the whole vocabulary per prompt token, n x V x 12 B for the chunk
    (8,192 x 128,256 x 12 B = 11.7 GiB) and twice that when the 1,024-row pieces are joined.
    A handful of prompt logprobs per token stays within 1,024-row pieces and fits."""
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=16384, max_logprobs=-1)
    _assert_oom(play(cfg, [Job(8000, Sampling(max_tokens=4, prompt_logprobs=-1))]))
    _assert_survives(
        play(
            SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=16384),
            [Job(8000, Sampling(max_tokens=4, prompt_logprobs=5))],
        ),
        1,
    )


def test_v2_speculative_decoding_with_many_running_requests() -> None:
    """Each decoding request verifies 1 + 4 tokens: 1,024 greedy requests bring 5,120 logits
    rows (5120 x 128,256 x 2 B = 1.22 GiB) where the profile's dummy batch had 1,024 (0.24
    GiB); a KV budget that leaves 512 MiB beyond the profile does not hold them. Without
    speculation the same traffic fits the same budget."""
    base = dict(
        model="llama-3.1-8b", gpu="h100-80gb", max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=1024
    )
    spec = dict(base, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    kv = _fully_utilized_kv(SimConfig(**spec), 512 * MiB)
    jobs = [Job(32, Sampling(max_tokens=64, temperature=0.0), count=1024)]
    outcome = play(SimConfig(**spec, kv_cache_memory_bytes=kv), jobs)
    _assert_oom(outcome)
    assert "Tried to allocate" in outcome.oom
    _assert_survives(play(SimConfig(**base, kv_cache_memory_bytes=kv), jobs), 1024)
