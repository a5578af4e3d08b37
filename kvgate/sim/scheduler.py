"""vLLM v1's scheduler (v1/core/sched/scheduler.py), reduced to what moves memory.

Each step first serves the running requests in order (decodes and unfinished prefill chunks),
then admits waiting ones, within `max_num_batched_tokens` and `max_num_seqs`. A long prompt is
cut into chunks (chunked prefill, optionally capped by `long_prefill_token_threshold`). When a
running request needs a block and the pool has none, the last running request is preempted
(recompute: its blocks are freed, its progress reset, it goes back to the front of the queue);
no waiting request is admitted in a step that preempted.

With speculative decoding each decoding request is scheduled with its draft tokens as well
(`num_lookahead_tokens`, v1/core/sched/scheduler.py: slots for `1 + num_speculative_tokens`
tokens, verified in one target forward); the simulator then advances it by the one token it
always keeps (every draft rejected: the memory of the step, not the speed-up, is what it plays).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvgate.sim.blocks import KVCacheManager
from kvgate.sim.request import Request, Status
from kvgate.sim.vision import EncoderScheduling


@dataclass
class ScheduledReq:
    request: Request
    num_new_tokens: int
    num_context: int
    num_draft_tokens: int = 0  # speculative tokens verified with the new ones


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledReq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_tokens for s in self.scheduled)


@dataclass
class PrefixStats:
    queries: int = 0
    hits: int = 0


class Scheduler:
    """Continuous batching over one KV cache manager."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        num_speculative_tokens: int = 0,
        encoder: EncoderScheduling | None = None,
    ) -> None:
        self.kv = kv
        self.encoder = encoder  # a multimodal model's encoder budget and cache (kvgate/sim/vision.py)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.long_prefill = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix = PrefixStats()
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.forget(req.request_id)
        self._release_images(req)
        req.status = Status.FINISHED

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.forget(req.request_id)
        self._release_images(req)
        req.status = Status.FINISHED

    def _release_images(self, req: Request) -> None:
        if self.encoder is not None and req.mm_items:
            self.encoder.cache.release_request(req.request_id)

    def _fit_images(self, req: Request, computed: int, n: int) -> int:
        """The chunk cut before an image the step's encoder budget or cache cannot take."""
        if self.encoder is None or not req.mm_items or computed >= req.num_prompt_tokens:
            return n
        return self.encoder.fit(req.request_id, req.mm_items, computed, n)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, remaining: int, budget: int) -> int:
        if self.long_prefill and remaining > self.long_prefill:
            remaining = self.long_prefill
        return min(remaining, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.encoder is not None:
            self.encoder.start_step()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            n = self._fit_images(req, req.num_computed_tokens, self._chunk(remaining, budget))
            if not n:  # its next image waits for the encoder's budget or cache
                i += 1
                continue
            drafts = (
                min(self.num_speculative_tokens, budget - n, self.max_model_len - req.num_tokens)
                if remaining == 1
                else 0
            )
            while not self.kv.allocate_slots(
                req.request_id,
                req.all_token_ids,
                req.num_computed_tokens,
                n + max(0, drafts),
                cache_salt=req.cache_salt,
            ):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    n = 0
                    break
            if not n:
                break
            drafts = max(0, drafts)
            out.scheduled.append(ScheduledReq(req, n, req.num_computed_tokens, drafts))
            budget -= n + drafts
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.request_id)
        self._release_images(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            skip_cache = req.sampling.prompt_logprobs is not None
            hit = [] if skip_cache else self.kv.get_computed_blocks(req.request_id, tokens, req.cache_salt)
            self.prefix.queries += len(tokens)
            self.prefix.hits += len(hit) * self.kv.block_size
            cached = len(hit) * self.kv.block_size
            n = self._fit_images(req, cached, self._chunk(len(tokens) - cached, budget))
            if not n:
                break
            if not self.kv.allocate_slots(req.request_id, tokens, 0, n, hit, req.cache_salt):
                self.prefix.queries -= len(tokens)
                self.prefix.hits -= cached
                break
            self.waiting.popleft()
            req.num_computed_tokens = cached
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledReq(req, n, cached))
            budget -= n
