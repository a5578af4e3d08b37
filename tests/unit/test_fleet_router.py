"""bench/fleet_router.py scores, filters and admits as llm-d's EPP does (the files its docstring
names): worked examples of each rule, and the flow controller's hold, dispatch and TTL."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from bench.fleet_router import NO_ENDPOINTS, TTL_EXPIRED, Endpoint, Router, gauges
from support.waiting import wait_for_async


def fresh_router(states: list[tuple[float, float]], *, flow_control: bool = False, seed: int = 0) -> Router:
    urls = [f"http://e{i}" for i in range(len(states))]
    router = Router(urls, 1.0, flow_control=flow_control, seed=seed, ready=ready_while(set(urls)))
    for endpoint, (waiting, kv) in zip(router.endpoints, states, strict=True):
        endpoint.waiting, endpoint.kv_usage = waiting, kv
        endpoint.updated_at = time.monotonic()
        endpoint.in_pool = True
    return router


def test_gauges_add_up_the_series_of_a_family() -> None:
    page = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0\n'
        "vllm:kv_cache_usage_perc 0.25\n"
    )
    assert gauges(page) == {"vllm:num_requests_waiting": 5.0, "vllm:kv_cache_usage_perc": 0.25}


def test_scores_are_the_weighted_queue_and_kv_scorers() -> None:
    # queue-scorer: (max - w) / (max - min) = e0 1.0, e1 0.0, e2 0.5; kv scorer: 1 - usage.
    # Weighted 2 + 2: e0 2.0 + 0.2 = 2.2, e1 0 + 1.8 = 1.8, e2 1.0 + 1.0 = 2.0.
    router = fresh_router([(0, 0.9), (4, 0.1), (2, 0.5)])
    assert router.pick(router.pool()).url == "http://e0"
    # Between two endpoints the min-max queue score is 1 or 0, worth more than any KV difference:
    # one fewer waiting request wins at 95 % KV usage against 10 %.
    router = fresh_router([(0, 0.95), (1, 0.1)])
    assert router.pick(router.pool()).url == "http://e0"


def test_equal_queues_score_neutral_and_ties_break_at_random() -> None:
    router = fresh_router([(3, 0.2), (3, 0.6)])
    assert router.pick(router.pool()).url == "http://e0"  # queue 1.0 each: KV decides
    router = fresh_router([(1, 0.3), (1, 0.3)], seed=1)
    picks = Counter(router.pick(router.pool()).url for _ in range(200))
    assert set(picks) == {"http://e0", "http://e1"}


def test_saturation_is_the_mean_roofline_with_stale_endpoints_full() -> None:
    router = fresh_router([(10, 0.4), (0, 0.4)])
    # max(10/5, 0.4/0.8) = 2.0 and max(0, 0.5) = 0.5: mean 1.25.
    assert router.saturation(router.pool()) == pytest.approx(1.25)
    router.endpoints[1].updated_at = time.monotonic() - 1.0  # older than 200 ms
    assert router.saturation(router.pool()) == pytest.approx(1.5)
    assert router.saturation([]) == 1.0


def test_the_detector_filter_drops_full_or_stale_endpoints_unless_none_is_left() -> None:
    router = fresh_router([(5, 0.1), (0, 0.8), (4, 0.79), (0, 0.0)])
    router.endpoints[3].updated_at = time.monotonic() - 1.0
    assert [e.url for e in router.detector_filter(router.pool())] == ["http://e2"]
    full = fresh_router([(9, 0.9), (6, 0.1)])
    assert full.detector_filter(full.pool()) == full.pool()


def scripted(states: dict[str, tuple[float, float]]):  # type: ignore[no-untyped-def]
    """A scrape that answers what `states` holds now (a missing URL fails like a down server)."""

    async def scrape(_client: httpx.AsyncClient, endpoint: Endpoint) -> tuple[float, float]:
        if endpoint.url not in states:
            raise httpx.ConnectError("down")
        return states[endpoint.url]

    return scrape


def ready_while(up: set[str]):  # type: ignore[no-untyped-def]
    """A readiness probe that passes for the URLs in `up` now."""

    async def probe(_client: httpx.AsyncClient, endpoint: Endpoint) -> bool:
        return endpoint.url in up

    return probe


async def test_without_flow_control_a_saturated_pool_still_gets_the_request() -> None:
    states = {"http://a": (50.0, 1.0), "http://b": (40.0, 1.0)}
    router = Router(list(states), 10.0, flow_control=False, scrape=scripted(states), ready=ready_while(set(states)))
    async with router.running():
        await router.pool_full(timeout_s=10)
        chosen = await router.admit()
    assert isinstance(chosen, Endpoint)
    assert chosen.url == "http://b"


async def test_flow_control_holds_while_saturated_then_dispatches() -> None:
    states = {"http://a": (10.0, 0.5), "http://b": (10.0, 0.5)}
    router = Router(list(states), 10.0, flow_control=True, scrape=scripted(states), ready=ready_while(set(states)))
    async with router.running():
        await router.pool_full(timeout_s=10)
        ticket = asyncio.create_task(router.admit())
        seen = sum(e.scrapes for e in router.endpoints)
        await wait_for_async(
            lambda: sum(e.scrapes for e in router.endpoints) >= seen + 10, timeout_s=10, what="ten more scrapes"
        )
        assert not ticket.done()  # saturation 2.0: held
        states["http://b"] = (0.0, 0.1)  # mean of 2.0 and 0.125: still saturated
        seen = sum(e.scrapes for e in router.endpoints)
        await wait_for_async(
            lambda: sum(e.scrapes for e in router.endpoints) >= seen + 10, timeout_s=10, what="ten more scrapes"
        )
        assert not ticket.done()
        states["http://a"] = (2.0, 0.2)  # mean of 0.4 and 0.125
        chosen = await asyncio.wait_for(ticket, 10)
    # The detector's filter leaves both (under the limits); the scorers pick b (queue 1.0, KV 0.9).
    assert isinstance(chosen, Endpoint)
    assert chosen.url == "http://b"


async def test_flow_control_answers_ttl_expired_after_the_ttl() -> None:
    states = {"http://a": (10.0, 1.0)}
    # At speed-up 600 the EPP's 60 s TTL is 0.1 s of wall time.
    router = Router(list(states), 600.0, flow_control=True, scrape=scripted(states), ready=ready_while(set(states)))
    async with router.running():
        await router.pool_full(timeout_s=10)
        assert await asyncio.wait_for(router.admit(), 10) == TTL_EXPIRED


async def test_readiness_decides_the_pool_and_a_failed_scrape_only_ages_the_metrics() -> None:
    states = {"http://a": (0.0, 0.0), "http://b": (0.0, 0.0)}
    up = set(states)
    router = Router(list(states), 10.0, flow_control=False, scrape=scripted(states), ready=ready_while(up))
    async with router.running():
        await router.pool_full(timeout_s=10)
        del states["http://a"]  # its /metrics fails, its readiness still passes
        failed = router.endpoints[0].failed_scrapes
        await wait_for_async(
            lambda: router.endpoints[0].failed_scrapes > failed + 4, timeout_s=10, what="a's scrapes failing"
        )
        assert router.endpoints[0].in_pool
        assert not router.fresh(router.endpoints[0])
        up.discard("http://a")
        await wait_for_async(lambda: not router.endpoints[0].in_pool, timeout_s=10, what="a out of the pool")
        assert [(await router.admit()).url for _ in range(5)] == ["http://b"] * 5  # type: ignore[union-attr]
        up.discard("http://b")
        await wait_for_async(lambda: not router.pool(), timeout_s=10, what="an empty pool")
        assert await router.admit() == NO_ENDPOINTS
