"""The repository stands alone: nothing in the code, tests, benchmarks or docs reads or cites a
file outside it, and every `docs/sources.md#...` citation names a section that exists.

A user's clone has nothing beside it; a path that only the development machine has turns into a
collection error or a dead reference there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [
    *sorted((ROOT / "kvgate").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted((ROOT / "bench").glob("*.py")),
    *sorted((ROOT / "scripts").glob("*")),
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "README.md",
    ROOT / "Makefile",
]
# Host paths a development machine has and a clone does not. Paths inside the images (/opt/kvgate,
# the vLLM container's /home/vllm) are the image's own.
HOST_PATH = re.compile(r"""(?<![\w.])/(work|root|mnt|shared|home/(?!vllm\b)[\w.-]+)/""")
RELATIVE_UP = re.compile(r"""(?:^|[\s"'`(\[])((?:\.\./)+[\w.\-/]*)""")
CLIMBS_OUT = re.compile(r"""\bROOT\.parent\b|parents\[[2-9]\]\s*\.parent""")
SOURCE_CITATION = re.compile(r"docs/sources\.md#([a-z0-9\-]+)")


def _lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(errors="replace").splitlines(), start=1))


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(path: Path) -> None:
    outside = []
    for number, line in _lines(path):
        if HOST_PATH.search(line) or CLIMBS_OUT.search(line):
            outside.append(f"{number}: {line.strip()}")
        for ref in RELATIVE_UP.findall(line):
            target = (path.parent / ref).resolve()
            if not target.is_relative_to(ROOT):
                outside.append(f"{number}: {line.strip()}")
    assert not outside, f"{path.relative_to(ROOT)} names paths outside the repository:\n" + "\n".join(outside)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    heads = re.findall(r"^#+\s+(.+)$", markdown, flags=re.M)
    return {re.sub(r"[^a-z0-9\- ]", "", h.lower()).strip().replace(" ", "-") for h in heads}


def test_every_source_citation_names_a_section_of_docs_sources() -> None:
    anchors = _anchors((ROOT / "docs" / "sources.md").read_text())
    dangling = [
        f"{path.relative_to(ROOT)}:{number}: #{anchor}"
        for path in SCANNED
        for number, line in _lines(path)
        for anchor in SOURCE_CITATION.findall(line)
        if anchor not in anchors
    ]
    assert not dangling, "citations of docs/sources.md sections that do not exist:\n" + "\n".join(dangling)
