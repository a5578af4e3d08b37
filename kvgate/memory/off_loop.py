"""Values of a deployment too costly to work out on the event loop, each worked out once on a
worker thread: allocator replays of 50 ms to seconds of CPU, asked for by the budget at a
request's charge. Until a value is known the caller gets None and charges cautiously; each value
known calls a listener on the worker thread (the gate's `changed_from_thread`), so requests that
waited on the cautious charge are weighed again at once, not at the next release or arrival."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Self, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


class OffLoopMemo(Generic[Key, Value]):
    """A memo of `_work_out(key)`, filled on one worker thread per deployment. Subclasses give
    `_work_out` and the public call that classes a request's inputs into keys (few per
    deployment, whatever clients send). `background=False` works each value out in the caller's
    thread (tests, one-shot tools)."""

    def __init__(self, thread_name: str, background: bool) -> None:
        self._known: dict[Key, Value] = {}
        self._pending: set[Key] = set()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=thread_name) if background else None
        self._listener: Callable[[], None] | None = None

    def when_known(self, listener: Callable[[], None]) -> None:
        """Call `listener` (thread-safe itself) on the worker thread each time a value is known."""
        self._listener = listener

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        """One memo per deployment, shared by copies of the limits that hold it
        (`dataclasses.asdict` deep-copies them): its worker thread cannot be copied."""
        return self

    @property
    def untouched(self) -> bool:
        """No value known or being worked out: a deployment's first headroom reading. Only then
        is a level started before a request asks for it: a headroom that falls reading after
        reading (a co-tenant growing, benchmark S6) would otherwise start a replay at each new
        low, each holding the GIL for 0.1-1.5 s beside the event loop (S6's TTFT p99 0.46-0.90
        s became 0.87-1.86 s)."""
        return not self._known and not self._pending

    def _lookup(self, key: Key, now: bool = False) -> Value | None:
        """The value of `key`, or None while the worker thread works it out; `now`: worked out
        in the caller's thread if not known (a verdict that must not depend on the worker's pace)."""
        known = self._known.get(key)
        if known is not None:
            return known
        if self._worker is None or now:
            known = self._known[key] = self._work_out(key)
            return known
        if key not in self._pending:
            self._pending.add(key)
            self._worker.submit(self._fill, key)
        return None

    def _fill(self, key: Key) -> None:
        """On the worker thread: one dict store, which the loop's thread reads whole or not."""
        self._known[key] = self._work_out(key)
        if self._listener is not None:
            self._listener()

    def _work_out(self, key: Key) -> Value:
        raise NotImplementedError
