"""kvgate's one view of the backend: its status, and the Retry-After it gives while the
backend is out, learned from how long the backend's recent outages lasted."""

from __future__ import annotations

from kvgate.gate.backend_state import UNKNOWN_OUTAGE_RETRY_S, BackendState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_until_an_outage_has_ended_the_retry_after_is_the_default() -> None:
    clock = Clock()
    backend = BackendState("up", clock=clock)
    backend.set("down", "connection refused")
    clock.now += 40
    assert backend.retry_after_s() == UNKNOWN_OUTAGE_RETRY_S


def test_the_retry_after_is_the_longest_recent_outage_less_the_time_this_one_lasted() -> None:
    clock = Clock()
    backend = BackendState("starting", clock=clock)
    clock.now += 300  # kvgate's own start (waiting for vLLM to load) is no outage
    backend.set("up")
    for lasted in (62.0, 58.5):  # two restarts after OOMs
        backend.set("down", "connection refused")
        clock.now += lasted
        backend.set("up")
        clock.now += 100
    assert list(backend.outages_s) == [62.0, 58.5]
    backend.set("down", "connection refused")
    clock.now += 20
    assert backend.retry_after_s() == 42
    backend.set("hung", "no answer")  # the same outage: still timed from its start
    clock.now += 41.5
    assert backend.retry_after_s() == 1
    clock.now += 5  # longer than any seen: kvgate cannot know
    assert backend.retry_after_s() == UNKNOWN_OUTAGE_RETRY_S
    backend.set("up")
    assert backend.outages_s[-1] == 66.5


def test_only_the_last_few_outages_count() -> None:
    clock = Clock()
    backend = BackendState("up", clock=clock)
    for lasted in (600.0, 30.0, 30.0, 30.0, 30.0, 30.0):  # the first (a cold image pull) ages out
        backend.set("down")
        clock.now += lasted
        backend.set("up")
    backend.set("down")
    assert backend.retry_after_s() == 30
