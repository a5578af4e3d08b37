"""What may be spent now: KV blocks of vLLM's pool and transient bytes of GPU headroom.

The budget is the policy half of admission (the gate is the mechanism): it says whether a demand
fits beside what the ledger already holds, and whether it could ever fit. Its numbers start from
flags and the backend's cache_config_info; the telemetry loop moves them later (live headroom,
calibrated factors, conservative scale), it holds every admission while its shared view of the
backend (kvgate.gate.backend_state, also read by /readyz) says the backend is not up, and every
move notifies the gate so it can re-check its queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvgate.errors import CacheOutgrown
from kvgate.gate.backend_state import BackendState, Status
from kvgate.memory.ceiling import Ceiling, StepHoldings, demand_step, forward_phase_bytes, step_charge
from kvgate.memory.demand import Demand

KV_BUSY = "kv_cache_busy"
TRANSIENT_BUSY = "transient_memory_busy"
BACKEND_DOWN = "backend_down"
BACKEND_HUNG = "backend_hung"
_HOLDS: dict[Status, str] = {"starting": BACKEND_DOWN, "down": BACKEND_DOWN, "hung": BACKEND_HUNG}


class SharedLevel(Protocol):
    """Whether a served step's forward pass of `forward_bytes` runs in `capacity` after any one
    earlier served step (kvgate/memory/activation.py SharedForward); `unknown`: the answer while
    the replay is still being worked out."""

    def __call__(self, forward_bytes: int, capacity: int, unknown: bool = False) -> bool: ...

    def prepare(self, capacity: int) -> None:
        """Start working out the level of `capacity` if no level is known or under way."""
        ...


class StepLevel(Protocol):
    """Whether a served step's forward pass of `tokens` tokens runs in `capacity` whatever the
    caching allocator holds cached after steps that sampled at most `rows` rows
    (kvgate/memory/activation.py AnyCacheForward); no while that is still being worked out."""

    def __call__(self, tokens: int, capacity: int, rows: int) -> bool: ...

    def more_caches(self, rows: int, than: int) -> bool:
        """Whether steps of `rows` sampled rows can leave larger segments than steps of `than`."""
        ...

    def prepare(self, capacity: int) -> None:
        """Start working out the level a step beside a one-row request asks at `capacity`, if no
        level is known or under way."""
        ...


class SamplerLevel(Protocol):
    """Whether a served step of `tokens` tokens sampling `rows` rows (its logits copied to fp32
    where it `copies` them) runs, forward pass and sampler phase, in `capacity` whatever the
    caching allocator holds cached after steps that sampled at most `seen` rows
    (kvgate/memory/activation.py AnyCacheSampler); no while that is still being worked out."""

    def __call__(self, tokens: int, rows: int, copies: bool, capacity: int, seen: int) -> bool: ...

    def runs(self, tokens: int, rows: int, copies: bool, capacity: int, seen: int) -> bool:
        """As a call, but no where the forward pass alone does not run from every cache."""
        ...

    def prepare(self, capacity: int) -> None:
        """Start working out the level that answers for every step at `capacity`, if no level is
        known or under way."""
        ...


class V1StepLevel(Protocol):
    """Whether the sampler phase of a V1 step of `tokens` tokens sampling `rows` rows (penalties
    on prompts of up to `prompt` tokens, 0: none; the batch's log-softmax where `logprobs`) runs
    with `headroom` bytes free beside the bytes V1's warm-up released, whatever the caching
    allocator holds cached (kvgate/memory/activation.py V1AnyCacheStep); no while that is still
    being worked out."""

    def __call__(self, tokens: int, rows: int, prompt: int, logprobs: bool, headroom: int) -> bool: ...

    def releases(self, tokens: int, rows: int, prompt: int, logprobs: bool, headroom: int) -> bool:
        """Whether the step, from the cache V1's warm-up leaves, releases it (a failed cudaMalloc)."""
        ...

    def prepare(self, headroom: int) -> None:
        """Start working out the first levels at `headroom`, if none is known or under way."""
        ...


class LoneRequestLevel(Protocol):
    """Whether a request of `prompt_tokens` alone runs its prefill's forward passes in `capacity`
    from every cache of `cached` bytes (kvgate/memory/activation.py LoneRequest); no while that is
    still being worked out, unless `now`."""

    def __call__(self, prompt_tokens: int, capacity: int, cached: int, now: bool = False) -> bool: ...

    def known(self, prompt_tokens: int, capacity: int, cached: int) -> bool | None:
        """As a call, but None while it is still being worked out."""
        ...

    def ever(self, prompt_tokens: int, capacity: int) -> bool:
        """Whether it runs from some cache: else waiting never lets it in."""
        ...


class Holdings(Protocol):
    """What the ledger holds; the budget only reads it."""

    def step(self) -> StepHoldings: ...

    def step_with(self, demand: Demand) -> StepHoldings: ...

    def new_blocks(self, demand: Demand) -> int: ...

    @property
    def kv_blocks(self) -> int: ...

    @property
    def kv_variance_blocks(self) -> float: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def peak_segment_rows(self) -> int: ...

    @property
    def warmup_released(self) -> bool: ...


@dataclass
class Budget:
    """The live limits. `None` means unknown: that dimension is not gated (and /readyz says so)."""

    kv_blocks: int | None = None
    transient_headroom_bytes: int | None = None
    max_transient_headroom_bytes: int | None = None
    transient_margin: float = 0.1
    kv_overcommit: float = 1.0
    # Standard deviations of the in-flight requests' summed KV growth kept free (outputs.py).
    kv_margin_z: float = 0.0
    profiled_peak_bytes: int = 0
    # Set when the headroom comes from GPU readings: then it includes whatever of the profile region
    # vLLM emptied after start-up, so profiled terms are charged against it too, up to this cap (the
    # part of the region the engine did not hold). None: a headroom from flags, beside the region.
    profiled_cap_bytes: int | None = None
    # The part of the profile peak the engine did not keep cached after start-up (kvgate/engine_config.py
    # profile_emptied_bytes); None: the utilization formula's alone.
    profile_emptied_bytes: int | None = None
    # The caching allocator's segments beyond the profile's allocated peak, as a share of the
    # profile peak, charged in proportion to the profiled bytes (kvgate/memory/activation.py
    # profile_segment_overhead_bytes).
    segment_overhead: float = 0.0
    # The same, seen on the GPU (kvgate/telemetry/calibration.py observe_region); the larger counts.
    learned_segment_overhead: float = 0.0
    # The profile region's segments the GPU has shown the engine take and keep this life
    # (kvgate/telemetry/calibration.py region_held): part of the headroom (its server growth) that
    # a step's profiled charge comes back into, not a prediction. The margin is not applied to it.
    held_region_bytes: int = 0
    # Kept back of the headroom for the other processes on the GPU: a repeat of the largest
    # allocation step one was seen to take, while the headroom could take it
    # (kvgate/telemetry/cotenants.py). Not of the never-fits ceiling: that is the idle server's.
    cotenant_reserve_bytes: int = 0
    # The profile's forward pass (kvgate/memory/activation.py profile_forward_bytes): the most the
    # open prefills' profiled forward terms take in one step (0: bounded by profiled_cap_bytes only).
    profiled_forward_bytes: int = 0
    # Its share a token: what each decoding row's token adds to a step's forward pass.
    forward_bytes_per_token: int = 0
    # Its final hidden states: the most of the open prefills' the sampler phase holds.
    profiled_hidden_bytes: int = 0
    # (sampled rows, step tokens, whether it copies the logits to fp32) -> the sampler phase's
    # segment overhead beside other requests (kvgate/memory/activation.py SamplerPhaseOverhead);
    # None: the profile's share.
    sampler_phase_overhead: Callable[[int, int, bool], int] | None = None
    # The share of it charged, relaxed on the GPU's evidence (kvgate/telemetry/calibration.py observe_slack).
    sampler_overhead_scale: float = 1.0
    # (step tokens, capacity) -> whether a lone request's forward pass runs in that capacity after
    # any one earlier step, its own size among them (kvgate/memory/activation.py LoneForward); None: it does.
    lone_forward: Callable[[int, int], bool] | None = None
    # (step tokens, headroom) -> whether a V1 step's forward pass runs from the cache V1's warm-up
    # leaves, in the headroom beside it (kvgate/memory/activation.py V1WarmupForward); None: not
    # judged (V2 empties its cache; expandable segments strand nothing).
    warmup_forward: Callable[[int, int], bool] | None = None
    # (step tokens, sampled rows, longest penalty prompt, logprobs, headroom) -> whether a V1 step's
    # sampler phase runs from any cache of a few free segments in the headroom and the warm-up's
    # released bytes (kvgate/memory/activation.py V1AnyCacheStep); None: not judged (V2; expandable segments).
    v1_any_cache: V1StepLevel | None = None
    # (forward bytes, capacity) -> whether a served step's forward pass of that many bytes runs in
    # that capacity after any one earlier served step, whoever's (kvgate/memory/activation.py
    # SharedForward, MLA deployments); None: the profile's share is charged beside others. Where
    # set, it judges a request alone too (`lone_step_fits`).
    shared_forward: SharedLevel | None = None
    # (step tokens, capacity) -> whether a step's forward pass runs in that capacity from any cache
    # of a few free segments (kvgate/memory/activation.py AnyCacheForward); None: not judged. Asked
    # of a step beside other requests, whose steps leave the cache (`any_cache_step_fits`).
    any_cache_forward: StepLevel | None = None
    # (step tokens, sampled rows, copies, capacity, rows seen) -> whether the step with its sampler
    # phase runs in that capacity from any such cache (kvgate/memory/activation.py
    # AnyCacheSampler); None: not judged.
    any_cache_sampler: SamplerLevel | None = None
    # (prompt tokens, capacity, cached bytes) -> whether a request alone runs its prefill's forward
    # passes in that capacity from every cache of the cached bytes (kvgate/memory/activation.py
    # LoneRequest); None: not judged.
    lone_request: LoneRequestLevel | None = None
    # What the caching allocator holds cached beyond start-up's, read from the GPU while the engine
    # was idle and nothing was admitted since (kvgate/telemetry/live.py); None: not known.
    idle_cache_bytes: int | None = None
    # The server's growth since this engine life's baseline at the last GPU reading, where that
    # baseline came before vLLM's first prompt token: the cache the engine will hold once idle,
    # if no step grows it further (a life's cache only grows: kvgate/telemetry/live.py); None: not known.
    grown_cache_bytes: int | None = None
    # (sampled rows, longest prompt) -> what a V1 step with a penalty row needs beyond the profile
    # region the engine keeps cached, or None while not known (kvgate/memory/activation.py
    # V1PenaltyStep); None: its prompt ids and bin counts come out of free memory whole.
    penalty_step: Callable[[int, int], int | None] | None = None
    # The one view of the backend; while it is not up nothing is admitted: arrivals wait in the queue.
    backend: BackendState = field(default_factory=BackendState)
    # Below 1 in conservative mode (stale readings): a share of the transient limit, never full
    # speed blind. Not of the KV limit: the pool is vLLM's own, sized at start-up, and stale
    # readings say nothing new about it (what they miss is another process taking GPU memory);
    # a full pool makes vLLM queue or preempt, never run out of memory. Overcommit is off then.
    scale: float = 1.0
    _listeners: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # Bumped by every change of the limits or the backend's status: what a request judged against
    # an idle server (the gate's set-aside waiters) depends on nothing else.
    moves: int = field(default=0, repr=False)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def update(self, **changes: object) -> None:
        """Change some limits and tell the gate; unknown names are a programming error."""
        for name, value in changes.items():
            if name.startswith("_") or not hasattr(self, name):
                raise AttributeError(name)
            setattr(self, name, value)
        if "transient_headroom_bytes" in changes or "profiled_cap_bytes" in changes:
            self._prepare_step_levels()
        self.moves += 1
        for listener in self._listeners:
            listener()

    def _prepare_step_levels(self) -> None:
        """Start the step level the first admission beside others will ask, off the loop, as soon
        as the first headroom is read: until a level is known the answer is no, so every request
        behind the first waited for the worker thread's replay (0.1-0.4 s wall in benchmark S10,
        each of them in the TTFT tail)."""
        capacity = self.transient_headroom_bytes
        if capacity is not None and self.v1_any_cache is not None:
            self.v1_any_cache.prepare(capacity)
        if capacity is None or not self.profiled_cap_bytes:
            return
        if self.shared_forward is not None:
            self.shared_forward.prepare(capacity)
        elif self.forward_bytes_per_token:
            for level in (self.any_cache_forward, self.any_cache_sampler):
                if level is not None:
                    level.prepare(capacity)

    def set_backend(self, status: Status, why: str | None = None) -> bool:
        """The backend's status, seen again or changed; on a change (True) the gate re-checks its queue."""
        changed = self.backend.set(status, why)
        if changed:
            self.moves += 1
            for listener in self._listeners:
                listener()
        return changed

    @property
    def hold(self) -> str | None:
        """Why nothing may be admitted now (the backend is not up), or None."""
        return _HOLDS.get(self.backend.status)

    @property
    def known(self) -> bool:
        return self.kv_blocks is not None

    def kv_limit(self) -> int | None:
        if self.kv_blocks is None:
            return None
        return math.floor(self.kv_blocks * self.kv_overcommit)

    @property
    def charged_segment_overhead(self) -> float:
        """The segment overhead the profiled terms are charged: the replay's or the GPU's, larger."""
        return max(self.segment_overhead, self.learned_segment_overhead)

    def transient_limit(self, held: int | None = None, beside_cotenants: bool = True) -> int | None:
        """The transient bytes kvgate may charge: the headroom less the co-tenants' reserve
        (`cotenant_reserve_bytes`; `beside_cotenants` false: not, for calibration, which judges
        kvgate's own charges against the engine's memory) and the safety margin, times the
        conservative scale. The margin is for what kvgate predicts and the engine has not shown:
        of the headroom, the `held` bytes (default the whole held region, `held_region_bytes`)
        are the profile region's segments the engine already took and kept, which a step's
        profiled charge comes back into, and count whole (`shortfall` credits a step only its
        own profiled part of them)."""
        if self.transient_headroom_bytes is None:
            return None
        headroom = self.transient_headroom_bytes - (self.cotenant_reserve_bytes if beside_cotenants else 0)
        return math.floor(self._spendable(max(0, headroom), held) * self.scale)

    def _spendable(self, headroom: int, held: int | None) -> float:
        """Of `headroom`, the held part whole and the rest less the margin."""
        held = min(headroom, self.held_region_bytes if held is None else held)
        return held + (headroom - held) * (1.0 - self.transient_margin)

    def kv_margin(self, variance_blocks: float) -> int:
        """Blocks kept free for output lengths beyond their means, whose variances sum to this."""
        return math.ceil(self.kv_margin_z * math.sqrt(max(0.0, variance_blocks)))

    def max_transient_limit(self) -> int | None:
        headroom = self.max_transient_headroom_bytes
        if headroom is None:
            headroom = self.transient_headroom_bytes
        if headroom is None:
            return None
        return math.floor(self._spendable(headroom, 0))

    def ceiling(self) -> Ceiling:
        """The most an idle server offers one request: whether it could ever fit is judged
        against this (kvgate/predict.py Predictor.check_fits_ever). Its profiled terms count at
        their allocated bytes, as vLLM's profile sized them, where its forward passes alone run in
        the largest headroom seen after any earlier step (`lone_step_fits`) or from some cache
        of free segments an idle engine may hold (`lone_request_ever_fits`: held-out H8b's and H1's
        long prompts run from an empty one, a state the readings show and kvgate then admits
        in); else they count at their segments, as beside other requests."""
        headroom = self.max_transient_headroom_bytes or self.transient_headroom_bytes
        return Ceiling(
            self.kv_blocks,
            self.max_transient_limit(),
            self.profiled_cap_bytes,
            self.charged_segment_overhead,
            None
            if headroom is None
            else lambda demand: (
                self.lone_step_fits(demand_step(demand), headroom, unknown=True)
                or self.lone_request_ever_fits(demand, headroom)
            ),
        )

    def _lone_replay(self) -> LoneRequestLevel | None:
        """The replay of a request alone from the idle engine's cache, where it judges: the profile
        region comes out of free memory only (`profiled_cap_bytes` above 0), and not on MLA
        deployments (their served steps' replay, `shared_step_fits`)."""
        if self.shared_forward is not None or not self.profiled_cap_bytes:
            return None
        return self.lone_request

    def lone_request_ever_fits(self, demand: Demand, capacity: int) -> bool:
        """Whether `demand` alone runs its prefill's forward passes in `capacity` from some cache
        an idle engine may hold (kvgate/memory/activation.py `lone_request_ever_fits`)."""
        replay = self._lone_replay()
        return replay is not None and replay.ever(demand.prompt_tokens, capacity)

    def forget_idle_cache(self) -> None:
        """A request was admitted: its steps will grow the cache, so the last idle reading of it
        no longer tells what the next request meets (until the engine is idle and read again).
        Nothing becomes admissible by forgetting: the gate is not told."""
        self.idle_cache_bytes = None

    def lone_request_fits(self, demand: Demand, capacity: int | None = None, cached: int | None = None) -> bool:
        """Whether `demand` alone on the idle engine may be charged its forward pass's allocated
        bytes because its prefill's forward passes run in the headroom (default the live one)
        from every cache of the bytes the GPU's readings show cached (default `idle_cache_bytes`;
        kvgate/memory/activation.py `lone_request_fits`), where `lone_step_fits`'s histories of
        one earlier step do not all run them (`_lone_replay`'s conditions); unknown cache or
        replay: no (the request waits)."""
        replay = self._lone_replay()
        capacity = self.transient_headroom_bytes if capacity is None else capacity
        cached = self.idle_cache_bytes if cached is None else cached
        if replay is None or capacity is None or cached is None:
            return False
        return replay(demand.prompt_tokens, capacity, cached, now=cached == 0)

    def fits_once_drained(self, demand: Demand, idle: Holdings) -> bool:
        """Whether `demand`, which runs only from the cache an idle engine's reading shows
        (`lone_request_fits`), is predicted to run once the requests in flight have ended: from
        the cache the engine has grown by now, where no idle reading was taken since the last
        admission (after one, it said so itself: draining again would show a cache no smaller),
        and within the limit alone (`idle`: the holdings of an idle server), at its allocated
        bytes: where the co-tenants' reserve leaves less than that, no drain lets it in (S6).
        Such a request heads the line and the engine drains for it (kvgate/gate/gate.py
        `_stranded`), as vLLM would have run it on an idle engine."""
        if self.idle_cache_bytes is not None or self.grown_cache_bytes is None:
            return False
        if not self.lone_request_fits(demand, cached=self.grown_cache_bytes):
            return False
        step = idle.step_with(demand)
        return not self._over_transient_limit(step, self._step_charge(step, beside_others=False))

    def outgrown(self, demand: Demand) -> CacheOutgrown | None:
        """Why `demand` will not run on this engine until it restarts, or None: it runs alone only
        from some cache (`lone_request_ever_fits`), not from every cache of what the engine has
        grown by (`grown_cache_bytes`) even at the largest headroom seen, and a caching allocator
        keeps its free segments for the engine's life (so an idle reading would show no less).
        None too while the replay is being worked out (the gate is told when it is known)."""
        replay, grown = self._lone_replay(), self.grown_cache_bytes
        capacity = self.max_transient_headroom_bytes or self.transient_headroom_bytes
        if replay is None or grown is None or capacity is None or not replay.ever(demand.prompt_tokens, capacity):
            return None
        if replay.known(demand.prompt_tokens, capacity, grown) is not False:
            return None
        return CacheOutgrown(demand.prompt_tokens, capacity, grown)

    def lone_step_fits(self, step: StepHoldings, capacity: int | None = None, unknown: bool = False) -> bool:
        """Whether a request alone on the engine may be charged its forward pass's allocated bytes.

        Alone, a request's steps run largest first (its prefill's chunks, then decode), but the
        caching allocator still holds the segments earlier requests' steps left (an idle engine
        does not empty its cache): only where its forward pass runs in the headroom after any one
        earlier step, its own size too (kvgate/memory/activation.py `lone_forward_fits`), are its
        segments known not to strand. An MLA deployment's served steps make the up-projection
        tensors that replay leaves out, so there the replay of served steps judges it as it judges
        a step beside others (`shared_step_fits`): the earlier steps' segments are there either
        way. Where the profile region comes out of free memory only (`profiled_cap_bytes` above
        0). `capacity`: the headroom to run in, default the live one; `unknown`: the answer while
        the served steps' replay is being worked out (the ceiling's: not a verdict of never
        fitting). Not scaled down in conservative mode: the replay asks what the allocator does in
        the memory it has; the charge is then weighed against the scaled limit (`shortfall`),
        which would count stale readings twice."""
        if capacity is None:
            capacity = self.transient_headroom_bytes
        if self.shared_forward is not None and self.profiled_cap_bytes and capacity is not None:
            return self.shared_step_fits(step, capacity, unknown)
        profiled_forward_bytes = step.forward_profiled
        if (
            self.lone_forward is None
            or not self.profiled_cap_bytes
            or not self.forward_bytes_per_token
            or profiled_forward_bytes <= 0
            or capacity is None
        ):
            return True
        return self.lone_forward(-(-profiled_forward_bytes // self.forward_bytes_per_token), capacity)

    def shared_step_fits(self, step: StepHoldings, capacity: int | None = None, unknown: bool = False) -> bool:
        """Whether `step`'s forward pass is charged its allocated bytes beside other requests: where
        the replay of served steps (kvgate/memory/activation.py `shared_forward_level`) says a
        forward pass of its bytes (its profiled phase and its unprofiled terms, the context
        up-projection beyond the profile among them) runs in the headroom (default the live one)
        after any one earlier step, which the other requests' steps leave cached. Else the
        profile's share counts. Not scaled in conservative mode, as `lone_step_fits`."""
        if capacity is None:
            capacity = self.transient_headroom_bytes
        if self.shared_forward is None or not self.profiled_cap_bytes or capacity is None:
            return False
        forward = forward_phase_bytes(
            step, self.profiled_cap_bytes, self.profiled_forward_bytes or None, self.forward_bytes_per_token
        )
        return self.shared_forward(forward + step.unprofiled, capacity, unknown)

    def any_cache_step_fits(self, step: StepHoldings, rows_seen: int = 0) -> bool:
        """Whether `step`'s forward pass (its open prefills' profiled terms and its decoding rows'
        tokens, at most max_num_batched_tokens) runs in the live headroom from any cache the other
        requests' steps can leave (kvgate/memory/activation.py `any_cache_forward_level`): the
        steps of this engine life, none of which made a larger sampler tensor than a copying step
        of `rows_seen` rows or `step` (`StepHoldings.segment_rows`: a segment is the size of a
        tensor some step made, and the sampler phase's logits or their fp32 copy make the largest). The segment share `shortfall` charges is the profile step's after one
        earlier step, a proportion: a step near the headroom it under-counts when earlier steps
        stranded more (held-out H7). Where the profile region comes out of free memory only
        (`profiled_cap_bytes` above 0), as `lone_step_fits`; an MLA deployment's served steps
        are judged by their own replay (`shared_step_fits`). Not scaled in conservative mode, as
        `lone_step_fits`. Then the whole step, its sampler phase after its forward pass, from the
        same caches (`any_cache_sampler`, kvgate/memory/activation.py `any_cache_sampled_rows`):
        the charge's sampler overhead is a replay after one earlier step, and the fp32 copies of
        several earlier steps left caches it under-counts (benchmark S9)."""
        return all(self._any_cache_verdicts(step, rows_seen))

    def whole_step_runs(self, step: StepHoldings, rows_seen: int) -> bool:
        """Whether `step`, its sampler phase after its forward pass, is known to run in the live
        headroom from every cache steps sampling at most `rows_seen` rows can leave
        (kvgate/memory/activation.py `AnyCacheSampler.runs`): not where its forward pass alone
        does not, nor while the level is being worked out."""
        capacity = self.transient_headroom_bytes
        sampler = self.any_cache_sampler
        if sampler is None or not self._any_cache_judges() or capacity is None or step.sampled_rows <= 0:
            return False
        seen = max(rows_seen, step.segment_rows)
        return sampler.runs(self._forward_tokens(step), step.sampled_rows, step.copies_logits, capacity, seen)

    def _any_cache_judges(self) -> bool:
        """Whether the any-cache levels judge this deployment's steps beside others: the profile
        region out of free memory only, not on MLA deployments (their served steps' replay)."""
        return (
            self.any_cache_forward is not None
            and self.shared_forward is None
            and bool(self.profiled_cap_bytes)
            and bool(self.forward_bytes_per_token)
        )

    def _any_cache_verdicts(self, step: StepHoldings, rows_seen: int) -> tuple[bool, bool]:
        """`any_cache_step_fits`' two verdicts: the forward pass's, and the whole step's."""
        capacity = self.transient_headroom_bytes
        if self.any_cache_forward is None or not self._any_cache_judges() or capacity is None:
            return True, True
        tokens, seen = self._forward_tokens(step), max(rows_seen, step.segment_rows)
        forward = tokens <= 0 or self.any_cache_forward(tokens, capacity, seen)
        sampler = self.any_cache_sampler
        whole = sampler is None or sampler(tokens, step.sampled_rows, step.copies_logits, capacity, seen)
        return forward, whole

    def _forward_tokens(self, step: StepHoldings) -> int:
        """The tokens of `step`'s forward pass, at most max_num_batched_tokens (the profile's)."""
        forward = step.forward_profiled + step.sampled_rows * self.forward_bytes_per_token
        if self.profiled_forward_bytes:
            forward = min(forward, self.profiled_forward_bytes)
        return -(-forward // self.forward_bytes_per_token)

    def _grows_past_any_cache(self, step: StepHoldings, holdings: Holdings) -> bool:
        """Whether admitting makes the worst step beside others larger than any cache runs, or
        lets a step sample more rows than any step of this engine life, enough to leave a larger
        segment cached for the next steps' (`StepLevel.more_caches`). Not where it does neither (the step
        no larger because max_num_batched_tokens caps it, and vLLM runs the capped step whoever
        asks in), which holding it back would not make safer. A step whose sampler phase does not
        run from every cache (`_any_cache_verdicts`' second) grows with its sampled rows too, and
        with a first row whose logits are copied to fp32."""
        if holdings.in_flight == 0:
            return False
        forward, whole = self._any_cache_verdicts(step, holdings.peak_segment_rows)
        if forward and whole:
            return False
        levels, peak, now = self.any_cache_forward, holdings.peak_segment_rows, holdings.step()
        if levels is not None and levels.more_caches(step.segment_rows, peak):
            return True
        more_tokens = self._forward_tokens(step) > self._forward_tokens(now)
        more_sampled = step.sampled_rows > now.sampled_rows or (step.copies_logits and not now.copies_logits)
        return (not forward and more_tokens) or (not whole and (more_tokens or more_sampled))

    def _strands_warmup_cache(self, step: StepHoldings) -> bool:
        """Whether `step`'s forward pass does not run from the cache V1's warm-up leaves in the live
        headroom (`warmup_forward`): its profiled tensors are counted inside the region the engine
        holds, which it holds in the warm-up's shapes (random engine R112's first large step ran
        out so). Such a step waits, alone too: the cache changes only as steps run. Not scaled in
        conservative mode, as `lone_step_fits`."""
        headroom = self.transient_headroom_bytes
        if self.warmup_forward is None or headroom is None or not self.forward_bytes_per_token:
            return False
        tokens = self._forward_tokens(step)
        return tokens > 0 and not self.warmup_forward(tokens, headroom)

    def releases_warmup_cache(self, holdings: Holdings) -> bool:
        """Whether the in-flight requests' worst step, just admitted, may release the cache V1's
        warm-up left (`V1StepLevel.releases`) where no step this engine life has yet: the gate
        then marks the life (`Ledger.warmup_released`). Asked at every admission: the worst step
        is worked out only where the question stands (V1 without expandable segments, not yet marked)."""
        if self.v1_any_cache is None or holdings.warmup_released:
            return False
        return self._releases_warmup(holdings.step())

    def _releases_warmup(self, step: StepHoldings) -> bool:
        headroom = self.transient_headroom_bytes
        if self.v1_any_cache is None or headroom is None:
            return False
        return self.v1_any_cache.releases(
            self._v1_tokens(step), step.sampled_rows, step.penalty_prompt, step.logprobs, headroom
        )

    def _v1_tokens(self, step: StepHoldings) -> int:
        return self._forward_tokens(step) if self.forward_bytes_per_token else step.sampled_rows

    def _grows_past_v1_any_cache(self, step: StepHoldings, holdings: Holdings) -> bool:
        """Whether admitting makes a V1 step beside others one whose sampler phase does not run from
        every cache in the live headroom and the warm-up's released bytes (`v1_any_cache`), and larger
        than the step in flight: more tokens or rows, a longer penalty prompt, a first penalty or
        logprobs row. Only once a step this engine life, or this one, may have released the
        warm-up's blocks (`Holdings.warmup_released`, `_releases_warmup`): until then the region
        is held in their shapes, which the profiled tensors the charge leaves out find. The steps
        beside others leave the cache; a step no larger than the one in flight holding back
        would not make safer (vLLM runs it whoever asks in). Not scaled in conservative mode, as
        `lone_step_fits`."""
        headroom = self.transient_headroom_bytes
        if self.v1_any_cache is None or headroom is None or holdings.in_flight == 0:
            return False
        if not (holdings.warmup_released or self._releases_warmup(step)):
            return False
        tokens = self._v1_tokens(step)
        if self.v1_any_cache(tokens, step.sampled_rows, step.penalty_prompt, step.logprobs, headroom):
            return False
        now = holdings.step()
        larger = tokens > self._v1_tokens(now)
        return (
            larger
            or step.sampled_rows > now.sampled_rows
            or step.penalty_prompt > now.penalty_prompt
            or (step.logprobs and not now.logprobs)
        )

    def transient_charge(self, holdings: Holdings) -> int:
        """What the in-flight requests hold of the transient limit: the larger phase of their
        worst step (kvgate/memory/ceiling.py step_charge), as `shortfall` charges it beside others."""
        step = holdings.step()
        return self._step_charge(
            step, True, self.shared_step_fits(step), self.whole_step_runs(step, holdings.peak_segment_rows)
        )

    def _step_charge(
        self, step: StepHoldings, beside_others: bool, forward_fits: bool = False, sampler_runs: bool = False
    ) -> int:
        """Alone on an idle engine a request's steps run largest first (see `ceiling`): no
        segment overhead then. `forward_fits`: beside others, the forward pass is known to run
        in the headroom at its allocated bytes (`shared_step_fits`); `sampler_runs`: beside others,
        the whole step runs from every cache (`whole_step_runs`).

        A V1 step with a penalty row (its bin counts and two prompt-id copies in
        `step.penalty_bytes`) where the engine holds the profile region (`profiled_cap_bytes` 0,
        GPU readings on V1: kvgate/memory/ceiling.py `step_charge`): those tensors land in the
        region's cached blocks wherever the replay of the step after earlier ones
        (`penalty_step`) finds room there, so the step is charged the rest and what the replay
        needs beyond the region, when that is less."""
        charge = self._phases_charge(step, beside_others, forward_fits, sampler_runs)
        if self.penalty_step is None or not step.penalty_bytes or self.profiled_cap_bytes != 0:
            return charge
        excess = self.penalty_step(step.sampled_rows, step.penalty_prompt)
        if excess is None:
            return charge
        lean = replace(step, sampler_unprofiled=step.sampler_unprofiled - step.penalty_bytes, penalty_bytes=0)
        return min(charge, self._phases_charge(lean, beside_others, forward_fits, sampler_runs) + excess)

    def _phases_charge(self, step: StepHoldings, beside_others: bool, forward_fits: bool, sampler_runs: bool) -> int:
        """`step_charge` with the budget's limits."""
        return step_charge(
            step,
            self.profiled_cap_bytes,
            self.charged_segment_overhead if beside_others else 0.0,
            self.profiled_forward_bytes or None,
            self.forward_bytes_per_token,
            self.profiled_hidden_bytes or None,
            self.sampler_phase_overhead,
            self.sampler_overhead_scale,
            0.0 if forward_fits else None,
            sampler_runs,
        )

    def shortfall(self, demand: Demand, holdings: Holdings) -> str | None:
        """Why the demand cannot be admitted beside current holdings, or None if it fits now.

        A demand is charged at most the whole KV limit: vLLM never holds more than its pool at
        once, and a request with several prompts (or samples) whose blocks add up to more runs
        them as the pool allows (kvgate/predict.py). So it waits for nothing else to be held, then
        goes in, rather than waiting forever; what it reserves keeps the rest waiting until it is
        done. A single engine request larger than the pool never gets here (KvNeverFits); a limit
        of 0 blocks admits nothing."""
        if self.hold is not None:
            return self.hold
        kv_limit = self.kv_limit()
        if kv_limit is not None:
            margin = self.kv_margin(holdings.kv_variance_blocks + demand.kv_variance_blocks)
            need = holdings.new_blocks(demand) + margin
            if holdings.kv_blocks + (min(need, kv_limit) if kv_limit > 0 else need) > kv_limit:
                return KV_BUSY
        step = holdings.step_with(demand)
        if self._grows_past_any_cache(step, holdings) or self._strands_warmup_cache(step):
            return TRANSIENT_BUSY
        if self._grows_past_v1_any_cache(step, holdings):
            return TRANSIENT_BUSY
        beside_others = holdings.in_flight > 0 or not (self.lone_step_fits(step) or self.lone_request_fits(demand))
        charge = self._step_charge(
            step,
            beside_others,
            beside_others and self.shared_step_fits(step),
            beside_others and self.whole_step_runs(step, holdings.peak_segment_rows),
        )
        return TRANSIENT_BUSY if self._over_transient_limit(step, charge) else None

    def _over_transient_limit(self, step: StepHoldings, charge: int) -> bool:
        """Whether `step`'s `charge` exceeds the transient limit. The held region counts whole only
        for the profiled bytes the step charges: the rest of the charge is kvgate's prediction,
        and has the margin."""
        transient_limit = self.transient_limit(min(self.held_region_bytes, step.profiled_charge(charge)))
        return transient_limit is not None and charge > transient_limit
