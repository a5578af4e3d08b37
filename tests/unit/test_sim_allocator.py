"""The caching-allocator model: rounding, caching, splitting, merging, the OOM message, and the
fragmentation of docs/sources.md#fragmentation-buffer-pr (failure mode 5 of docs/sources.md)."""

from __future__ import annotations

import asyncio

import pytest
from sim_support import make_engine

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device, format_size
from kvgate.sim.request import Request, Sampling
from kvgate.units import MiB


def test_rounding_and_pools() -> None:
    a = CachingAllocator(Device(1 << 34), "p")
    small = a.malloc(100)
    assert small.size == 512
    assert a.reserved() == 2 * MiB
    mid = a.malloc(3 * MiB)
    assert a.reserved() == 2 * MiB + 20 * MiB  # 20 MiB large buffer for < 10 MiB
    assert a.malloc(11 * MiB).segment is mid.segment  # fits in the 20 MiB segment's rest
    big = a.malloc(30 * MiB + 1)
    assert big.segment.size == 32 * MiB  # its own segment, rounded up to 2 MiB
    for b in (small, mid, big):
        a.free(b)
    assert a.reserved() == 54 * MiB  # cached, not returned
    a.empty_cache()
    assert a.reserved() == 20 * MiB  # the segment still holding the 11 MiB tensor stays


def test_split_then_merge_reuses_the_segment() -> None:
    a = CachingAllocator(Device(1 << 34), "p")
    x = a.malloc(100 * MiB)
    a.free(x)
    y, z = a.malloc(40 * MiB), a.malloc(50 * MiB)
    assert y.segment is z.segment
    assert a.reserved() == 100 * MiB
    a.free(y)
    a.free(z)
    assert len(x.segment.blocks) == 1
    assert a.malloc(100 * MiB).segment is x.segment


def test_large_blocks_split_only_when_more_than_1_mib_is_left() -> None:
    """PyTorch's should_split: a large-pool rest of exactly 1 MiB stays with the tensor."""
    a = CachingAllocator(Device(1 << 34), "p")
    a.free(a.malloc(12 * MiB))
    whole = a.malloc(11 * MiB)
    assert whole.size == 12 * MiB
    assert len(whole.segment.blocks) == 1
    a.free(whole)
    part = a.malloc(10 * MiB + MiB // 2)
    assert part.size == 10 * MiB + MiB // 2
    assert len(part.segment.blocks) == 2


def test_fragmentation_fails_with_reserved_but_unallocated_memory() -> None:
    """A 384 MiB request fails with 330 MiB free and 370 MiB cached: the cached bytes sit in a
    segment that also holds a live tensor, so they can be neither used nor released."""
    dev = Device(400 * MiB + 330 * MiB)
    a = CachingAllocator(dev, "vllm")
    a.free(a.malloc(400 * MiB))
    live = a.malloc(30 * MiB)  # best fit: carved out of the cached 400 MiB segment
    with pytest.raises(CudaOutOfMemory) as exc:
        a.malloc(384 * MiB)
    msg = str(exc.value)
    assert "Tried to allocate 384.00 MiB" in msg
    assert "of which 330.00 MiB is free" in msg
    assert "370.00 MiB is reserved by PyTorch but unallocated" in msg
    assert "expandable_segments:True" in msg
    a.free(live)


def test_expandable_segments_do_not_strand_free_bytes() -> None:
    dev = Device(400 * MiB + 330 * MiB)
    a = CachingAllocator(dev, "vllm", expandable_segments=True)
    a.free(a.malloc(400 * MiB))
    a.malloc(30 * MiB)
    assert a.malloc(384 * MiB).size >= 384 * MiB


def test_expandable_segments_keep_freed_pages_mapped_until_the_cache_is_released() -> None:
    # PyTorch unmaps an expandable segment's free pages only in release_cached_blocks (the retry
    # after a failed mapping, empty_cache): NVML keeps counting a freed tensor's pages, and a
    # smaller tensor takes them without the device giving more.
    dev = Device(1024 * MiB)
    a = CachingAllocator(dev, "vllm", expandable_segments=True)
    a.free(a.malloc(400 * MiB))
    assert dev.used() == 400 * MiB
    a.malloc(100 * MiB)
    assert dev.used() == 400 * MiB
    assert a.allocated() == 100 * MiB
    a.empty_cache()
    assert dev.used() == 100 * MiB


def test_oom_names_other_processes_and_private_pools() -> None:
    dev = Device(1024 * MiB)
    dev.set_usage("cotenant", 512 * MiB)
    a = CachingAllocator(dev, "vllm")
    a.malloc(100 * MiB, pool="private")
    with pytest.raises(CudaOutOfMemory) as exc:
        a.malloc(500 * MiB)
    assert "Process cotenant has 512.00 MiB memory in use." in str(exc.value)
    assert "with 100.00 MiB allocated in private pools (e.g., CUDA Graphs)" in str(exc.value)


def test_format_size_units() -> None:
    assert format_size(100) == "100 bytes"
    assert format_size(5 * 1024) == "5.00 KiB"
    assert format_size(int(5.34 * (1 << 30))) == "5.34 GiB"


def engine_with_two_prompts(penalties: bool, **config: object) -> Engine:
    """A Llama-3.1-8B engine on an H100 holding two requests of 3,000 and 1,000 prompt tokens."""
    engine = make_engine(
        SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192, max_num_seqs=64, speedup=1e9, **config)
    )
    for i, n in enumerate((3000, 1000)):
        engine.add(Request(f"r{i}", [10 + i] * n, Sampling(max_tokens=4, penalties=penalties, ignore_eos=True), 0.0))
    return engine


def run_steps(engine: Engine, k: int) -> None:
    async def steps() -> None:
        for _ in range(k):
            await engine.step()

    asyncio.run(steps())


def test_penalty_prompt_ids_live_across_steps_until_the_batch_changes() -> None:
    """vLLM's V1 persistent batch keeps `[num_reqs, max_prompt_len]` int64 prompt ids on the GPU
    while any request has penalties, rebuilt only when the batch's requests change."""
    engine = engine_with_two_prompts(True, model_runner="v1")
    run_steps(engine, 1)
    held = engine.carry.penalty_prompt_ids
    assert held is not None
    assert held.requested == 2 * 3000 * 8
    assert held.allocated
    run_steps(engine, 1)
    assert engine.carry.penalty_prompt_ids is held  # same batch, same tensor
    run_steps(engine, 10)
    assert not engine.scheduler.has_work()
    assert held.allocated
    engine.add(Request("r2", [7] * 500, Sampling(max_tokens=2), 0.0))
    run_steps(engine, 1)
    assert engine.carry.penalty_prompt_ids is None  # new batch without penalties: freed (block may be reused)


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0"])
def test_model_runner_v2_holds_no_penalty_prompt_ids(version: str) -> None:
    """V2 counts a penalised prompt into `PenaltiesState`'s start-up tensors (v1/worker/gpu/sample/
    penalties.py in vLLM 0.31.0 - 0.33.0): no `[num_reqs, max_prompt_len]` tensor is made when a
    penalised request joins, and a step beside it allocates what the same step without the
    penalty allocates. (The simulator made V1's tensor on V2 until session 42: a random scenario's
    24,000-token prompt beside 381 penalised rows ran V2 out on a 73 MiB tensor vLLM never makes.)"""

    def reserved_after_two_steps(penalties: bool) -> int:
        engine = engine_with_two_prompts(penalties, vllm_version=version)
        assert engine.resolved.flavor.v2
        run_steps(engine, 2)
        assert engine.carry.penalty_prompt_ids is None
        return engine.alloc.reserved()

    assert reserved_after_two_steps(True) == reserved_after_two_steps(False)
