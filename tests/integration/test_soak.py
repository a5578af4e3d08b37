"""The soak (bench/soak.py), short: the same mix of normal, disconnecting and hostile clients, with
the backend SIGKILLed and SIGSTOPped, through kvgate and a simulator started as subprocesses.

It asserts what a short run on a shared machine can assert honestly: no 5xx of kvgate's own,
every request answered or hung up by its client, every hostile body a 4xx, the ledger back to 0
and every admission released. RSS and fd growth and /healthz latency need the long run
(`python -m bench --soak`, docs/benchmarks.md): a few hundred requests are all warm-up.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import soak


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """At log level info, so that a failure can quote what kvgate decided about the request; its
    and the simulator's logs are kept in pytest's temporary folder (the path is in the message)."""
    logs = tmp_path_factory.mktemp("soak-logs")
    summary = soak.summary(
        soak.run_soak(requests=400, concurrency=16, seed=3, hang_s=2.0, logs_dir=logs, log_level="info")
    )
    return summary | {"logs_dir": str(logs)}


def story(examples: list[dict], log: list[str], logs_dir: str) -> str:
    """A failed request as the one who must fix it needs it: the answers, then kvgate's log
    records about them (tracebacks whole), then where the full logs are."""
    lines = [json.dumps(e) for e in examples]
    return "\n".join([*lines, "--- kvgate's log about them:", *log, f"--- full logs: {logs_dir}"])


def test_no_kvgate_5xx_and_every_request_answered(short_soak: dict) -> None:
    assert short_soak["kvgate_5xx"] == 0, story(
        short_soak["kvgate_5xx_examples"], short_soak["kvgate_5xx_log"], short_soak["logs_dir"]
    )
    assert short_soak["no_answer"] == 0, short_soak["no_answer_examples"]
    answered = {k: v for k, v in short_soak["by_outcome"].items() if k.isdigit() or k == "client disconnect"}
    assert sum(answered.values()) == 400, short_soak["by_outcome"]
    assert short_soak["by_outcome"].get("200", 0) > 100  # it did serve, between the faults


def test_every_hostile_body_gets_a_4xx(short_soak: dict) -> None:
    """A malformed or abusive request gets a 4xx; a memory-hostile body is bounded, not refused
    for its size alone: it gets a 4xx, or a 200 where it fits and vLLM would serve it (the tests'
    template renders no tools, so 160,000 tools make a short prompt). Admitted, it meets the
    backend's faults as a normal request does: a 502/503/504 then, which the 5xx test above
    counts unless it is the honest answer to the fault, given while the fault lasted."""
    by_variant = short_soak["hostile_by_variant"]
    allowed = {v: ("4", "200", "502", "503", "504") if v in soak.MEMORY_BODIES else ("4",) for v in by_variant}
    outcomes = Counter(o for v in by_variant.values() for o in v)
    wrong = {v: seen for v, seen in by_variant.items() if any(not o.startswith(allowed[v]) for o in seen)}
    assert outcomes, wrong
    assert not wrong, wrong


def test_ledger_is_empty_after_the_soak(short_soak: dict) -> None:
    assert short_soak["ledger_after"] == dict.fromkeys(soak.LEDGER, 0.0)
    assert short_soak["admitted"] == short_soak["released"] > 0
    assert short_soak["releases_by_outcome"].get("disconnected", 0) > 0


def test_both_faults_happened_during_the_load(short_soak: dict) -> None:
    assert short_soak["kill"]["restart_s"] is not None
    # kvgate saw the hang. The closed-loop clients may all be stuck on requests forwarded before
    # it could tell (none then arrives during the hang: a loaded machine did that), so the hang's
    # arrivals are the probes, sent once /readyz said 503: they waited in kvgate's queue and were
    # served after it.
    assert short_soak["hang"]["declared_after_s"] is not None
    assert short_soak["hang"]["max_queue_depth"] > 0
    assert short_soak["hang"]["probes"] == {"200": soak.HANG_PROBES}
