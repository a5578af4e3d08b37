"""An out-of-memory inside a step leaves a record to diagnose it by: the tensor that asked, the
step's tensors alive then and the allocator's segments, beside PyTorch's unchanged message."""

from __future__ import annotations

import re

import pytest

from kvgate.sim.gpu import CachingAllocator, CudaOutOfMemory, Device
from kvgate.sim.step_memory import run_tape
from kvgate.units import MiB


def test_a_tape_that_runs_out_names_its_tensor_and_the_allocators_segments() -> None:
    # 64 MiB of device: two 30 MiB tensors fit, the third finds 4 MiB free and no cached block.
    alloc = CachingAllocator(Device(64 * MiB), "vllm")
    alloc.malloc(100)  # a 2 MiB small-pool segment that stays
    tape = [("alloc", "qkv", 30 * MiB), ("alloc", "gate_up", 29 * MiB), ("alloc", "logits_f32", 30 * MiB)]
    with pytest.raises(CudaOutOfMemory) as caught:
        run_tape(alloc, tape)
    exc = caught.value
    assert exc.tensor == "logits_f32"
    assert exc.requested == 30 * MiB
    assert exc.live == {"qkv": 30 * MiB, "gate_up": 29 * MiB}
    state = exc.allocator
    assert state["reserved"] == 62 * MiB  # 2 + 30 + 30 (29 MiB rounds up to a 30 MiB segment)
    assert state["allocated"] == 60 * MiB + 512  # the 29 MiB tensor keeps its whole block
    assert state["device_free"] == 2 * MiB
    assert [(s["pool"], s["size"]) for s in state["segments"]] == [
        ("small", 2 * MiB),
        ("large", 30 * MiB),
        ("large", 30 * MiB),
    ]
    # the small segment's rest and the last large segment's 1 MiB tail are free blocks
    assert state["segments"][0]["blocks"] == [[512, True], [2 * MiB - 512, False]]
    assert state["segments"][2]["blocks"] == [[30 * MiB, True]]  # a 1 MiB rest is not split off
    # PyTorch's message is untouched, and its numbers are the record's
    text = str(exc)
    assert text.startswith("CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a total capacity of 64.00 MiB")
    unallocated = float(re.search(r"and ([0-9.]+) MiB is reserved by PyTorch but unallocated", text).group(1))
    assert unallocated == pytest.approx((state["reserved"] - state["allocated"]) / MiB, abs=0.01)


def test_the_closest_call_is_the_least_room_an_allocation_left() -> None:
    alloc = CachingAllocator(Device(64 * MiB), "vllm")
    first = alloc.malloc(30 * MiB)  # a new 30 MiB segment of 64 MiB free
    assert alloc.closest_call == 34 * MiB
    alloc.malloc(20 * MiB)  # 34 MiB free: 14 MiB to spare
    assert alloc.closest_call == 14 * MiB
    alloc.free(first)
    # 14 MiB free on the device, the 30 MiB segment cached and free: given back on a retry, it
    # makes 44 MiB, so a 40 MiB tensor had 4 MiB to spare
    alloc.malloc(40 * MiB)
    assert alloc.closest_call == 4 * MiB
    with pytest.raises(CudaOutOfMemory):
        alloc.malloc(6 * MiB)  # a 20 MiB segment of the 4 MiB left
    assert alloc.closest_call == 4 * MiB - 20 * MiB
    alloc.watch_closest_call()
    assert alloc.closest_call is None
