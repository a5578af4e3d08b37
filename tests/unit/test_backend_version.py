"""kvgate learns which vLLM it guards from GET /version and shows it as kvgate_backend_info."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.memory.vllm_runner import resolve_runtime
from kvgate.telemetry.metrics import TelemetryMetrics
from kvgate.telemetry.vllm import fetch_version


def version_of(handler) -> str | None:
    async def ask() -> str | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm") as client:
            return await fetch_version(client)

    return asyncio.run(ask())


def test_vllms_version_route_is_read() -> None:
    assert version_of(lambda request: httpx.Response(200, json={"version": "0.32.0"})) == "0.32.0"


def test_a_backend_without_the_route_or_with_nonsense_has_no_version() -> None:
    assert version_of(lambda request: httpx.Response(404, text="Not Found")) is None
    assert version_of(lambda request: httpx.Response(200, text="<html>")) is None
    assert version_of(lambda request: httpx.Response(200, json={"version": 32})) is None


def test_backend_info_gauge_names_version_runner_and_sampler() -> None:
    registry = CollectorRegistry()
    metrics = TelemetryMetrics(registry)
    metrics.set_backend_info(resolve_runtime("0.33.0", "v1").labels())
    metrics.set_backend_info(resolve_runtime("0.32.0").labels())  # a restart onto another version
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("kvgate_backend_info{")]
    assert lines == [
        'kvgate_backend_info{model_version="0.32.0",runner="v2",sampler="flashinfer",version="0.32.0"} 1.0'
    ]
