"""The vLLM gauges kvgate serves a router and an autoscaler (kvgate.metrics.PoolGauges), the page
cache, the scrape pace and the drop reasons on refusals, without any network."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvgate import errors
from kvgate.gate.backend_state import BackendState
from kvgate.gate.budget import Budget
from kvgate.gate.gate import Gate
from kvgate.gate.observer import Decision, Observers
from kvgate.http.errors import error_headers, status_of
from kvgate.memory.demand import Demand
from kvgate.metrics import MetricsPage, PoolGauges
from kvgate.telemetry.poller import PollPace
from kvgate.telemetry.vllm import BackendSnapshot, parse_metrics
from kvgate.units import MiB
from support.exposition import declared_types, python_samples
from support.waiting import wait_for_async

POOL = 100
ROUTING = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def demand(blocks: int) -> Demand:
    return Demand(
        prompt_tokens=16,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=blocks,
        transient_prefill_bytes=0,
    )


def snapshot(kv_usage: float = 0.0, running: float = 0.0, waiting: float = 0.0) -> BackendSnapshot:
    return BackendSnapshot(None, kv_usage, running, waiting, 0.0, model_name="m")


class Pod:
    """A gate over a pool of POOL blocks, and the gauges read from it and a settable snapshot."""

    def __init__(self, max_queue: int = 2) -> None:
        self.budget = Budget(kv_blocks=POOL, backend=BackendState("up"))
        self.gate: Gate[None] = Gate(self.budget, Observers(), max_queue, 60.0)
        self.snapshot: BackendSnapshot | None = snapshot()
        self.gauges = PoolGauges(self.gate, lambda: True, lambda: self.snapshot, lambda: None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.gauges)

    def page(self) -> str:
        return MetricsPage(self.gauges, CollectorRegistry(), cache_s=0).render().decode()

    def routing(self) -> dict[str, float]:
        samples = [s for s in python_samples(self.page()) if s.name in ROUTING]
        assert sorted(s.name for s in samples) == sorted(ROUTING)  # one series each
        assert all(s.labels == {"model_name": "m"} for s in samples)
        return {s.name: s.value for s in samples}


async def test_kvgates_reservations_show_when_they_are_larger_than_vllms_usage() -> None:
    pod = Pod()
    await pod.gate.acquire(demand(40), 0, "t")
    pod.snapshot = snapshot(kv_usage=0.1, running=1, waiting=2)
    assert pod.routing() == {
        "vllm:num_requests_waiting": 2,
        "vllm:num_requests_running": 1,
        "vllm:kv_cache_usage_perc": pytest.approx(0.4),
    }
    pod.snapshot = snapshot(kv_usage=0.7, running=1)
    assert pod.routing()["vllm:kv_cache_usage_perc"] == pytest.approx(0.7)


async def test_kvgates_queue_is_waiting_and_a_full_queue_reads_as_a_full_cache() -> None:
    pod = Pod(max_queue=2)
    await pod.gate.acquire(demand(90), 0, "t")
    pod.snapshot = snapshot(kv_usage=0.2, running=1, waiting=1)
    first = asyncio.create_task(pod.gate.acquire(demand(20), 0, "t"))
    await wait_for_async(lambda: pod.gate.waiting == 1, timeout_s=5, what="a request in kvgate's queue")
    assert pod.routing()["vllm:num_requests_waiting"] == 2
    assert pod.routing()["vllm:kv_cache_usage_perc"] == pytest.approx(0.9)
    second = asyncio.create_task(pod.gate.acquire(demand(20), 0, "t"))
    await wait_for_async(lambda: pod.gate.waiting == 2, timeout_s=5, what="two requests in kvgate's queue")
    assert pod.routing() == {
        "vllm:num_requests_waiting": 3,
        "vllm:num_requests_running": 1,
        "vllm:kv_cache_usage_perc": 1.0,  # the next request would get 429 queue_full
    }
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


def test_a_backend_down_reads_as_full_and_idle() -> None:
    pod = Pod()
    pod.snapshot = snapshot(kv_usage=0.3, running=4, waiting=5)  # its last scrape before it went
    pod.budget.set_backend("down", "refused")
    assert pod.routing() == {
        "vllm:num_requests_waiting": 0,
        "vllm:num_requests_running": 0,
        "vllm:kv_cache_usage_perc": 1.0,
    }


def test_vllms_info_families_pass_through_as_one_series_each() -> None:
    """Two data-parallel engines' cache_config_info and two lora_requests_info series (vLLM 0.32.0
    adds one each interval whose adapters differ, its value the time it was set): engine 0's
    cache config and the newest LoRA series come out, with their labels and values as vLLM wrote them."""
    vllm_page = "\n".join(
        [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="900"} 1.0',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="800"} 1.0',
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 1.7e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.8e+09',
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="tiny"} 3.0',
        ]
    )
    pod = Pod()
    pod.snapshot = parse_metrics(vllm_page + "\n")
    page = pod.page()
    assert all(n == 1 for n in declared_types(page).values())
    samples = {s.name: s for s in python_samples(page)}
    assert len([s for s in python_samples(page) if s.name.startswith("vllm:")]) == 5
    assert samples["vllm:cache_config_info"].labels == {"block_size": "16", "engine": "0", "num_gpu_blocks": "800"}
    assert samples["vllm:lora_requests_info"].labels == {
        "max_lora": "2",
        "running_lora_adapters": "a,b",
        "waiting_lora_adapters": "c",
    }
    assert samples["vllm:lora_requests_info"].value == 1.8e9
    assert samples["vllm:num_requests_running"].value == 5  # both engines: the pod's total
    assert samples["vllm:num_requests_running"].labels == {"model_name": "tiny"}


def test_kvgates_own_families_come_from_the_cache_and_the_routing_gauges_do_not() -> None:
    pod = Pod()
    own = CollectorRegistry()
    counter = Counter("kvgate_things", "Things.", registry=own)
    now = [0.0]
    page = MetricsPage(pod.gauges, own, cache_s=1.0, clock=lambda: now[0])

    def read(name: str) -> float:
        return next(s.value for s in python_samples(page.render().decode()) if s.name == name)

    assert read("kvgate_things_total") == 0
    counter.inc()
    pod.snapshot = snapshot(waiting=7)
    assert read("kvgate_things_total") == 0  # rendered less than cache_s ago
    assert read("vllm:num_requests_waiting") == 7  # computed on every scrape
    now[0] = 1.0
    assert read("kvgate_things_total") == 1


async def test_the_pace_is_slow_while_idle_and_the_next_request_wakes_it() -> None:
    busy = [False]
    told: list[float] = []
    pace = PollPace(0.25, 60.0, lambda: busy[0], told.append, clock=lambda: 0.0)
    sleeping = asyncio.create_task(pace.sleep(started=0.0))
    await wait_for_async(lambda: told == [60.0], timeout_s=5, what="the idle interval in force")
    assert not sleeping.done()
    pace.decided(Decision("reject", "queue_full", "r"))  # a refusal brings no work
    await asyncio.sleep(0)
    assert not sleeping.done()
    pace.decided(Decision("admit", "fits", "r"))
    await asyncio.wait_for(sleeping, timeout=5)
    busy[0] = True
    assert pace.interval() == 0.25


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (errors.QueueFull(8, 3), 429, "rejected-saturated"),
        (errors.WorkMemoryBusy(10, 100, 95, 1.0), 429, "rejected-saturated"),
        (errors.QueueTimeout(30.0, "kv_cache_busy", 4), 429, "rejected-ttl-expired"),
        (errors.BackendDown("connection refused", 7), 503, "rejected-no-endpoints"),
        (errors.NotReady("not synchronised"), 503, "rejected-no-endpoints"),
        (errors.CacheOutgrown(7000, 900 * MiB, 600 * MiB), 503, None),  # this engine cannot, another may
        (errors.BackendBroke("reset"), 502, None),  # sent to vLLM: not a drop
    ],
)
def test_refusals_carry_the_pickers_drop_reason_and_retry_after(
    error: errors.KvgateError, status: int, reason: str | None
) -> None:
    headers = error_headers(error)
    assert status_of(error) == status
    assert headers.get("x-llm-d-request-dropped-reason") == reason
    assert int(headers["Retry-After"]) >= 1
