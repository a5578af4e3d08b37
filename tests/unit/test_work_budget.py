"""The shared budget of request preparation (kvgate/work_budget.py): what a request holds, when it
waits, when it is refused, and where the process's limit comes from."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvgate.errors import RequestTooCostly, WorkMemoryBusy
from kvgate.http.errors import error_body, error_headers, status_of
from kvgate.work_budget import (
    VALUE_COUNT_SLICE,
    WorkBudget,
    body_values,
    container_memory_limit,
    count_body_values,
    preparation_cost,
)
from support.waiting import wait_for_async


async def test_a_request_that_fits_goes_at_once_and_gives_back_what_it_grew_by() -> None:
    budget = WorkBudget(100)
    async with budget.hold(30) as grant:
        await grant.grow(50)
        assert budget.in_use == 80 == grant.bytes
    assert budget.in_use == 0


async def test_a_request_waits_for_room_then_goes() -> None:
    budget = WorkBudget(100)
    order: list[str] = []
    big_in = asyncio.Event()

    async def big() -> None:
        async with budget.hold(80):
            order.append("big in")
            big_in.set()
            await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the second to wait")
        order.append("big out")

    async def second() -> None:
        await big_in.wait()
        async with budget.hold(60):
            order.append("second in")

    await asyncio.gather(big(), second())
    assert order == ["big in", "big out", "second in"]
    assert budget.in_use == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_small_requests_pass_a_large_one_waiting_for_room() -> None:
    """First fit: a large body waiting never holds up the small requests behind it (within its
    pass window), and it is not refused for waiting: it goes once room comes back."""
    budget = WorkBudget(100)
    big = budget.hold(60)
    await big.__aenter__()
    large = asyncio.create_task(budget.hold(50).__aenter__())
    await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the large request to wait")
    async with budget.hold(10):  # fits beside the 60 held: not behind the waiting 50
        assert budget.in_use == 70
    assert not large.done()
    await big.__aexit__(None, None, None)
    grant = await large
    assert grant.bytes == 50 == budget.in_use


async def test_a_request_still_waiting_at_its_deadline_is_429() -> None:
    budget = WorkBudget(100)
    async with budget.hold(60):
        with pytest.raises(WorkMemoryBusy) as caught:
            async with budget.hold(50, deadline=time.monotonic() + 0.05):
                pass
    assert budget.in_use == 0
    assert not budget._waiters
    assert status_of(caught.value) == 429
    assert error_headers(caught.value) == {"Retry-After": "1", "x-llm-d-request-dropped-reason": "rejected-saturated"}
    assert error_body(caught.value)["error"]["code"] == "work_memory_busy"


async def test_a_large_request_past_its_pass_window_is_not_passed_any_more() -> None:
    """No starvation: once the oldest waiter has waited its pass window, small requests that
    would fit wait behind it; it goes as soon as the work under way gives its bytes back."""
    clock = FakeClock()
    budget = WorkBudget(100, pass_window_s=1.0, clock=clock)
    first = budget.hold(60)
    await first.__aenter__()
    large = asyncio.create_task(budget.hold(50, deadline=clock.now + 60).__aenter__())
    await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the large request to wait")
    clock.now += 1.0  # its window is over
    small = asyncio.create_task(budget.hold(10, deadline=clock.now + 60).__aenter__())
    await wait_for_async(lambda: len(budget._waiters) == 2, timeout_s=5, what="the small request to wait too")
    assert budget.in_use == 60  # 10 would fit, but may not pass
    await first.__aexit__(None, None, None)
    assert (await large).bytes == 50
    assert (await small).bytes == 10
    assert budget.in_use == 60


async def test_a_preparation_under_way_grows_before_new_requests_start() -> None:
    """Growing a grant (the tokenizer's stage) comes before new requests: finishing the work under
    way is what frees memory."""
    clock = FakeClock()
    budget = WorkBudget(100, clock=clock)
    async with budget.hold(40, deadline=clock.now + 60) as under_way:
        other = budget.hold(50, deadline=clock.now + 60)
        await other.__aenter__()
        growth = asyncio.create_task(under_way.grow(30))
        await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the growth to wait")
        newcomer = asyncio.create_task(budget.hold(10, deadline=clock.now + 60).__aenter__())
        await wait_for_async(lambda: len(budget._waiters) == 2, timeout_s=5, what="the newcomer to wait")
        assert budget.in_use == 90  # 10 would fit, but the growth goes first
        await other.__aexit__(None, None, None)
        await growth
        assert under_way.bytes == 70
        assert (await newcomer).bytes == 10
    assert budget.in_use == 10


async def test_growers_that_hold_everything_and_wait_for_each_other_do_not_wait_forever() -> None:
    """Two preparations each holding 50 and each needing 30 more could never go on: the younger
    is refused (429) and the older goes with the bytes it gives back."""
    budget = WorkBudget(100)
    outcomes: dict[str, str] = {}
    both_in = asyncio.Barrier(2)

    async def preparation(name: str) -> None:
        try:
            async with budget.hold(50, deadline=time.monotonic() + 60) as grant:
                await both_in.wait()
                if name == "younger":
                    await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the older to wait")
                await grant.grow(30)
                outcomes[name] = "grew"
        except WorkMemoryBusy:
            outcomes[name] = "429"

    await asyncio.gather(preparation("older"), preparation("younger"))
    assert outcomes == {"older": "grew", "younger": "429"}
    assert budget.in_use == 0


async def test_a_request_the_budget_could_never_hold_is_413_at_once() -> None:
    budget = WorkBudget(100)
    with pytest.raises(RequestTooCostly) as caught:
        async with budget.hold(101):
            pass
    assert status_of(caught.value) == 413
    assert error_body(caught.value)["error"]["code"] == "request_too_costly"
    async with budget.hold(60) as grant:
        with pytest.raises(RequestTooCostly):
            await grant.grow(41)  # 101 in all
    assert budget.in_use == 0


async def test_a_waiter_that_leaves_holds_nothing() -> None:
    budget = WorkBudget(100, wait_s=5)
    async with budget.hold(90):
        waiter = asyncio.create_task(budget.hold(50).__aenter__())
        await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the request to wait")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert budget.in_use == 0
    assert not budget._waiters


def test_the_cost_grows_with_bytes_and_values() -> None:
    small, values = b'{"prompt": "hi"}', b'{"prompt": [' + b"1," * 1000 + b"1]}"
    assert preparation_cost(values, body_values(values)) > preparation_cost(small, body_values(small))
    assert body_values(values) == 1001


async def test_a_large_body_is_counted_in_slices_to_the_same_count() -> None:
    """A body past VALUE_COUNT_SLICE is counted a slice at a time between turns of the event loop."""
    raw = b'{"prompt": [' + b"1," * (2 * VALUE_COUNT_SLICE // 2 + 7) + b'{"a": 1}]}'
    assert len(raw) > 2 * VALUE_COUNT_SLICE
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    try:
        assert await count_body_values(raw) == body_values(raw)
    finally:
        task.cancel()
    assert turns >= 3  # the other task ran between slices


@pytest.mark.parametrize(
    ("membership", "files", "limit"),
    [
        # A container with its own cgroup namespace: its cgroup is the root as mounted.
        ("0::/\n", {"memory.max": "2147483648\n"}, 2147483648),
        ("0::/\n", {"memory.max": "max\n"}, None),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "1073741824\n"}, 1073741824),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1's "unlimited"
        # v1 bind-mounted (Docker): /proc/self/cgroup names a path the container cannot see.
        ("4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "1073741824\n"}, 1073741824),
        # No namespace (--cgroupns=host, a systemd unit): the named cgroup, and its parent's limit.
        (
            "0::/kubepods/pod1/c1\n",
            {"memory.max": "max\n", "kubepods/pod1/c1/memory.max": "max\n", "kubepods/pod1/memory.max": "805306368\n"},
            805306368,
        ),
        (
            "12:cpu,cpuacct:/x\n4:memory:/process_api/abc\n0::/\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712\n",
                "memory/process_api/abc/memory.limit_in_bytes": "536870912\n",
            },
            536870912,
        ),
        ("0::/\n", {}, None),
        (None, {"memory.max": "2147483648\n"}, 2147483648),  # no /proc/self/cgroup: the root's
    ],
)
def test_the_containers_limit_is_its_cgroups_tightest(
    tmp_path: Path, membership: str | None, files: dict[str, str], limit: int | None
) -> None:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if membership is not None:
        (tmp_path / "self-cgroup").write_text(membership)
    assert container_memory_limit(root, tmp_path / "self-cgroup") == limit


async def test_the_bodies_waiting_for_room_are_bounded() -> None:
    """A waiting request holds its body, already read: past max_waiting_body_bytes of them a new
    one is refused at once (429), so memory stays bounded however many arrive."""
    budget = WorkBudget(100, max_waiting_body_bytes=30)
    async with budget.hold(90):
        first = asyncio.create_task(budget.hold(50, body_bytes=20).__aenter__())
        await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the first to wait")
        assert budget.waiting_body_bytes == 20
        with pytest.raises(WorkMemoryBusy):
            await budget.hold(50, body_bytes=20).__aenter__()  # 20 + 20 > 30
        assert budget.waiting_body_bytes == 20
    assert (await first).bytes == 50
    assert budget.waiting_body_bytes == 0
