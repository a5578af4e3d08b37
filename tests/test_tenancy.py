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

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateServer, running_kvgate

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
        await asyncio.sleep(0.3)  # the flood is queued first
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
