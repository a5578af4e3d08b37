"""One log format for everything a kvgate process prints: its own loggers, uvicorn's, libraries'."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# uvicorn's ERROR line for an ASGI app that returned with its response unfinished
# (uvicorn/protocols/http/httptools_impl.py RequestResponseCycle.run_asgi, which then closes the
# connection). kvgate ends a response so on purpose, and only when it cuts a stream whose client
# stopped reading (kvgate/http/proxy.py Relay), and logs its own warning for it.
_UNFINISHED = "ASGI callable returned without completing response."
_unfinished_on_purpose: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


def ending_response_unfinished() -> None:
    """The request being served (its task: uvicorn's run_asgi awaits the app in it) ends its
    response unfinished on purpose: uvicorn's ERROR line for it is not logged."""
    task = asyncio.current_task()
    if task is not None:
        _unfinished_on_purpose.add(task)


class _UnfinishedOnPurpose(logging.Filter):
    """Drops uvicorn's unfinished-response line for the requests kvgate cut, and only those."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _UNFINISHED:
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread
            return True
        return task is None or task not in _unfinished_on_purpose


def quiet_transformers_advice() -> None:
    """transformers advises once, when it is imported, to install PyTorch: kvgate uses only its
    tokenizers and configuration classes, never a model, so torch is absent on purpose. The advice
    is turned off the way transformers offers (TRANSFORMERS_NO_ADVISORY_WARNINGS, read when it
    advises), in the environment so that the preparation workers kvgate spawns inherit it. The
    command line's entry points call this before anything imports transformers; importing kvgate
    changes nothing. An operator's own value is kept."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class SecondCachedFormatter(logging.Formatter):
    """logging.Formatter's own asctime ("2026-11-27 04:05:06,789"), its date and time part
    formatted once a second rather than once a line: every decision is logged, and strftime of
    the local time was half the cost of formatting a line."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second: int | None = None
        self._text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._text = time.strftime(self.default_time_format, self.converter(record.created))
        return f"{self._text},{int(record.msecs):03d}"  # default_msec_format, '%s,%03d'


def configure_logging(level: str) -> None:
    """kvgate's format on the root logger; uvicorn, run with log_config=None, propagates to it."""
    handler = logging.StreamHandler()
    handler.setFormatter(SecondCachedFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # The format shows neither the caller nor the thread or process: do not collect them for
    # every record (the caller is a walk up the stack, the process id a system call). At
    # --log-level info that is a quarter of each decision line's cost.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(_UnfinishedOnPurpose())
