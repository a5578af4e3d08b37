"""The benchmark scenarios' premises, checked against the simulator they run on: a change to the
simulator's start-up moves what is free after it, and a scenario built on the old figure then
silently stops testing what its title says (S6 stopped OOMing without a gate that way)."""

from __future__ import annotations

from dataclasses import replace

from sim_support import make_engine

from bench.scenarios import SCENARIOS


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
