"""Room kept for the other processes on the GPU: a repeat of the largest step they were seen to take.

kvgate admits on its last GPU reading, up to `--scrape-interval` old, and the engine takes a
step's transient memory out of free memory a few milliseconds after the admission. Another
process that allocates in between takes that memory first, and vLLM's next step dies of CUDA
OOM: the benchmark's S6 (three trainers of 3, 3 and 2.5 GiB beside a Llama engine with
expandable segments) lost its engine on an 8,000-token prefill admitted 93 ms after the third
trainer had taken 2.5 GiB of the 3.2 GiB kvgate's reading still showed free
(bench/results/s6race-session36). No reading can see that growth in time, so kvgate keeps room for it: the
largest allocation step any other process was seen to take (its whole holding when a reading
first shows it, since it went from nothing to that; any rise between two readings after that),
on the GPU's own rank, as long as that rank's headroom could take such a step. A CUDA allocation
is all or nothing, so a step larger than the headroom cannot happen there and keeps nothing back:
once the trainers have taken all they fit, the engine gets the rest.

What it does not cover: a process that takes more at once than any step seen before, processes
NVML does not show (no process list, or no per-process bytes: the margin is all there is), and
two steps between two readings. Steps are remembered across engine lives (the other processes
outlive vLLM's restarts), rounded to MiB, at most `MAX_STEPS` of them (the oldest go first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.telemetry.gpu import GpuReading
from kvgate.units import MiB

MAX_STEPS = 64


@dataclass
class CotenantSteps:
    """The allocation steps of the processes beside the server, per GPU."""

    _held: dict[tuple[str, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes at the last reading
    _steps: dict[str, list[int]] = field(default_factory=dict)  # gpu -> step sizes in MiB, oldest first

    def observe(self, reading: GpuReading, servers: Mapping[str, int]) -> None:
        """Record the steps this reading shows; `servers`: each GPU's server pid (its own growth
        is the headroom's, not a co-tenant's)."""
        held: dict[tuple[str, int], int] = {}
        for device in reading.devices:
            for process in device.processes:
                if process.used_bytes is None or process.pid == servers.get(device.gpu):
                    continue
                key = (device.gpu, process.pid)
                held[key] = process.used_bytes
                step = process.used_bytes - self._held.get(key, 0)
                if step >= MiB:
                    self._record(device.gpu, step)
        self._held = held

    def _record(self, gpu: str, step: int) -> None:
        steps = self._steps.setdefault(gpu, [])
        size = step // MiB
        if size in steps:
            steps.remove(size)
        steps.append(size)
        del steps[:-MAX_STEPS]

    def reserve(self, gpu: str, headroom: int) -> int:
        """Bytes kept back on `gpu` out of `headroom`: the largest step seen there that still fits in it."""
        return max((size * MiB for size in self._steps.get(gpu, ()) if size * MiB <= headroom), default=0)
