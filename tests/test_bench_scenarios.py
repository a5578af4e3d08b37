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
