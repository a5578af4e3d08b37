"""The benchmark scenarios' premises, checked against the simulator they run on: a change to the
simulator's start-up moves what is free after it, and a scenario built on the old figure then
silently stops testing what its title says (S6 stopped OOMing without a gate that way)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from sim_support import make_engine

from bench.__main__ import scenarios_from
from bench.scenarios import SCENARIOS
from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape


def test_s6_co_tenant_fits_beside_the_engine_and_leaves_less_than_its_profiled_peak() -> None:
    """Every step of the co-tenant starts (the simulator starts a step only if the device has
    it), and once grown it leaves the engine less than the activation peak its own start-up
    profile measured: a step as large as the profile's can then OOM."""
    s6 = next(s for s in SCENARIOS if s.key == "S6")
    engine = make_engine(replace(s6.sim, cotenants=[], speedup=1e9))
    free_after_start = engine.device.free()
    grown = sum(c.bytes for c in s6.sim.cotenants)
    assert grown <= free_after_start
    assert free_after_start - grown < engine.report.activation_peak


def test_s11_leaves_room_for_one_step_of_v2_prompt_logprobs_but_not_for_several_held() -> None:
    """S11's premise, from the simulator's start-up and kvgate's reading of V2 (issue #27): the
    memory outside the engine's budget holds one 2,048-token step of `prompt_logprobs: -1` (two
    sub-chunks' logits, the step's results and their concatenation), not a 6,000-token passage's
    earlier steps held beside its last step's LogprobsTensors.cat."""
    from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient
    from kvgate.memory.geometry import ModelGeometry

    s11 = next(s for s in SCENARIOS if s.key == "S11")
    engine = make_engine(replace(s11.sim, speedup=1e9))
    assert engine.resolved.flavor.v2
    free = engine.device.free()  # the profile's region was emptied after start-up
    llama = ModelGeometry(32, 32, 8, 128, 4096, 14336, 128256, 2, 131072)
    shape = EngineShape(16384, 2048, 256, runner="v2")

    def need(prompt: int) -> int:
        est = estimate_transient(llama, shape, prompt, SamplingShape(prompt_logprobs=-1))
        return sum(t.bytes for t in est.terms if t.name.startswith("prompt_logprobs"))

    assert need(1500) < free < need(6000)


@pytest.mark.parametrize(("key", "document"), [("S12", {"logprobs": 5}), ("S13", {"processes": True})])
def test_head_of_line_documents_make_a_400_row_step_run_out_and_only_they(key: str, document: dict) -> None:
    """S12/S13's premise (issue 24: a judged scenario must OOM the unprotected engine): on the
    engine as it starts, a decoding step of 400 chat rows (the batch job) beside one document
    runs the GPU out, because of what the document asks (V1: raw logprobs of every row; V2: every
    row's logits copied to fp32); the same 400 rows beside a document that asks neither fit."""
    scenario = next(s for s in SCENARIOS if s.key == key)
    seed = {"seeded": True, "random": True, "processes": False}  # chats at temperature 1.0, seeded

    def step(**doc: object) -> StepShape:
        rows = [ReqSlice(1, 300, **seed) for _ in range(400)]
        return StepShape((*rows, ReqSlice(1, 16000, **{**seed, **doc})))

    engine = make_engine(replace(scenario.sim, speedup=1e9))
    for block in run_tape(engine.alloc, engine.steps.plan(step())):
        engine.alloc.free(block)
    with pytest.raises(CudaOutOfMemory):
        run_tape(engine.alloc, engine.steps.plan(step(**document)))


@pytest.mark.parametrize("name", ["non_streaming.py", "non_streaming_heldout.py"])
def test_a_non_streaming_variant_plays_its_scenarios_very_calls_without_stream(name: str) -> None:
    """`S8n` / `H1n` must be S8's / H1's traffic, call for call, so a comparison with the streaming
    run measures the missing first token and nothing else: same place in the list (the seed is the
    index), same times, paths and bodies but for `stream` and `stream_options`."""
    heldout = Path(__file__).parents[1] / "heldout"
    plain = scenarios_from(heldout / name)
    streaming = SCENARIOS if name == "non_streaming.py" else scenarios_from(heldout / "scenarios.py")
    assert [s.key for s in plain] == [f"{s.key}n" for s in streaming]
    for original, variant in zip(streaming, plain, strict=True):
        calls = original.traffic(random.Random(7), 0.1)
        assert calls, original.key
        for call, bare in zip(calls, variant.traffic(random.Random(7), 0.1), strict=True):
            assert "stream" not in bare.body
            assert "stream_options" not in bare.body
            expected = {k: v for k, v in call.body.items() if k not in ("stream", "stream_options")}
            assert (bare.at, bare.path, bare.body) == (call.at, call.path, expected)


def test_h8s_and_h8b_play_h8s_very_calls() -> None:
    """`H8s` must send H8's calls with each list of prompts as one call per prompt at the list's
    time, and `H8b` H8's calls unchanged (only the engine's step size differs), so that their
    comparisons with H8 measure the lists' grouping and the step size, and nothing else."""
    heldout = Path(__file__).parents[1] / "heldout"
    heldouts = scenarios_from(heldout / "scenarios.py")
    index = [s.key for s in heldouts].index("H8")
    h8 = heldouts[index]
    split = scenarios_from(heldout / "prompt_lists_split.py")
    big = scenarios_from(heldout / "prompt_lists_8192.py")
    assert split[index].key == "H8s"
    assert big[index].key == "H8b"
    assert big[index].sim.max_num_batched_tokens == 8192
    calls = h8.traffic(random.Random(7), 0.2)
    assert any(isinstance(c.body["prompt"], list) for c in calls if c.path == "/v1/completions")
    assert [(c.at, c.body) for c in big[index].traffic(random.Random(7), 0.2)] == [(c.at, c.body) for c in calls]
    expected = [
        (c.at, {**c.body, "prompt": p})
        for c in calls
        for p in (c.body["prompt"] if isinstance(c.body.get("prompt"), list) else [c.body.get("prompt")])
    ]
    played = [
        (c.at, c.body if "prompt" in c.body else {**c.body, "prompt": None})
        for c in split[index].traffic(random.Random(7), 0.2)
    ]
    assert played == expected


def test_random_scenarios_are_a_function_of_their_index_and_each_engine_starts() -> None:
    """bench/random_scenarios.py: the same index draws the same engine, flags and traffic on
    every machine (a hunt's finding is replayed from its name), different indexes differ, and
    every drawn engine starts on the simulator (a draw that would not is drawn again)."""
    from bench import random_scenarios

    def drawn(index: int) -> tuple[object, list[str], list[tuple[float, str, str]]]:
        scenario = random_scenarios.scenario(index)
        calls = scenario.traffic(random.Random(7), 0.2)
        return scenario.sim, scenario.kvgate_flags, [(c.at, c.path, repr(sorted(c.body.items()))) for c in calls]

    assert drawn(3) == drawn(3)
    assert len({repr(drawn(i)[:2]) for i in range(8)}) == 8
    for index in range(8):
        scenario = random_scenarios.scenario(index)
        make_engine(replace(scenario.sim, speedup=1e9))  # raises StartupError where vLLM would not start
        assert {c.body["model"] for c in scenario.traffic(random.Random(1), 0.2)} == {scenario.sim.model}
