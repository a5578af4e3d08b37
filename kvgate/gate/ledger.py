"""The ledger: every admitted request's reservation of KV blocks and transient memory.

It mirrors vLLM's prefix cache vocabulary: a prompt's full blocks are known by their chained
block hashes and reference-counted, so a shared system prompt held by many in-flight requests is
counted once, exactly as vLLM's block pool would hold it once. The ledger is the only owner of
reservations; the gate asks it what is reserved and tells it what to reserve or release.

Transient bytes aggregate in two ways. Prefill-phase terms (attention over the computed prefix,
prompt_logprobs, oversized MLP chunks) grow with the prompt tokens a step schedules, and one
step schedules at most max_num_batched_tokens of them across all requests, each term already
sized for a full chunk: the worst step holds at most the largest such term, not their sum,
except where vLLM frees one request's tensors only when the next request's replace them (V1's
prompt logprobs, Demand.step_pair_bytes): there the second largest is added.
The sampler stage is one per step, sized by the whole batch (kvgate/memory/sampler.py): the ledger
keeps what the in-flight requests put in it, and asks what the stage takes with a candidate added.
The profiled forward terms (hidden states, MLP) and the sampler stage run one after the other in
a step: the ledger hands them to the budget apart (`step`, kvgate/memory/ceiling.py StepHoldings),
which charges the larger phase.
The open prefills' profiled forward terms are summed, each sized for a whole chunk, but one step
computes at most max_num_batched_tokens tokens whoever's they are: where the deployment has a
step bound (MLA, kvgate/memory/activation.py StepForwardBound) the sum is charged at most that
bound, with the prefills' MLA up-projections, which do add up in one step, summed into it; what of it
exceeds the profile's forward pass comes out of free memory and counts as unprofiled.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvgate.gate.plain_prefills import PlainPrefills, Relief, largest_without
from kvgate.memory.activation import StepForwardBound
from kvgate.memory.ceiling import StepHoldings
from kvgate.memory.demand import Demand
from kvgate.memory.sampler import SamplerBatch, SamplerStage

# `peak_segment_rows` where this engine life ran steps kvgate did not see: any row count
ANY_ROWS = sys.maxsize


@dataclass
class Reservation:
    """One admitted request's hold on the ledger; released exactly once."""

    id: int
    demand: Demand
    prefill_open: bool = True
    released: bool = False
    hashes: frozenset[int] = field(default_factory=frozenset)
    # The most its V2 prompt logprobs' steps have taken beyond its own since it was admitted
    # (Demand.shared_step for the others' tokens then): kept until its prefill ends, since a prompt
    # that others cut over several steps holds the earlier steps' results until its last.
    shared_extra: int = 0
    admitted_at: float = 0.0  # the gate's clock: when it ends is predicted from it (backfilling)
    # Read by the traffic record when it is admitted (kvgate/traffic_record.py), counted by `reserve`
    # as it goes so that the record does not walk the hashes and the worst step again: its prompt
    # blocks another in-flight request held too, and the ledger's transient bytes with it reserved.
    shared_blocks_at_admission: int = 0
    transient_bytes_at_admission: int = 0
    first_token_at: float | None = None  # the gate's clock, when a stream's first token came (Pace)


class Ledger:
    """Reserved KV blocks (shared prefixes once) and reserved transient bytes."""

    def __init__(
        self,
        pool: Callable[[], int | None] | None = None,
        peak_segment_rows: int = 0,
        snapshots: bool = True,
        warmup_released: bool = False,
    ) -> None:
        """`pool`: the KV blocks of vLLM's pool, None when unknown (kvgate/gate/budget.py
        Budget.kv_blocks); it says whether vLLM may preempt (`_preemption_free`).
        `peak_segment_rows`, `warmup_released`: the life's marks to start from (a plan's copy of the gate's).
        `snapshots`: whether each reservation records the worst step's transient bytes at its
        admission and their high-water mark (the gate's ledger: the traffic record and the GPU
        calibration read them); a head's companions (kvgate/gate/backfill.py), which only ask what
        fits beside them, do not work out that worst step at each reservation."""
        self._snapshots = snapshots
        self._pool = pool
        self._growth_blocks = 0  # summed Demand.growth_blocks of the in-flight requests
        self._growth_unknown = 0  # how many of them said None
        self._refcounts: dict[int, int] = {}
        self._private_blocks = 0
        self._kv_variance = 0.0
        # sorted one-step prefill bytes (their transient less what they hold across steps) of the
        # requests still prefilling, and the sum of what they hold across steps
        self._open_prefills: list[int] = []
        self._open_pairs: list[int] = []  # sorted Demand.step_pair_bytes of the open prefills
        self._held_bytes = 0
        # The most tokens the in-flight requests put in one step (Demand.step_tokens while
        # prefilling, decode_tokens after), and how many of them said None (unknown: any number).
        self._step_tokens = 0
        self._unknown_tokens = 0
        # The open prefills whose steps others' tokens make larger (Demand.shared_step).
        self._shared: dict[int, Reservation] = {}
        self._profiled_prefill_bytes = 0  # summed over open prefills: their chunks share a step
        self._profiled_residual_bytes = 0  # of those, their hidden states (Demand.profiled_residual_bytes)
        self._upproject_bytes = 0  # summed Demand.upproject_bytes of the open prefills
        self._step_bound: StepForwardBound | None = None  # the deployment's, from its demands
        self._sampler = SamplerBatch()
        # Non-streaming requests' prefills, closed on vLLM's count of first tokens (plain_prefills.py)
        self.plain = PlainPrefills()
        self.peak_transient_bytes = 0  # high-water mark since the last reset_peak()
        # The largest sampler tensor the in-flight requests' step made since the last reset_peak()
        # (the engine's life), in rows of a step copying its logits to fp32 (SamplerStage.segment_rows):
        # what bounds the segments its sampler phases left cached (Budget.any_cache_step_fits)
        self.peak_segment_rows = peak_segment_rows
        # Whether a step admitted this engine life may have released V1's warm-up cache (set by
        # the gate on Budget.releases_warmup_cache): then V1 steps are judged from any cache
        self.warmup_released = warmup_released
        self._reservations: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self.reserved_total = 0  # reservations ever made: whether any came between two looks

    def copy(self) -> Ledger:
        """The same reservations, each a copy under its id (`reservation`), changed apart from
        this ledger from now on and without admission snapshots (`snapshots`): a head's plan
        starts from it and releases the requests the head waits for (kvgate/gate/backfill.py).
        Reserving every in-flight request again was two thirds of a plan's CPU in benchmark S13
        (~200 of them at each new head, under cProfile). Each copy keeps what its reservation
        holds now: its V2 prompt logprobs' extra as charged since admission (never less than
        charging it afresh), its prefill closed or open, and the plain prefills' account."""
        twin = copy.copy(self)
        twin._snapshots = False
        twin._refcounts = dict(self._refcounts)
        twin._open_prefills = list(self._open_prefills)
        twin._open_pairs = list(self._open_pairs)
        twin._reservations = {rid: replace(r) for rid, r in self._reservations.items()}
        twin._shared = {rid: twin._reservations[rid] for rid in self._shared}
        twin._sampler = self._sampler.copy()
        twin.plain = self.plain.copy()
        twin._ids = itertools.count(self.reserved_total + 1)  # ids are handed out in order from 1
        return twin

    def reservation(self, reservation_id: int) -> Reservation:
        """The in-flight reservation of that id."""
        return self._reservations[reservation_id]

    @property
    def kv_blocks(self) -> int:
        return len(self._refcounts) + self._private_blocks

    @property
    def kv_variance_blocks(self) -> float:
        """Summed variances of the in-flight requests' KV growth (blocks^2; see outputs.py)."""
        return self._kv_variance

    @property
    def transient_bytes(self) -> int:
        """Unprofiled transient memory the worst step of the in-flight requests can take."""
        return self.step().transient_bytes

    def transient_bytes_with(self, demand: Demand) -> int:
        """What transient_bytes would be with this demand admitted too."""
        return self.step_with(demand).transient_bytes

    def _second_pair_with(self, demand: Demand, closed: Relief) -> int:
        """The second largest Demand.step_pair_bytes of the open prefills and `demand`: with the
        largest one-step term, a bound on two requests' prompt logprobs alive in one V1 step
        (the larger of the pair is at most the largest one-step term)."""
        top = sorted((*self._top_pairs(closed), demand.step_pair_bytes))
        return top[-2] if len(top) > 1 else 0

    def _largest_prefill(self, closed: Relief) -> int:
        """The largest one-step prefill term of the open prefills (the plain ones once all of
        them have finished: kvgate/gate/plain_prefills.py)."""
        if closed.all_finished:
            return next(iter(largest_without(self._open_prefills, self.plain.one_steps, 1)), 0)
        return self._open_prefills[-1] if self._open_prefills else 0

    def _top_pairs(self, closed: Relief) -> list[int]:
        """The two largest Demand.step_pair_bytes of the open prefills, as `_largest_prefill`."""
        if closed.all_finished:
            return largest_without(self._open_pairs, self.plain.pairs, 2)
        return self._open_pairs[-2:]

    def _shared_extras(self, joining: Demand | None = None) -> int:
        """What the open prefills' V2 prompt logprobs take beyond their own steps, each for the
        tokens every other in-flight request (and `joining`) can put in one step beside it
        (Demand.shared_step, Demand.step_tokens): alone, nothing; a request that joins makes the
        steps of those already in flight larger, and theirs are weighed again; none is charged less
        than it was since admitted (Reservation.shared_extra)."""
        members = len(self._reservations) + (joining is not None)
        total, unknown = self._step_tokens, self._unknown_tokens
        if joining is not None:
            total += joining.step_tokens or 0
            unknown += joining.step_tokens is None
        # another prefill in the step (the open prefills, `joining` among them): see `_extra_of`
        shared_step_free = len(self._open_prefills) + (joining is not None) < 2 and self._preemption_free(joining)
        mixed = not shared_step_free
        extras = sum(
            max(r.shared_extra, self._extra_of(r.demand, members, total, unknown, mixed)) for r in self._shared.values()
        )
        if joining is not None and joining.shared_step is not None:
            extras += self._extra_of(joining, members, total, unknown, mixed)
        return extras

    @staticmethod
    def _extra_of(demand: Demand, members: int, total: int, unknown: int, mixed: bool) -> int:
        """A request's shared-step extra among `members` in flight (itself included) that put
        `total` tokens in a step, `unknown` of them any number; `mixed`: another request may
        prefill in its step, which the step's tokens do not bound alone: vLLM may preempt one,
        which resumes by prefilling its prompt and outputs again, and another open prefill's
        tensors beside the prompt logprobs' gigabyte ones fragment the caching allocator's
        segments beyond what kvgate charges (allocated bytes): on the simulator's allocator a
        step of 40 decoding rows and a 2,000-token passage with k = -1 needs 7,773 MiB, with a
        700-token prefill beside them 8,975 MiB, its allocated peak 6,738 and 6,896 MiB
        (bench/results/s10-session28). So a step is bounded by its tokens only where every other
        request in it decodes; else it is taken as full."""
        if members < 2:
            return 0
        assert demand.shared_step is not None
        known = unknown == (demand.step_tokens is None) and not mixed
        return demand.shared_step.bytes(total - (demand.step_tokens or 0) if known else None)

    def _preemption_free(self, joining: Demand | None = None) -> bool:
        """Whether vLLM can never preempt an in-flight request (with `joining` admitted too): they
        fit its pool at their full growth to max_tokens (vllm 0.32.0 v1/core/sched/scheduler.py
        `schedule` preempts only when a running request cannot get a block). A preempted request
        resumes by prefilling its prompt and outputs again (`request.num_tokens -
        num_computed_tokens`), so only then is a decoding request's step its decode rows."""
        pool = self._pool() if self._pool is not None else None
        if pool is None or self._growth_unknown or (joining is not None and joining.growth_blocks is None):
            return False
        blocks = self.kv_blocks + self._growth_blocks
        if joining is not None:
            blocks += self.new_blocks(joining) + (joining.growth_blocks or 0)
        return blocks <= pool

    @property
    def profiled_bytes(self) -> int:
        """Profiled terms of the larger phase of the in-flight requests' worst step (the budget caps it)."""
        return self.step().profiled_bytes

    def step(self) -> StepHoldings:
        """The worst step of the in-flight requests, by phase (kvgate/memory/ceiling.py)."""
        closed = self.plain.relief  # plain prefills the engine has finished (plain_prefills.py)
        largest_prefill = self._largest_prefill(closed)
        pairs = self._top_pairs(closed)
        second_pair = min(pairs) if len(pairs) > 1 else 0
        sampler = self._sampler.stage()
        forward, beyond = self._forward(
            self._profiled_prefill_bytes - closed.profiled_prefill,
            self._upproject_bytes - closed.upproject,
            self._step_bound,
        )
        return StepHoldings(
            unprofiled=self._held_bytes - closed.held + self._shared_extras() + largest_prefill + second_pair + beyond,
            forward_profiled=forward,
            residual_profiled=self._profiled_residual_bytes - closed.profiled_residual,
            sampler_unprofiled=sampler.unprofiled,
            sampler_profiled=sampler.profiled,
            sampled_rows=sampler.rows,
            penalty_bytes=sampler.penalties + sampler.prompt_ids,
            penalty_prompt=sampler.penalty_prompt,
            copies_logits=sampler.copies_logits,
            segment_rows=sampler.segment_rows,
            logprobs=sampler.logprobs > 0,
        )

    def step_with(self, demand: Demand) -> StepHoldings:
        """`step` with this demand admitted too."""
        closed = self.plain.relief
        largest_prefill = max(self._largest_prefill(closed), _one_step(demand))
        held = self._held_bytes - closed.held + demand.transient_held_bytes + self._shared_extras(demand)
        sampler = self.sampler_with(demand)
        forward, beyond = self._forward(
            self._profiled_prefill_bytes - closed.profiled_prefill + demand.profiled_prefill_bytes,
            self._upproject_bytes - closed.upproject + demand.upproject_bytes,
            demand.step_bound or self._step_bound,
        )
        return StepHoldings(
            unprofiled=held + largest_prefill + self._second_pair_with(demand, closed) + beyond,
            forward_profiled=forward,
            residual_profiled=self._profiled_residual_bytes - closed.profiled_residual + demand.profiled_residual_bytes,
            sampler_unprofiled=sampler.unprofiled,
            sampler_profiled=sampler.profiled,
            sampled_rows=sampler.rows,
            penalty_bytes=sampler.penalties + sampler.prompt_ids,
            penalty_prompt=sampler.penalty_prompt,
            copies_logits=sampler.copies_logits,
            segment_rows=sampler.segment_rows,
            logprobs=sampler.logprobs > 0,
        )

    @staticmethod
    def _forward(summed: int, upproject: int, bound: StepForwardBound | None) -> tuple[int, int]:
        """The open prefills' profiled forward terms in one step, (within the profile's forward
        pass, beyond it): their sum, at most the step bound for their summed up-projections."""
        if bound is None:
            return summed, 0
        step = min(summed, bound.forward_bytes(upproject))
        return min(step, bound.profile_forward_bytes), max(0, step - bound.profile_forward_bytes)

    def sampler_with(self, demand: Demand) -> SamplerStage:
        """The sampler stage of the in-flight batch with this demand joining it."""
        return self._sampler.stage(demand.sampler) if demand.sampler else self._sampler.stage()

    @property
    def in_flight(self) -> int:
        return len(self._reservations)

    def reservations(self) -> list[Reservation]:
        """The in-flight reservations, oldest first."""
        return list(self._reservations.values())

    def new_blocks(self, demand: Demand) -> int:
        """Blocks the pool would have to give this request beyond what in-flight ones already hold."""
        # set.difference with a dict looks each hash up in it in C (the set's own hashes reused)
        return len(set(demand.shared_block_hashes).difference(self._refcounts)) + demand.private_blocks

    def reserve(self, demand: Demand) -> Reservation:
        hashes = frozenset(demand.shared_block_hashes)
        refcounts, shared = self._refcounts, 0
        for h in hashes:
            held = refcounts.get(h, 0)
            shared += held > 0  # another in-flight request holds it too
            refcounts[h] = held + 1
        self._private_blocks += demand.private_blocks
        self._kv_variance += demand.kv_variance_blocks
        self._add_growth(demand.growth_blocks, 1)
        bisect.insort(self._open_prefills, _one_step(demand))
        bisect.insort(self._open_pairs, demand.step_pair_bytes)
        self._held_bytes += demand.transient_held_bytes
        self._add_tokens(demand.step_tokens, 1)
        self._profiled_prefill_bytes += demand.profiled_prefill_bytes
        self._profiled_residual_bytes += demand.profiled_residual_bytes
        self._upproject_bytes += demand.upproject_bytes
        self._step_bound = demand.step_bound or self._step_bound
        if demand.sampler:
            self._sampler.add(demand.sampler)
        self.plain.reserved(demand)
        self.reserved_total += 1
        reservation = Reservation(id=next(self._ids), demand=demand, hashes=hashes, shared_blocks_at_admission=shared)
        if demand.shared_step is not None:
            self._shared[reservation.id] = reservation
        members = len(self._reservations) + 1
        mixed = len(self._open_prefills) > 1 or not self._preemption_free()
        for other in self._shared.values():
            extra = self._extra_of(other.demand, members, self._step_tokens, self._unknown_tokens, mixed)
            other.shared_extra = max(other.shared_extra, extra)
        self._reservations[reservation.id] = reservation
        if self._snapshots:
            transient = reservation.transient_bytes_at_admission = self.transient_bytes
            self.peak_transient_bytes = max(self.peak_transient_bytes, transient)
        self.peak_segment_rows = max(self.peak_segment_rows, self._sampler.stage().segment_rows)
        return reservation

    def _add_tokens(self, tokens: int | None, sign: int) -> None:
        """Count a request's tokens a step in (sign 1) or out (-1) of `_step_tokens`."""
        if tokens is None:
            self._unknown_tokens += sign
        else:
            self._step_tokens += sign * tokens

    def _add_growth(self, blocks: int | None, sign: int) -> None:
        """Count a request's growth blocks in (sign 1) or out (-1)."""
        if blocks is None:
            self._growth_unknown += sign
        else:
            self._growth_blocks += sign * blocks

    def reset_peak(self) -> None:
        """Start new high-water marks (a new engine life) from what is reserved now."""
        self.peak_transient_bytes = self.transient_bytes
        self.peak_segment_rows = self._sampler.stage().segment_rows
        self.warmup_released = False

    def unseen_steps(self) -> None:
        """The engine ran steps kvgate did not see (it had served requests when kvgate first read
        it): any row count may have left its segments cached this life, and released V1's
        warm-up cache."""
        self.peak_segment_rows = ANY_ROWS
        self.warmup_released = True

    def end_prefill(self, reservation: Reservation) -> bool:
        """The first token is out: the prefill-only transient terms are gone. True if it changed.

        Not for a request of several engine requests (prompts x n, kvgate/predict.py, or a beam
        search's one per beam per output token): the first token is one of theirs, and vLLM may
        still prefill the others later, as the pool allows; vLLM's count of first tokens closes
        their prefill terms (`mark_plain`, plain_prefills.py), or a stream's every choice showing a
        token (`end_every_prefill`), a beam search's only its end."""
        if reservation.released or not reservation.prefill_open or reservation.demand.engine_requests > 1:
            return False
        if reservation.id in self.plain:  # a plain request's prefill is closed by the engine's count
            return False
        reservation.prefill_open = False
        self._close_prefill(reservation)
        self.plain.first_token_shown(reservation.demand)
        return True

    def end_every_prefill(self, reservation: Reservation) -> bool:
        """A stream of several engine requests showed a token of each of them (every choice of n > 1
        or of several prompts: kvgate/http/choice_watch.py): all their prefills are over, so its
        prefill-only terms are gone, whatever vLLM's count of first tokens says yet. Not a beam
        search, whose engine requests prefill again for each output token. True if it changed."""
        demand = reservation.demand
        if reservation.released or not reservation.prefill_open or demand.beam_iterations > 1:
            return False
        self.plain.all_shown(reservation.id, demand, _one_step(demand))
        reservation.prefill_open = False
        self._close_prefill(reservation)
        return True

    def mark_plain(self, reservation: Reservation) -> None:
        """The admitted request shows no first token that closes its prefill (non-streaming, or
        several engine requests), so its prefill closes on vLLM's count of first tokens instead
        (plain_prefills.py)."""
        if reservation.released or not reservation.prefill_open or reservation.id in self.plain:
            return
        if PlainPrefills.eligible(reservation.demand):
            self.plain.add(reservation.id, reservation.demand, _one_step(reservation.demand))

    def _close_prefill(self, reservation: Reservation) -> None:
        demand = reservation.demand
        del self._open_prefills[bisect.bisect_left(self._open_prefills, _one_step(demand))]
        del self._open_pairs[bisect.bisect_left(self._open_pairs, demand.step_pair_bytes)]
        self._held_bytes -= demand.transient_held_bytes
        self._shared.pop(reservation.id, None)
        self._add_tokens(demand.step_tokens, -1)
        self._add_tokens(demand.decode_tokens, 1)
        self._profiled_prefill_bytes -= demand.profiled_prefill_bytes
        self._profiled_residual_bytes -= demand.profiled_residual_bytes
        self._upproject_bytes -= demand.upproject_bytes

    def release(self, reservation: Reservation) -> bool:
        """Give everything back; a second call is a no-op and returns False."""
        if reservation.released:
            return False
        reservation.released = True
        for h in reservation.hashes:
            count = self._refcounts[h] - 1
            if count:
                self._refcounts[h] = count
            else:
                del self._refcounts[h]
        self._private_blocks -= reservation.demand.private_blocks
        self._kv_variance -= reservation.demand.kv_variance_blocks
        self._add_growth(reservation.demand.growth_blocks, -1)
        if reservation.demand.sampler:
            self._sampler.remove(reservation.demand.sampler)
        self.plain.released(
            reservation.id,
            reservation.demand,
            shown=not reservation.prefill_open,
            one_step=_one_step(reservation.demand),
        )
        if reservation.prefill_open:
            self._close_prefill(reservation)
            reservation.prefill_open = False
        self._add_tokens(reservation.demand.decode_tokens, -1)
        del self._reservations[reservation.id]
        if not self._reservations:
            self._kv_variance = 0.0  # no float drift carried from one busy period to the next
        return True


def _one_step(demand: Demand) -> int:
    """A prefill's transient bytes that only its worst step takes (not held across steps)."""
    return demand.transient_prefill_bytes - demand.transient_held_bytes
