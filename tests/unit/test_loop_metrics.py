"""kvgate's per-request counters and histograms (kvgate.metrics LoopCounter, LoopHistogram) write
the /metrics page prometheus_client's Counter and Histogram write for the same events."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvgate.metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 1.0, 64.0)
# Bounds themselves (Prometheus' `le` takes them), between, below the first, beyond the last.
VALUES = (0.0, 0.001, 0.0011, 0.01, 0.5, 1.0, 64.0, 64.5, 1e9, 0.0002)


def page(registry: CollectorRegistry) -> str:
    """The page with each `_created` timestamp blanked: they differ by when each was made."""
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


def test_a_loop_counter_writes_the_counters_page() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("kvgate_decisions", "Decisions.", ["decision", "reason"], registry=theirs)
    loop = LoopCounter("kvgate_decisions", "Decisions.", ["decision", "reason"], registry=ours)
    for labels in (("admit", "fits"), ("reject", "too_long"), ("admit", "fits"), ("queue", "kv_busy")):
        counter.labels(*labels).inc()
        loop.inc(*labels)
    assert page(ours) == page(theirs)
    assert ours.get_sample_value("kvgate_decisions_total", {"decision": "admit", "reason": "fits"}) == 2
    assert ours.get_sample_value("kvgate_decisions_total", {"decision": "queue", "reason": "kv_busy"}) == 1


def test_an_unused_loop_counter_writes_its_header_only() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    Counter("kvgate_releases", "Releases.", ["outcome"], registry=theirs)
    LoopCounter("kvgate_releases", "Releases.", ["outcome"], registry=ours)
    assert page(ours) == page(theirs)


def test_a_loop_histogram_writes_the_histograms_page() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("kvgate_wait_seconds", "Waits.", buckets=BUCKETS, registry=theirs)
    loop = LoopHistogram("kvgate_wait_seconds", "Waits.", buckets=BUCKETS, registry=ours)
    assert page(ours) == page(theirs)  # nothing observed yet
    for value in VALUES:
        histogram.observe(value)
        loop.observe(value)
    assert page(ours) == page(theirs)
    assert ours.get_sample_value("kvgate_wait_seconds_bucket", {"le": "0.001"}) == 3  # 0.0, 0.0002 and the bound
    assert ours.get_sample_value("kvgate_wait_seconds_count") == len(VALUES)


def test_a_name_taken_twice_on_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    LoopCounter("kvgate_decisions", "Decisions.", ["decision"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        LoopHistogram("kvgate_decisions", "Again.", buckets=BUCKETS, registry=registry)
