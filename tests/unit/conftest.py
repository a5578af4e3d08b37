"""tests/unit starts no process: a test here (its fixtures included) that spawns one fails.

`make unit` promises seconds to a minute with no vLLM venv and no server process; the promise stays
true as tests are added only if something enforces it. Every way Python starts a process
(subprocess and asyncio's subprocesses, multiprocessing, os.fork/posix_spawn) ends in one of the
functions replaced here while a unit test's setup, call and teardown run. In-process servers
(a uvicorn thread, an ASGI transport) are fine: they start no process.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import multiprocessing.util
import os
import subprocess
from collections.abc import Iterator

import pytest

with contextlib.suppress(ImportError):
    # matplotlib (bench's plots, tests/unit/test_bench_report.py) lists the system's fonts with
    # `fc-list` the first time it is imported on a machine with no font cache yet (a fresh CI
    # machine): done here, at collection, before any test runs under the guard below.
    import matplotlib.font_manager  # noqa: F401

_SPAWNERS: tuple[tuple[object, str], ...] = (
    (subprocess.Popen, "_execute_child"),
    (_posixsubprocess, "fork_exec"),
    (multiprocessing.util, "spawnv_passfds"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
)


class ProcessInUnitTest(AssertionError):
    """A unit test started a process."""


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise ProcessInUnitTest(
        "tests/unit starts no process (no subprocess, no server process, no vLLM venv): "
        "move this test to tests/integration/"
    )


@contextlib.contextmanager
def _no_process() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in _SPAWNERS:
            if hasattr(owner, name):
                patch.setattr(owner, name, _refuse)
        yield


# Item hooks of this conftest run for tests/unit's items only. Setup and teardown cover the
# module- and session-scoped fixtures a unit test brings up or closes, not just its body.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_process():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_process():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _no_process():
        return (yield)
