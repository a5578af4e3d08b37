"""`kvgate advise` against public vLLM start-up logs (tests/data/startup_logs.json, sources in
docs/calibration.md): the KV pool within max(0.6 GiB, 4 %), weights within 2 %, the profile's torch
peak within 0.1 GiB where logged, and the start-up failure (step and flag) where the log shows one.
Each row's flags go through kvgate's own command-line parser, as a user pastes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate import advise
from kvgate.advise_startup import Startup, predict
from kvgate.cli import parse_command_line
from kvgate.units import GiB
from support.geometry import write_config

DATA = Path(__file__).resolve().parents[1] / "data" / "startup_logs.json"
ROWS: list[dict[str, Any]] = json.loads(DATA.read_text())["rows"]


def replay(row: dict[str, Any], folder: Path) -> Startup:
    write_config(folder, row["model"])
    argv = ["advise", "--model", str(folder), "--gpu", row["gpu"], "--vllm-version", row["vllm_version"], *row["flags"]]
    return predict(advise.request_from(parse_command_line(argv)))


def params(check: str) -> list[Any]:
    """Every row a check applies to; a row kvgate does not reproduce for it is a strict xfail."""
    out = []
    for row in ROWS:
        reason = (row.get("not_reproduced") or {}).get(check)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(row, id=row["id"], marks=marks))
    return out


@pytest.mark.parametrize("row", [p for p in params("available_kv") if "available_kv_gib" in p.values[0]["logged"]])
def test_kv_pool_within_target_of_the_log(row: dict[str, Any], tmp_path: Path) -> None:
    startup = replay(row, tmp_path)
    logged = row["logged"]["available_kv_gib"]
    assert startup.kv_cache_bytes / GiB == pytest.approx(logged, abs=max(0.6, 0.04 * logged))


@pytest.mark.parametrize("row", [p for p in params("weights") if "weights_gib" in p.values[0]["logged"]])
def test_weights_within_2_percent(row: dict[str, Any], tmp_path: Path) -> None:
    """vLLM's figure also holds the RoPE cos/sin cache, which kvgate leaves out (about 1 %)."""
    assert replay(row, tmp_path).weights / GiB == pytest.approx(row["logged"]["weights_gib"], rel=0.02)


@pytest.mark.parametrize("row", [p for p in params("torch_peak") if "torch_peak_gib" in p.values[0]["logged"]])
def test_profile_peak_within_0_1_gib(row: dict[str, Any], tmp_path: Path) -> None:
    """The rows whose peak is the sampler's sort over 256 or 1,024 rows: CUDA's sort scratch included."""
    assert replay(row, tmp_path).profile_peak / GiB == pytest.approx(row["logged"]["torch_peak_gib"], abs=0.1)


@pytest.mark.parametrize("row", params("failure"))
def test_failure_predicted_where_the_log_shows_one(row: dict[str, Any], tmp_path: Path) -> None:
    startup = replay(row, tmp_path)
    logged = row["failure"]
    if logged is None:
        assert startup.failure is None
        return
    assert startup.failure is not None
    assert startup.failure.step.startswith(logged["step"])
    assert startup.failure.flag == logged["flag"]


def test_the_profile_oom_names_the_allocation_vllm_failed_on(tmp_path: Path) -> None:
    """docs/sources.md#large-max-num-batched-tokens: "Tried to allocate 5.34 GiB" ([200000, 14336] bf16)."""
    (row,) = [r for r in ROWS if r["id"] == "mistral-200000-tokens"]
    failure = replay(row, tmp_path).failure
    assert failure is not None
    assert failure.bytes / GiB == pytest.approx(row["logged"]["allocation_gib"], abs=0.01)


def test_refusal_gives_the_length_that_fits(tmp_path: Path) -> None:
    """vLLM's "estimated maximum model length": the pool's tokens for a full-attention model (issue
    #13061's pool, 5,096 blocks logged, held 81,536 tokens)."""
    (row,) = [r for r in ROWS if r["id"] == "issue-13061"]
    startup = replay(row, tmp_path)
    assert startup.estimated_max_model_len == startup.capacity.num_blocks * startup.block_size
    assert startup.estimated_max_model_len == pytest.approx(81_536, rel=0.05)
