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

A process's steps go with it: one that left the GPU takes nothing again (a new process is a new
first holding). What it does not cover: a step larger than any the processes still on the GPU were
seen to take, processes NVML does not show (no process list, or no per-process bytes: the
margin is all there is), and two steps between two readings. The cost: while a process that once
took a step of S stays, up to S of the headroom is kept from the engine whenever it could take
S. Steps are remembered across engine lives (the other processes outlive vLLM's restarts),
in MiB, at most `MAX_STEPS` a process (the oldest go first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.telemetry.gpu import GpuReading
from kvgate.units import MiB

MAX_STEPS = 64


@dataclass
class CotenantSteps:
    """The allocation steps of the processes beside the server, per GPU and process."""

    _held: dict[tuple[str, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes at the last reading
    _steps: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (gpu, pid) -> steps in MiB, oldest first

    def observe(self, reading: GpuReading, servers: Mapping[str, int]) -> None:
        """Record the steps this reading shows and forget the processes gone; `servers`: each
        GPU's server pid (its own growth is the headroom's, not a co-tenant's)."""
        held: dict[tuple[str, int], int] = {}
        for device in reading.devices:
            for process in device.processes:
                if process.used_bytes is None or process.pid == servers.get(device.gpu):
                    continue
                key = (device.gpu, process.pid)
                held[key] = process.used_bytes
                step = process.used_bytes - self._held.get(key, 0)
                if step >= MiB:
                    self._record(key, step)
        self._held = held
        self._steps = {key: steps for key, steps in self._steps.items() if key in held}

    def _record(self, key: tuple[str, int], step: int) -> None:
        steps = self._steps.setdefault(key, [])
        size = step // MiB
        if size in steps:
            steps.remove(size)
        steps.append(size)
        del steps[:-MAX_STEPS]

    def reserve(self, gpu: str, headroom: int) -> int:
        """Bytes kept back on `gpu` out of `headroom`: the largest step of a process still there
        that fits in it."""
        sizes = (size * MiB for (on, _), steps in self._steps.items() if on == gpu for size in steps)
        return max((size for size in sizes if size <= headroom), default=0)
