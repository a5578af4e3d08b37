"""One log format for everything a kvgate process prints: its own loggers, uvicorn's, libraries'."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class _TorchAbsence(logging.Filter):
    """Drops transformers' "PyTorch was not found" advice: kvgate uses only its tokenizers and
    configuration classes, never a model, so torch is absent on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found")


def silence_torch_absence() -> None:
    """Install the filter before transformers is imported (it advises once, at import)."""
    logging.getLogger("transformers").addFilter(_TorchAbsence())


def configure_logging(level: str) -> None:
    """kvgate's format on the root logger; uvicorn, run with log_config=None, propagates to it."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    # The format shows neither the caller nor the thread or process: do not collect them for
    # every record (the caller is a walk up the stack, the process id a system call). At
    # --log-level info that is a quarter of each decision line's cost.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("httpx").setLevel(logging.WARNING)
