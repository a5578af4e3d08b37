"""Calibration: correct the budget from what vLLM and the GPU were seen doing.

Pure: observations and the time come in as numbers, factors and reasons go out.

Two allowances, each adjusted AIMD-style (additive increase, multiplicative decrease, bounded):

- `kv_overcommit` (pool x factor = KV blocks kvgate may reserve). The ledger reserves each
  request's expected growth, and a pool held to 100 % of those reservations still runs fewer
  requests than vLLM would alone: vLLM admits on the blocks a prompt needs now and preempts
  (recomputes) when the pool runs dry, which costs a little latency, never an OOM. So the factor
  starts at `max_overcommit` (where reservations are most cautious: full max_tokens until output
  lengths are learned), backs off (x 0.8, floor 1.0) when vLLM preempts and holds for `hold_s`,
  then rises again (+0.05 per second, up to `max_overcommit`) while requests wait for KV; each
  rise that ends in a preemption soon after doubles the hold, up to `max_kv_hold_s`: kvgate runs
  the pool about as full as vLLM itself would, with a rare preemption instead of a queue.
- `transient_spendable` = 1 - transient safety margin (fraction of the live headroom kvgate may
  reserve, beyond the profile region's segments the engine already took and kept: `region_held`,
  which the budget counts whole as it is no prediction). Backed off (x 0.8, floor 1 - `max_margin`) after an OOM restart that followed admitted
  steps, and when the server's memory grew beyond what kvgate predicted; raised (+0.01 per 2 s,
  at most 1 - the configured margin) only while requests wait for transient memory and nothing
  went wrong for `hold_s`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgate.memory.demand import Demand
from kvgate.units import MiB


def region_segments(profiled_peak: int, segment_overhead: float) -> int:
    """The profile region at its caching-allocator segments' size (kvgate/memory/allocator.py, or
    the overhead the GPU showed, `Calibration.observe_region`)."""
    return math.ceil(profiled_peak * (1 + segment_overhead))


def growth_tolerance(headroom: int) -> int:
    """How far the server's memory may grow beyond kvgate's prediction (its unprofiled peak and
    the profile region at its segments, which comes back out of free memory) before the margin
    backs off: max(64 MiB, 5 % of the headroom)."""
    return max(64 * MiB, headroom // 20)


def region_held(server_growth: int, unprofiled_peak: int, region: int) -> int:
    """The profile region's segments the engine has been seen to take and keep this life.

    The server's growth since start-up is what its caching allocator reserved for earlier steps
    and keeps cached (NVML counts it as used; kvgate/telemetry/headroom.py): bytes the engine
    demonstrably holds, and held through the steps it survived. Of it, at most the most
    unprofiled bytes kvgate had in flight at once (`unprofiled_peak`) are kvgate's predicted
    terms; the rest, up to the `region` kvgate charges (`region_segments` of the part of the
    profile region that comes out of free memory), is the region's segments, which the next
    step's profiled tensors come back into. Not a prediction, so the budget keeps no safety
    margin on it (kvgate/gate/budget.py `transient_limit`)."""
    return max(0, min(region, server_growth - unprofiled_peak))


@dataclass
class Aimd:
    """A bounded allowance: additive increase at most every `interval_s`, multiplicative decrease.

    After a decrease it holds `hold_s` before rising again. With `max_hold_s` above `hold_s`, a
    rise that ends in another decrease within twice the hold doubles the hold (up to
    `max_hold_s`), and a later one resets it: a limit found by probing (a KV pool found by
    preemptions) is probed ever less often while it stays where it was found.
    """

    value: float
    low: float
    high: float
    step: float
    factor: float
    hold_s: float
    interval_s: float
    max_hold_s: float = 0.0
    last_backoff: float = -math.inf
    last_raise: float = -math.inf
    hold: float = field(init=False)

    def __post_init__(self) -> None:
        self.hold = self.hold_s
        self.max_hold_s = max(self.hold_s, self.max_hold_s)  # 0 (the default): the hold never grows

    def backoff(self, now: float) -> bool:
        """Multiplicative decrease; True if the value moved."""
        if self.last_raise > self.last_backoff:  # it rose since the last decrease: a failed probe
            soon = now - self.last_backoff < 2 * self.hold
            self.hold = min(self.max_hold_s, 2 * self.hold) if soon else self.hold_s
        self.last_backoff = now
        old, self.value = self.value, round(max(self.low, self.value * self.factor), 6)
        return self.value != old

    def raise_(self, now: float) -> bool:
        """Additive increase, unless backed off lately or raised too recently; True if it moved."""
        if now - self.last_backoff < self.hold or now - self.last_raise < self.interval_s:
            return False
        self.last_raise = now
        old, self.value = self.value, round(min(self.high, self.value + self.step), 6)
        return self.value != old


@dataclass
class EvidenceScale:
    """A cautious term's share, 1.0 at first: it relaxes one `step` (down to `low`) after
    `evidence` readings in a row showed slack, and goes back to 1.0 at a near-miss, after which it
    needs twice the evidence (up to `max_evidence`) before relaxing again. Counted in GPU
    readings that showed slack, not in seconds since a back-off: a wall-clock hold (the transient
    margin's 30 s) outlasts a benchmark that plays 30 simulated seconds in 7.5, where eight
    readings of slack still come (readings follow the poll, so at a speed-up each covers more of
    the engine's time)."""

    low: float = 0.25
    step: float = 0.25
    evidence: int = 8
    max_evidence: int = 64
    value: float = 1.0
    seen: int = 0  # readings with slack in a row
    needed: int = field(init=False)

    def __post_init__(self) -> None:
        self.needed = self.evidence

    def slack(self) -> bool:
        """One more reading with slack; True if the share moved down."""
        self.seen += 1
        if self.seen < self.needed or self.value <= self.low:
            return False
        self.seen = 0
        self.value = round(max(self.low, self.value - self.step), 6)
        return True

    def no_slack(self) -> None:
        self.seen = 0

    def near_miss(self) -> bool:
        """Back to the whole term; True if it had relaxed."""
        moved = self.value < 1.0
        self.value, self.seen = 1.0, 0
        self.needed = min(self.max_evidence, 2 * self.needed)
        return moved


@dataclass(frozen=True)
class InFlight:
    """One admitted request as the KV estimate sees it."""

    demand: Demand
    admitted_at: float


def blocks_in_use(requests: Iterable[InFlight], block_size: int, now: float, decode_tokens_per_s: float | None) -> int:
    """Blocks vLLM should hold now for these requests (kvgate's prediction of its usage).

    Shared prompt blocks count once (as vLLM's prefix cache holds them once). A request's other
    blocks grow with its output: `g` tokens generated so far is estimated as time since admission
    x the per-sequence decode rate vLLM reports, capped at the tokens reserved; its private blocks are
    its full-growth private blocks scaled by how far its token count has grown into them.
    """
    shared: set[int] = set()
    private = 0.0
    for r in requests:
        d = r.demand
        hashes = set(d.shared_block_hashes)
        shared |= hashes
        rate = decode_tokens_per_s or 0.0
        generated = min(d.reserved_tokens, max(0.0, now - r.admitted_at) * rate)
        full_prompt = len(hashes) if hashes else 0
        grown = math.ceil((d.prompt_tokens + generated) / block_size) - full_prompt
        at_end = math.ceil((d.prompt_tokens + d.reserved_tokens) / block_size) - full_prompt
        private += d.private_blocks * (min(grown, at_end) / at_end if at_end > 0 else 1.0)
    return len(shared) + round(private)


@dataclass
class CalibrationConfig:
    margin: float  # the configured transient safety margin (the floor)
    max_margin: float = 0.6
    max_overcommit: float = 1.0
    max_kv_hold_s: float = 300.0  # the longest wait between two probes of the KV pool
    hold_s: float = 10.0


@dataclass
class Calibration:
    """The two allowances and the last prediction errors; each method returns why it moved."""

    config: CalibrationConfig
    kv: Aimd = field(init=False)
    transient: Aimd = field(init=False)
    kv_error_blocks: float = 0.0
    kv_abs_error_blocks: float = 0.0  # exponentially smoothed |predicted - observed|
    transient_error_bytes: int = 0
    growth_at_backoff: int = 0  # server growth already answered by a back-off this engine life
    # The profile region's segment overhead seen on the GPU (a share of the profile peak): only
    # ever raised, and kept across engine lives (see observe_region)
    segment_overhead: float = 0.0
    # The share of the sampler phase's replayed segment overhead charged (see observe_slack)
    sampler_overhead: EvidenceScale = field(default_factory=EvidenceScale)

    def __post_init__(self) -> None:
        c = self.config
        top_kv = max(1.0, c.max_overcommit)
        self.kv = Aimd(top_kv, 1.0, top_kv, 0.05, 0.8, c.hold_s, 1.0, max_hold_s=c.max_kv_hold_s)
        top = 1.0 - c.margin
        self.transient = Aimd(top, min(top, 1.0 - c.max_margin), top, 0.01, 0.8, c.hold_s * 3, 2.0)

    @property
    def kv_overcommit(self) -> float:
        return self.kv.value

    @property
    def transient_margin(self) -> float:
        return round(1.0 - self.transient.value, 6)

    def observe_kv(
        self,
        now: float,
        predicted: int,
        observed: float,
        usable: int,
        preempted: float,
        waiting_for_kv: bool,
        settled: bool = True,
    ) -> str | None:
        """Adjust the overcommit factor; record the prediction error if the moment is settled."""
        if settled:
            self.kv_error_blocks = predicted - observed
            self.kv_abs_error_blocks += 0.2 * (abs(self.kv_error_blocks) - self.kv_abs_error_blocks)
        if preempted > 0:
            if self.kv.backoff(now):
                return f"{preempted:g} preemptions: KV overcommit down to {self.kv.value:.2f}"
            return None
        if waiting_for_kv and self.kv.raise_(now):
            usage = observed / usable if usable > 0 else 0.0
            return f"requests wait for KV at usage {usage:.0%}: KV overcommit up to {self.kv.value:.2f}"
        return None

    def observe_transient(
        self,
        now: float,
        server_growth: int,
        predicted_peak: int,
        tolerance: int,
        waiting_for_transient: bool,
    ) -> str | None:
        """Compare the server's memory growth with kvgate's predicted transient peak: its highest
        unprofiled reservation plus the profile region at its segments (`region_segments`), what
        the engine may reserve beyond its start-up footprint. The error (growth - prediction) is
        kvgate_transient_prediction_error_bytes: above zero, the engine took more than predicted."""
        self.transient_error_bytes = server_growth - predicted_peak
        if self.transient_error_bytes > tolerance:
            # The growth is cumulative over the engine life: back off once per new growth, not
            # again at every reading of the same allocator cache.
            if server_growth <= self.growth_at_backoff:
                return None
            self.growth_at_backoff = server_growth
            if self.transient.backoff(now):
                return (
                    f"server memory grew {server_growth / MiB:.0f} MiB, kvgate predicted at most "
                    f"{predicted_peak / MiB:.0f} MiB: transient margin up to {self.transient_margin:.2f}"
                )
            return None
        if waiting_for_transient and self.transient.raise_(now):
            return f"requests wait for transient memory: margin down to {self.transient_margin:.2f}"
        return None

    def observe_region(
        self, server_growth: int, unprofiled_peak: int, profiled_peak: int, charged: float
    ) -> str | None:
        """Tighten the segment overhead when the GPU shows the profile region took more.

        What the server reserved since start-up beyond the most unprofiled bytes kvgate ever
        held at once this life is what the profiled tensors' segments took (the caching
        allocator keeps segments cached, so the growth is their high-water mark). When that
        exceeds the region at `charged` overhead (kvgate/memory/allocator.py's replay, or what
        was learned before), the overhead rises to match: mixed step sizes strand more than the
        profile step alone. It never falls: NVML does not show which cached bytes are free."""
        if profiled_peak <= 0:
            return None
        seen = (server_growth - unprofiled_peak) / profiled_peak - 1.0
        if seen <= max(charged, self.segment_overhead) + 1e-9:
            return None
        self.segment_overhead = seen
        return (
            f"server memory grew {server_growth / MiB:.0f} MiB with at most {unprofiled_peak / MiB:.0f} MiB of "
            f"unprofiled terms in flight: the {profiled_peak / MiB:.0f} MiB profile region took "
            f"{(server_growth - unprofiled_peak) / MiB:.0f} MiB of segments; segment overhead up to {seen:.2f}"
        )

    def observe_slack(
        self, server_growth: int, headroom: int, min_free: int, limit: int | None, waiting_for_transient: bool
    ) -> str | None:
        """Relax or restore the sampler phase's replayed segment overhead (kvgate/memory/activation.py
        `sampler_phase_overhead_bytes`, the worst over the allocator histories it replays) from
        what the engine's memory shows.

        Near-miss: the GPU's free memory fell below half of what the margin keeps back
        (`headroom - limit`): the whole term again, and twice the evidence before the next relax.
        Slack: requests wait for transient memory (the charge binds) while everything the engine
        reserved since start-up, its allocator's cache included (`server_growth`, a high-water
        mark: NVML counts cached segments as used), stays below three quarters of the limit: the
        engine never needed what kvgate holds back for it, so one step less of the term."""
        if limit is None or headroom <= 0:
            return None
        if min_free < (headroom - limit) // 2:
            if self.sampler_overhead.near_miss():
                return (
                    f"free memory {min_free / MiB:.0f} MiB, under half the margin: the sampler phase's "
                    "segment overhead is charged whole again"
                )
            return None
        if waiting_for_transient and server_growth < 0.75 * limit:
            if self.sampler_overhead.slack():
                return (
                    f"requests wait for transient memory while the engine reserved at most "
                    f"{server_growth / MiB:.0f} MiB of the {limit / MiB:.0f} MiB limit: the sampler phase's "
                    f"segment overhead charged at {self.sampler_overhead.value:.2f}"
                )
            return None
        self.sampler_overhead.no_slack()
        return None

    def new_life(self) -> None:
        """The backend restarted: its allocator cache, and so its growth, start from zero."""
        self.growth_at_backoff = 0

    def oom_restart(self, now: float) -> float:
        """The backend died after admitted steps: spend less of the headroom from now on, and
        charge the sampler phase's segment overhead whole again."""
        self.transient.backoff(now)
        self.sampler_overhead.near_miss()
        return self.transient_margin
