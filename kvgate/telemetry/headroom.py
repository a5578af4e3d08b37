"""The live transient headroom, derived from GPU readings.

vLLM has already taken its KV pool, weights and CUDA graphs when it starts serving. It empties
its allocator cache after the start-up profile, so part of the profiled activation region may
show as free. That part is every step's working memory: the profiled tensors (MLP, hidden states,
the sampler's sort) come back for it, and a co-tenant that takes it leaves them nothing. So the
headroom counts it, and the budget charges the in-flight requests' profiled terms against it, up
to the size of the emptied region. Per device, over one engine life:

    headroom_d    = free_d + growth_d
    growth_d      = max(0, server_used_d - server_used_at_start_d)
    profiled_cap  = max over devices of
                    min(profile peak, max(0, gpu_memory_utilization x total_d - server_used_at_start_d))

where the server is the process holding the most memory at the first reading of the life (vLLM's
engine: its KV pool dominates). With `--kv-cache-memory-bytes` the pool is fixed and vLLM's
utilization envelope bounds nothing (vllm/config/cache.py `kv_cache_memory_bytes`, vLLM 0.32.0),
so the engine usually holds more than utilization x total and the formula gives 0, which would
hide the region the engine emptied; under utilization the CUDA graphs, captured after the pool
out of free memory, read as region the engine holds. So `profiled_cap` is at least what
start-up left out of the cache (kvgate/engine_config.py `profile_emptied_bytes`), with either
flag. Model Runner V2 empties the
allocator's cache after capturing its graphs and, unlike V1, warms no sampler up after it
(v1/worker/gpu_worker.py `compile_or_warm_up_model`, v1/worker/gpu/model_runner.py
`capture_model`), so every profiled tensor comes back out of free memory: the whole profile peak.
V1's warm-up re-reserves the segments of a `_dummy_run` and a `_dummy_sampler_run` of
max_num_seqs rows after capture: all of the region where the sampler set the peak (a 128k
vocabulary), not where the forward pass of max_num_batched_tokens tokens did (Mixtral-8x7B,
held-out H4: 36 of the 306 MiB region beside its kept MoE workspace come back out of free memory;
kvgate/memory/activation.py `moe_workspace_bytes`). `growth` is what PyTorch's caching allocator has reserved since
start-up for earlier steps and keeps cached: NVML counts it as used, yet the next transient
tensor reuses it, so without it every large request would shrink the headroom for good.
`profiled_cap` is the part of vLLM's own envelope (utilization x total) its engine did not hold
at start-up: the profile region it emptied (a sampler warm-up re-reserves some; what the engine
holds already serves its profiled tensors without new memory). Memory a co-tenant takes lowers
`free_d` and nothing gives it back: the headroom shrinks at once, and a request whose only
transient memory is profiled (the MLP of a long prefill) now waits for it like any other. The
budget's headroom is the minimum over the devices (tensor parallel ranks run the same step).
The profiled terms charged against it take the caching allocator's segments, not just their
bytes: the budget charges them with the profile step's segment overhead
(kvgate/memory/allocator.py, kvgate/memory/ceiling.py `transient_charge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.telemetry.cotenants import CotenantSteps
from kvgate.telemetry.gpu import DeviceMemory, GpuReading


@dataclass(frozen=True)
class Headroom:
    bytes: int  # min over devices of free + server growth
    server_growth: int  # max over devices of the server's growth since its start
    min_free: int
    profiled_cap: int  # max over devices of the profile region the engine emptied
    # What the budget keeps back of `bytes` for the other processes' next step
    # (kvgate/telemetry/cotenants.py): bytes - cotenant_reserve is the min over devices of
    # free + growth - that device's reserve.
    cotenant_reserve: int = 0
    # The most the headroom can reach this life as the readings show it: min over devices of
    # free + growth + what the other listed processes hold (they may leave; the driver's
    # reserve and unlisted memory never come back). None where a process's use is not shown.
    reachable: int | None = None


@dataclass
class HeadroomTracker:
    """Remembers the server's footprint at the start of each engine life, and the other
    processes' allocation steps across lives."""

    _start: dict[str, tuple[int, int]] = field(default_factory=dict)  # gpu -> (pid, used)
    cotenants: CotenantSteps = field(default_factory=CotenantSteps)

    @property
    def started(self) -> bool:
        """Whether this engine life's baseline is set (its first reading with a process came)."""
        return bool(self._start)

    def reset(self) -> None:
        """A new engine life (restart): the next reading sets the baseline again."""
        self._start.clear()

    def _growth(self, device: DeviceMemory) -> int:
        known = [p for p in device.processes if p.used_bytes is not None]
        if device.gpu not in self._start:
            if not known:
                return 0
            server = max(known, key=lambda p: p.used_bytes or 0)
            self._start[device.gpu] = (server.pid, server.used_bytes or 0)
        pid, start = self._start[device.gpu]
        now = next((p.used_bytes for p in known if p.pid == pid), None)
        return 0 if now is None else max(0, now - start)

    def _reachable(self, device: DeviceMemory, room: int) -> int | None:
        """`room` (free + growth) plus the memory of every listed process but the server's, or None
        where the server or some process's use is unknown."""
        start = self._start.get(device.gpu)
        if start is None or any(p.used_bytes is None for p in device.processes):
            return None
        return room + sum(p.used_bytes or 0 for p in device.processes if p.pid != start[0])

    def _profiled_cap(
        self, device: DeviceMemory, utilization: float | None, profile_peak: int, emptied: int | None
    ) -> int:
        known = 0 if emptied is None else min(profile_peak, emptied)
        start = self._start.get(device.gpu)
        if utilization is None or start is None:
            return known
        return max(known, min(profile_peak, max(0, int(utilization * device.total) - start[1])))

    def update(
        self,
        reading: GpuReading,
        utilization: float | None = None,
        profile_peak: int = 0,
        profile_emptied: int | None = None,
    ) -> Headroom | None:
        """Headroom from one reading; `utilization` is vLLM's gpu_memory_utilization, if known;
        `profile_emptied`: the part of the profile peak the engine did not keep after start-up
        (see the module docstring)."""
        if not reading.devices:
            return None
        growth = {d.gpu: self._growth(d) for d in reading.devices}
        self.cotenants.observe(reading, {gpu: pid for gpu, (pid, _) in self._start.items()})
        room = {d.gpu: d.free + growth[d.gpu] for d in reading.devices}
        headroom = min(room.values())
        reach = [r for d in reading.devices if (r := self._reachable(d, room[d.gpu])) is not None]
        return Headroom(
            bytes=headroom,
            server_growth=max(growth.values()),
            min_free=min(d.free for d in reading.devices),
            profiled_cap=max(
                self._profiled_cap(d, utilization, profile_peak, profile_emptied) for d in reading.devices
            ),
            cotenant_reserve=headroom - min(room[gpu] - self.cotenants.reserve(gpu, room[gpu]) for gpu in room),
            reachable=min(reach) if len(reach) == len(reading.devices) else None,
        )
