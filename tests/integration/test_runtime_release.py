"""Release handling at the composition root (issue #27): a vLLM newer than any kvgate read is
modelled as the newest one it knows, and says so once, however often kvgate synchronises."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvgate.composition import Runtime
from kvgate.memory.vllm_runner import NEWEST_KNOWN
from kvgate.model_folder import load_geometry
from kvgate.settings import Settings
from support.fake_backend import running_fake_backend


@pytest.mark.parametrize(("version", "modelled", "warnings"), [("0.34.0", NEWEST_KNOWN, 1), ("0.33.0rc1", "0.33.0", 0)])
async def test_the_backends_release_is_modelled_with_at_most_one_warning(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, version: str, modelled: str, warnings: int
) -> None:
    with running_fake_backend(version=version) as backend:
        rt = Runtime(Settings(backend=backend.base_url, model=str(tiny_model_dir), block_size=16, num_gpu_blocks=64))
        rt.geometry = load_geometry(str(tiny_model_dir))  # what start() reads before its watcher syncs
        try:
            with caplog.at_level(logging.WARNING, logger="kvgate"):
                for _ in range(3):  # the watcher synchronises again after every backend restart
                    await rt.sync_once()
        finally:
            await rt.stop()
    assert rt.deployment is not None
    assert (rt.deployment.runtime.version, rt.deployment.runtime.model_version) == (version, modelled)
    said = [r.getMessage() for r in caplog.records if "newer than any kvgate knows" in r.getMessage()]
    assert len(said) == warnings, said
    if warnings:
        assert f"models it as vLLM {NEWEST_KNOWN}, the newest it knows" in said[0]
