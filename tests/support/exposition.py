"""A /metrics page read as its consumers read it: Prometheus' own Go text parser (the one llm-d's
endpoint picker and Prometheus use) and prometheus_client's Python parser.

The Go parser is prometheus/common's expfmt.TextParser, run by `promtool check metrics` (Debian's
prometheus package; `make promtool` puts the binary in .tools/). promtool exits 1 when the page
does not parse, 3 when it parses but breaks a naming convention (vLLM's own `vllm:` names do:
"metric names should not contain ':'"), 0 when neither.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PROMTOOL = Path(__file__).resolve().parents[2] / ".tools" / "promtool"
PARSED, LINT_ONLY = 0, 3  # promtool's exit codes for a page that parses


def promtool() -> str:
    found = str(PROMTOOL) if PROMTOOL.exists() else shutil.which("promtool")
    if found is None:
        pytest.fail(f"{PROMTOOL} is missing: run `make promtool` (Debian's prometheus package).", pytrace=False)
    return found


def go_parse_error(page: str) -> str | None:
    """None when Prometheus' Go parser accepts the page, else what it said."""
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=page, capture_output=True, text=True, timeout=30, check=False
    )
    return None if done.returncode in (PARSED, LINT_ONLY) else f"exit {done.returncode}: {done.stderr.strip()}"


def python_samples(page: str) -> list[Sample]:
    """Every sample, through prometheus_client's parser (raises on a page it cannot read)."""
    return [s for family in text_string_to_metric_families(page) for s in family.samples]


def declared_types(page: str) -> Counter[str]:
    """How many `# TYPE` lines declare each family."""
    return Counter(line.split(" ")[2] for line in page.splitlines() if line.startswith("# TYPE "))
