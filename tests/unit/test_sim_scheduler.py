"""Scheduler properties: token budget, max_num_seqs, preemption, prefix hits, chunk order."""

from __future__ import annotations

from kvgate.sim.blocks import BlockPool, KVCacheManager
from kvgate.sim.request import Request, Sampling, Status
from kvgate.sim.scheduler import Scheduler, SchedulerOutput


def make(num_blocks: int = 1000, mnbt: int = 64, mns: int = 4, caching: bool = True, threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, caching), 16)
    return Scheduler(kv, mnbt, mns, 4096, threshold)


def req(i: int, n: int, max_tokens: int = 4, prefix: list[int] | None = None) -> Request:
    ids = (prefix or []) + [1000 * i + j for j in range(n - len(prefix or []))]
    return Request(f"r{i}", ids, Sampling(max_tokens=max_tokens), 0.0)


def step(s: Scheduler) -> SchedulerOutput:
    """One step as the engine does it: schedule, compute, sample, finish; the schedule."""
    out = s.schedule()
    for x in out.scheduled:
        r = x.request
        r.num_computed_tokens += x.num_new_tokens
        if r.num_computed_tokens >= r.num_tokens:
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.sampling.max_tokens:
                s.finish(r)
    return out


def advance(s: Scheduler) -> list[tuple[str, int, int]]:
    """One step; what it scheduled as (request, new tokens, context)."""
    return [(x.request.request_id, x.num_new_tokens, x.num_context) for x in step(s).scheduled]


def test_budget_and_max_num_seqs_are_never_exceeded() -> None:
    s = make(mnbt=64, mns=4)
    for i in range(10):
        s.add(req(i, 40))
    while s.has_work():
        batch = advance(s)
        assert sum(n for _, n, _ in batch) <= 64
        assert len(s.running) <= 4
        assert len(batch) <= 4


def test_chunked_prefill_runs_chunks_in_order_with_growing_context() -> None:
    s = make(mnbt=64, threshold=0)
    s.add(req(0, 200))
    chunks = [advance(s)[0] for _ in range(4)]
    assert chunks == [("r0", 64, 0), ("r0", 64, 64), ("r0", 64, 128), ("r0", 8, 192)]
    s2 = make(mnbt=64, threshold=16)
    s2.add(req(0, 40))
    assert advance(s2) == [("r0", 16, 0)]


def test_preemption_when_blocks_run_out() -> None:
    s = make(num_blocks=1 + 6, mnbt=256, mns=4)  # 6 usable blocks of 16 tokens
    s.add(req(0, 40, max_tokens=30))
    s.add(req(1, 40, max_tokens=30))
    preempted = 0
    for _ in range(80):
        if not s.has_work():
            break
        preempted += len(step(s).preempted)
        assert s.kv.pool.num_free >= 0
    assert preempted > 0
    assert s.num_preemptions == preempted
    assert not s.has_work()


def test_prefix_hits_are_counted_and_shared_blocks_reused() -> None:
    s = make(mnbt=512)
    shared = list(range(5, 5 + 64))
    s.add(req(0, 100, prefix=shared))
    advance(s)
    s.add(req(1, 100, prefix=shared))
    batch = advance(s)
    assert ("r1", 100 - 64, 64) in batch
    assert s.prefix.hits == 64
    assert s.prefix.queries == 200
    b0, b1 = s.kv.req_blocks["r0"], s.kv.req_blocks["r1"]
    assert b0[:4] == b1[:4]
    assert b0[0].ref_cnt == 2


def test_freed_blocks_stay_cached_and_count_as_free() -> None:
    s = make(mnbt=512)
    r = req(0, 64, max_tokens=1)
    s.add(r)
    advance(s)
    assert r.status == Status.FINISHED
    assert s.kv.pool.usage() == 0.0
    assert len(s.kv.pool.cached) == 4


def test_a_cache_salt_keeps_a_prompt_out_of_other_salts_prefix_cache() -> None:
    """vLLM 0.32.0 hashes a request's cache_salt into its first block: the same 64 tokens are a
    full prefix hit under the same salt and none under another salt or none."""
    kv = KVCacheManager(BlockPool(64, True), 16)
    tokens = list(range(65))
    assert kv.allocate_slots("a", tokens, 0, 65, cache_salt="s1")
    assert len(kv.get_computed_blocks("b", tokens, "s1")) == 4
    assert kv.get_computed_blocks("c", tokens, "s2") == []
    assert kv.get_computed_blocks("d", tokens) == []
