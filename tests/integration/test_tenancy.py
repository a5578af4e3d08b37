"""Priority and tenant from trusted sources only (issue 15, finding 5): a client that floods with
`"priority": -10`, a priority header and a new tenant header on every request still takes turns
with a second API key's requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gate.tenants import NEW_KEYS, TenantTurns
from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateServer, running_kvgate
from support.waiting import wait_for_async

# Each request reserves about 32 of the fake backend's 64 KV blocks: two run at a time.
BODY = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 500}
FLOOD = 12


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with running_fake_backend(completion_mode="slow", slow_s=0.25) as backend:
        yield backend


def kvgate_with(backend: FakeBackend, scratch: Path, tiny_model_dir: Path, *flags: str):
    return running_kvgate(
        backend.base_url,
        tiny_model_dir,
        scratch,
        "--kv-output-quantile",
        "1",
        "--max-kv-overcommit",
        "1",
        "--max-queue-wait",
        "60",
        *flags,
    )


def taken_in(kvgate: KvgateServer) -> float:
    """Requests kvgate has taken in: finished, admitted or queued, from one scrape (read apart,
    requests moving on between the reads would be missed)."""
    return sum(
        s.value
        for s in kvgate.scrape()
        if s.name in ("kvgate_in_flight_requests", "kvgate_queue_depth")
        or (s.name == "kvgate_reservations_released_total" and s.labels.get("outcome") == "completed")
    )


async def finish_times(kvgate: KvgateServer) -> tuple[list[float], list[float]]:
    """When each of the flooder's and the honest client's requests finished (seconds)."""
    started = time.monotonic()

    async def send(client: httpx.AsyncClient, body: dict, headers: dict[str, str]) -> float:
        response = await client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return time.monotonic() - started

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60, limits=limits) as client:
        flood = [
            asyncio.create_task(
                send(
                    client,
                    {**BODY, "priority": -10},
                    {"authorization": "Bearer flooder", "x-kvgate-priority": "-10", "x-kvgate-tenant": f"t{i}"},
                )
            )
            for i in range(FLOOD)
        ]
        await wait_for_async(lambda: taken_in(kvgate) >= FLOOD, timeout_s=30, what="the flood to arrive first")
        honest = [asyncio.create_task(send(client, BODY, {"authorization": "Bearer honest"})) for _ in range(2)]
        return list(await asyncio.gather(*flood)), list(await asyncio.gather(*honest))


async def test_a_flooding_client_cannot_starve_another(
    backend: FakeBackend, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with kvgate_with(backend, tmp_path, tiny_model_dir) as kvgate:
        flood, honest = await finish_times(kvgate)
    # Turns alternate between the two API keys: the honest requests are among the first few to
    # finish, long before the flood drains (in line behind all of it they would finish last).
    assert max(honest) < sorted(flood)[FLOOD // 2], (sorted(flood), honest)


async def test_a_trusted_gateway_header_names_tenant_and_priority(
    backend: FakeBackend, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With the gateway's headers trusted, its priorities order the queue again: the flood's
    -10 goes first, the honest requests (priority 0) after all of it."""
    with kvgate_with(
        backend,
        tmp_path,
        tiny_model_dir,
        "--tenant-header",
        "x-kvgate-tenant",
        "--priority-header",
        "x-kvgate-priority",
    ) as kvgate:
        flood, honest = await finish_times(kvgate)
    assert min(honest) > max(flood) - 0.3, (sorted(flood), honest)


async def test_made_up_keys_share_one_turn(backend: FakeBackend, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A client inventing a new API key for every request (the backend checks none) takes one
    turn however many keys it invents: an honest key's requests after its first are served
    long before the flood drains. The honest key's first request waits with the new keys."""
    started = time.monotonic()

    async def send(client: httpx.AsyncClient, key: str) -> float:
        response = await client.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return time.monotonic() - started

    with kvgate_with(backend, tmp_path, tiny_model_dir) as kvgate:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=kvgate.base_url, timeout=60, limits=limits) as client:
            flood = [asyncio.create_task(send(client, f"made-up-{i}")) for i in range(FLOOD)]
            await wait_for_async(lambda: taken_in(kvgate) >= FLOOD, timeout_s=30, what="the flood to arrive first")
            first = asyncio.create_task(send(client, "honest"))
            await wait_for_async(
                lambda: taken_in(kvgate) >= FLOOD + 1, timeout_s=30, what="the honest key's first request"
            )
            later = [asyncio.create_task(send(client, "honest")) for _ in range(2)]
            flood_done, later_done = await asyncio.gather(*flood), await asyncio.gather(*later)
            first_done = await first
    # One turn for the flood, one for the honest key: its later requests finish among the first.
    assert max(later_done) < sorted(flood_done)[FLOOD // 2], (sorted(flood_done), later_done)
    assert first_done > sorted(flood_done)[FLOOD // 2]  # queued behind the new keys ahead of it


def test_keys_earn_a_turn_on_their_second_request_and_are_bounded() -> None:
    turns = TenantTurns(max_tenants=2)
    assert turns.turn("gateway-tenant", vouched=True) == "gateway-tenant"  # the gateway vouches
    assert [turns.turn("a", vouched=False) for _ in range(3)] == [NEW_KEYS, "a", "a"]
    assert [turns.turn(f"made-up-{i}", vouched=False) for i in range(1000)] == [NEW_KEYS] * 1000
    assert turns.turn("a", vouched=False) == "a"  # a flood of new keys does not push out "a"
    for key in ("b", "b", "c", "c"):  # two more returning keys: "a", the least recent, is forgotten
        turns.turn(key, vouched=False)
    assert turns.returning == 2
    assert turns.turn("a", vouched=False) == NEW_KEYS
