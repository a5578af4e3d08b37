"""Every link in the README and docs/ resolves: a relative link names a file of the repository and,
with a `#fragment`, a heading of that file (GitHub's anchors); every source file a page names
exists (a renamed module or a moved test leaves no dead reference behind)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
# a path of this repository's own code, not one inside vLLM's tree (no '/' or word before it)
SOURCE_PATH = re.compile(r"(?<![\w/.-])(?:kvgate|tests|bench|demo|scripts|deploy)/[\w/.-]*?\.py\b")
# benchmarks.md copies bench/results tables (py-spy frames included) verbatim, and those keep the
# paths they were run with
RECORDS = {"benchmarks.md"}


def _prose(page: Path) -> str:
    """The page without its fenced blocks: printed output there is not a link."""
    return FENCE.sub("", page.read_text())


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, every character but letters, digits,
    spaces, '-' and '_' dropped, spaces to '-'; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_anchors_follow_githubs_rule() -> None:
    page = "# Restarts and blindness: four budget modes (`kvgate_budget_mode{mode}`)\n## Errors\n## Errors\n"
    assert anchors(page) == {"restarts-and-blindness-four-budget-modes-kvgate_budget_modemode", "errors", "errors-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    dead = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or not file.is_relative_to(ROOT):
            dead.append(f"{target}: no such file")
        elif fragment and (file.suffix != ".md" or fragment not in anchors(file.read_text())):
            dead.append(f"{target}: no such heading")
    assert dead == []


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in RECORDS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_source_file_named_exists(page: Path) -> None:
    missing = sorted({p for p in SOURCE_PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert missing == []
