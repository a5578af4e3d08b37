"""The README is the front door: it must document every flag and metric kvgate really has."""

from __future__ import annotations

from pathlib import Path

from kvgate.metrics import KvgateMetrics
from kvgate.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_serve_flag_is_documented() -> None:
    missing = [n for n in Settings.model_fields if f"--{n.replace('_', '-')}" not in README]
    assert missing == []


def test_every_kvgate_metric_is_documented() -> None:
    families = {m.name for m in KvgateMetrics().registry.collect()}
    names = {f"{f}_total" if f"{f}_total" in README else f for f in families}
    assert sorted(n for n in names if n not in README) == []


def test_readme_gives_the_two_commands() -> None:
    assert "make demo" in README and "make test" in README
