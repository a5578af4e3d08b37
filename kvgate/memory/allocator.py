"""What PyTorch's CUDA caching allocator reserves for a sequence of tensors, beyond their bytes.

vLLM sizes its KV pool with the profile run's *allocated* peak (vllm 0.32.0
`vllm/utils/mem_utils.py` `memory_profiling`: `allocated_bytes.all.peak`, with `empty_cache()`
before and after), but the allocator must *reserve* segments to hold those tensors again, and
segments never merge. So when a step's profiled tensors come back out of free memory, they take
more than the profile peak. This module replays an allocation tape under the allocator's rules
and returns the reserved peak; kvgate/memory/activation.py builds the profile step's tape.

The rules, from pytorch/pytorch `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`;
the constants and the behaviour are the same from PyTorch 2.1 to 2.9, the versions vLLM 0.22 -
0.33 pin), with the default configuration (no `max_split_size_mb`, one stream):

- `round_size`: a request rounds up to a multiple of `kMinBlockSize` (512 B);
- `get_pool` / `get_allocation_size`: up to `kSmallSize` (1 MiB) in the small pool, in
  `kSmallBuffer` (2 MiB) segments; larger ones in the large pool, in a `kLargeBuffer` (20 MiB)
  segment under `kMinLargeAlloc` (10 MiB), else in a segment of their own size rounded up to
  `kRoundLarge` (2 MiB);
- `get_free_block`: the smallest cached free block of the pool that fits (best fit);
- `should_split`: the block is split when the rest is at least 512 B (small pool) or more than
  1 MiB (large pool);
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its own
  segment only; a segment goes back to the driver only whole (`release_cached_blocks`, on
  `empty_cache()` or after a failed `cudaMalloc`).

With `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (`ExpandableSegment`) the pool is one
growable mapping of 2 MiB pages whose free pages are mapped again where needed, so freed bytes
never strand: the replay then charges each live tensor its page-rounded size.

The replay starts from an empty cache, as vLLM's profile does after `empty_cache()`; a
history of other steps can strand more (the simulator shows how: docs/memory-model.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgate.units import MiB

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize
SMALL_BUFFER = 2 * MiB  # kSmallBuffer
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
EXPANDABLE_PAGE = 2 * MiB  # ExpandableSegment's granularity for the large pool

# One step of a tape: ("alloc", name, bytes) or ("free", name, 0).
TapeOp = tuple[str, str, int]


def alloc(name: str, nbytes: int) -> TapeOp:
    return ("alloc", name, nbytes)


def free(*names: str) -> list[TapeOp]:
    return [("free", name, 0) for name in names]


@dataclass(eq=False)
class _Block:
    size: int
    allocated: bool = False


@dataclass(eq=False)
class _Segment:
    pool: str
    blocks: list[_Block] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)


def _rounded(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def _segment_size(size: int, pool: str) -> int:
    if pool == "small":
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class Footprint:
    """A tape's allocated peak (what vLLM's profile records) and reserved peak (what the
    allocator must hold for it); `overhead` is the difference."""

    allocated_peak: int
    reserved_peak: int

    @property
    def overhead(self) -> int:
        return max(0, self.reserved_peak - self.allocated_peak)


def footprint(tape: Iterable[TapeOp], expandable_segments: bool = False) -> Footprint:
    """Replay `tape` on an empty caching allocator (the rules in the module docstring)."""
    if expandable_segments:
        return _expandable_footprint(tape)
    segments: list[_Segment] = []
    live: dict[str, tuple[_Segment, _Block]] = {}
    allocated = peak_allocated = peak_reserved = 0
    for op, name, nbytes in tape:
        if op == "free":
            seg, block = live.pop(name)
            allocated -= block.size
            _release(seg, block)
            continue
        size = _rounded(nbytes)
        pool = "small" if size <= SMALL_SIZE else "large"
        found = _best_fit(segments, size, pool)
        if found is None:
            seg = _Segment(pool, [_Block(_segment_size(size, pool))])
            segments.append(seg)
            found = (seg, seg.blocks[0])
        seg, block = found
        rest = block.size - size
        if rest >= MIN_BLOCK if pool == "small" else rest > SMALL_SIZE:
            seg.blocks.insert(seg.blocks.index(block) + 1, _Block(rest))
            block.size = size
        block.allocated = True
        live[name] = (seg, block)
        allocated += block.size
        peak_allocated = max(peak_allocated, allocated)
        peak_reserved = max(peak_reserved, sum(s.size for s in segments))
    return Footprint(peak_allocated, peak_reserved)


def _expandable_footprint(tape: Iterable[TapeOp]) -> Footprint:
    sizes: dict[str, int] = {}
    peak_allocated = peak_reserved = 0
    for op, name, nbytes in tape:
        if op == "free":
            sizes.pop(name)
            continue
        sizes[name] = nbytes
        peak_allocated = max(peak_allocated, sum(_rounded(n) for n in sizes.values()))
        pages = sum(-(-n // EXPANDABLE_PAGE) * EXPANDABLE_PAGE for n in sizes.values())
        peak_reserved = max(peak_reserved, pages)
    return Footprint(peak_allocated, peak_reserved)


def _best_fit(segments: list[_Segment], size: int, pool: str) -> tuple[_Segment, _Block] | None:
    best: tuple[_Segment, _Block] | None = None
    for seg in segments:
        if seg.pool != pool:
            continue
        for block in seg.blocks:
            if not block.allocated and block.size >= size and (best is None or block.size < best[1].size):
                best = (seg, block)
    return best


def _release(seg: _Segment, block: _Block) -> None:
    """free_block: mark free and merge with free neighbours inside the segment."""
    block.allocated = False
    blocks = seg.blocks
    i = blocks.index(block)
    if i + 1 < len(blocks) and not blocks[i + 1].allocated:
        block.size += blocks.pop(i + 1).size
    if i > 0 and not blocks[i - 1].allocated:
        blocks[i - 1].size += block.size
        blocks.pop(i)
