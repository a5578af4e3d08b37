"""The split of the suite holds: a unit test that starts a process fails, however it starts it
(tests/unit/conftest.py), and no test file sits where `make unit` and `make test` never look."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

REFUSED = "tests/unit starts no process"


def test_subprocess_is_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


async def test_asyncio_subprocess_is_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_is_refused(method: str) -> None:
    process = multiprocessing.get_context(method).Process(target=print)
    with pytest.raises(AssertionError, match=REFUSED):
        process.start()


def test_fork_and_system_are_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        os.fork()
    with pytest.raises(AssertionError, match=REFUSED):
        os.system("true")


def test_every_test_file_is_in_unit_or_integration() -> None:
    """pyproject's testpaths are tests/unit and tests/integration: a test file anywhere else in
    tests/ would never run."""
    tests = Path(__file__).resolve().parents[1]
    found = [*tests.rglob("test_*.py"), *tests.rglob("*_test.py")]
    stray = sorted(
        str(p.relative_to(tests)) for p in found if p.relative_to(tests).parts[0] not in ("unit", "integration")
    )
    assert stray == []
    assert len(found) > 80  # the search itself found the suite
