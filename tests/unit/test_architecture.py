"""The layer contracts in pyproject.toml (run by `lint-imports` in `make test`) stay complete."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Modules every layer may import: they import nothing else of kvgate (their own contract).
SHARED_VOCABULARY = {"kvgate.units", "kvgate.vllm_flags"}


def kvgate_modules() -> set[str]:
    """Every top-level module and package of kvgate/."""
    modules = {f"kvgate.{p.stem}" for p in (ROOT / "kvgate").glob("*.py") if p.stem not in ("__init__", "__main__")}
    return modules | {f"kvgate.{p.parent.name}" for p in (ROOT / "kvgate").glob("*/__init__.py")}


def contract(name: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (found,) = [c for c in config["contracts"] if c["name"] == name]
    return found


def test_the_memory_contract_names_every_other_kvgate_module() -> None:
    """import-linter forbids what it is told to: a new package left out of the list would be free
    to be imported by the memory model. Of the shared vocabulary it may read the units (vLLM's
    flags come to it as plain values)."""
    memory = contract("The memory model imports no other kvgate package")
    assert set(memory["forbidden_modules"]) == kvgate_modules() - {"kvgate.memory", "kvgate.units"}


def test_the_shared_vocabulary_contract_names_every_other_kvgate_module() -> None:
    shared = contract("Shared vocabulary imports nothing else of kvgate")
    assert set(shared["source_modules"]) == SHARED_VOCABULARY
    assert set(shared["forbidden_modules"]) == kvgate_modules() - SHARED_VOCABULARY


def test_the_memory_model_opens_no_file() -> None:
    """The import contract keeps json, pathlib and os out of kvgate.memory; the builtin `open` needs
    no import, so it is looked for here."""
    opened = [
        f"{path.name}:{node.lineno}"
        for path in sorted((ROOT / "kvgate" / "memory").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open"
    ]
    assert opened == []
