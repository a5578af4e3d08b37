"""The memory kvgate may spend preparing requests (parse, chat render, tokenize), as one shared budget.

kvgate runs in a container with a memory limit (the manifests give it 2 GiB); a request body of
28 MiB inside the body limit cost 1.9 GB of RSS to parse and tokenize, and two at once would have
the kernel kill kvgate and every client of the pod with it. So each request's cost is bounded
from its size before any work starts, and charged to a budget that is a share of the process's
limit: a request that does not fit waits a little for others to finish, then gets a 429; one that
could never fit gets a 413.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from kvgate.errors import RequestTooCostly, WorkMemoryBusy
from kvgate.units import GiB, MiB

# Where the kernel shows cgroups, and which ones this process is in.
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_MEMBERSHIP = Path("/proc/self/cgroup")
_NO_LIMIT = 2**60  # v1 writes PAGE_COUNTER_MAX pages (about 2**63) for "unlimited"
# Without a limit from the flag or the cgroup: the manifests' (deploy/), so that kvgate behaves in
# development as it will in the pod.
DEFAULT_PROCESS_MEMORY = 2 * GiB
# The share of the process's memory that in-flight request preparation may hold; the rest is
# kvgate's own (interpreter, tokenizer, the preparation workers' start-up heap, the bodies being
# read and relayed).
WORK_SHARE = 0.5

# Memory a body takes while it is parsed and its chat rendered, at most, measured
# (bench/work_cost.py, bench/results/work_cost.md) on the worst shapes: many small JSON objects
# (Responses function_call items, tool calls, tools, Anthropic blocks, messages: 370-590 bytes a
# value, where the parsed objects and the rendered pieces dominate) and long prompts (2 bytes a
# body byte: the body and its strings). Values are counted by their commas and braces (C-speed).
WORK_BYTES_PER_BODY_BYTE = 4
WORK_BYTES_PER_VALUE = 640
WORK_FIXED_BYTES = 1 * MiB  # a request's own objects, whatever its size
# Memory the Rust tokenizer takes per UTF-8 byte of the text it encodes, at most: its encoding
# keeps each token's text, offsets and masks, and its normalizer an alignment per byte (measured
# 150-350 bytes with a BPE tokenizer on punctuation, CJK, English and rendered chats:
# bench/results/work_cost.md).
TOKENIZE_BYTES_PER_TEXT_BYTE = 400


# The request's way to grow its grant from deep inside preparation (the tokenizer, once it knows
# how much text it has): set by whoever runs the preparation, in kvgate's process or in a worker.
_grow: ContextVar[Callable[[int], Awaitable[None]] | None] = ContextVar("kvgate_work_grant", default=None)


async def charge(cost: int) -> None:
    """Hold `cost` more bytes for the request being prepared, before spending them."""
    grow = _grow.get()
    if grow is not None:
        await grow(cost)


class charging:
    """Route charge() in this context (a request's task, a worker's job) to `grow` meanwhile.
    A class rather than a generator context manager: it is entered once per request."""

    __slots__ = ("_grow", "_token")

    def __init__(self, grow: Callable[[int], Awaitable[None]]) -> None:
        self._grow = grow

    def __enter__(self) -> None:
        self._token = _grow.set(self._grow)

    def __exit__(self, *exc_info: object) -> None:
        _grow.reset(self._token)


def container_memory_limit(root: Path = _CGROUP_ROOT, membership: Path = _MEMBERSHIP) -> int | None:
    """The memory limit of the cgroup kvgate runs in, or None without one: the tightest over its
    cgroup and their ancestors, v2's memory.max ("max" when none) and v1's memory.limit_in_bytes
    (a huge number when none). In a container with its own cgroup namespace the cgroup is the
    hierarchy's root as mounted; without one (Docker's --cgroupns=host, v1 hosts, a systemd unit)
    it is the path /proc/self/cgroup names, and a limit on a parent (a pod's) holds it too."""
    paths: list[str] = []
    try:
        for line in membership.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "memory" in controllers.split(","):
                paths.append(path)
    except (OSError, ValueError):
        pass
    limits = [
        limit
        for folder, name in ((root, "memory.max"), (root / "memory", "memory.limit_in_bytes"))
        for path in paths or ["/"]
        if (limit := _tightest_limit(folder, path.strip("/"), name)) is not None
    ]
    return min(limits, default=None)


def _tightest_limit(folder: Path, path: str, name: str) -> int | None:
    """The smallest limit in `name` files from folder/path up to folder itself."""
    parts = path.split("/") if path else []
    limits = []
    for depth in range(len(parts), -1, -1):
        try:
            text = folder.joinpath(*parts[:depth], name).read_text().strip()
        except OSError:
            continue
        if text != "max" and text.isdigit() and int(text) < _NO_LIMIT:
            limits.append(int(text))
    return min(limits, default=None)


def process_memory(flag: int | None) -> int:
    """The memory kvgate may use: the flag, else the cgroup's limit, else DEFAULT_PROCESS_MEMORY."""
    return flag or container_memory_limit() or DEFAULT_PROCESS_MEMORY


# glibc raises its mmap threshold to the size of every mmapped block it frees (up to 32 MiB), and
# its trim threshold to twice that: after the first large body is freed, the next ones (28 MiB, and
# their joined copies) come from the heap and stay resident once freed: 20 rounds of a 28 MiB body
# and its copy on two threads left 56 MiB resident, 0 with the threshold fixed
# (tests/integration/test_work_memory.py; the soak's kvgate had grown 126 -> 154 MiB over 2,000
# requests). A fixed M_MMAP_THRESHOLD (mallopt(3); setting it stops the adjustment) maps every
# block past it and unmaps it when freed.
LARGE_BLOCK_BYTES = 1 * MiB
_M_MMAP_THRESHOLD = -3  # malloc.h


def libc() -> Any | None:
    """glibc, where there is one (not under musl)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def give_large_blocks_back() -> bool:
    """Fix glibc's mmap threshold at LARGE_BLOCK_BYTES for this process; False without glibc."""
    c = libc()
    return c is not None and bool(c.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))


def body_values(raw: bytes) -> int:
    """About how many JSON values `raw` holds (its commas and braces: C-speed, 10 ms for 28 MiB)."""
    return raw.count(b",") + raw.count(b"{")


# Bytes of a body counted between two turns of the event loop: a 28 MiB body's count held the loop
# 43-78 ms at once on the loaded 2-core machine (bench/loop_stalls.py, issue 28's bodies).
VALUE_COUNT_SLICE = 1 * MiB


async def count_body_values(raw: bytes) -> int:
    """body_values, letting the event loop run between slices of a large body."""
    if len(raw) <= VALUE_COUNT_SLICE:
        return body_values(raw)
    values = 0
    for start in range(0, len(raw), VALUE_COUNT_SLICE):
        end = start + VALUE_COUNT_SLICE
        values += raw.count(b",", start, end) + raw.count(b"{", start, end)
        await asyncio.sleep(0)
    return values


def preparation_cost(raw: bytes, values: int) -> int:
    """The most memory parsing `raw` (of `values` values, body_values) and rendering its chat
    take (tokenizing is charged apart, once the text is known: kvgate/tokens.py)."""
    return WORK_FIXED_BYTES + WORK_BYTES_PER_BODY_BYTE * len(raw) + WORK_BYTES_PER_VALUE * values


class Grant:
    """What one request holds of the budget; it grows stage by stage, before each stage runs."""

    def __init__(self, budget: WorkBudget) -> None:
        self._budget = budget
        self.bytes = 0

    @property
    def capacity(self) -> int:
        """The whole budget's, the most a grant can grow to."""
        return self._budget.capacity

    async def grow(self, cost: int) -> None:
        """Hold `cost` more bytes: at once if they are free, after a short wait, or a domain
        error (429 work_memory_busy; 413 request_too_costly if the budget could never hold it)."""
        if self.bytes + cost > self._budget.capacity:
            raise RequestTooCostly(self.bytes + cost, self._budget.capacity)
        await self._budget._acquire(cost)
        self.bytes += cost


class Held:
    """The block a request's preparation runs in (WorkBudget.hold): its Grant is returned to the
    budget when the block ends. A class rather than a generator context manager: it is entered
    once per request."""

    __slots__ = ("_budget", "_cost", "_grant")

    def __init__(self, budget: WorkBudget, cost: int) -> None:
        self._budget, self._cost = budget, cost

    async def __aenter__(self) -> Grant:
        grant = Grant(self._budget)
        await grant.grow(self._cost)  # nothing is held if this raises
        self._grant = grant
        return grant

    async def __aexit__(self, *exc_info: object) -> None:
        self._budget._return(self._grant)


class WorkBudget:
    """Bytes of request preparation in flight, shared by every request: `async with hold(cost)`.

    First fit: a request whose cost fits what is free goes at once, so a large body waiting for
    room never holds up the small requests of ordinary clients behind it; each waits at most
    `wait_s`, then gets a 429."""

    def __init__(self, capacity: int, wait_s: float = 5.0) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.in_use = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def hold(self, cost: int) -> Held:
        """`async with budget.hold(cost) as grant`: `cost` bytes held until the block ends, with
        what the Grant grows by."""
        return Held(self, cost)

    def _return(self, grant: Grant) -> None:
        self.in_use -= grant.bytes
        self._wake()

    async def _acquire(self, cost: int) -> None:
        if self.in_use + cost <= self.capacity:
            self.in_use += cost
            return
        started = time.monotonic()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (cost, turn)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.wait_s)
        except TimeoutError:
            if turn.done():  # granted as the time ran out: it is ours
                return
            self._waiters.remove(entry)
            self._wake()
            raise WorkMemoryBusy(cost, self.capacity, self.in_use, time.monotonic() - started) from None
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif turn.done() and not turn.cancelled():
                self.in_use -= cost  # granted, but the request is gone
            self._wake()
            raise

    def _wake(self) -> None:
        """Grant every waiter that fits, oldest first."""
        for entry in list(self._waiters):
            cost, turn = entry
            if self.in_use + cost <= self.capacity:
                self._waiters.remove(entry)
                self.in_use += cost
                turn.set_result(None)
