"""GPU memory as the driver sees it: one probe interface, three sources.

- `NvmlProbe` reads nvidia-ml-py (`pynvml`). In a container NVML numbers the host's GPUs and
  ignores CUDA_VISIBLE_DEVICES, so devices are chosen as NVIDIA_VISIBLE_DEVICES names them (UUIDs,
  `MIG-...` UUIDs or indices); a GPU in MIG mode is read through its instances' own handles.
- `SimGpuProbe` reads the simulator's `/sim/gpu`, the same figures over HTTP.
- `NoGpuProbe`: no GPU or no NVML. kvgate runs on flags alone and says so (`available` false).

A probe never raises on a read: a failed read is a reading with an error, so the loop that
calls it decides what blindness means.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import httpx

log = logging.getLogger("kvgate.gpu")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # NVML gives None where it may not say (no permission, WDDM)


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU (or MIG instance): what NVML's nvmlDeviceGetMemoryInfo and process list say."""

    gpu: str  # UUID: stable, and what NVIDIA_VISIBLE_DEVICES uses
    name: str
    total: int
    free: int
    used: int
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuReading:
    devices: tuple[DeviceMemory, ...] = ()
    error: str | None = None


class GpuProbe(Protocol):
    kind: str
    available: bool
    problem: str | None

    async def read(self) -> GpuReading: ...


@dataclass
class NoGpuProbe:
    """No GPU readings: the transient budget stays what the flags say."""

    problem: str | None = "no GPU probe configured"
    kind: str = "none"
    available: bool = False

    async def read(self) -> GpuReading:
        return GpuReading(error=self.problem)


class SimGpuProbe:
    """The simulator's NVML view (`GET /sim/gpu`), read over the backend's HTTP client."""

    kind = "sim"
    available = True
    problem: str | None = None

    def __init__(self, client: httpx.AsyncClient, timeout_s: float = 1.0) -> None:
        self._client = client
        self._timeout = timeout_s

    async def read(self) -> GpuReading:
        try:
            response = await self._client.get("/sim/gpu", timeout=self._timeout)
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return GpuReading(error=f"/sim/gpu: {type(exc).__name__}: {exc}")
        processes = tuple(GpuProcess(int(p["pid"]), p.get("used_gpu_memory")) for p in body["processes"])
        device = DeviceMemory(
            body["uuid"], body["name"], int(body["total"]), int(body["free"]), int(body["used"]), processes
        )
        return GpuReading((device,))


def visible_devices(spec: str | None) -> list[str] | None:
    """NVIDIA_VISIBLE_DEVICES as a list of names; None for all devices, [] for none."""
    if spec is None or spec.strip() in ("", "all"):
        return None
    if spec.strip() in ("none", "void", "NoDevFiles"):
        return []
    return [s.strip() for s in spec.split(",") if s.strip()]


class NvmlProbe:
    """nvidia-ml-py readings of the devices the server runs on (min free across them)."""

    kind = "nvml"
    available = True
    problem: str | None = None

    def __init__(self, nvml: ModuleType, devices: list[str] | None) -> None:
        """`nvml` is the pynvml module (a fake one in tests); `devices` as visible_devices()."""
        self._nvml = nvml
        nvml.nvmlInit()
        self.handles = self._handles(devices)
        if not self.handles:
            raise RuntimeError(f"NVML sees no device matching {devices!r}")

    def _handles(self, devices: list[str] | None) -> list[Any]:
        nv = self._nvml
        if devices is None:
            parents = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        else:
            parents = [
                nv.nvmlDeviceGetHandleByIndex(int(d)) if d.isdigit() else nv.nvmlDeviceGetHandleByUUID(d)
                for d in devices
            ]
        handles: list[Any] = []
        for handle in parents:
            handles.extend(self._mig_instances(handle) or [handle])
        return handles

    def _mig_instances(self, handle: Any) -> list[Any]:
        """A whole GPU in MIG mode says nothing useful about one instance: read each instance."""
        nv = self._nvml
        try:
            if (
                nv.nvmlDeviceIsMigDeviceHandle(handle)
                or nv.nvmlDeviceGetMigMode(handle)[0] != nv.NVML_DEVICE_MIG_ENABLE
            ):
                return []
            count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nv.NVMLError:  # MIG not supported on this GPU
            return []
        instances = []
        for i in range(count):
            try:
                instances.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nv.NVMLError:  # empty slot
                continue
        if instances:
            log.warning(
                "GPU %s is in MIG mode; reading all %d of its instances (the tightest wins): "
                "name the server's instance by its MIG- UUID in NVIDIA_VISIBLE_DEVICES to read only it",
                _text(nv.nvmlDeviceGetUUID(handle)),
                len(instances),
            )
        return instances

    def _device(self, handle: Any) -> DeviceMemory:
        nv = self._nvml
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        try:
            processes = tuple(
                GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)
            )
        except nv.NVMLError:  # no permission (MIG without admin rights): memory is enough
            processes = ()
        return DeviceMemory(
            _text(nv.nvmlDeviceGetUUID(handle)),
            _text(nv.nvmlDeviceGetName(handle)),
            int(memory.total),
            int(memory.free),
            int(memory.used),
            processes,
        )

    def _read(self) -> GpuReading:
        try:
            return GpuReading(tuple(self._device(h) for h in self.handles))
        except self._nvml.NVMLError as exc:
            return GpuReading(error=f"NVML: {exc}")

    async def read(self) -> GpuReading:
        return await asyncio.to_thread(self._read)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _import_pynvml() -> ModuleType:
    import pynvml

    return pynvml


def make_probe(
    mode: str, client: httpx.AsyncClient, devices_spec: str | None = None, nvml: ModuleType | None = None
) -> GpuProbe:
    """The probe for `--gpu-probe` (nvml, sim, none; auto is resolved by `detect_probe`)."""
    if mode == "none":
        return NoGpuProbe("GPU probe disabled (--gpu-probe none)")
    if mode == "sim":
        return SimGpuProbe(client)
    probe = nvml_probe(devices_spec, nvml)
    if not probe.available:
        log.warning("%s; the transient budget comes from flags only", probe.problem)
    return probe


def nvml_probe(devices_spec: str | None = None, nvml: ModuleType | None = None) -> GpuProbe:
    """NVML's probe of the devices `devices_spec` (default: NVIDIA_VISIBLE_DEVICES) names, or a
    NoGpuProbe saying why NVML cannot be read."""
    spec = devices_spec if devices_spec is not None else os.environ.get("NVIDIA_VISIBLE_DEVICES")
    try:
        return NvmlProbe(nvml or _import_pynvml(), visible_devices(spec))
    except Exception as exc:  # noqa: BLE001 - any NVML failure means: run without GPU readings
        return NoGpuProbe(f"no GPU readings: NVML unavailable ({type(exc).__name__}: {exc})")


async def detect_probe(
    mode: str, client: httpx.AsyncClient, devices_spec: str | None = None, nvml: ModuleType | None = None
) -> GpuProbe:
    """`auto`: the simulator's endpoint if the backend has one, else NVML, else none."""
    if mode != "auto":
        return make_probe(mode, client, devices_spec, nvml)
    sim = SimGpuProbe(client)
    if (await sim.read()).error is None:
        return sim
    return make_probe("nvml", client, devices_spec, nvml)
