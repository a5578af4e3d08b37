"""Where `--model` points: a folder with config.json, a Hugging Face hub cache entry, or a model id
found in the local hub cache.

kvgate never downloads: a model id resolves only from files already in the hub cache (the same
cache vLLM fills when it downloads the model; `HF_HUB_CACHE`/`HF_HOME` choose it), through
huggingface_hub's own `snapshot_download(local_files_only=True)`, so the cache layout
(refs/main -> snapshots/<commit>) is read the way the library writes it.

Reading `config.json` happens here too, so the memory model (kvgate.memory) takes plain dicts and
does no I/O of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from kvgate.memory.geometry import ModelGeometry

_HUB_REPO_PREFIX = "models--"


class ModelFolderError(ValueError):
    """`--model` names nothing kvgate can read a config.json from."""


def resolve_model_folder(model: str | None) -> Path:
    """The local folder holding the model's config.json (and tokenizer files, if any)."""
    if not model:
        raise ModelFolderError(
            "--model is required: the folder vLLM serves (config.json and tokenizer), a Hugging "
            "Face hub cache entry, or a model id already in the local hub cache"
        )
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir() and path.name.startswith(_HUB_REPO_PREFIX):
        repo_id = path.name[len(_HUB_REPO_PREFIX) :].replace("--", "/")
        return _cached_snapshot(repo_id, cache_dir=path.parent, shown=model)
    if path.is_dir():
        raise ModelFolderError(f"--model {model!r} is a folder without config.json")
    return _cached_snapshot(model, cache_dir=None, shown=model)


def _cached_snapshot(repo_id: str, cache_dir: Path | None, shown: str) -> Path:
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        raise ModelFolderError(
            f"--model {shown!r} is neither a folder with config.json nor a model in the local "
            "Hugging Face hub cache (kvgate never downloads: point it at the folder vLLM serves; "
            "in front of `kvgate sim`, at the folder it prints)"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"--model {shown!r}: the hub cache snapshot {folder} has no config.json")
    return folder


def read_sampling_defaults(folder: str | Path | None) -> dict[str, float]:
    """The request defaults vLLM takes from ``folder/generation_config.json`` with its default
    ``--generation-config auto`` (vllm 0.32.0 config/model.py:1847-1890 get_diff_sampling_param;
    kvgate/sampling_params.py SAMPLING_DEFAULT_KEYS). None, no file or an unreadable one: none."""
    from kvgate.sampling_params import SAMPLING_DEFAULT_KEYS

    if folder is None:
        return {}
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {
        key: float(value)
        for key in SAMPLING_DEFAULT_KEYS
        if isinstance(value := config.get(key), (int, float)) and not isinstance(value, bool)
    }


def read_model_config(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; ValueError naming the file when missing or not JSON."""
    file = Path(folder) / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"no config.json in {folder}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def load_geometry(folder: str | Path) -> ModelGeometry:
    """The memory-relevant shape of the model whose config.json is in `folder`."""
    return ModelGeometry.from_config(read_model_config(folder))
