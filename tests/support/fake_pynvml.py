"""A stand-in for the `pynvml` module (nvidia-ml-py): the only mock the test suite allows, because
these machines have no GPU. It mirrors the calls kvgate makes, with pynvml's names, argument
order, return shapes (memory object with total/free/used, process objects with pid and
usedGpuMemory that may be None) and errors (NVMLError with a value)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_NO_PERMISSION = 4
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass(eq=False)
class FakeDevice:
    """A GPU or a MIG instance; `processes` maps pid -> bytes (None: NVML may not say)."""

    uuid: str
    total: int
    name: str = "NVIDIA H100 80GB HBM3"
    processes: dict[int, int | None] = field(default_factory=dict)
    mig_capable: bool = False
    mig_enabled: bool = False
    instances: list[FakeDevice | None] = field(default_factory=list)  # None: empty slot
    is_mig: bool = False
    processes_denied: bool = False

    @property
    def used(self) -> int:
        return sum(b or 0 for b in self.processes.values())


class FakeNvml:
    """Use an instance where kvgate expects the pynvml module."""

    NVMLError = NVMLError
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE

    def __init__(self, devices: list[FakeDevice], driver: bool = True) -> None:
        self.devices = devices
        self.driver = driver
        self.initialised = False

    def _all(self) -> list[FakeDevice]:
        out = []
        for d in self.devices:
            out.append(d)
            out.extend(i for i in d.instances if i is not None)
        return out

    def nvmlInit(self) -> None:
        if not self.driver:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        for d in self._all():
            if d.uuid == uuid:
                return d
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> SimpleNamespace:
        return SimpleNamespace(total=handle.total, free=handle.total - handle.used, used=handle.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        if handle.processes_denied:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in handle.processes.items()]

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeDevice) -> int:
        return int(handle.is_mig)

    def nvmlDeviceGetMigMode(self, handle: FakeDevice) -> list[int]:
        if not handle.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if handle.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeDevice) -> int:
        return len(handle.instances)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeDevice, index: int) -> FakeDevice:
        instance = handle.instances[index]
        if instance is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return instance
