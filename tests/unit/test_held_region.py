"""The transient safety margin covers what kvgate predicts, not the profile region's segments the
engine already took and kept (kvgate/gate/budget.py transient_limit, kvgate/telemetry/calibration.py
region_held): benchmark S13 (issue 24), where a 10 % margin on a region the engine held kept any
request from fitting beside one long document's full-size step."""

from __future__ import annotations

from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.demand import Demand
from kvgate.telemetry.calibration import Calibration, CalibrationConfig, growth_tolerance, region_held, region_segments
from kvgate.units import MiB

# S13's kvgate readings (bench/results/goodput-session27/s4s13/s13-before2.json): V2 with a fixed
# pool, its 200 MiB profile forward pass emptied whole (profiled_cap = the profile peak), a live
# headroom of 316,837,725 B, and the server grown 294 MiB with no unprofiled terms in flight.
HEADROOM = 316_837_725
PROFILE = 200 * MiB
OVERHEAD = 0.47
GROWTH = 294 * MiB


def s13_budget(held: int) -> Budget:
    return Budget(
        transient_headroom_bytes=HEADROOM,
        transient_margin=0.1,
        profiled_peak_bytes=PROFILE,
        profiled_cap_bytes=PROFILE,
        learned_segment_overhead=OVERHEAD,
        profiled_forward_bytes=PROFILE,
        forward_bytes_per_token=PROFILE // 2048,
        held_region_bytes=held,
    )


def request(profiled: int = 0, unprofiled: int = 0) -> Demand:
    return Demand(
        prompt_tokens=64,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=1,
        transient_prefill_bytes=unprofiled,
        profiled_prefill_bytes=profiled,
    )


def s13_held() -> int:
    return region_held(GROWTH, 0, region_segments(PROFILE, OVERHEAD))


def test_the_region_held_is_the_growth_beyond_the_unprofiled_peak_up_to_the_region_charged() -> None:
    region = region_segments(PROFILE, OVERHEAD)
    assert region == 308_281_344  # 200 MiB at 1.47
    assert s13_held() == GROWTH  # all of the growth: no unprofiled terms were in flight
    assert region_held(GROWTH, 10 * MiB, region) == GROWTH - 10 * MiB  # kvgate's own terms are not the region
    assert region_held(400 * MiB, 0, region) == region  # never more than the region charged
    assert region_held(5 * MiB, 10 * MiB, region) == 0
    # V1 (the engine holds its region at start-up, profiled_cap 0): nothing is credited
    assert region_held(GROWTH, 0, region_segments(0, OVERHEAD)) == 0


def test_a_chat_fits_beside_a_full_size_step_once_the_engine_holds_its_segments() -> None:
    """One long document in flight prefills at the step's cap: the forward phase charges the whole
    profile forward pass at its segments (294 MiB) whatever else runs. Against the headroom less
    10 % (272 MiB) nothing fits beside it; the engine has held those 294 MiB, so only the rest of
    the headroom keeps the margin, and a short chat goes in."""
    document = request(profiled=PROFILE)
    chat = request(unprofiled=4096)
    before = s13_budget(held=0)
    ledger = Ledger()
    assert before.shortfall(document, ledger) is None  # alone: its allocated bytes
    ledger.reserve(document)
    assert before.transient_charge(ledger) == region_segments(PROFILE, OVERHEAD)
    assert before.shortfall(chat, ledger) == TRANSIENT_BUSY
    after = s13_budget(held=s13_held())
    assert after.shortfall(chat, ledger) is None
    assert after.transient_limit() == GROWTH + int((HEADROOM - GROWTH) * 0.9)


def test_what_kvgate_predicts_beyond_the_held_region_still_has_the_margin() -> None:
    """The unprofiled bytes are kvgate's prediction: beside the held region they fit only in the
    rest of the headroom less the margin, never in the margin itself."""
    budget = s13_budget(held=s13_held())
    ledger = Ledger()
    ledger.reserve(request(profiled=PROFILE))
    region = region_segments(PROFILE, OVERHEAD)
    rest = HEADROOM - GROWTH
    room = GROWTH + int(rest * 0.9) - region  # beside the whole region charged
    assert budget.shortfall(request(unprofiled=room), ledger) is None
    assert budget.shortfall(request(unprofiled=room + rest // 20), ledger) == TRANSIENT_BUSY
    # a step with no profiled bytes gets no credit: its unprofiled bytes keep the margin whole
    unprofiled_only = Ledger()
    assert budget.shortfall(request(unprofiled=int(HEADROOM * 0.9)), unprofiled_only) is None
    assert budget.shortfall(request(unprofiled=int(HEADROOM * 0.95)), unprofiled_only) == TRANSIENT_BUSY


def test_stale_readings_still_scale_the_held_region_down() -> None:
    budget = s13_budget(held=s13_held())
    full = budget.transient_limit()
    assert full is not None
    budget.update(scale=0.5)
    assert budget.transient_limit() == (GROWTH + (HEADROOM - GROWTH) * 0.9) * 0.5 // 1


def test_the_never_fits_ceiling_is_unchanged_by_the_held_region() -> None:
    assert s13_budget(held=s13_held()).max_transient_limit() == s13_budget(held=0).max_transient_limit()


def test_the_prediction_error_counts_the_region_as_predicted_not_as_an_under_prediction() -> None:
    """kvgate_transient_prediction_error_bytes: S13's server grew 294 MiB for the region's
    segments with no unprofiled term in flight; that growth is what kvgate charges, error <= 0,
    where it used to read +294 MiB. Growth beyond the region and the tolerance backs off."""
    c = Calibration(CalibrationConfig(margin=0.1))
    predicted = 0 + region_segments(PROFILE, OVERHEAD)
    assert c.observe_transient(0.0, GROWTH, predicted, growth_tolerance(HEADROOM), False) is None
    assert c.transient_error_bytes == GROWTH - predicted
    assert c.transient_error_bytes <= 0
    grown = predicted + growth_tolerance(HEADROOM) + 1
    assert "transient margin up to" in (
        c.observe_transient(1.0, grown, predicted, growth_tolerance(HEADROOM), False) or ""
    )
