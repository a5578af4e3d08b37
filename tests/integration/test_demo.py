"""The demo's scenarios (docs/demo.md) at reduced size: the simulated vLLM dies of OOM without kvgate and
lives with it, and every request through kvgate completes or gets a clean 4xx/429."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from demo.replay import SCENARIOS, Call, document, main, run_scenario

DEMO_DOC = Path(__file__).resolve().parents[2] / "docs" / "demo.md"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.key for s in SCENARIOS])
def test_demo_scenario_dies_without_kvgate_and_survives_with_it(scenario) -> None:
    res = run_scenario(scenario, quick=True)
    assert res.direct_oom
    assert "CUDA out of memory. Tried to allocate" in res.direct_oom
    assert any(o.status != 200 for o in res.direct)  # requests failed with the engine
    if not res.direct_startup_failed:
        assert any(o.status == 500 for o in res.direct)
    assert res.gated_ooms == []
    assert all(o.status in (200, 400, 429) for o in res.gated), [
        (o.call.label, o.status, o.message) for o in res.gated if o.status not in (200, 400, 429)
    ]
    assert any(o.status == 200 for o in res.gated)
    for o in res.gated:
        if o.status in (400, 429):
            assert o.message  # vLLM-shaped error body with a message
    assert any(dec == "admit" for dec, _ in res.decisions)
    # it held something back: refused it, or (a batch vLLM serves once the pool is free) queued it
    assert any(dec in ("reject", "queue") for dec, _ in res.decisions)


def _prompt_past_the_profile_stand_in(rng: random.Random, quick: bool) -> list[Call]:
    return [document(rng, "deepseek-v2-lite", 48000)]


def test_mla_prompt_past_the_profile_stand_in_never_ooms() -> None:
    """A 48k-token document: its last chunks up-project ~46k tokens of context, more than the
    profile's [W, heads, nope + v] stand-in covered; through kvgate it never OOMs the engine."""
    scenario = replace(SCENARIOS[0], workload=_prompt_past_the_profile_stand_in)
    res = run_scenario(scenario, quick=True)
    assert res.gated_ooms == []


def _documented_printout() -> str:
    section = DEMO_DOC.read_text().split("## What `make demo` prints", 1)[1]
    return section.split("```\n", 2)[1]


def _timing_aside(printout: str) -> str:
    """The run's duration, the Retry-After kvgate derives from the drain rate it measured, and
    which of the requests admitted from the queue passed a waiting head (backfilling predicts
    from the pace it measured) are the machine's (wall-clock); everything else is the seed's."""
    printout = re.sub(r"^done in [0-9.]+ s", "done in <time> s", printout, flags=re.M)
    printout = re.sub(r"^.*admit (?:backfilled|dequeued): .*$", _from_the_queue, printout, flags=re.M)
    return re.sub(r"Retry after [0-9]+ s\.", "Retry after <drain> s.", printout)


def _from_the_queue(line: re.Match[str]) -> str:
    """A decisions line with its backfilled and dequeued admissions as one count."""
    counts = {k: int(n) for k, n in re.findall(r"admit (backfilled|dequeued): (\d+)", line[0])}
    rest = re.sub(r"admit (?:backfilled|dequeued): \d+(?:, )?", "", line[0])
    return f"{rest} [admitted from the queue: {sum(counts.values())}]"


def test_make_demo_prints_exactly_what_docs_demo_shows(capsys) -> None:
    """The whole demo, as `make demo` runs it: same counts, same messages, every run."""
    assert main([]) == 0
    printed = capsys.readouterr().out
    assert _timing_aside(printed) == _timing_aside(_documented_printout())
