"""Waiting on a condition with a deadline: the tests' one way to synchronize with a server.

A sleep guesses how long something takes and is either slow or flaky; these poll the condition the
test actually needs and fail, naming it, once the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.02


# What the test waited for: a phrase, or a function that describes the state at the deadline.
What = str | Callable[[], str]


def wait_for(predicate: Callable[[], object], *, timeout_s: float, what: What) -> None:
    """Return as soon as predicate() is truthy; fail after timeout_s naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise _timed_out(timeout_s, what)
        time.sleep(POLL_S)


async def wait_for_async(predicate: Callable[[], object], *, timeout_s: float, what: What) -> None:
    """wait_for inside a running event loop: the loop's other tasks keep running while it polls."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise _timed_out(timeout_s, what)
        await asyncio.sleep(POLL_S)


def _timed_out(timeout_s: float, what: What) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s} s waiting for {what if isinstance(what, str) else what()}")
