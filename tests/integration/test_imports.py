"""What importing and serving load: `import kvgate` changes nothing, and `kvgate serve` never
loads the simulator (kvgate.sim is importable, for `kvgate sim` and the tests, but not served)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.fake_backend import running_fake_backend
from support.kvgate_server import running_kvgate

REPO = Path(__file__).resolve().parents[2]

NOTHING_CHANGES = """
import json, logging, os, sys
handlers, filters = list(logging.getLogger().handlers), list(logging.getLogger("transformers").filters)
environ, loggers = dict(os.environ), dict(logging.Logger.manager.loggerDict)
import kvgate
print(json.dumps({
    "environ": dict(os.environ) == environ,
    "loggers": sorted(set(logging.Logger.manager.loggerDict) - set(loggers)),
    "handlers": logging.getLogger().handlers == handlers,
    "filters": logging.getLogger("transformers").filters == filters,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("kvgate", "transformers", "jinja2")),
}))
"""


def test_importing_kvgate_changes_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NOTHING_CHANGES], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == {
        "environ": True,
        "loggers": [],
        "handlers": True,
        "filters": True,
        "modules": ["kvgate"],
    }


def imported_modules(importtime_log: str) -> list[str]:
    """The modules a process imported, from what PYTHONPROFILEIMPORTTIME wrote to its stderr."""
    return [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")]


def test_kvgate_serve_never_imports_the_simulator(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every import `kvgate serve` makes, start-up and a served request included (lazy imports
    too), is written to its log by Python's import profiler."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    with running_fake_backend() as backend, running_kvgate(backend.base_url, tiny_model_dir, tmp_path) as kvgate:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = httpx.post(kvgate.base_url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        log = kvgate.log()
    imported = imported_modules(log)
    assert {"kvgate.http.server", "kvgate.pipeline", "kvgate.tokens"} <= set(imported)  # the profile is read
    assert [m for m in imported if m == "kvgate.sim" or m.startswith("kvgate.sim.")] == []
    assert "PyTorch was not found" not in log


def test_kvgate_serve_help_loads_neither_the_simulator_nor_transformers() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvgate.cli", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    imported = imported_modules(done.stderr)
    assert "kvgate.settings" in imported  # the serve parser was built
    assert [m for m in imported if m.split(".")[0] == "transformers" or m.startswith("kvgate.sim")] == []
