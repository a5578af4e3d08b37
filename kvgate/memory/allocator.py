"""What PyTorch's CUDA caching allocator needs for a step's tensors, beyond their bytes.

vLLM sizes its KV pool with the profile run's *allocated* peak (vllm 0.32.0
`vllm/utils/mem_utils.py` `memory_profiling`: `allocated_bytes.all.peak`, with `empty_cache()`
before and after), but the allocator holds tensors in segments that never merge. When a step's
profiled tensors come back out of free memory, a tensor that best fit puts into a larger cached
segment pins the whole segment, and a later tensor that fits in no freed block needs a new one.
This module replays allocation tapes under the allocator's rules; kvgate/memory/activation.py
builds the forward pass's tape.

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
  segment only;
- `malloc`: when `cudaMalloc` fails, `release_cached_blocks` gives back every segment with no
  live block and retries once. So what a step *needs* at a malloc is the segments that hold a
  live block plus the new one (`need`); the cached free segments only lend memory until then.

With `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (`ExpandableSegment`) the pool is one
growable mapping of 2 MiB pages whose free pages are mapped again where needed, so freed bytes
never strand: the replay then charges each live tensor its page-rounded size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations_with_replacement

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
    size: int  # cudaMalloc's: its blocks split and merge within it
    blocks: list[_Block] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return any(b.allocated for b in self.blocks)


def _rounded(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def _pages(nbytes: int) -> int:
    return -(-nbytes // EXPANDABLE_PAGE) * EXPANDABLE_PAGE


def _segment_size(size: int, pool: str) -> int:
    if pool == "small":
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True)
class Footprint:
    """One replay: the allocated peak (what vLLM's profile records), the reserved peak (what
    the allocator caches) and the need (segments holding a live block at a malloc, the new one
    included: what must fit in the GPU's memory)."""

    allocated_peak: int
    reserved_peak: int
    need: int


class _OutOfMemory(Exception):
    """A replay with a capacity ran out of it: cudaMalloc failed again after the cache was released."""


class _Replay:
    """One process's large and small pools, played op by op; with a `capacity` (the bytes the
    process may reserve) a segment that does not fit first releases the cached free ones, as
    `malloc` does, and raises _OutOfMemory when it still does not fit."""

    def __init__(self, expandable_segments: bool, capacity: int | None = None) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity
        self.segments: list[_Segment] = []
        self.live: dict[str, tuple[_Segment, _Block]] = {}
        self.sizes: dict[str, int] = {}  # expandable segments: each live tensor's bytes
        self.releases = 0  # how many times a cudaMalloc that did not fit released the cache

    def copy(self) -> _Replay:
        """The same pools, to play on apart (the histories `fitting_prefix` reuses)."""
        other = _Replay(self.expandable, self.capacity)
        blocks: dict[int, _Block] = {}
        for seg in self.segments:
            copied = _Segment(
                seg.pool, seg.size, [blocks.setdefault(id(b), _Block(b.size, b.allocated)) for b in seg.blocks]
            )
            other.segments.append(copied)
            for name, (live_seg, block) in self.live.items():
                if live_seg is seg:
                    other.live[name] = (copied, blocks[id(block)])
        other.sizes = dict(self.sizes)
        other.releases = self.releases
        return other

    def release_cached_blocks(self) -> None:
        self.segments = [s for s in self.segments if s.live]

    def run(self, tape: Iterable[TapeOp]) -> None:
        """`play` without the footprint: only whether it runs out (_OutOfMemory)."""
        for op, name, nbytes in tape:
            if op == "free":
                self._free(name)
            else:
                self._malloc(name, nbytes)

    def play(self, tape: Iterable[TapeOp]) -> Footprint:
        allocated = reserved = need = 0
        for op, name, nbytes in tape:
            if op == "free":
                self._free(name)
                continue
            self._malloc(name, nbytes)
            if self.expandable:
                held = sum(_pages(n) for n in self.sizes.values())
                allocated, reserved, need = (
                    max(allocated, sum(_rounded(n) for n in self.sizes.values())),
                    max(reserved, held),
                    max(need, held),
                )
                continue
            allocated = max(allocated, sum(b.size for _, b in self.live.values()))
            reserved = max(reserved, sum(s.size for s in self.segments))
            need = max(need, sum(s.size for s in self.segments if s.live))
        return Footprint(allocated, reserved, need)

    def _malloc(self, name: str, nbytes: int) -> None:
        if self.expandable:
            self.sizes[name] = nbytes
            if self.capacity is not None and sum(_pages(n) for n in self.sizes.values()) > self.capacity:
                raise _OutOfMemory(name)
            return
        size = _rounded(nbytes)
        pool = "small" if size <= SMALL_SIZE else "large"
        found = _best_fit(self.segments, size, pool)
        if found is None:
            segment = _segment_size(size, pool)
            self._make_room(segment, name)
            seg = _Segment(pool, segment, [_Block(segment)])
            self.segments.append(seg)
            found = (seg, seg.blocks[0])
        seg, block = found
        rest = block.size - size
        if rest >= MIN_BLOCK if pool == "small" else rest > SMALL_SIZE:
            seg.blocks.insert(seg.blocks.index(block) + 1, _Block(rest))
            block.size = size
        block.allocated = True
        self.live[name] = (seg, block)

    def _make_room(self, nbytes: int, name: str) -> None:
        """`malloc`'s cudaMalloc of a new segment: when it does not fit, `release_cached_blocks`
        and one more try."""
        if self.capacity is None or sum(s.size for s in self.segments) + nbytes <= self.capacity:
            return
        self.releases += 1
        self.release_cached_blocks()
        if sum(s.size for s in self.segments) + nbytes > self.capacity:
            raise _OutOfMemory(name)

    def _free(self, name: str) -> None:
        if self.expandable:
            del self.sizes[name]
            return
        seg, block = self.live.pop(name)
        block.allocated = False
        blocks = seg.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].allocated:
            block.size += blocks.pop(i + 1).size
        if i > 0 and not blocks[i - 1].allocated:
            blocks[i - 1].size += block.size
            blocks.pop(i)


def footprint(tape: Iterable[TapeOp], expandable_segments: bool = False) -> Footprint:
    """Replay `tape` on an empty caching allocator (the rules in the module docstring)."""
    return _Replay(expandable_segments).play(tape)


def kept_after(tape: Iterable[TapeOp], expandable_segments: bool = False) -> int:
    """What a process still reserves after `tape` played from an empty cache once a failed
    cudaMalloc has released its cached free segments (`release_cached_blocks`): the segments that
    hold the tensors it kept."""
    replay = _Replay(expandable_segments)
    replay.run(tape)
    if expandable_segments:
        return sum(_pages(n) for n in replay.sizes.values())
    replay.release_cached_blocks()
    return sum(s.size for s in replay.segments)


def releases_cache_after(step: Sequence[TapeOp], history: Sequence[TapeOp], capacity: int) -> bool:
    """Whether `step`, played after `history` from an empty cache in `capacity` bytes, makes a
    cudaMalloc that does not fit beside the cache, so that PyTorch releases the cached free
    segments (``release_cached_blocks``), or runs out: either way the cache `history` left is gone."""
    replay = _Replay(False, capacity)
    try:
        replay.run(history)
        before = replay.releases
        replay.run(step)
    except _OutOfMemory:
        return True
    return replay.releases > before


def worst_need(
    step: Sequence[TapeOp],
    earlier: Iterable[Sequence[Sequence[TapeOp]]],
    expandable_segments: bool = False,
    from_empty: bool = True,
) -> int:
    """The most `step` needs (`Footprint.need`) after any of the `earlier` histories of steps,
    each played from an empty cache, and each also with the cache released before `step` (a
    failed cudaMalloc in between does that): the allocator's state is history, so the same
    step needs more after steps of other sizes left their segments for best fit to split.
    `from_empty`: `step` alone on an empty cache counts too (False where it frees a tensor an
    earlier step made)."""
    worst = footprint(step, expandable_segments).need if from_empty else 0
    for history in earlier:
        for released in (False, True):
            replay = _Replay(expandable_segments)
            for tape in history:
                replay.play(tape)
            if released:
                replay.release_cached_blocks()
            worst = max(worst, replay.play(step).need)
    return worst


class PlayedStep:
    """The allocator's pools after one step played from an empty cache, and what that step needed
    (`Footprint.need`): kept to play several later steps from (`worst_need_beyond_earlier`)."""

    def __init__(self, tape: Sequence[TapeOp], expandable_segments: bool = False) -> None:
        self._replay = _Replay(expandable_segments)
        self.need = self._replay.play(tape).need

    def then(self, lead_in: Sequence[TapeOp], step: Sequence[TapeOp]) -> int:
        """What `step` needs played after `lead_in` from these pools (a copy: they stay as they are)."""
        replay = self._replay.copy()
        replay.play(lead_in)
        return replay.play(step).need


def worst_need_beyond_earlier(step: Sequence[TapeOp], earlier: Iterable[tuple[PlayedStep, Sequence[TapeOp]]]) -> int:
    """The most `step` needs after any of the `earlier` (played step, lead-in) pairs (an earlier
    step, then what runs of `step`'s own step before it), counted only where `step` needs more
    than the earlier step did: where it needs no more, the earlier step ran in the same memory and
    left the cache `step` meets, so it runs too (0 when no pair counts). The cache is kept in
    between: released, the earlier step leaves nothing cached and `step` runs as from an empty
    cache, which `worst_need` plays."""
    worst = 0
    for earlier_step, lead_in in earlier:
        need = earlier_step.then(lead_in, step)
        if need > earlier_step.need:
            worst = max(worst, need)
    return worst


def _best_fit(segments: list[_Segment], size: int, pool: str) -> tuple[_Segment, _Block] | None:
    best: tuple[_Segment, _Block] | None = None
    for seg in segments:
        if seg.pool != pool:
            continue
        for block in seg.blocks:
            if not block.allocated and block.size >= size and (best is None or block.size < best[1].size):
                best = (seg, block)
    return best


def fits_after_any(
    step: Sequence[TapeOp],
    earlier: Iterable[Sequence[Sequence[TapeOp]]],
    capacity: int,
    expandable_segments: bool = False,
) -> bool:
    """Whether `step` runs in `capacity` bytes (what the process may reserve beyond what it holds
    for good) from an empty cache and after each of the `earlier` histories, each also with the
    cache released before `step`. Unlike `worst_need` the histories run in the same capacity, so
    the cache holds only what a real process could have kept (a segment that did not fit released
    the cached ones first), and a history that itself runs out is no state `step` can meet."""
    for replay in _histories_played(earlier, capacity, expandable_segments):
        try:
            replay.play(step)
        except _OutOfMemory:
            return False
    return True


def _histories_played(
    earlier: Iterable[Sequence[Sequence[TapeOp]]], capacity: int, expandable_segments: bool
) -> Iterator[_Replay]:
    """The allocator's state after an empty history and after each of `earlier`, each with its
    cache kept and released, in `capacity`; a history that itself runs out is left out."""
    for history in [(), *earlier]:
        for released in (False, True):
            replay = _Replay(expandable_segments, capacity)
            try:
                for tape in history:
                    replay.play(tape)
            except _OutOfMemory:
                continue
            if released:
                replay.release_cached_blocks()
            yield replay


def fits_from_any_cache(
    step: Sequence[TapeOp],
    capacity: int,
    sizes: Sequence[int],
    most: int,
    expandable_segments: bool = False,
    cached: int | None = None,
) -> bool:
    """Whether `step` runs in `capacity` bytes from an empty cache and from every cache of at most
    `most` free large-pool segments whose sizes are among `sizes` and add up to at most `capacity`,
    and at most `cached` where given (what the GPU's readings show cached: 0, the empty cache only).

    Between steps every transient tensor is dead, so a free segment merges back into one block
    (`try_merge_blocks`) and the cache a step starts from is a set of whole free segments, each the
    size some earlier tensor had when cudaMalloc made it; which ones depends on the whole history,
    which the histories of `fits_after_any` only sample (held-out H7: two earlier steps strand what
    one never does). Here the cache is not played from steps but chosen: best fit may place the
    step's first tensors in segments that are too large, pinned while later ones take new
    segments, and the cached rest is released only when a cudaMalloc fails. With expandable
    segments freed pages are mapped again where needed: only the step's own pages count."""
    caches = _caches(sizes, most, capacity, cached, expandable_segments)
    return all(_runs_from(step, capacity, cache, expandable_segments) for cache in caches)


def most_from_any_cache(
    step_of: Callable[[int], Sequence[TapeOp]],
    low: int,
    high: int,
    capacity: int,
    sizes: Sequence[int],
    most: int,
    expandable_segments: bool = False,
) -> int:
    """The largest `x` in `[low, high]` whose `step_of(x)` runs from every cache of
    `fits_from_any_cache` (`low` where none above it does; `low` itself is not played), for
    steps that grow with `x` (a larger step is never safer from one cache).

    The level is the least over the caches of each cache's own, so each cache is played at the
    level found so far and bisected below it only where it does not run there (a few dozen of
    thousands); the caches that ran a level since lowered are played again at the new one, so
    the answer runs from every cache, as a bisection's last passing probe does. A bisection over
    all caches plays every cache at each of its passing probes (about half of ~11)."""
    tapes: dict[int, Sequence[TapeOp]] = {}

    def runs(x: int, cache: tuple[int, ...]) -> bool:
        tape = tapes.get(x)
        if tape is None:
            tape = tapes[x] = step_of(x)
        return _runs_from(tape, capacity, cache, expandable_segments)

    pending = list(_caches(sizes, most, capacity, None, expandable_segments))
    level = high
    while pending:
        ran: list[tuple[int, ...]] = []  # the caches run at `level` so far
        stale: list[tuple[int, ...]] = []  # the caches run only at a level since lowered: again
        for cache in pending:
            if runs(level, cache):
                ran.append(cache)
                continue
            below, above = low, level - 1
            while below < above:
                middle = (below + above + 1) // 2
                below, above = (middle, above) if runs(middle, cache) else (below, middle - 1)
            if below == low:
                return low
            level = below
            stale += ran
            ran = [cache]
        pending = stale
    return level


def fits_from_some_cache(
    step: Sequence[TapeOp], capacity: int, sizes: Sequence[int], most: int, expandable_segments: bool = False
) -> bool:
    """Whether `step` runs in `capacity` bytes from an empty cache or from some cache of at most
    `most` free large-pool segments of `sizes` (`fits_from_any_cache`'s caches): False only where
    none of them runs it."""
    caches = _caches(sizes, most, capacity, None, expandable_segments)
    return any(_runs_from(step, capacity, cache, expandable_segments) for cache in caches)


def _caches(
    sizes: Sequence[int], most: int, capacity: int, cached: int | None, expandable_segments: bool
) -> Iterator[tuple[int, ...]]:
    """The empty cache, then every multiset of at most `most` of `sizes` adding up to at most
    `capacity` (and `cached`, where given); with expandable segments the empty cache only (freed
    pages are mapped again where needed: no segment strands)."""
    yield ()
    if expandable_segments:
        return
    bound = capacity if cached is None else min(capacity, cached)
    for k in range(1, most + 1):
        yield from (c for c in combinations_with_replacement(sizes, k) if sum(c) <= bound)


def _runs_from(step: Sequence[TapeOp], capacity: int, cache: tuple[int, ...], expandable_segments: bool) -> bool:
    """Whether `step` runs in `capacity` from free large-pool segments of the sizes `cache` holds."""
    replay = _Replay(expandable_segments, capacity)
    replay.segments = [_Segment("large", size, [_Block(size)]) for size in cache]
    try:
        replay.run(step)
    except _OutOfMemory:
        return False
    return True


def fitting_prefix(
    steps: Sequence[Sequence[TapeOp]],
    earlier: Iterable[Sequence[Sequence[TapeOp]]],
    capacity: int,
    expandable_segments: bool = False,
) -> int:
    """How many of `steps`, in order, each run in `capacity` after every one of the `earlier`
    histories as `fits_after_any` plays them: the count before the first that does not. Each
    history is played once and its cache copied for every step."""
    states = list(_histories_played(earlier, capacity, expandable_segments))
    for count, step in enumerate(steps):
        for state in states:
            try:
                state.copy().play(step)
            except _OutOfMemory:
                return count
    return len(steps)
