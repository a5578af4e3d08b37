"""The layer contracts in pyproject.toml (run by `lint-imports` in `make test`) stay complete."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Modules every layer may import: they import nothing else of kvgate (their own contract).
SHARED_VOCABULARY = {"kvgate.units", "kvgate.vllm_flags", "kvgate.gpus", "kvgate.frozen_values"}


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
    flags come to it as plain values) and its values' direct __init__ (kvgate.frozen_values)."""
    memory = contract("The memory model imports no other kvgate package")
    assert set(memory["forbidden_modules"]) == kvgate_modules() - {
        "kvgate.memory",
        "kvgate.units",
        "kvgate.frozen_values",
    }


def test_the_shared_vocabulary_contract_names_every_other_kvgate_module() -> None:
    shared = contract("Shared vocabulary imports nothing else of kvgate")
    assert set(shared["source_modules"]) == SHARED_VOCABULARY
    assert set(shared["forbidden_modules"]) == kvgate_modules() - SHARED_VOCABULARY


def test_the_layers_contract_keeps_one_direction_from_the_edge_down() -> None:
    """The order docs/architecture.md draws: http > composition > pipeline > predict | gate >
    memory, the shared vocabulary at the bottom; the predictor and the gate share a layer and
    import nothing of each other (`|`)."""
    layers = contract("Layers: http > composition > pipeline > predict | gate > memory, vocabulary below")["layers"]
    level = {module: i for i, layer in enumerate(layers) for module in layer.split(" | ")}
    spine = ["kvgate.http", "kvgate.composition", "kvgate.pipeline", "kvgate.predict", "kvgate.memory"]
    assert [level[m] for m in spine] == sorted({level[m] for m in spine})  # strictly downwards
    assert level["kvgate.gate"] == level["kvgate.predict"]
    assert "|" in layers[level["kvgate.gate"]]
    assert all(level[m] > level["kvgate.memory"] for m in SHARED_VOCABULARY)
    assert set(level) <= kvgate_modules()


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


def kvgate_imports(module: str) -> set[str]:
    """The kvgate modules and packages (first two name parts) that `module`'s files import,
    itself left out."""
    folder = ROOT / module.replace(".", "/")
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    found: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvgate":
                found |= {f"kvgate.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvgate."):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.startswith("kvgate.")}
    return {".".join(name.split(".")[:2]) for name in found} - {module}


def ownership_table() -> list[tuple[list[str], str]]:
    """docs/architecture.md's "Who owns what": each row's kvgate modules and its "May import" cell."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`kvgate"):
            named = re.findall(r"`(kvgate(?:\.\w+)?)`", cells[0].split("(")[0])
            rows.append((named, cells[2]))
    return rows


def test_the_architecture_doc_has_a_row_for_every_module() -> None:
    documented = {module for named, _ in ownership_table() for module in named}
    assert kvgate_modules() - documented == set()
    assert documented - kvgate_modules() == set()


def test_the_architecture_doc_says_what_each_module_imports() -> None:
    """Where the "May import" cell is a list of modules (or "nothing else of `kvgate`"), the row's
    modules import nothing of kvgate beyond it (a submodule named counts as its package)."""
    checked = 0
    for named, may in ownership_table():
        if may == "nothing else of `kvgate`":
            allowed: set[str] = set()
        elif re.fullmatch(r"`kvgate\.[\w.]+`(, `kvgate\.[\w.]+`)*( only)?", may):
            allowed = {".".join(m.split(".")[:2]) for m in re.findall(r"`(kvgate\.[\w.]+)`", may)}
        else:
            continue
        for module in named:
            assert kvgate_imports(module) <= allowed | set(named), (module, kvgate_imports(module) - allowed)
            checked += 1
    assert checked >= 25
