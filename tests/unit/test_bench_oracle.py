"""The benchmark's memory oracle (bench/oracle.py): the whole queue is checked at once, its
longest prefix that survives a dry run is admitted as a batch, an over-large request is refused,
and a dry run never touches the live engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from sim_support import make_engine, prompt

from bench import oracle
from kvgate.sim import engine as sim_engine
from kvgate.sim.api import Prompt
from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine, play_encoder
from kvgate.sim.request import Request, Sampling
from kvgate.sim.runner import SimRunner
from kvgate.sim.vision import EncoderScheduling, Item

CHAT = Sampling(max_tokens=8, temperature=0.7)


def _long_context(**kw) -> SimConfig:
    """Chunked prefill over a long prefix on a materializing backend: a 60k-token prompt OOMs
    an idle engine (chunk x context fp32 scores), 2k-token prompts do not."""
    return SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        max_model_len=65536,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        attention_backend="materializing",
        **kw,
    )


def _engine(cfg: SimConfig) -> Engine:
    cfg.speedup = 1e9
    return make_engine(cfg)


def _groups(lengths: list[int]) -> list[list[Request]]:
    return [[Request(f"q{i}", prompt(i, n), CHAT, 0.0, stream_seed=i)] for i, n in enumerate(lengths)]


def _admit_and_run(engine: Engine, groups: list[list[Request]]) -> int:
    """Add the groups to the live engine, as the oracle does, and step it until it is done;
    returns the number of finished sequences."""
    finished: list[str] = []
    for g in groups:
        for r in g:
            engine.add(
                Request(
                    r.request_id,
                    list(r.prompt_token_ids),
                    r.sampling,
                    0.0,
                    sink=lambda kind, data: finished.append(kind) if kind == "finish" else None,
                    stream_seed=r.stream_seed,
                )
            )

    async def run() -> None:
        while engine.ready and engine.scheduler.has_work():
            await engine.step()

    asyncio.run(run())
    return len(finished)


def test_a_queue_is_admitted_as_one_batch_and_runs_without_oom() -> None:
    engine = _engine(_long_context())
    groups = _groups([2000, 300, 1500, 800, 2000, 64, 1200, 900, 2000, 400, 700, 1800])
    k, oom, runs = oracle.longest_prefix(engine, groups)
    assert (k, oom, runs) == (len(groups), None, 1)  # one dry run for the whole queue
    assert _admit_and_run(engine, groups) == len(groups)
    assert engine.ooms == []


def test_an_over_large_request_stops_the_prefix_and_never_fits() -> None:
    engine = _engine(_long_context())
    groups = _groups([2000, 1500, 60000, 300, 300])
    k, oom, runs = oracle.longest_prefix(engine, groups)
    assert k == 2
    assert oom is not None
    assert "CUDA out of memory" in oom
    assert runs <= 3  # all, then under the bound the failing dry run gave
    # the head of what is left would OOM an idle engine too: refused, not queued
    assert oracle.would_oom(engine, groups[2], idle=True) is not None
    assert oracle.would_oom(engine, groups[3], idle=True) is None
    assert _admit_and_run(engine, groups[:k]) == k
    assert engine.ooms == []


def test_a_failing_dry_run_condemns_every_longer_prefix() -> None:
    engine = _engine(_long_context())
    groups = _groups([2000, 1500, 60000, 300, 300, 2000])
    msg, bound = oracle.dry_run(engine, groups)
    assert msg is not None
    assert 1 <= bound <= 3
    for k in range(bound, len(groups) + 1):  # the same steps up to the same OOM
        assert oracle.dry_run(engine, groups[:k]) == (msg, bound)
    assert oracle.dry_run(engine, groups[:2]) == (None, 2)


def test_a_dry_run_leaves_the_live_engine_alone() -> None:
    engine = _engine(SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=16384))
    running = _groups([3000, 500, 100])
    for g in running:
        for r in g:
            engine.add(r)
    out = engine.scheduler.schedule()  # a step in flight: its tape has run, tokens uncounted
    engine.carry.start_step([s.request for s in out.scheduled])
    engine.carry.keep_outputs(oracle.run_tape(engine.alloc, engine.steps.plan(Engine.shape(out))))

    def state() -> tuple:
        a = engine.alloc
        return (
            tuple((s.size, tuple((b.offset, b.size, b.allocated) for b in s.blocks)) for s in a.segments),
            dict(engine.device.processes),
            [
                (r.request_id, r.num_computed_tokens, len(r.output_token_ids), r.status)
                for r in (*engine.scheduler.running, *engine.scheduler.waiting)
            ],
            engine.carry.penalty_prompt_ids,
            list(engine.carry.outputs),
        )

    before = state()
    memo = oracle.Memo()
    assert oracle.dry_run(engine, _groups([2000] * 8), out, memo=memo) == (None, 8)
    assert oracle.dry_run(engine, _groups([2000] * 8), out, idle=True) == (None, 8)
    assert state() == before
    assert memo.stops  # end-of-sequence positions remembered for the next check


def test_the_window_keeps_about_two_steps_of_work_in_the_engine() -> None:
    engine = _engine(_long_context())
    entries = [SimpleNamespace(parsed=SimpleNamespace(prompts=[Prompt([1] * 1000, CHAT)], n=1)) for _ in range(10)]
    assert oracle.window(engine, entries) == 5  # 2 x 2048 tokens: the 5th is let in at 96 left
    lists = [SimpleNamespace(parsed=SimpleNamespace(prompts=[Prompt([1] * 1000, CHAT)] * 2, n=1)) for _ in range(10)]
    assert oracle.window(engine, lists) == 3  # a list of two prompts is two prompts' work
    engine.add(Request("doc", prompt(0, 30000), CHAT, 0.0))
    assert oracle.window(engine, entries) == 0  # a long prefill ahead: nothing would start


def test_the_routes_admit_a_burst_and_refuse_what_never_fits() -> None:
    cfg = _long_context(speedup=50.0)
    runner = SimRunner(cfg)
    stats = oracle.install(runner.app, max_wait_s=30.0)
    with runner as sim:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=sim.url, timeout=60) as client:
                bodies = [
                    {"model": "llama-3.1-8b", "prompt": " ".join(["tok"] * n), "max_tokens": 4}
                    for n in [300] * 12 + [62000]
                ]
                return await asyncio.gather(*(client.post("/oracle/v1/completions", json=b) for b in bodies))

        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * 12 + [400]
        assert responses[-1].json()["error"]["code"] == "oracle_never_fits"
        assert sim.engine.ooms == []
    assert stats["admitted"] == 12
    assert stats["never_fits"] == 1
    assert stats["batches"] <= 12
    assert stats["dry_runs"] >= 1
    assert stats["check_ms_total"] >= 0
    assert stats["checks"] >= 1


def test_the_routes_check_whole_vocabulary_prompt_logprobs_where_the_server_allows_them() -> None:
    """On a server started with `--max-logprobs -1`, `prompt_logprobs: -1` is a valid request:
    the oracle must dry-run it like any other (it once parsed with vLLM's default limit of 20,
    let the request through unchecked, and the engine died of it)."""
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=16384, max_logprobs=-1, speedup=50.0)
    runner = SimRunner(cfg)
    stats = oracle.install(runner.app, max_wait_s=30.0)
    with runner as sim:
        body = {"model": "llama-3.1-8b", "prompt": " ".join(["tok"] * 4000), "max_tokens": 1, "prompt_logprobs": -1}
        r = httpx.post(sim.url + "/oracle/v1/completions", json=body, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "oracle_never_fits"
        assert sim.engine.ooms == []
    assert stats["never_fits"] == 1


def test_a_dry_run_plays_the_steps_the_engine_plays_with_shared_prompts() -> None:
    """The n sequences of one request share its prompt: vLLM caches a block when it allocates
    it, so the siblings hit the first one's blocks in the very step it computes them, and a step
    samples all of them. The dry run must batch them the same way, or it sees fewer sampled rows
    (fp32 logits) than the engine then allocates: S8's oracle admitted n = 16 requests that the
    engine OOMed on."""
    engine = _engine(SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192))
    sampling = Sampling(max_tokens=4, temperature=1.0)
    shared = prompt(0, 600)
    siblings = [[Request(f"s{i}", list(shared), sampling, 0.0, stream_seed=i) for i in range(16)]]
    played: list[object] = []
    plan = engine.steps.plan

    def recording(shape: object) -> object:
        played.append(shape)
        return plan(shape)

    engine.steps.plan = recording  # type: ignore[method-assign]
    assert oracle.dry_run(engine, siblings) == (None, 1)
    dry = list(played)
    played.clear()
    assert _admit_and_run(engine, siblings) == 16
    assert len(dry[0].reqs) == 16  # one step computes the prompt once and samples all 16
    assert dry == played[: len(dry)]


def test_a_dry_run_frees_encoder_cache_entries_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine lets an image's encoder output go once its prompt has read it (vLLM
    `_free_encoder_inputs`, kvgate/sim/engine.py `_update`) and when its request finishes
    (Scheduler.finish): the entry becomes freeable and the next image gets the cache's room. A dry
    run that kept every entry saw the cache full and deferred the next images' encoding, so it
    played steps without their encoder activations that the engine then ran: S14's oracle
    admitted an album the engine OOMed on (a 113.91 MiB allocation, session 26's full run)."""
    engine = _engine(
        SimConfig(model="qwen2.5-vl-7b", gpu="h100-80gb", max_model_len=32768, max_num_batched_tokens=8192)
    )
    items = 3888  # a 2,016 x 1,512 photo's tokens: two fill the 8,192-embedding cache
    photos = []
    for i in range(8):
        req = Request(f"p{i}", prompt(i, items + 40), CHAT, 0.0, stream_seed=i)
        req.mm_items = [Item(20, items)]
        photos.append([req])
    encoded: list[list[str]] = []

    def recording(vision: object, encoder: EncoderScheduling, alloc: object, out: object) -> None:
        if encoder.to_encode:
            encoded.append(sorted(encoder.to_encode))
        play_encoder(vision, encoder, alloc, out)  # type: ignore[arg-type]

    monkeypatch.setattr(oracle, "play_encoder", recording)
    monkeypatch.setattr(sim_engine, "play_encoder", recording)
    assert oracle.dry_run(engine, photos) == (None, 8)
    dry = list(encoded)
    encoded.clear()
    for group in photos:
        for r in group:
            engine.add(Request(r.request_id, list(r.prompt_token_ids), r.sampling, 0.0, stream_seed=r.stream_seed))
            engine.scheduler.waiting[-1].mm_items = list(r.mm_items)

    async def run() -> None:
        while engine.ready and engine.scheduler.has_work():
            await engine.step()

    asyncio.run(run())
    assert not engine.ooms
    assert sorted(p for step in encoded for p in step) == [f"p{i}" for i in range(8)]  # every photo encoded
    assert dry == encoded  # the dry run, the same photos in the same steps
