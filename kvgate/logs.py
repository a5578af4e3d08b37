"""One log format for everything a kvgate process prints: its own loggers, uvicorn's, libraries'."""

from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def quiet_transformers_advice() -> None:
    """transformers advises once, when it is imported, to install PyTorch: kvgate uses only its
    tokenizers and configuration classes, never a model, so torch is absent on purpose. The advice
    is turned off the way transformers offers (TRANSFORMERS_NO_ADVISORY_WARNINGS, read when it
    advises), in the environment so that the preparation workers kvgate spawns inherit it. The
    command line's entry points call this before anything imports transformers; importing kvgate
    changes nothing. An operator's own value is kept."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def configure_logging(level: str) -> None:
    """kvgate's format on the root logger; uvicorn, run with log_config=None, propagates to it."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    # The format shows neither the caller nor the thread or process: do not collect them for
    # every record (the caller is a walk up the stack, the process id a system call). At
    # --log-level info that is a quarter of each decision line's cost.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("httpx").setLevel(logging.WARNING)
