"""The model names the backend serves now: its base model and the LoRA adapters loaded beside it.

vLLM serves an adapter under its own name (`--lora-modules NAME=PATH` at start-up, or
`POST /v1/load_lora_adapter` at run time with VLLM_ALLOW_RUNTIME_LORA_UPDATING), lists it in
`/v1/models` with `parent` set to the base model (vLLM 0.32.0
vllm/entrypoints/openai/models/serving.py show_available_models) and forgets it on
`/v1/unload_lora_adapter`. kvgate re-reads the list when one of those routes answers 200 through
it, and when a request names a model it does not know: an adapter may have been loaded behind
kvgate's back (straight to vLLM). That re-read is shared by the requests waiting on it and done at
most once per `min_interval_s`, so a client sending made-up names cannot make kvgate hammer
`/v1/models`: an unknown name that arrives sooner waits for the next allowed re-read (at most
`min_interval_s`) rather than being answered 404 from a list that may predate the adapter's load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import httpx

log = logging.getLogger("kvgate.served_names")

# Seconds between two re-reads of /v1/models prompted by unknown model names.
REREAD_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Served:
    """One name in the backend's /v1/models."""

    name: str
    base: str | None = None  # a LoRA adapter's base model (its `parent`); None for a base model
    path: str | None = None  # the adapter's folder (its `root`): vLLM's prefix-cache key has it

    @property
    def is_adapter(self) -> bool:
        return self.base is not None


class ServedNames:
    """The names kvgate lets through, kept as the backend lists them."""

    def __init__(
        self,
        reread: Callable[[], Awaitable[Iterable[Served]]] | None = None,
        min_interval_s: float = REREAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._served: dict[str, Served] = {}
        self._reread = reread
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._sleep = sleep
        self._last_reread: float | None = None
        self._pending: asyncio.Task[None] | None = None
        self.rereads = 0  # re-reads prompted by unknown names (what the rate limit bounds)

    def __bool__(self) -> bool:
        return bool(self._served)

    def __contains__(self, name: object) -> bool:
        return name in self._served

    def names(self) -> list[str]:
        return list(self._served)

    def adapters(self) -> list[Served]:
        return [s for s in self._served.values() if s.is_adapter]

    def get(self, name: str | None) -> Served | None:
        return None if name is None else self._served.get(name)

    def add(self, name: str) -> None:
        """A name known before the backend answers (--served-model-name)."""
        self._served.setdefault(name, Served(name))

    def replace(self, served: Iterable[Served]) -> None:
        """The backend's list as just read: adapters loaded since appear, unloaded ones go."""
        new = {s.name: s for s in served}
        gone, came = self._served.keys() - new.keys(), new.keys() - self._served.keys()
        if self._served and (gone or came):
            log.info("served models changed: +%s -%s", sorted(came), sorted(gone))
        self._served = new

    async def refresh(self) -> None:
        """Re-read the backend's list now (after a load or unload went through kvgate)."""
        if self._reread is not None:
            self.replace(await self._reread())

    async def knows(self, name: str) -> bool:
        """Whether the backend serves `name`, re-reading its list first when the name is unknown.
        Re-reads are shared and spaced `min_interval_s` apart: a name that arrives too soon after
        the last one waits for the next; a failed re-read keeps the last list."""
        if name in self._served or self._reread is None:
            return name in self._served
        if self._pending is None:
            now = self._clock()
            due = now if self._last_reread is None else max(now, self._last_reread + self._min_interval_s)
            self._last_reread = due
            self.rereads += 1
            self._pending = asyncio.ensure_future(self._reread_once(due - now))
        await asyncio.shield(self._pending)
        return name in self._served

    async def _reread_once(self, delay_s: float) -> None:
        try:
            if delay_s > 0:
                await self._sleep(delay_s)
            await self.refresh()
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:  # down, or garbage: keep what we had
            log.warning("re-reading the backend's models failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._pending = None
