"""The shared budget of request preparation (kvgate/work_budget.py): what a request holds, when it
waits, when it is refused, and where the process's limit comes from."""

from __future__ import annotations

import asyncio
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
    budget = WorkBudget(100, wait_s=5)
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


async def test_small_requests_pass_a_large_one_waiting_for_room() -> None:
    """First fit: a large body waiting never holds up the small requests behind it."""
    budget = WorkBudget(100, wait_s=0.2)
    async with budget.hold(60):
        large = asyncio.create_task(budget.hold(50).__aenter__())
        await wait_for_async(lambda: budget._waiters, timeout_s=5, what="the large request to wait")
        async with budget.hold(10):  # fits beside the 60 held: not behind the waiting 50
            assert budget.in_use == 70
        with pytest.raises(WorkMemoryBusy) as caught:
            await large
    assert budget.in_use == 0
    assert status_of(caught.value) == 429
    assert error_headers(caught.value) == {"Retry-After": "1", "x-llm-d-request-dropped-reason": "rejected-saturated"}
    assert error_body(caught.value)["error"]["code"] == "work_memory_busy"


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
