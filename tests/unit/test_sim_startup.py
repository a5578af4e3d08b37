"""Start-up numbers against vLLM's formulas and public figures (docs/calibration.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepShape
from kvgate.units import GiB, MiB
from support.geometry import config_path


def boot(**kw) -> tuple[startup.Resolved, startup.StartupReport, Device]:
    cfg = SimConfig(**kw)
    g = load_model(cfg.model, cfg.dtype)
    dev = Device(gpu_total_bytes(cfg.gpu))
    r, rep = startup.start(cfg, g, dev, CachingAllocator(dev, "vllm"))
    return r, rep, dev


PR_10511 = dict(model="llama-3-8b", gpu="h100-80gb", max_num_seqs=256, max_num_batched_tokens=8192)
# vLLM's defaults for `vllm serve` in the V1 releases of 2025 (the logs below print them).
SERVE_2025 = dict(max_num_batched_tokens=2048, max_num_seqs=256)
# The first release that subtracts its CUDA-graph estimate by default (kvgate/sim/flavor.py).
CUDAGRAPHS_IN_BUDGET_FROM = "0.20.0"
# llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md: `vllm serve` (0.11.0 as
# the file names it; a sort-path profile, as 0.12 - 0.16 run by default: docs/calibration.md) on
# an H100 (79.18 GiB), `--max-model-len=16000 --block-size=128 --enable-prefix-caching`,
# utilization 0.9, batch defaults (H100: 8,192 tokens, 1,024 seqs).
LLMD_H100 = dict(gpu="79.18GiB", vllm_version="0.11.0", max_model_len=16000, block_size=128)


@dataclass(frozen=True)
class LoggedStartup:
    """One public vLLM start-up log (docs/calibration.md): configuration and logged figures."""

    source: str
    config: dict
    weights_gib: float
    available_gib: float  # "Available KV cache memory" (or available_kv_cache_memory)
    config_file: str | None = None  # the model's config.json in tests/configs, if not a preset
    # The profile's logged torch peak, where the sampler's sort sets it (docs/calibration.md)
    activation_gib: float | None = None
    refusal: str | None = None  # the error vLLM raised after logging the available memory


CALIBRATION = [
    LoggedStartup(
        "vLLM PR #10511, H100, TP 1 (vLLM 0.6.5)",
        dict(PR_10511, gpu="79.22GiB", vllm_version="0.6.5"),
        14.96,
        53.29,
        activation_gib=1.26,
    ),
    # The TP 2 log's last line is cut in the PR; 71.29 - 7.48 - 3.58 - 1.26 from its own lines.
    LoggedStartup(
        "vLLM PR #10511, H100, TP 2 (vLLM 0.6.5)",
        dict(PR_10511, gpu="79.22GiB", vllm_version="0.6.5", tensor_parallel_size=2),
        7.48,
        58.97,
        activation_gib=1.26,
    ),
    # Unsloth's GRPO notebook log: vLLM 0.7.2 V0, chunked prefill off, so the profile runs
    # max_model_len (32,768) tokens at once.
    LoggedStartup(
        "Qwen2.5-1.5B-Instruct, T4, TP 1 (vLLM 0.7.2, V0)",
        dict(
            gpu="14.56GiB",
            vllm_version="0.7.2",
            dtype="float16",
            max_model_len=32768,
            max_num_batched_tokens=32768,
            max_num_seqs=256,
            gpu_memory_utilization=0.5,
        ),
        2.89,
        2.36,
        "qwen2.5-1.5b-instruct",
    ),
    LoggedStartup(
        "DeepSeek-R1-0528-Qwen3-8B, RTX 2080 Ti 22GB, TP 4 (vLLM 0.8.5, V0)",
        dict(
            gpu="21.48GiB",
            vllm_version="0.8.5",
            dtype="float16",
            tensor_parallel_size=4,
            max_model_len=65536,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
            enforce_eager=True,
            gpu_memory_utilization=0.93,
        ),
        3.85,
        14.49,
        "deepseek-r1-0528-qwen3-8b",
        activation_gib=1.45,
    ),
    # "Requested memory: 0.90 (util), 39.88 GiB": the GPU reports 39.88 / 0.9 GiB.
    LoggedStartup(
        "Llama-3.2-1B, 44.31 GiB GPU, TP 1 (vLLM 0.10 dev, V1)",
        dict(SERVE_2025, gpu=f"{39.88 / 0.9}GiB", vllm_version="0.10.0"),
        2.32,
        37.10,
        "llama-3.2-1b",
    ),
    # The GPU is not named; at utilization 0.9 only a ~39.4 GiB card (A100-40GB) fits its figures.
    LoggedStartup(
        "Llama-3.1-8B-Instruct, A100-40GB (inferred), TP 1 (vLLM 0.10.1.1, V1)",
        dict(SERVE_2025, model="llama-3.1-8b", gpu="a100-40gb", vllm_version="0.10.1.1", dtype="float16"),
        14.99,
        19.25,
    ),
    LoggedStartup(
        "Llama-3.1-8B-Instruct, RTX 3090/4090 24GB, TP 1 (vLLM 0.11 dev, V1)",
        dict(SERVE_2025, model="llama-3.1-8b", gpu="rtx-4090-24gb", vllm_version="0.11.0", max_model_len=10000),
        14.99,
        4.95,
    ),
    # "GPU KV cache size: 89,040 tokens" = 5,565 blocks x 16 x 144 KiB; 31.36 GiB is what PyTorch
    # reports for an RTX 5090. A later boot of the same command logged 95,936 tokens (13.17 GiB).
    LoggedStartup(
        "Qwen3-8B, RTX 5090, TP 1 (vLLM 0.24.0, V1)",
        dict(
            SERVE_2025,
            gpu="31.36GiB",
            vllm_version="0.24.0",
            max_model_len=32768,
            gpu_memory_utilization=0.92,
            sampler="triton",  # the log's VLLM_USE_FLASHINFER_SAMPLER=0
        ),
        15.27,
        5565 * 16 * 147456 / GiB,
        "qwen3-8b",
    ),
    # vLLM issue #13061: `vllm serve DeepSeek-R1-Distill-Qwen-14B --tensor_parallel_size 2
    # --gpu_memory_utilization=0.98` on 2 x RTX 4090; V0 0.7.2 (its log lines `__init__.py:190`,
    # `model_runner.py:1115`), chunked prefill on for a 131,072-token model: 2,048 tokens, 256
    # seqs. It refused: "max seq len (131072) is larger than the maximum number of tokens that
    # can be stored in KV cache (81536)". The quoted profile line is rank 1's, which samples
    # nothing; the pool is sized by rank 0, the sampling rank: 81,536 tokens = 5,096 blocks of
    # 16 x 96 KiB (48 layers x K, V x 4 KV heads x 128 x 2 B).
    LoggedStartup(
        "DeepSeek-R1-Distill-Qwen-14B, 2 x RTX 4090, TP 2 (vLLM 0.7.2, V0)",
        dict(
            gpu="23.55GiB",
            vllm_version="0.7.2",
            tensor_parallel_size=2,
            gpu_memory_utilization=0.98,
            max_num_batched_tokens=2048,
            max_num_seqs=256,
        ),
        13.95,
        5096 * 16 * 98304 / GiB,
        "deepseek-r1-distill-qwen-14b",
        refusal="max seq len (131072)",
    ),
    # Four boots on one H100 with one image and flags (LLMD_H100); DEBUG logs give the torch peak.
    LoggedStartup(
        "Llama-3.1-8B-Instruct, H100, TP 1 (vLLM 0.11.0, V1)",
        dict(LLMD_H100, model="llama-3.1-8b"),
        14.99,
        51.38,
        activation_gib=4.76,
    ),
    LoggedStartup("Qwen3-0.6B, H100, TP 1 (vLLM 0.11.0, V1)", LLMD_H100, 1.12, 64.45, "qwen3-0.6b", 5.56),
    LoggedStartup("Qwen3-32B, H100, TP 1 (vLLM 0.11.0, V1)", LLMD_H100, 61.03, 4.45, "qwen3-32b", 5.64),
    LoggedStartup(
        "Qwen3-32B, 2 x H100, TP 2 (vLLM 0.11.0, V1)",
        dict(LLMD_H100, tensor_parallel_size=2),
        30.59,
        34.49,
        "qwen3-32b",
        5.64,
    ),
]


_AVAILABLE = r"Available KV cache memory: ([\d.]+) GiB"


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, id=r.source) for r in CALIBRATION],
)
def test_available_kv_memory_matches_public_logs(row: LoggedStartup, tmp_path: Path) -> None:
    """Every row of the calibration table within max(0.6 GiB, 4 %) of vLLM's logged figure, and
    the profile's torch peak within 0.1 GiB where the log gives it and the sampler's sort sets it.
    Weights within 2 %: vLLM's also hold the RoPE cos/sin cache (max_position x rotary_dim x
    dtype on every rank; 32 MiB, 1 % of Qwen3-8B's TP 4 shard), which the simulator leaves out."""
    config = dict(row.config)
    if row.config_file:
        (tmp_path / "config.json").write_text(config_path(row.config_file).read_text())
        config["model"] = str(tmp_path)
    if row.refusal is None:
        _, rep, _ = boot(**config)
        weights, available, peak = rep.weights / GiB, rep.kv_available / GiB, rep.activation_peak / GiB
    else:
        with pytest.raises(startup.StartupError, match=re.escape(row.refusal)) as refused:
            boot(**config)
        # vLLM logs the weights, the profile and the available memory before it refuses
        weights, peak, available = (
            float(re.search(pattern, "\n".join(refused.value.log)).group(1))  # type: ignore[union-attr]
            for pattern in (r"Model loading took ([\d.]+) GiB", r"torch peak memory increase: ([\d.]+)GiB", _AVAILABLE)
        )
    assert weights == pytest.approx(row.weights_gib, rel=0.02)
    tolerance = max(0.6, 0.04 * row.available_gib)
    assert available == pytest.approx(row.available_gib, abs=tolerance)
    if row.activation_gib is not None:
        # The sort's peak is inside torch.sort (its CUDA scratch: step_memory.torch_sort_scratch_bytes)
        assert peak == pytest.approx(row.activation_gib, abs=0.1)


def test_cuda_graphs_come_out_of_the_budget_only_where_the_release_does_it() -> None:
    """V0 and older V1 capture the graphs after sizing the pool, on top of total x utilization
    (the logs above: available = requested - weights - peak - non-torch); newer releases
    subtract `profile_cudagraph_memory()` first (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`)."""
    for version, in_budget in (
        ("0.6.5", False),
        ("0.19.0", False),
        (CUDAGRAPHS_IN_BUDGET_FROM, True),
        ("0.32.0", True),
    ):
        _, rep, _ = boot(**PR_10511, vllm_version=version)
        before_graphs = rep.requested - rep.weights - rep.persistent - rep.activation_peak - rep.non_torch
        assert rep.cudagraph > 0
        assert rep.kv_available == before_graphs - (rep.cudagraph if in_budget else 0), version
    # The flag overrides the release, as the environment variable does.
    _, forced, _ = boot(**PR_10511, vllm_version="0.10.0", cudagraph_memory_in_budget=True)
    _, plain, _ = boot(**PR_10511, vllm_version="0.10.0")
    assert plain.kv_available - forced.kv_available == forced.cudagraph


def test_before_0_7_the_whole_non_torch_footprint_is_in_the_budget() -> None:
    """PR #10511's figures (1.79 GiB per GPU at TP 1, 3.58 at TP 2); from 0.7 on only the
    profile's increase (PR #12126: 0.16 GiB), the CUDA context held outside the budget."""
    for tp, legacy in ((1, 1.79), (2, 3.58)):
        _, old, _ = boot(**PR_10511, vllm_version="0.6.5", tensor_parallel_size=tp)
        assert old.non_torch / GiB == pytest.approx(legacy, abs=0.01)
        assert old.context == 0
    _, new, dev = boot(**PR_10511)
    _, bare, bare_dev = boot(**PR_10511, cuda_context_bytes=0)
    assert new.non_torch / GiB == pytest.approx(0.16, abs=0.01)
    # The context takes device memory (NVML sees it) but none of the KV budget.
    assert dev.used() - bare_dev.used() == new.context > 0
    assert new.kv_available == bare.kv_available


def test_llama_3_1_8b_starts_on_a_24_gib_card_at_20000_tokens() -> None:
    """`--max-model-len 20000 --max-num-batched-tokens 20000` on an RTX 4090 (23.64 GiB): 20,000
    tokens of KV (2.44 GiB) fit, as vLLM starts it."""
    for runner in ("v1", "v2"):
        r, rep, _ = boot(
            model="llama-3.1-8b",
            gpu="rtx-4090-24gb",
            max_model_len=20000,
            max_num_batched_tokens=20000,
            model_runner=runner,
        )
        assert r.flavor.runner == runner
        assert rep.kv_available > 20000 * 2 * 8 * 128 * 2 * 32
        assert rep.max_concurrency > 1


def test_refusal_logs_available_memory_first() -> None:
    """vLLM logs "Available KV cache memory" and only then raises the max_model_len error."""
    with pytest.raises(startup.StartupError) as info:
        boot(model="llama-3.1-8b", gpu="l4-24gb", max_model_len=20000, max_num_batched_tokens=20000)
    assert info.value.log[-1].startswith("Available KV cache memory: ")
    assert "max seq len (20000)" in str(info.value)


def test_default_plays_vllm_0_32_model_runner_v2() -> None:
    r, _, _ = boot(**PR_10511)
    assert (r.flavor.version, r.flavor.runner) == ((0, 32, 0), "v2")
    # 1,024 one-token requests: the sampler sets the profile peak. V1 samples them with top-p /
    # top-k: the fp32 logits copy (4 B a logit), then FlashInfer (masked logits + probs, 8 B) and,
    # warming forward_native with a seed, Triton's [132 SMs, V] buffer + softmax and noise (8 B):
    # 1024 x V x 12 B + 132 x V x 4 B = 1.53 GiB; V2 greedily (bf16 logits only).
    sampler_bound = dict(PR_10511, max_num_batched_tokens=1024, max_num_seqs=1024)
    _, v2, _ = boot(**sampler_bound)
    _, v1, _ = boot(**sampler_bound, model_runner="v1")
    assert (v1.activation_peak - v2.activation_peak) / GiB == pytest.approx(1.53, abs=0.01)
    # V2 holds its penalty counts from the start: 1024 x (V + V/32) x 4 B.
    assert v2.persistent == 1024 * (128256 + 4008) * 4
    assert v1.persistent == 0
    old, _, _ = boot(**PR_10511, vllm_version="0.21.0")  # before 0.22 V2 ran only on request
    assert old.flavor.runner == "v1"


def test_kv_pool_is_sized_as_vllm_sizes_it() -> None:
    r, rep, _ = boot(**PR_10511)
    expected = rep.requested - rep.weights - rep.persistent - rep.activation_peak - rep.non_torch - rep.cudagraph
    assert rep.kv_available == expected
    page = 2 * 16 * 8 * 128 * 2 * 32  # K and V, block 16, 8 KV heads, dim 128, bf16, 32 layers
    assert r.page_bytes == page
    assert rep.num_gpu_blocks == expected // page
    assert rep.max_concurrency == rep.num_gpu_blocks / (8192 // 16)
    assert rep.kv_tokens == int(rep.max_concurrency * 8192)
    assert (
        f"GPU KV cache size: {rep.kv_tokens:,} tokens, Maximum concurrency for 8,192 tokens "
        f"per request: {rep.max_concurrency:.2f}x"
    ) in rep.log


def test_explicit_kv_cache_memory_bytes_and_graphs_outside_budget() -> None:
    _, rep, _ = boot(**PR_10511, kv_cache_memory_bytes=10 * GiB)
    assert rep.kv_available == 10 * GiB
    _, a, _ = boot(**PR_10511, cudagraph_memory_in_budget=False)
    _, b, _ = boot(**PR_10511)
    assert a.kv_available - b.kv_available == b.cudagraph > 0
    _, eager, _ = boot(**PR_10511, enforce_eager=True)
    assert eager.cudagraph == 0


def test_defaults_follow_the_gpu() -> None:
    big, _, _ = boot(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192)
    a100, _, _ = boot(model="llama-3.1-8b", gpu="a100-80gb", max_model_len=8192)
    assert (big.max_num_batched_tokens, big.max_num_seqs) == (8192, 1024)
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    assert big.max_model_len == 8192
    assert big.block_size == 16


def test_mla_page_and_block_size() -> None:
    r, _, _ = boot(model="deepseek-v2-lite", gpu="h100-80gb", max_model_len=32768)
    assert r.block_size == 64
    assert r.backend == "mla"
    assert r.page_bytes == 64 * (512 + 64) * 2 * 27  # no factor 2 for K and V


def test_fp8_kv_halves_the_page() -> None:
    r, _, _ = boot(**PR_10511, kv_cache_dtype="fp8")
    assert r.page_bytes == 2 * 16 * 8 * 128 * 1 * 32


def test_refuses_max_model_len_that_does_not_fit() -> None:
    with pytest.raises(
        startup.StartupError,
        match=r"To serve at least one request with the "
        r"model's max seq len \(131072\)",
    ):
        boot(model="llama-3.1-8b", gpu="l4-24gb")


def test_tp_must_divide_heads() -> None:
    with pytest.raises(startup.StartupError, match="divisible by tensor parallel size"):
        boot(model="qwen2.5-7b", gpu="h100-80gb", tensor_parallel_size=3)


def test_speculative_draft_model_shares_weights_budget_and_kv_pool() -> None:
    """A draft model's weights load beside the target's and its layers join the KV pool with a
    block size that makes their page the target's (`unify_kv_cache_spec_page_size`)."""
    spec = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3}
    plain, base, _ = boot(**PR_10511)
    r, rep, _ = boot(**PR_10511, speculative_config=spec)
    assert r.num_speculative_tokens == 3
    assert r.draft is not None
    assert rep.weights - base.weights == pytest.approx(r.draft.parameter_count() * 2, abs=512)
    # tiny-llama: 2 layers x 2 KV heads x 32 dims x 2 (K, V) x 2 B = 256 B per token and layer;
    # the target's page is 16 tokens x 4 KiB, so the draft's block holds 256 tokens.
    assert {(g.kind, g.block_size, g.copies) for g in r.layout.groups} == {("full", 16, 16), ("full", 256, 1)}
    assert r.layout.layers_per_group == 2
    assert plain.layout.layers_per_group == 32
    with pytest.raises(startup.StartupError, match="num_speculative_tokens"):
        boot(**PR_10511, speculative_config={"method": "ngram"})
    with pytest.raises(startup.StartupError, match="draft model 'nope'"):
        boot(**PR_10511, speculative_config={"model": "nope", "num_speculative_tokens": 2})


def test_moe_models_play_their_dense_layers_too() -> None:
    """DeepSeek-V2-Lite's first layer keeps a 10,944-wide dense MLP beside 64 routed experts;
    Mixtral has none."""

    def allocations(model: str) -> set[str]:
        r, _, _ = boot(model=model, gpu="h200-141gb", max_model_len=8192)
        tape = startup.step_memories(r)[0].plan(startup.profile_shape(r))
        return {name for op, name, _ in tape if op == "alloc"}

    assert {"dense_gate_up", "topk"} <= allocations("deepseek-v2-lite")
    mixtral = allocations("mixtral-8x7b")
    assert "topk" in mixtral
    assert "dense_gate_up" not in mixtral


def test_the_moe_intermediates_live_in_a_workspace_the_profile_makes_and_keeps() -> None:
    """vLLM 0.16 - 0.33 (modular_kernel.py `_allocate_buffers` -> v1/worker/workspace.py
    `get_simultaneous`): the unquantized CUDA MoE's intermediates come from one workspace the
    profile grows to max_num_batched_tokens and start-up locks; a step allocates none of them.
    Mixtral-8x7B at 8,192 tokens: top-2 x (14,336 + 28,672) x 2 B = 168 KiB a token, 1,344 MiB,
    counted in the profile's peak and still allocated after start-up. vLLM 0.15 (not read) keeps
    the per-call caches of `fused_experts_impl`."""
    workspace = 8192 * 2 * (14336 + 28672) * 2
    assert workspace == 1344 * MiB
    shape = dict(model="mixtral-8x7b", gpu="h200-141gb", max_model_len=8192, max_num_batched_tokens=8192)
    for version in ("0.16.0", "0.31.0", "0.33.0"):
        cfg = SimConfig(**shape, vllm_version=version)
        dev = Device(gpu_total_bytes(cfg.gpu))
        alloc = CachingAllocator(dev, "vllm")
        r, rep = startup.start(cfg, load_model(cfg.model, cfg.dtype), dev, alloc)
        steps = startup.step_memories(r)[0]
        assert steps.moe_workspace_bytes() == workspace
        assert rep.activation_peak >= workspace
        kv = rep.num_gpu_blocks * r.layout.page_bytes * r.layout.layers_per_group
        assert alloc.allocated() >= rep.weights + kv + workspace
        tape = steps.plan(StepShape((ReqSlice(8192, 0),)))
        assert not {"moe_cache13", "moe_cache2"} & {name for op, name, _ in tape if op == "alloc"}
    r, rep, _ = boot(**shape, vllm_version="0.15.0")
    old = startup.step_memories(r)[0]
    assert old.moe_workspace_bytes() == 0
    assert {"moe_cache13", "moe_cache2"} <= {
        name for op, name, _ in old.plan(StepShape((ReqSlice(8192, 0),))) if op == "alloc"
    }


def test_materializing_scores_stop_at_the_window_when_every_layer_slides(tmp_path) -> None:
    """Mistral-7B-v0.1 slides every layer over 4,096 tokens: a 2,048-token chunk at 20,000
    tokens of context scores 2,048 x (4,096 + 2,048) keys, not 2,048 x 22,048."""
    config = config_path("mistral-7b-v0.1")
    (tmp_path / "config.json").write_text(config.read_text())
    r, _, _ = boot(
        model=str(tmp_path),
        gpu="h100-80gb",
        max_model_len=32768,
        max_num_batched_tokens=2048,
        attention_backend="materializing",
    )
    chunk = startup.StepShape((startup.ReqSlice(2048, 20000),))
    scores = {n: b for op, n, b in startup.step_memories(r)[0].plan(chunk) if op == "alloc"}
    assert scores["attn_scores"] == r.dims.q_heads * 2048 * (4096 + 2048) * 4


def test_only_v1_from_0_9_1_refuses_a_budget_above_the_free_memory() -> None:
    """v1/worker/gpu_worker.py `init_device` checks free >= total x utilization from 0.9.1 on;
    V0 and earlier V1 go on, size the pool from total x utilization and run out of memory when
    it and the warm-up do not fit (vLLM issue #13061's util 0.98 on an RTX 4090 profiled on
    0.7.2 before its max-seq-len refusal)."""
    over = dict(PR_10511, gpu_memory_utilization=0.995)  # the 500 MiB context leaves less free
    with pytest.raises(startup.StartupError, match="less than desired GPU memory utilization"):
        boot(**over, vllm_version="0.9.1")
    with pytest.raises(startup.StartupError, match="OutOfMemoryError") as late:
        boot(**over, vllm_version="0.9.0")
    assert any(line.startswith("Available KV cache memory: ") for line in late.value.log)


def test_v2_0_33_serves_with_none_of_its_warm_up_cached() -> None:
    """vllm 0.33.0 v1/worker/gpu_worker.py `_compile_or_warm_up_model`: V2's `warmup_kernels`
    (the warm-up parameters' sampler pass) runs before `capture_model`, which first empties the
    cache (v1/worker/gpu/model_runner.py); enforce_eager turns the JIT warm-up off
    (config/vllm.py). So a 0.33 V2 engine starts serving with as little cached as 0.32's, and
    V1's post-capture warm-up (kept for good) still leaves more."""
    cached = {}
    for version, runner, eager in (
        ("0.32.0", "v2", False),
        ("0.33.0", "v2", False),
        ("0.33.0", "v2", True),
        ("0.33.0", "v1", False),
    ):
        cfg = SimConfig(
            model="llama-3.1-8b",
            vllm_version=version,
            model_runner=runner,
            enforce_eager=eager,
            kv_cache_memory_bytes=40 * GiB,  # one pool size: only what start-up leaves cached differs
        )
        g = load_model(cfg.model, cfg.dtype)
        dev = Device(gpu_total_bytes(cfg.gpu))
        alloc = CachingAllocator(dev, "vllm")
        startup.start(cfg, g, dev, alloc)
        cached[(version, runner, eager)] = alloc.reserved() - alloc.allocated()
    assert abs(cached[("0.33.0", "v2", False)] - cached[("0.32.0", "v2", False)]) < MiB
    assert abs(cached[("0.33.0", "v2", True)] - cached[("0.32.0", "v2", False)]) < MiB
    assert cached[("0.33.0", "v1", False)] > cached[("0.33.0", "v2", False)] + 100 * MiB
