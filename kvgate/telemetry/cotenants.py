"""Room kept for the other processes on the GPU: a repeat of the largest step they were seen to take.

kvgate admits on its last GPU reading, up to `--scrape-interval` old, and the engine takes a
step's transient memory out of free memory a few milliseconds after the admission. Another
process that allocates in between takes that memory first, and vLLM's next step dies of CUDA
OOM: the benchmark's S6 (three trainers of 3, 3 and 2.5 GiB beside a Llama engine with
expandable segments) lost its engine on an 8,000-token prefill admitted 93 ms after the third
trainer had taken 2.5 GiB of the 3.2 GiB kvgate's reading still showed free
(bench/results/s6race-session36). No reading can see that growth in time, so kvgate keeps room for
it: the largest allocation step any other process was seen to take, on the GPU's own rank, as
long as that rank's headroom could take such a step. A CUDA allocation is all or nothing, so a
step larger than the headroom cannot happen there and keeps nothing back: once the trainers have
taken all they fit, the engine gets the rest.

What a step is, from what two readings can show:

- a process that first shows between two readings of its GPU went from nothing to its holding in
  that interval: its holding is a step;
- a change of a process's holding between two readings is a step of that size, a fall as much as
  a rise (memory a process gave back is memory it has shown it takes and may take again, as a
  trainer's cycles do);
- a process already there at kvgate's first reading of the GPU (kvgate started or restarted
  beside it) showed no step: its holding counts as one only for `SETTLE_S` after that reading,
  since kvgate cannot tell a neighbour that has sat still for hours from the first of a job's
  processes that came a moment before (S6's crash: kvgate's first reading showed two trainers,
  the third came 0.6 s later; `python -m bench.cotenant_race` plays it). After that, a neighbour
  that held still keeps nothing back; its later moves count as above.

The processes of the server itself are not co-tenants: on each GPU the one `HeadroomTracker` takes
for the engine (the largest at the life's first reading), and that pid on every other GPU too (a
tensor-parallel worker's thread that misses its `set_device` opens a context on device 0: vLLM
0.32.0 guards it in v1/executor/multiproc_executor.py `WorkerProc.async_output_busy_loop`).
vLLM 0.32.0's API server holds no GPU memory unless frontend GPU multimodal decoding is on
(`--mm-ipc-gpu-memory-gb`, a GPU video backend: vllm/multimodal/gpu_ipc_memory.py): its decoded
frames then come out of free memory like any co-tenant's step and are counted as one. A
separate EngineCore (tensor or pipeline parallel) opens a context on device 0 with the outlines
or lm-format-enforcer structured-output backends (their pinned bitmask): counted as a step too,
since NVML's names (`VLLM::EngineCore`) are any vLLM's and a second vLLM's steps must count.

A process's steps go with it: one that left the GPU takes nothing again (a new process is a new
first holding). What it does not cover: a step larger than any the processes still on the GPU
were seen to take, processes NVML does not show (no process list, or no per-process bytes: the
margin is all there is), two moves between two readings, and a neighbour that was there at the
first reading and first moves by taking more than it holds. The cost: while a process that once
took a step of S stays, up to S of the headroom is kept from the engine whenever it could take S.
Steps are remembered across engine lives (the other processes outlive vLLM's restarts), in MiB,
at most `MAX_STEPS` a process (the oldest go first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgate.telemetry.gpu import GpuReading
from kvgate.units import MiB

MAX_STEPS = 64
# How long a holding seen at kvgate's first reading of a GPU counts as a step: a judgement (a job
# launching its processes, a trainer's warm-up), not a measurement.
SETTLE_S = 30.0


@dataclass
class CotenantSteps:
    """The allocation steps of the processes beside the server, per GPU and process."""

    clock: Callable[[], float] = time.monotonic
    _held: dict[tuple[str, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes at the last reading
    _steps: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (gpu, pid) -> steps in MiB, oldest first
    _first_read: dict[str, float] = field(default_factory=dict)  # gpu -> when kvgate first read it
    # (gpu, pid) -> MiB held at kvgate's first reading of the GPU: a step until SETTLE_S after it
    _unsettled: dict[tuple[str, int], int] = field(default_factory=dict)

    def observe(self, reading: GpuReading, servers: Mapping[str, int]) -> None:
        """Record the steps this reading shows and forget the processes gone; `servers`: each
        GPU's server pid (its growth is the headroom's, not a co-tenant's, on any GPU)."""
        now = self.clock()
        engine = set(servers.values())
        held: dict[tuple[str, int], int] = {}
        for device in reading.devices:
            first = device.gpu not in self._first_read
            if first:
                self._first_read[device.gpu] = now
            for process in device.processes:
                if process.used_bytes is None or process.pid in engine:
                    continue
                key = (device.gpu, process.pid)
                held[key] = process.used_bytes
                if first:
                    self._unsettled[key] = process.used_bytes // MiB
                    continue
                step = abs(process.used_bytes - self._held.get(key, 0))
                if step >= MiB:
                    self._record(key, step)
        self._held = held
        self._steps = {key: steps for key, steps in self._steps.items() if key in held}
        self._unsettled = {
            key: size
            for key, size in self._unsettled.items()
            if key in held and now - self._first_read[key[0]] < SETTLE_S
        }

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
        seen = (size for (on, _), steps in self._steps.items() if on == gpu for size in steps)
        unsettled = (size for (on, _), size in self._unsettled.items() if on == gpu)
        sizes = (size * MiB for source in (seen, unsettled) for size in source)
        return max((size for size in sizes if size <= headroom), default=0)
