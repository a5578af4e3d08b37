"""The published config.json files of tests/configs (provenance in tests/configs/README.md), in the
forms the tests read them: the file, its JSON, kvgate's ModelGeometry and its KV layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.kv import KVLayout

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config_path(name: str) -> Path:
    """tests/configs/<name>.json."""
    return CONFIGS / f"{name}.json"


def config_json(name: str) -> dict[str, Any]:
    """The config.json of a published model, as a dict the caller may change."""
    return json.loads(config_path(name).read_text())


def write_config(folder: Path, name: str, **overrides: Any) -> Path:
    """A model folder holding only a published config.json, `overrides` replacing its fields."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config_json(name), **overrides}))
    return folder


def model_geometry(name: str, **overrides: Any) -> ModelGeometry:
    """kvgate's reading of a published config.json, with `overrides` replacing its fields."""
    return ModelGeometry.from_config({**config_json(name), **overrides})


def layout(name: str) -> KVLayout:
    """The KV layout of a published model with KVLayout's defaults (16-token blocks, the model's dtype)."""
    return KVLayout(model_geometry(name))
