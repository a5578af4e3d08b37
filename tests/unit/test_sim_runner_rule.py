"""The simulator's `--model-runner auto` picks the runner vLLM picks, release by release
(kvgate/sim/flavor.py RUNNER_RULES, read in each release's vllm/config/vllm.py)."""

from __future__ import annotations

import json

import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.flavor import Flavor
from kvgate.sim.model import SimModel, load_model, read_config
from kvgate.sim.presets import model_config
from support.geometry import CONFIGS


def _model(name: str) -> SimModel:
    """A preset, a config of tests/configs, or tiny-llama renamed to another architecture."""
    if name.endswith(".json"):
        return read_config(json.loads((CONFIGS / name).read_text()), name)
    if name.startswith("arch:"):
        return read_config({**model_config("tiny-llama"), "architectures": [name[5:]]}, name)
    return load_model(name)


@pytest.mark.parametrize(
    ("version", "model", "method", "runner"),
    [
        # 0.21.0: VLLM_USE_V2_MODEL_RUNNER defaults to 0 (envs.py), no default-V2 model.
        ("0.21.0", "arch:Qwen3ForCausalLM", None, "v1"),
        # 0.22.0: only DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = {Qwen3ForCausalLM}, not MoE.
        ("0.22.0", "arch:Qwen3ForCausalLM", None, "v2"),
        ("0.22.0", "llama-3.1-8b", None, "v1"),
        ("0.22.0", "arch:Qwen3ForCausalLM", "ngram", "v1"),  # only eagle/eagle3/mtp drafters
        # 0.25.0 - 0.28.0: every dense model, and the listed MoE architectures.
        ("0.25.0", "llama-3.1-8b", None, "v2"),
        ("0.25.0", "deepseek-v2-lite", None, "v2"),
        ("0.25.0", "mixtral-8x7b", None, "v1"),
        ("0.26.0", "jamba-v0.1.json", None, "v1"),  # hybrid
        ("0.28.0", "qwen3-next-80b-a3b.json", None, "v1"),  # hybrid, not listed
        ("0.28.0", "llama-3.1-8b", "ngram", "v1"),
        ("0.28.0", "llama-3.1-8b", "eagle3", "v2"),
        # 0.29.0 on: every model; the speculative methods decide.
        ("0.29.0", "mixtral-8x7b", None, "v2"),
        ("0.29.0", "jamba-v0.1.json", None, "v2"),
        ("0.29.0", "llama-3.1-8b", "ngram", "v1"),
        ("0.30.0", "llama-3.1-8b", "draft_model", "v1"),
        ("0.31.1", "llama-3.1-8b", None, "v2"),
        ("0.31.0", "llama-3.1-8b", "ngram", "v1"),
        ("0.31.0", "llama-3.1-8b", "draft_model", "v2"),
        ("0.32.0", "llama-3.1-8b", "ngram", "v2"),
        ("0.32.0", "llama-3.1-8b", "medusa", "v1"),
        ("0.33.0", "llama-3.1-8b", "medusa", "v2"),
        ("0.33.0", "llama-3.1-8b", "suffix", "v1"),
    ],
)
def test_auto_runner_is_the_one_vllm_picks(version: str, model: str, method: str | None, runner: str) -> None:
    spec = {"method": method, "num_speculative_tokens": 4} if method else None
    cfg = SimConfig(vllm_version=version, speculative_config=spec)
    assert Flavor.of(cfg, _model(model)).runner == runner


def test_model_runner_flag_wins() -> None:
    """`--model-runner` plays what it says, as VLLM_USE_V2_MODEL_RUNNER overrides vLLM's rule."""
    cfg = SimConfig(vllm_version="0.21.0", model_runner="v2")
    assert Flavor.of(cfg, _model("llama-3.1-8b")).runner == "v2"
