"""tests/unit/conftest.py's promise: a unit test that starts a process fails, however it starts it."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys

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
