"""The simulator's top-k/top-p path per vLLM release (kvgate/sim/flavor.py) and what each path
allocates in a step (kvgate/sim/step_memory.py)."""

from __future__ import annotations

import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.flavor import Flavor, top_k_top_p
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.request import Request, Sampling
from kvgate.sim.scheduler import ScheduledReq, SchedulerOutput
from kvgate.sim.startup import resolve, triton_buffer_bytes
from kvgate.sim.step_memory import ModelDims, ReqSlice, StepMemory, StepShape, TopKTopP, run_tape
from kvgate.units import GiB, MiB

V = 128256
DIMS = ModelDims(
    hidden=4096,
    intermediate=14336,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=V,
    dtype_bytes=2,
)


@pytest.mark.parametrize(
    ("version", "path"),
    [
        ((0, 10, 1), TopKTopP("sort")),
        ((0, 16, 0), TopKTopP("sort")),  # no topk_topp_triton.py yet
        ((0, 17, 0), TopKTopP("triton", 8)),  # HAS_TRITON and logits.shape[0] >= 8
        ((0, 20, 0), TopKTopP("triton", 8)),
        ((0, 21, 0), TopKTopP("flashinfer", 8)),  # VLLM_USE_FLASHINFER_SAMPLER on by default
        ((0, 30, 0), TopKTopP("flashinfer")),  # Triton for every batch
        ((0, 32, 0), TopKTopP("flashinfer")),
    ],
)
def test_each_release_plays_its_own_top_k_top_p_path(version: tuple[int, int, int], path: TopKTopP) -> None:
    assert top_k_top_p(version) == path


def test_the_sampler_flag_picks_the_path() -> None:
    model = load_model("llama-3.1-8b", "bfloat16")
    flavor = Flavor.of(SimConfig(vllm_version="0.31.0", model_runner="v1", sampler="pytorch"), model)
    assert flavor.top_k_top_p == TopKTopP("sort")
    assert Flavor.of(SimConfig(vllm_version="0.24.0", sampler="triton"), model).top_k_top_p == TopKTopP("triton", 8)


def sampler_peak(path: TopKTopP, rows: int, runner: str = "v1", **req: bool) -> int:
    """Peak bytes of a step of `rows` one-token random top-p/top-k requests, above the step's
    forward (the same step without top-k/top-p is subtracted)."""

    def peak(top_p_k: bool) -> int:
        alloc = CachingAllocator(Device(200 * GiB), "sim")
        shape = StepShape(tuple(ReqSlice(1, top_p_k=top_p_k, random=True, **req) for _ in range(rows)))
        run_tape(alloc, StepMemory(DIMS, "flash-attn", runner=runner, top_k_top_p=path).plan(shape))
        return alloc.peak_allocated

    return peak(True) - peak(False)


def test_v1_sort_triton_and_flashinfer_allocate_per_vllms_code() -> None:
    rows = 256
    # sort: its peak is inside torch.sort, the sorted values (4 B) and int64 indices (8 B) plus
    # the CUDA sort's scratch (20 B from 128 rows: step_memory.torch_sort_scratch_bytes) beside
    # the logits and their fp32 copy: 24 B a logit above the plain batch's softmax and noise (8 B)
    assert sampler_peak(TopKTopP("sort"), rows) == pytest.approx(rows * V * 24, rel=0.01)
    # Triton masks in place (its cached buffer is held from start-up: see the test below)
    assert sampler_peak(TopKTopP("triton"), rows) == 0
    # FlashInfer: masked logits + probs (8 B), instead of the softmax and noise (8 B)
    assert sampler_peak(TopKTopP("flashinfer"), rows) == pytest.approx(0, abs=0.01 * rows * V)


def test_small_batches_sort_and_seeded_batches_leave_flashinfer() -> None:
    # under 128 rows PyTorch sorts the batch as one flat array: 32 B a logit of scratch (28.7 MB,
    # which the allocator rounds up to 2 MiB: 2 % of the figure)
    assert sampler_peak(TopKTopP("triton", 8), 7) == pytest.approx(7 * V * 36, rel=0.03)
    assert sampler_peak(TopKTopP("triton", 8), 8) == 0
    seeded = sampler_peak(TopKTopP("flashinfer"), 64, seeded=True)
    assert seeded == sampler_peak(TopKTopP("triton"), 64)


def test_v2_triton_masks_in_place_and_flashinfer_keeps_its_probabilities() -> None:
    assert sampler_peak(TopKTopP("triton"), 256, "v2") == 0
    assert sampler_peak(TopKTopP("flashinfer"), 256, "v2") == pytest.approx(256 * V * 8, rel=0.01)
    # a greedy row keeps V2 off FlashInfer (fused_sampler_eligible): Triton, in place
    mixed = StepShape((ReqSlice(1), *(ReqSlice(1, top_p_k=True, random=True) for _ in range(255))))
    assert not flashinfer_allocations(mixed)
    assert flashinfer_allocations(StepShape(mixed.reqs[1:]))


def test_v2_verification_never_takes_flashinfer_and_copies_fp32_in_chunks() -> None:
    """vllm 0.32.0 gpu/model_runner.py `sample`: a step with draft tokens goes to the
    RejectionSampler, whose `_verify` applies top-k/top-p with `apply_top_k_top_p` (Triton) and
    whose `_verify_in_chunks` copies at most 2**30 // (V x 4) = 2,092 rows to fp32 at a time, whole
    requests: 348 requests of 1 + 5 rows."""
    drafting = StepShape(tuple(ReqSlice(6, top_p_k=True, random=True, draft_tokens=5) for _ in range(500)))
    assert not flashinfer_allocations(drafting)
    tape = StepMemory(DIMS, "flash-attn", runner="v2").plan(drafting)
    assert [n for op, name, n in tape if name == "logits_f32" and op == "alloc"] == [348 * 6 * V * 4]
    # without drafts (first tokens only) the plain Sampler fuses FlashInfer over the whole batch
    first_tokens = StepShape(tuple(ReqSlice(1, top_p_k=True, random=True) for _ in range(256)))
    assert flashinfer_allocations(first_tokens)


def flashinfer_allocations(shape: StepShape) -> list[str]:
    tape = StepMemory(DIMS, "flash-attn", runner="v2").plan(shape)
    return [name for op, name, _ in tape if op == "alloc" and name.startswith("flashinfer")]


@pytest.mark.parametrize(
    ("version", "runner", "rows"),
    [("0.16.0", "v1", 0), ("0.20.0", "v1", 132), ("0.31.0", "v1", 132), ("0.32.0", "v2", 0)],
)
def test_the_triton_buffer_is_held_from_start_up(version: str, runner: str, rows: int) -> None:
    """[min(next_pow2(min(SMs, B)), SMs), V] fp32 at max_num_seqs = 256 rows, 132 SMs: V1 caches
    it in the profile (Triton at 0.20; the seeded warm-up of forward_native from 0.21); 0.16.0
    has no Triton kernel; V2's greedy profile makes none (not played after it)."""
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", vllm_version=version, model_runner=runner, max_num_seqs=256)
    r = resolve(cfg, load_model("llama-3.1-8b"), 80 * GiB)
    assert triton_buffer_bytes(r) == rows * V * 4


def test_a_requests_seed_reaches_the_step() -> None:
    """bench traffic sends `seed` with every chat turn: FlashInfer cannot take such a batch."""

    def slice_of(seed: int | None) -> ReqSlice:
        req = Request("r", [1, 2, 3], Sampling(max_tokens=4, top_p=0.9, seed=seed), 0.0)
        return Engine.shape(SchedulerOutput([ScheduledReq(req, 3, 0)])).reqs[0]

    assert slice_of(7).seeded
    assert not slice_of(None).seeded


def test_flashinfer_with_top_p_alone_keeps_one_softmax() -> None:
    """flashinfer_sample (v1/sample/ops/topk_topp_sampler.py:599-613): no row sets top-k, so the
    batch's k is None and FlashInfer samples from one fp32 softmax; a row setting top-k beside
    rows setting top-p makes it top_k_top_p_sampling_from_logits (masked logits and probs)."""
    top_p = sampler_peak(TopKTopP("flashinfer"), 256, "v2", top_k=False, top_p=True)
    assert top_p == pytest.approx(256 * V * 4, rel=0.01)
    rows = [ReqSlice(1, top_p_k=True, random=True, top_k=False, top_p=True) for _ in range(255)]
    mixed = StepShape((*rows, ReqSlice(1, top_p_k=True, random=True, top_k=True, top_p=False)))
    assert len(flashinfer_allocations(mixed)) == 2
    assert len(flashinfer_allocations(StepShape(tuple(rows)))) == 1


@pytest.mark.parametrize(("runner", "per_logit"), [("v1", 4 + 12 + 4 + 8 + 20), ("v2", 2 + 8 + 2 + 8 + 20)])
def test_logprobs_all_vocab_peak_inside_cudas_topk_sort(runner: str, per_logit: int) -> None:
    # logprobs -1 (k = V > 4,096): torch.topk sorts what it selected (PyTorch TensorTopK.cpp
    # topk_out_cuda), its sorted values and int64 indices and the sort's scratch (20 B a logit at
    # 128+ rows) beside its own values and indices. V1 (v1/sample/sampler.py gather_logprobs): the
    # fp32 raw logprobs (4) + topk's fp32 values and indices (12) + the sort; V2
    # (gpu/sample/logprob.py compute_topk_scores): topk of the bf16 logits, no [B, V] logprobs
    rows = 256

    def peak(logprobs: int | None) -> int:
        alloc = CachingAllocator(Device(200 * GiB), "sim")
        shape = StepShape(tuple(ReqSlice(1, logprobs=logprobs) for _ in range(rows)))
        run_tape(alloc, StepMemory(DIMS, "flash-attn", runner=runner).plan(shape))
        return alloc.peak_allocated

    derived = rows * V * per_logit
    assert derived <= peak(-1) - peak(None) <= derived + 32 * MiB
    assert peak(20) - peak(None) < rows * V * 8  # a top-20 sorts in place: no [B, V] copy
