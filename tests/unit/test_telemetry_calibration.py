"""Calibration, pure: the AIMD bounds and triggers, and the blocks-in-use estimate."""

from __future__ import annotations

from kvgate.memory.demand import Demand
from kvgate.telemetry.calibration import Aimd, Calibration, CalibrationConfig, InFlight, blocks_in_use
from kvgate.units import MiB


def demand(prompt: int, max_new: int, hashes: tuple[int, ...], private: int) -> Demand:
    return Demand(prompt, max_new, hashes, private, 0, 0)


def test_aimd_is_bounded_and_holds_after_a_backoff() -> None:
    a = Aimd(1.0, 1.0, 1.5, 0.05, 0.8, hold_s=10, interval_s=1)
    assert a.raise_(0)
    assert a.value == 1.05
    assert not a.raise_(0.5)  # too soon
    for t in range(1, 20):
        a.raise_(t)
    assert a.value == 1.5  # ceiling
    a.backoff(20)
    assert a.value == 1.2
    assert not a.raise_(25)
    for _ in range(10):
        a.backoff(30)
    assert a.value == 1.0  # floor


def test_a_probe_that_fails_soon_doubles_the_hold_and_a_late_one_resets_it() -> None:
    a = Aimd(1.2, 1.0, 1.2, 0.05, 0.8, hold_s=10, interval_s=1, max_hold_s=35)
    a.backoff(0)
    a.backoff(0.25)  # the same episode (no rise in between): the hold stays
    assert a.hold == 10
    assert not a.raise_(10)
    assert a.raise_(10.25)
    a.backoff(15)  # the probe failed within 2 x 10 s
    assert a.hold == 20
    assert not a.raise_(34)
    assert a.raise_(35)
    a.backoff(40)
    assert a.hold == 35  # at most max_hold_s
    assert a.raise_(75)
    a.backoff(200)  # the pool held for long after the probe: back to the base hold
    assert a.hold == 10
    plain = Aimd(1.0, 1.0, 1.5, 0.05, 0.8, hold_s=10, interval_s=1)
    plain.raise_(0)
    plain.backoff(1)
    assert plain.hold == 10  # without max_hold_s the hold never grows


def test_kv_overcommit_starts_high_falls_on_preemption_and_rises_while_requests_wait() -> None:
    c = Calibration(CalibrationConfig(margin=0.1, max_overcommit=1.2, hold_s=10))
    assert c.kv_overcommit == 1.2
    assert c.observe_kv(0, 95, 99, 100, 0, waiting_for_kv=True) is None  # a full pool is no reason
    assert "preemptions" in (c.observe_kv(1, 80, 95, 100, 3, waiting_for_kv=True) or "")
    assert c.kv_overcommit == 1.0
    assert c.kv_error_blocks == -15
    assert c.observe_kv(5, 80, 80, 100, 0, waiting_for_kv=True) is None  # held after the preemption
    assert "up to 1.05" in (c.observe_kv(11, 90, 90, 100, 0, waiting_for_kv=True) or "")
    assert c.observe_kv(13, 90, 90, 100, 0, waiting_for_kv=False) is None  # nobody waits
    assert c.kv_overcommit == 1.05
    for t in range(20, 30):
        c.observe_kv(t, 90, 99, 100, 0, waiting_for_kv=True)
    assert c.kv_overcommit == 1.2  # the ceiling


def test_kv_overcommit_one_never_reserves_beyond_the_pool() -> None:
    c = Calibration(CalibrationConfig(margin=0.1, max_overcommit=1.0))
    for t in range(30):
        c.observe_kv(t, 50, 50, 100, 0, waiting_for_kv=True)
    assert c.kv_overcommit == 1.0


def test_transient_margin_backs_off_on_oom_and_unpredicted_growth_then_relaxes_to_the_floor() -> None:
    c = Calibration(CalibrationConfig(margin=0.1, max_margin=0.6, hold_s=1))
    assert c.transient_margin == 0.1
    assert c.oom_restart(0) == 0.28  # 1 - 0.9 x 0.8
    why = c.observe_transient(
        1, server_growth=900 * MiB, predicted_peak=100 * MiB, tolerance=200 * MiB, waiting_for_transient=False
    )
    assert why
    assert "grew 900 MiB" in why
    assert c.transient_error_bytes == 800 * MiB
    for t in range(2, 40):
        c.oom_restart(t)
    assert c.transient_margin == 0.6  # bounded
    for t in range(100, 400, 2):
        c.observe_transient(t, 0, 0, 1, waiting_for_transient=True)
    assert c.transient_margin == 0.1  # never below the configured margin
    c.observe_transient(500, 0, 0, 1, waiting_for_transient=False)
    assert c.transient_margin == 0.1


def test_blocks_in_use_counts_shared_prefixes_once_and_grows_with_output() -> None:
    # 200-token prompt, block 128: one full (shared) prompt block; 300 new tokens -> 4 blocks in all.
    a = InFlight(demand(200, 300, (11,), 3), admitted_at=0.0)
    b = InFlight(demand(200, 300, (11,), 3), admitted_at=0.0)
    assert blocks_in_use([a, b], 128, now=0.0, decode_tokens_per_s=None) == 1 + 2 * 1
    # 100 tokens/s for 1 s: 300 tokens -> 3 blocks each, the prefix still once.
    assert blocks_in_use([a, b], 128, now=1.0, decode_tokens_per_s=100) == 1 + 2 * 2
    assert blocks_in_use([a, b], 128, now=60.0, decode_tokens_per_s=100) == 1 + 2 * 3
    # Without prefix caching every block is private: ceil(200/128) = 2 now, 4 at the end.
    c = InFlight(demand(200, 300, (), 4), admitted_at=0.0)
    assert blocks_in_use([c, c], 128, now=0.0, decode_tokens_per_s=None) == 4
    assert blocks_in_use([], 128, 0.0, None) == 0


def test_one_unexplained_growth_backs_off_once_not_at_every_reading() -> None:
    """The growth is cumulative over an engine life: the allocator keeps what one step took."""
    c = Calibration(CalibrationConfig(margin=0.1, max_margin=0.6))
    seen = dict(predicted_peak=100 * MiB, tolerance=200 * MiB, waiting_for_transient=False)
    assert c.observe_transient(1, server_growth=900 * MiB, **seen)
    once = c.transient_margin
    for t in range(2, 10):
        assert c.observe_transient(t, server_growth=900 * MiB, **seen) is None
    assert c.transient_margin == once
    assert c.observe_transient(10, server_growth=1500 * MiB, **seen)  # new, larger growth
    assert c.transient_margin > once
    c.new_life()  # a restart: its allocator starts empty, so the same growth is news again
    assert c.observe_transient(11, server_growth=900 * MiB, **seen)


def test_growth_is_judged_against_the_profile_region_at_its_segments_size() -> None:
    """S13: a 400 MiB profile region comes back as 480 MiB of segments; growth up to that, the
    unprofiled peak and 64 MiB is explained, beyond it the margin backs off."""
    from kvgate.telemetry.calibration import growth_tolerance, region_segments

    assert region_segments(400 * MiB, 0.2) == 480 * MiB
    assert region_segments(400 * MiB, 0.0) == 400 * MiB  # --expandable-segments
    tolerance = growth_tolerance(547 * MiB)
    assert tolerance == 64 * MiB
    predicted = 11 * MiB + region_segments(400 * MiB, 0.2)
    c = Calibration(CalibrationConfig(margin=0.1))
    assert c.observe_transient(0.0, 528 * MiB, predicted, tolerance, False) is None
    assert "server memory grew 560 MiB" in (c.observe_transient(1.0, 560 * MiB, predicted, tolerance, False) or "")


def test_the_segment_overhead_rises_to_what_the_gpu_shows_and_never_falls() -> None:
    """S13's repeat runs: the server grew 528 MiB while kvgate held at most 11 MiB of unprofiled
    terms, so the 400 MiB profile region took 517 MiB of segments, more than the replay's 480."""
    c = Calibration(CalibrationConfig(margin=0.1))
    assert c.observe_region(480 * MiB, 0, 400 * MiB, 0.2) is None  # the replay's own figure
    assert c.observe_region(470 * MiB, 11 * MiB, 400 * MiB, 0.2) is None
    reason = c.observe_region(528 * MiB, 11 * MiB, 400 * MiB, 0.2)
    assert reason is not None
    assert "took 517 MiB of segments" in reason
    assert round(c.segment_overhead, 4) == round(517 / 400 - 1, 4)
    assert c.observe_region(500 * MiB, 0, 400 * MiB, 0.2) is None  # less growth later: kept
    c.new_life()
    assert round(c.segment_overhead, 4) == round(517 / 400 - 1, 4)  # a property of the workload
    assert c.observe_region(10**9, 0, 0, 0.2) is None  # no profile peak known: nothing to learn


def test_the_sampler_overhead_relaxes_after_readings_of_slack_and_is_whole_again_at_a_near_miss() -> None:
    """Counted in readings, not seconds: the same evidence at any speed-up. A 304 MiB headroom
    (benchmark S9's), a 274 MiB limit: half the margin is 15 MiB of free memory."""
    c = Calibration(CalibrationConfig(margin=0.1))
    headroom, limit = 304 * MiB, 274 * MiB
    scale = c.sampler_overhead
    for _ in range(7):  # requests wait, the engine reserved 150 MiB at most: slack, not yet enough
        assert c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=True) is None
    assert scale.value == 1.0
    reason = c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=True)
    assert reason is not None
    assert "0.75" in reason
    # nothing waits: no evidence that the charge binds, and the run of slack starts again
    assert c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=False) is None
    for _ in range(8):
        c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=True)
    assert scale.value == 0.5
    # the engine's reserved memory reached three quarters of the limit: no slack, no change
    for _ in range(20):
        c.observe_slack(210 * MiB, headroom, 94 * MiB, limit, waiting_for_transient=True)
    assert scale.value == 0.5
    # near-miss: 14 MiB free, under half the 30 MiB margin: whole again, and twice the evidence
    assert c.observe_slack(290 * MiB, headroom, 14 * MiB, limit, waiting_for_transient=True) is not None
    assert scale.value == 1.0
    for _ in range(15):
        c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=True)
    assert scale.value == 1.0
    c.observe_slack(150 * MiB, headroom, 154 * MiB, limit, waiting_for_transient=True)
    assert scale.value == 0.75


def test_the_sampler_overhead_never_relaxes_below_its_floor_and_an_oom_restores_it() -> None:
    c = Calibration(CalibrationConfig(margin=0.1))
    for _ in range(200):
        c.observe_slack(0, 300 * MiB, 300 * MiB, 270 * MiB, waiting_for_transient=True)
    assert c.sampler_overhead.value == c.sampler_overhead.low == 0.25
    c.oom_restart(now=0.0)
    assert c.sampler_overhead.value == 1.0
    assert c.observe_slack(0, 300 * MiB, 300 * MiB, None, waiting_for_transient=True) is None  # no limit known
