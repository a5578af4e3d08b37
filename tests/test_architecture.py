"""The layer contracts in pyproject.toml (run by `lint-imports` in `make test`) stay complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_memory_contract_names_every_other_kvgate_module() -> None:
    """import-linter forbids what it is told to: a new package left out of the list would be free
    to be imported by the memory model."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (memory,) = [c for c in config["contracts"] if c["source_modules"] == ["app.memory"]]
    modules = {f"app.{p.stem}" for p in (ROOT / "app").glob("*.py") if p.stem not in ("__init__", "__main__")}
    packages = {f"app.{p.parent.name}" for p in (ROOT / "app").glob("*/__init__.py")}
    assert set(memory["forbidden_modules"]) == (modules | packages) - {"app.memory"}
