"""One simulated GPU: the device (processes and their memory) and PyTorch's caching allocator.

The allocator follows c10/cuda/CUDACachingAllocator.cpp (`DeviceCachingAllocator`) closely
enough to fail where it fails, with its default configuration (no `max_split_size_mb`, no
garbage-collection threshold, one stream):

- `round_size`: requests round up to a multiple of 512 bytes;
- `get_pool` / `get_allocation_size`: requests of at most 1 MiB live in the small pool, in
  2 MiB segments; larger ones in the large pool, in a 20 MiB segment under 10 MiB, else in a
  segment of their own size rounded up to 2 MiB; the pools never share a segment;
- `get_free_block`: the smallest cached free block of the pool that fits (best fit);
- `should_split`: the block is split when the rest is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); otherwise the request keeps the whole block;
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its segment,
  never across segments;
- `malloc`: when no cached block fits, cudaMalloc a new segment; when that fails,
  `release_cached_blocks` gives back every segment that is entirely free and retries once, then
  raises with the numbers of its OOM message.

So a request can fail while "reserved but unallocated" exceeds it: the free bytes sit in
segments that also hold a live tensor, and a segment is only ever given back whole
(fragmentation). With `expandable_segments` the reserved memory behaves as growable mappings
of 2 MiB pages (`ExpandableSegment`): a freed tensor's pages stay mapped, cached like any freed
block (NVML still counts them), and only `release_cached_blocks` (the retry after a failed
mapping, or `empty_cache`) unmaps free pages (`release_expandable_segment` -> `unmap_block`,
"only called by release_cached_blocks()"), which can then be mapped again anywhere, so free bytes
never strand. The model gives each tensor a page-rounded mapping of its own: a new one, or
the pages of a cached free mapping at least as large (the rest stays a cached mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvgate.units import GiB, KiB, MiB

_MIN_BLOCK = 512
_SMALL_SIZE = 1 * MiB
_SMALL_BUFFER = 2 * MiB
_LARGE_BUFFER = 20 * MiB
_MIN_LARGE_ALLOC = 10 * MiB
_ROUND_LARGE = 2 * MiB
_PAGE = 2 * MiB


def format_size(n: int) -> str:
    """PyTorch's format_size: the unit strings its OOM message uses."""
    if n < KiB:
        return f"{n} bytes"
    if n < MiB:
        return f"{n / KiB:.2f} KiB"
    if n < GiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / GiB:.2f} GiB"


class CudaOutOfMemory(RuntimeError):
    """torch.OutOfMemoryError: the message is PyTorch's, the numbers the simulated device's.

    Beside the message it carries what a rare crash needs to be diagnosed after the fact (the
    message alone cannot tell fragmentation from an under-counted tensor): the allocator's
    segments when the request failed (`CachingAllocator.snapshot`) and, once `run_tape` has
    seen it, the tape's tensor that asked and the step's tensors alive beside it."""

    def __init__(self, message: str, requested: int, allocator: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.requested = requested
        self.allocator = allocator or {}
        self.tensor = ""
        self.live: dict[str, int] = {}


class Device:
    """The GPU as NVML sees it: a capacity and the memory each process holds."""

    def __init__(self, total_bytes: int, index: int = 0) -> None:
        self.total = total_bytes
        self.index = index
        self.processes: dict[str, int] = {}

    def used(self) -> int:
        return sum(self.processes.values())

    def free(self) -> int:
        return self.total - self.used()

    def set_usage(self, name: str, nbytes: int) -> None:
        if nbytes <= 0:
            self.processes.pop(name, None)
        else:
            self.processes[name] = nbytes


@dataclass(eq=False)
class Block:
    segment: Segment
    offset: int
    size: int
    allocated: bool = False
    requested: int = 0


@dataclass(eq=False)
class Segment:
    size: int
    pool: str
    blocks: list[Block] = field(default_factory=list)

    def fully_free(self) -> bool:
        return all(not b.allocated for b in self.blocks)


class CachingAllocator:
    """PyTorch's CUDA caching allocator for one process on `device`."""

    def __init__(self, device: Device, process: str, expandable_segments: bool = False) -> None:
        self.device = device
        self.process = process
        self.expandable = expandable_segments
        self.segments: list[Segment] = []
        self.non_torch = 0
        self.peak_allocated = 0
        # The least margin any allocation had since the last `watch_closest_call` (None: none
        # made): how close this process came to an out-of-memory (`_margin`).
        self.closest_call: int | None = None
        self._sync_device()

    # ----- accounting -------------------------------------------------------------------------
    def allocated(self, pool: str | None = None) -> int:
        return sum(b.size for s in self.segments if pool is None or s.pool == pool for b in s.blocks if b.allocated)

    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    def process_bytes(self) -> int:
        """What NVML shows for this process: reserved by torch plus non-torch memory."""
        return self.reserved() + self.non_torch

    def set_non_torch(self, nbytes: int) -> None:
        self.non_torch = nbytes
        self._sync_device()

    def snapshot(self) -> dict[str, Any]:
        """The allocator's state in numbers, as `torch.cuda.memory_snapshot()` lists it: every
        segment (pool, size, its blocks in address order as [size, allocated]), reserved and
        allocated bytes, non-torch bytes and what the device has free."""
        return {
            "reserved": self.reserved(),
            "allocated": self.allocated(),
            "non_torch": self.non_torch,
            "device_free": self.device.free(),
            "segments": [
                {"pool": s.pool, "size": s.size, "blocks": [[b.size, b.allocated] for b in s.blocks]}
                for s in self.segments
            ],
        }

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated()

    def _sync_device(self) -> None:
        self.device.set_usage(self.process, self.process_bytes())

    # ----- malloc / free ----------------------------------------------------------------------
    def malloc(self, nbytes: int, pool: str | None = None) -> Block:
        """Allocate a tensor of `nbytes`; raises CudaOutOfMemory as PyTorch would."""
        size = max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)
        pool = pool or ("small" if size <= _SMALL_SIZE else "large")
        margin = self._margin(size, pool)
        self.closest_call = margin if self.closest_call is None else min(self.closest_call, margin)
        block = self._best_fit(size, pool)
        if block is None:
            seg_size = self._segment_size(size, pool)
            if not self._cuda_malloc(seg_size):
                self.empty_cache()
                if not self._cuda_malloc(seg_size):
                    raise CudaOutOfMemory(self._oom_message(nbytes), nbytes, self.snapshot())
            seg = Segment(seg_size, pool)
            block = Block(seg, 0, seg_size)
            seg.blocks.append(block)
            self.segments.append(seg)
        self._split(block, size, pool)
        block.allocated = True
        block.requested = nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated())
        self._sync_device()
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].allocated:
            block.size += blocks.pop(i + 1).size
        if i > 0 and not blocks[i - 1].allocated:
            prev = blocks[i - 1]
            prev.size += block.size
            blocks.pop(i)
        self._sync_device()

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): give every fully free segment back to the driver."""
        for seg in [s for s in self.segments if s.fully_free()]:
            self._release(seg)
        self._sync_device()

    def _release(self, seg: Segment) -> None:
        self.segments.remove(seg)

    def _best_fit(self, size: int, pool: str) -> Block | None:
        best: Block | None = None
        for seg in self.segments:
            if seg.pool != pool:
                continue
            for b in seg.blocks:
                if not b.allocated and b.size >= size and (best is None or b.size < best.size):
                    best = b
        return best

    def _split(self, block: Block, size: int, pool: str) -> None:
        if self.expandable:
            self._lend_pages(block, self._segment_size(size, pool))
            return
        remaining = block.size - size
        worth_it = remaining >= _MIN_BLOCK if pool == "small" else remaining > _SMALL_SIZE
        if worth_it:
            blocks = block.segment.blocks
            rest = Block(block.segment, block.offset + size, remaining)
            blocks.insert(blocks.index(block) + 1, rest)
            block.size = size

    def _lend_pages(self, block: Block, pages: int) -> None:
        """Expandable segments: a cached free mapping larger than the tensor's `pages` keeps the
        rest as a cached mapping of its own (pages are fungible, so where they sit is moot)."""
        if block.size > pages:
            rest = Segment(block.size - pages, block.segment.pool)
            rest.blocks.append(Block(rest, 0, rest.size))
            self.segments.append(rest)
            block.segment.size = block.size = pages

    def _segment_size(self, size: int, pool: str) -> int:
        if self.expandable:
            return -(-size // _PAGE) * _PAGE
        if pool == "small":
            return _SMALL_BUFFER
        if size < _MIN_LARGE_ALLOC:
            return _LARGE_BUFFER
        return -(-size // _ROUND_LARGE) * _ROUND_LARGE

    def watch_closest_call(self) -> None:
        """Count the closest call from now on (the engine's steps, not its start-up profile)."""
        self.closest_call = None

    def _margin(self, size: int, pool: str) -> int:
        """How many more bytes a request of `size` could have asked and still succeeded (negative:
        it fails): the larger of what the pool's largest cached free block and a new segment
        (what the device has free, with every fully free segment given back as the retry after
        `release_cached_blocks` has it) leave over. Device free bytes alone say little: the cache
        grows until it holds almost all of them, and a step served from it risks nothing."""
        releasable = sum(s.size for s in self.segments if s.fully_free())
        fresh = self.device.free() + releasable - self._segment_size(size, pool)
        cached = (b.size - size for s in self.segments if s.pool == pool for b in s.blocks if not b.allocated)
        return max([fresh, *cached])

    def _cuda_malloc(self, nbytes: int) -> bool:
        return nbytes <= self.device.free()

    def _oom_message(self, nbytes: int) -> str:
        dev = self.device
        others = "".join(
            f"Process {name} has {format_size(used)} memory in use. "
            for name, used in sorted(dev.processes.items())
            if name != self.process
        )
        allocated = self.allocated()
        return (
            f"CUDA out of memory. Tried to allocate {format_size(nbytes)}. "
            f"GPU {dev.index} has a total capacity of {format_size(dev.total)} of which "
            f"{format_size(dev.free())} is free. {others}Including non-PyTorch memory, this "
            f"process has {format_size(self.process_bytes())} memory in use. Of the allocated "
            f"memory {format_size(allocated)} is allocated by PyTorch, with "
            f"{format_size(self.allocated('private'))} allocated in private pools (e.g., CUDA "
            f"Graphs), and {format_size(self.reserved() - allocated)} is reserved by PyTorch "
            "but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
