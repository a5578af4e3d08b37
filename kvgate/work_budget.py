"""The memory kvgate may spend preparing requests (parse, chat render, tokenize), as one shared budget.

kvgate runs in a container with a memory limit (the manifests give it 2 GiB); a request body of
28 MiB inside the body limit cost 1.9 GB of RSS to parse and tokenize, and two at once would have
the kernel kill kvgate and every client of the pod with it. So each request's cost is bounded
from its size before any work starts, and charged to a budget that is a share of the process's
limit: a request that does not fit waits for others to finish, until its own deadline (the one it
waits for the gate with); one that could never fit gets a 413. Waiting is not refusing: vLLM would
have served the request, so kvgate refuses it only when the wait runs out (429, like a queue
timeout). A waiting request holds nothing of the budget, only its body, already read (kvgate's own
share); the bodies waiting are bounded too (a quarter of the budget: past it a request is refused
429 at once), so memory stays bounded however many arrive.
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


# How long a waiting request may be passed by later ones that fit (first fit): after that the
# line behind it waits until it has its bytes, so a large body cannot be starved by a stream of
# small ones. Preparations last milliseconds to seconds (PREPARE_SECONDS bounds a worker's), so it
# then waits at most for the ones under way to end.
PASS_WINDOW_S = 1.0
# How long a request without a deadline of its own waits (a pass-through body checked in a worker).
DEFAULT_WAIT_S = 5.0


class Grant:
    """What one request holds of the budget; it grows stage by stage, before each stage runs,
    waiting at most until `deadline` (time.monotonic) for room."""

    def __init__(self, budget: WorkBudget, deadline: float, body_bytes: int = 0) -> None:
        self._budget = budget
        self.deadline = deadline
        self.body_bytes = body_bytes  # what it holds outside the budget while it waits
        self.bytes = 0

    @property
    def capacity(self) -> int:
        """The whole budget's, the most a grant can grow to."""
        return self._budget.capacity

    async def grow(self, cost: int) -> None:
        """Hold `cost` more bytes: at once if they are free, else once others give them back (a
        domain error: 413 request_too_costly if the budget could never hold it; 429
        work_memory_busy if the deadline passes first, or if every byte in use is held by
        requests that, like this one, wait to grow: none of them could ever go on)."""
        if self.bytes + cost > self._budget.capacity:
            raise RequestTooCostly(self.bytes + cost, self._budget.capacity)
        await self._budget._acquire(self, cost)
        self.bytes += cost


class Held:
    """The block a request's preparation runs in (WorkBudget.hold): its Grant is returned to the
    budget when the block ends. A class rather than a generator context manager: it is entered
    once per request."""

    __slots__ = ("_body_bytes", "_budget", "_cost", "_deadline", "_grant")

    def __init__(self, budget: WorkBudget, cost: int, deadline: float, body_bytes: int) -> None:
        self._budget, self._cost, self._deadline, self._body_bytes = budget, cost, deadline, body_bytes

    async def __aenter__(self) -> Grant:
        grant = Grant(self._budget, self._deadline, self._body_bytes)
        await grant.grow(self._cost)  # nothing is held if this raises
        self._grant = grant
        return grant

    async def __aexit__(self, *exc_info: object) -> None:
        self._budget._return(self._grant)


class _Waiter:
    """A grant waiting for `cost` more bytes; `growing`: it already holds some (its preparation
    is under way and needs the next stage's memory)."""

    __slots__ = ("cost", "grant", "growing", "since", "turn")

    def __init__(self, grant: Grant, cost: int, since: float, turn: asyncio.Future[None]) -> None:
        self.grant, self.cost, self.since, self.turn = grant, cost, since, turn
        self.growing = grant.bytes > 0


class WorkBudget:
    """Bytes of request preparation in flight, shared by every request: `async with hold(cost, deadline)`.

    Who goes when bytes come back, in this order:
    1. a preparation under way that waits to grow (oldest first, any that fits): finishing it is
       what frees memory, and new work must not take the bytes it needs to finish;
    2. new requests, first fit in arrival order, so a large body waiting never holds up the
       small requests of ordinary clients behind it, until the oldest has waited PASS_WINDOW_S:
       from then on nobody passes it (it cannot starve; it waits for the work under way).
    A request waits until its deadline. If every byte in use is held by preparations that wait
    to grow and none fits, none can ever go on: the youngest of them is refused (429), which
    frees its bytes for the others."""

    def __init__(
        self,
        capacity: int,
        wait_s: float = DEFAULT_WAIT_S,
        pass_window_s: float = PASS_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        max_waiting_body_bytes: int | None = None,
    ) -> None:
        self.capacity = capacity
        # Bodies of new requests waiting for room, at most (default: a quarter of the capacity,
        # the bodies of the largest preparations it could hold at once: WORK_BYTES_PER_BODY_BYTE).
        self.max_waiting_body_bytes = (
            capacity // WORK_BYTES_PER_BODY_BYTE if max_waiting_body_bytes is None else max_waiting_body_bytes
        )
        self.waiting_body_bytes = 0
        self.wait_s = wait_s  # for a request without a deadline of its own
        self.pass_window_s = pass_window_s
        self._clock = clock
        self.in_use = 0
        self._waiters: list[_Waiter] = []  # in arrival order

    def hold(self, cost: int, deadline: float | None = None, body_bytes: int = 0) -> Held:
        """`async with budget.hold(cost, deadline, body_bytes) as grant`: `cost` bytes held until
        the block ends, with what the Grant grows by; it waits for room until `deadline`
        (time.monotonic; None: `wait_s` from now), holding its `body_bytes` meanwhile."""
        return Held(self, cost, self._clock() + self.wait_s if deadline is None else deadline, body_bytes)

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._waiters)

    def _return(self, grant: Grant) -> None:
        self.in_use -= grant.bytes
        grant.bytes = 0
        self._wake()

    def _may_go_now(self, grant: Grant, cost: int) -> bool:
        """Whether a request arriving now (not yet waiting) takes its bytes at once."""
        if self.in_use + cost > self.capacity:
            return False
        if grant.bytes > 0:  # growing: only an older grower that fits would go first, and none waits that fits
            return True
        return not any(w.growing for w in self._waiters) and not self._line_closed()

    def _line_closed(self) -> bool:
        """The oldest new request has waited its pass window: nobody new may pass it."""
        oldest = next((w for w in self._waiters if not w.growing), None)
        return oldest is not None and self._clock() - oldest.since >= self.pass_window_s

    async def _acquire(self, grant: Grant, cost: int) -> None:
        if self._may_go_now(grant, cost):
            self.in_use += cost
            return
        started = self._clock()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(grant, cost, started, turn)
        if not waiter.growing:
            if self._waiters and self.waiting_body_bytes + grant.body_bytes > self.max_waiting_body_bytes:
                raise WorkMemoryBusy(cost, self.capacity, self.in_use, 0.0)  # the bodies waiting are at their bound
            self.waiting_body_bytes += grant.body_bytes
        self._waiters.append(waiter)
        self._break_deadlock()
        try:
            await asyncio.wait_for(asyncio.shield(turn), max(0.0, grant.deadline - started))
        except TimeoutError:
            if turn.done() and turn.exception() is None:  # granted as the time ran out: it is ours
                return
            self._leave(waiter)
            raise WorkMemoryBusy(cost, self.capacity, self.in_use, self._clock() - started) from None
        except BaseException:
            if waiter in self._waiters:
                self._leave(waiter)
            elif turn.done() and not turn.cancelled() and turn.exception() is None:
                self.in_use -= cost  # granted, but the request is gone
                self._wake()
            raise

    def _leave(self, waiter: _Waiter) -> None:
        self._remove(waiter)
        self._wake()

    def _remove(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        if not waiter.growing:
            self.waiting_body_bytes -= waiter.grant.body_bytes

    def _wake(self) -> None:
        """Grant what may go (the class's order), then look for a deadlock among growers."""
        for waiter in [w for w in self._waiters if w.growing]:
            if self.in_use + waiter.cost <= self.capacity:
                self._grant(waiter)
        if not any(w.growing for w in self._waiters):
            now = self._clock()
            for waiter in [w for w in self._waiters if not w.growing]:
                if self.in_use + waiter.cost <= self.capacity:
                    self._grant(waiter)
                elif now - waiter.since >= self.pass_window_s:
                    break  # its window is over: nobody behind it passes
        self._break_deadlock()

    def _grant(self, waiter: _Waiter) -> None:
        self._remove(waiter)
        self.in_use += waiter.cost
        waiter.turn.set_result(None)

    def _break_deadlock(self) -> None:
        """If only waiting growers hold bytes, nothing will ever come back: refuse the youngest
        (its block ends and returns its bytes, and the others are woken)."""
        growers = [w for w in self._waiters if w.growing]
        if not growers or sum(w.grant.bytes for w in growers) < self.in_use:
            return
        youngest = growers[-1]
        self._remove(youngest)
        waited = self._clock() - youngest.since
        youngest.turn.set_exception(WorkMemoryBusy(youngest.cost, self.capacity, self.in_use, waited))
