"""Which modality vLLM's start-up profile encodes (kvgate/profiled_media.py) and what kvgate's
encoder budget credits it with (engine_config.encoder_budget), per family and flags.

The expected numbers are vLLM 0.32.0's own: multimodal/encoder_budget.py `MultiModalBudget` run
in-process (tests/support/vllm_profiled_media.py) on folders with these settings, the tiny
models' (tests/support/tiny_qwen2_vl.py, tiny_qwen3_vl.py, tiny_llava_onevision.py), each also
derived by hand below; tests/integration/test_multimodal_vllm.py checks two of them against vLLM
on every run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.engine_config import encoder_budget
from kvgate.memory.encoder import OTHER_MODALITY
from kvgate.memory.geometry import ModelGeometry
from kvgate.multimodal import media_options
from kvgate.profiled_media import ProfiledItem, profiled_item
from support.encoder_budgets import deployment, profile_of, tiny_budget
from support.geometry import config_json, write_config
from support.tiny_phi4mm import PHI4MM_CONFIG

TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "vocab_size": 2054,
}
TOKENS = {"image_token_id": 2050, "video_token_id": 2051, "vision_start_token_id": 2048, "vision_end_token_id": 2049}
QWEN2_VL = {
    "model_type": "qwen2_vl",
    **TOKENS,
    "text_config": {**TEXT, "model_type": "qwen2_vl_text"},
    "vision_config": {"embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14, "hidden_size": 128,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}  # fmt: skip
# 4 to 256 merged 28-pixel patches an image (tiny_qwen2_vl.py): the largest image is 256 embeddings.
QWEN2_VL_PROCESSOR = {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "merge_size": 2,
                      "temporal_patch_size": 2}  # fmt: skip
QWEN3_VL = {
    "model_type": "qwen3_vl",
    **TOKENS,
    "text_config": {**TEXT, "model_type": "qwen3_vl_text"},
    "vision_config": {"deepstack_visual_indexes": [0], "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                      "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}  # fmt: skip
QWEN3_VL_IMAGES = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                   "size": {"shortest_edge": 4096, "longest_edge": 262144}}  # fmt: skip
QWEN3_VL_VIDEOS = {**QWEN3_VL_IMAGES, "size": {"shortest_edge": 8192, "longest_edge": 524288}, "fps": 2,
                   "min_frames": 4, "max_frames": 768, "video_processor_type": "Qwen3VLVideoProcessor"}  # fmt: skip


def _folder(tmp_path: Path, config: dict, images: dict, videos: dict | None = None) -> Path:
    folder = tmp_path / str(config["model_type"])
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(images))
    if videos is not None:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(videos))
    return folder


def test_the_largest_modality_wins_and_a_tie_goes_to_video() -> None:
    """multimodal/encoder_budget.py `get_modality_with_max_tokens`: max by (tokens, name)."""
    items = {"image": (256, 256, 0), "video": (256, 9, 0)}
    assert profiled_item(items, {}, 999) == ProfiledItem("video", 256, 9)
    assert profiled_item({**items, "image": (257, 257, 0)}, {}, 999) == ProfiledItem("image", 257, 257)
    assert profiled_item(items, {"video": 0}, 999) == ProfiledItem("image", 256, 256)
    assert profiled_item(items, {"video": 0, "image": 0}, 999) is None


@pytest.mark.parametrize(
    ("limits", "kwargs", "expected"),
    [
        # 14 frames of the 256-embedding image: 7 temporal patches, M_video 1,792 above M_image 256;
        # vLLM: {"image": 256, "video": 1792}, profiled with 1 video of 1,792 (B 2,048).
        ({"image": 4, "video": 1}, None, (1792, 2048, 1, 1792)),
        # images off: the same video
        ({"image": 0, "video": 2}, None, (1792, 2048, 1, 1792)),
        # videos off: 8 images of 256 (2,048 // 256, at most 8 sequences x 4 images)
        ({"image": 4, "video": 0}, None, (256, 2048, 8, 256)),
        # a video frame of at most 50,176 pixels: 64 embeddings, 14 frames 448; 4 videos (2,048 // 448)
        ({"image": 4, "video": 1}, {"videos_kwargs": {"max_pixels": 50176}}, (448, 2048, 4, 448)),
        # 16 embeddings a frame: 14 frames are 112, below the image's 256, so images are profiled
        ({"image": 4, "video": 1}, {"videos_kwargs": {"max_pixels": 12544}}, (256, 2048, 8, 256)),
        # --limit-mm-per-prompt's video options shrink the dummy (4 frames, 200 pixels wide: 224)
        # while K stays M_video's: vLLM's dummy is 224
        ({"image": 4, "video": {"count": 1, "num_frames": 4, "width": 200}}, None, (1792, 2048, 1, 224)),
    ],
)
def test_qwen2_vl_profiles_the_modality_vllm_picks(
    tmp_path: Path, limits: dict, kwargs: dict | None, expected: tuple[int, int, int, int]
) -> None:
    folder = _folder(
        tmp_path, QWEN2_VL, QWEN2_VL_PROCESSOR, {**QWEN2_VL_PROCESSOR, "video_processor_type": "Qwen2VLVideoProcessor"}
    )
    assert profile_of(tiny_budget(folder, limits, kwargs)) == expected


def test_qwen2_vl_counts_its_largest_video_at_the_image_size_but_encodes_it_at_the_video_size(tmp_path: Path) -> None:
    """qwen2_vl.py `_get_vision_info(modality="video")` sizes frames by the IMAGE processor's
    size (`default_size=image_processor.size`): M_video is 1,792 however small the video
    processor's max_pixels; the dummy video goes through the video processor (50,176 pixels a
    frame: 64 embeddings, 448 for 14 frames). vLLM: M 1,792, 1 item, dummy 448. kvgate credits the
    profile 448 embeddings, not 1,792."""
    videos = {**QWEN2_VL_PROCESSOR, "max_pixels": 50176, "video_processor_type": "Qwen2VLVideoProcessor"}
    budget = tiny_budget(_folder(tmp_path, QWEN2_VL, QWEN2_VL_PROCESSOR, videos), {"image": 4, "video": 1})
    assert profile_of(budget) == (1792, 2048, 1, 448)
    assert budget.profiled_embeddings == 448


@pytest.mark.parametrize(
    ("limits", "kwargs", "expected"),
    [
        # two frames within the video's 524,288 pixels (t x h x w): 256 embeddings, tied with the
        # 256-embedding image: video wins the tie. vLLM: {"image": 256, "video": 256}, video, 8 items.
        ({"image": 4, "video": 1}, None, (256, 2048, 8, 256)),
        ({"image": 0, "video": 1}, None, (256, 2048, 8, 256)),
        ({"image": 4, "video": 0}, None, (256, 2048, 8, 256)),
        # smaller images: the video is profiled (vLLM: {"image": 64, "video": 256})
        ({"image": 4, "video": 1}, {"images_kwargs": {"max_pixels": 65536}}, (256, 2048, 8, 256)),
        # a 100 x 90 dummy video: 96 x 96 after smart_resize, 9 embeddings (vLLM's dummy: 9)
        ({"image": 4, "video": {"count": 1, "width": 100, "height": 90}}, None, (256, 2048, 8, 9)),
    ],
)
def test_qwen3_vl_profiles_the_modality_vllm_picks(
    tmp_path: Path, limits: dict, kwargs: dict | None, expected: tuple[int, int, int, int]
) -> None:
    folder = _folder(tmp_path, QWEN3_VL, QWEN3_VL_IMAGES, QWEN3_VL_VIDEOS)
    assert profile_of(tiny_budget(folder, limits, kwargs)) == expected


@pytest.mark.parametrize(
    ("video_config", "kwargs", "dummy"),
    [
        # the processor's own cap at 24 tokens a frame: the 2-frame dummy of 512 x 512 frames gets
        # max(min(24,576, 262,144), 8,601) pixels a frame: 128 x 128, 16 embeddings
        ({"cap_pixels_per_frame": True, "max_video_tokens": 24}, None, 16),
        # the flag's cap: vLLM spreads the dummy over ceil(524,288 / 24,576) = 22 frames of
        # 128 x 128, which the cap (23,831 a frame) keeps: 11 patches of 16
        ({"cap_pixels_per_frame": True, "max_video_tokens": 24}, {"cap_pixels_per_frame": True}, 176),
        ({}, {"cap_pixels_per_frame": True, "max_video_tokens": 24}, 176),
        # the flag's cap at 768 tokens a frame (transformers' default) does not bind: 2 frames
        ({}, {"cap_pixels_per_frame": True}, 256),
        # a videos_kwargs max_video_tokens of 8 spreads the dummy over 64 frames of 64 x 64, which
        # the processor's own 24 (the call's 8 does not reach resize) leaves at 4 a patch: 128
        (
            {"cap_pixels_per_frame": True, "max_video_tokens": 24},
            {"videos_kwargs": {"cap_pixels_per_frame": True, "max_video_tokens": 8}},
            128,
        ),
    ],
)
def test_qwen3_vl_profile_encodes_the_capped_dummy_vllm_draws(
    tmp_path: Path, video_config: dict, kwargs: dict | None, dummy: int
) -> None:
    """qwen3_vl.py `Qwen3VLDummyInputsBuilder.get_dummy_mm_data` (vLLM 0.32.0 and 0.33.0) with
    cap_pixels_per_frame in --mm-processor-kwargs, and transformers 5.19's capped resize of the
    dummy: M stays the uncapped 2-frame count (256), the profile is credited the dummy's own
    embeddings (vLLM's, from MultiModalBudget in-process on the tiny folder with these files)."""
    folder = _folder(tmp_path, QWEN3_VL, QWEN3_VL_IMAGES, {**QWEN3_VL_VIDEOS, **video_config})
    for limits in ({"image": 4, "video": 1}, {"image": 0, "video": 1}):
        assert profile_of(tiny_budget(folder, limits, kwargs)) == (256, 2048, 8, dummy)


@pytest.mark.parametrize(
    ("limits", "kwargs"),
    [
        # images of at most 64 embeddings profiled; videos (M 256) embedding-only
        ({"image": 4, "video": 0}, {"images_kwargs": {"max_pixels": 65536}}),
        # videos of at most 64 profiled; images (M 256) embedding-only
        ({"image": 0, "video": 1}, {"videos_kwargs": {"size": {"longest_edge": 131072, "shortest_edge": 8192}}}),
    ],
)
def test_enable_mm_embeds_widens_the_encoder_budget_by_the_embedding_only_modality(
    tmp_path: Path, limits: dict, kwargs: dict
) -> None:
    """vLLM's --enable-mm-embeds (multimodal/encoder_budget.py `MultiModalBudget.__init__`, 0.32.0
    = 0.33.0): a modality at --limit-mm-per-prompt 0 is embedding-only and its M joins
    `compute_mm_encoder_budget`. At 128 batched tokens, vLLM's B = C = 256 (the other modality's
    M) with the flag, 128 without, and its profile then runs 4 items of 64, not 2 (vLLM's numbers,
    MultiModalBudget in-process on the tiny folder). kvgate's B and C are vLLM's; its K stays 2,
    what the tower's M alone gives (a credit of no more than the profile ran)."""
    folder = _folder(tmp_path, QWEN3_VL, QWEN3_VL_IMAGES, QWEN3_VL_VIDEOS)
    geometry = ModelGeometry.from_config(QWEN3_VL)
    settings = deployment(8192, 128, 8)
    plain = encoder_budget(str(folder), settings, media_options(kwargs, limits), geometry)
    embeds = encoder_budget(str(folder), settings, media_options(kwargs, limits), geometry, enable_mm_embeds=True)
    assert plain is not None
    assert embeds is not None
    assert (profile_of(plain), plain.cache_size) == ((64, 128, 2, 64), 128)
    assert (profile_of(embeds), embeds.cache_size) == ((64, 256, 2, 64), 256)
    # with both modalities on, nothing is embedding-only: the flag changes nothing
    both = encoder_budget(str(folder), settings, media_options(kwargs, {"image": 4, "video": 1}), geometry, False, True)
    assert both == encoder_budget(str(folder), settings, media_options(kwargs, {"image": 4, "video": 1}), geometry)


def test_onevision_profiles_images_unless_they_are_off(tmp_path: Path) -> None:
    """LLaVA-OneVision (64-pixel SigLIP, 16-pixel patches: 4 x 4 patches pooled to 2 x 2 = 4
    embeddings a frame): 16 frames + the newline are 65 embeddings, below its largest image, so
    images are profiled; with images off, 2,048 // 65 = 31, at most 8 sequences x 1 video: 8
    videos of 65, each 16 frames (tiles) through the tower; --limit-mm-per-prompt's num_frames 3
    makes the dummy, and with it M, 13 (vLLM counts the dummy: no get_mm_max_tokens_per_item).
    The image profile's dummy is vLLM's fixed 1153 x 944 (`get_image_size_with_most_features`):
    the 128 x 128 pinpoint, unpadded to 6 x 8 patches + 6 newlines + the 16 of the base view = 70
    embeddings over 5 tiles, below the 8 x 8 grid's 88 kvgate charges an unseen image.
    vLLM: image 70 x 29; video 65 x 8; video 13 x 8."""
    config = {
        "model_type": "llava_onevision",
        "image_token_index": 2050,
        "video_token_index": 2051,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "image_grid_pinpoints": [[64, 64], [64, 128], [128, 64], [128, 128]],
        "text_config": {**TEXT, "model_type": "qwen2"},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "image_size": 64, "patch_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1},
    }  # fmt: skip
    images = {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": 64, "width": 64},
              "image_grid_pinpoints": config["image_grid_pinpoints"]}  # fmt: skip
    folder = _folder(tmp_path, config, images)
    both = tiny_budget(folder, {"image": 4, "video": 1}, max_model_len=1024)
    # K is vLLM's, of its M (the dummy's 70): 2,048 // 70 = 29 items (not 2,048 // 88)
    assert (profile_of(both), both.profiled_tiles) == ((88, 2048, 2048 // 70, 70), 5)
    videos = tiny_budget(folder, {"image": 0, "video": 1}, max_model_len=1024)
    assert (profile_of(videos), videos.profiled_tiles) == ((65, 2048, 8, 65), 16)
    few = tiny_budget(folder, {"image": 0, "video": {"count": 1, "num_frames": 3}}, max_model_len=1024)
    assert (profile_of(few), few.profiled_tiles) == ((13, 2048, 8, 13), 3)


def test_onevision_profiles_a_video_between_vllms_image_and_the_largest(tmp_path: Path) -> None:
    """vLLM's OneVision image M is its 1153 x 944 dummy's count (no get_mm_max_tokens_per_item),
    159 on a 4 x 4 grid of 64-pixel tiles, below the 198 of the largest image. A video of 11
    unpooled frames (spatial_pool_stride 1: 16 embeddings a frame, + the newline = 177) lies
    between: vLLM profiles the video, so kvgate credits the video's dummy, not images. Images
    only: vLLM's 2,048 // 159 = 12 dummy images, as kvgate credits."""
    pinpoints = [[64 * r, 64 * c] for r in range(1, 5) for c in range(1, 5)]
    config = {
        "model_type": "llava_onevision",
        "image_token_index": 2050,
        "video_token_index": 2051,
        "spatial_pool_stride": 1,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "image_grid_pinpoints": pinpoints,
        "text_config": {**TEXT, "model_type": "qwen2"},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "image_size": 64, "patch_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1},
    }  # fmt: skip
    images = {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": 64, "width": 64},
              "image_grid_pinpoints": pinpoints}  # fmt: skip
    folder = _folder(tmp_path, config, images)
    images_only = tiny_budget(folder, {"image": 4, "video": 0}, max_model_len=1024)
    assert (profile_of(images_only), images_only.profiled_tiles) == ((198, 2048, 2048 // 159, 159), 17)
    video = tiny_budget(folder, {"image": 4, "video": {"count": 1, "num_frames": 11}}, max_model_len=1024)
    assert (video.profiled_modality, profile_of(video), video.profiled_tiles) == ("video", (177, 2048, 8, 177), 11)


def test_internvl_profiles_its_video_of_the_frames_the_context_holds(tmp_path: Path) -> None:
    """InternVL (transformers format, vLLM's interns1.py): no get_mm_max_tokens_per_item, so M is
    the dummy's count; the dummy video has a frame of 256 embeddings for each 256 tokens of
    max_model_len left after one largest image (13 x 256 = 3,328): at 8,192, 19 frames (4,864), so
    the video is profiled, one a step (B = 4,864); with images off, 32 frames (the whole 8,192);
    with num_frames 4 the dummy and M are 1,024, below the image: one image a step (B = 3,328)."""
    config = {
        "model_type": "internvl",
        "image_token_id": 2050,
        "downsample_ratio": 0.5,
        "text_config": {**TEXT, "model_type": "qwen2"},
        "vision_config": {"hidden_size": 64, "intermediate_size": 128, "image_size": [448, 448],
                          "patch_size": [14, 14], "num_attention_heads": 2},
    }  # fmt: skip
    images = {"image_seq_length": 256, "size": {"height": 448, "width": 448}, "max_patches": 12}
    folder = _folder(tmp_path, config, images)
    both = tiny_budget(folder, {"image": 4, "video": 1}, max_model_len=8192)
    assert (both.profiled_modality, profile_of(both)) == ("video", (4864, 4864, 1, 4864))
    videos = tiny_budget(folder, {"image": 0, "video": 1}, max_model_len=8192)
    assert (videos.profiled_modality, profile_of(videos)) == ("video", (8192, 8192, 1, 8192))
    few = tiny_budget(folder, {"image": 4, "video": {"count": 1, "num_frames": 4}}, max_model_len=8192)
    assert (few.profiled_modality, profile_of(few)) == ("image", (3328, 3328, 1, 3328))
    # InternVL3-hf's preprocessor_config.json turns crop_to_patches off: vLLM's get_max_image_tokens
    # then says 1 patch (256), leaving 31 frames (7,936), though the processor crops the image.
    (folder / "preprocessor_config.json").write_text(json.dumps({**images, "crop_to_patches": False}))
    uncropped = tiny_budget(folder, {"image": 4, "video": 1}, max_model_len=8192)
    assert (uncropped.profiled_modality, profile_of(uncropped)) == ("video", (7936, 7936, 1, 7936))


def test_a_qwen2_5_vl_with_videos_on_credits_one_video_not_six_images(tmp_path: Path) -> None:
    """The published Qwen2.5-VL config with the processors' defaults (transformers 5.19: images of
    at most 1,003,520 pixels, 1,280 embeddings; video frames of at most 602,112) at max_model_len
    32,768 and max_num_batched_tokens 8,192: M_video is 14 frames of the 1,280-embedding image,
    7 x 1,280 = 8,960, so vLLM profiles ONE video, resized by the video processor to 720
    embeddings a frame: 5,040. kvgate used to credit 6 images of 1,280 (7,680): a step of six
    full images is now charged the 8,960 - 5,040 embeddings' activations the profile did not
    run, not the 512 a step of B exceeds six images by."""
    folder = write_config(tmp_path / "qwen2.5-vl", "qwen2.5-vl-7b-instruct")
    geometry = ModelGeometry.from_config(config_json("qwen2.5-vl-7b-instruct"))
    settings = deployment(32768, 8192, 256)
    videos_on = encoder_budget(str(folder), settings, media_options(None, None), geometry)
    images_only = encoder_budget(str(folder), settings, media_options(None, {"video": 0}), geometry)
    assert videos_on is not None
    assert images_only is not None
    assert profile_of(videos_on) == (8960, 8960, 1, 5040)
    assert profile_of(images_only) == (1280, 8192, 6, 1280)
    step = videos_on.terms([1280] * 6)
    tower = videos_on.tower
    charged = {t.name: t.bytes for t in step}
    assert charged["encoder_activations"] == tower.activation_bytes(8960 - 5040, 0)
    assert charged["encoder_cache"] == tower.output_bytes(8960 - 5040)
    # images only: the profile ran 6 x 1,280 of B 8,192, so only the 512 a step can exceed it by
    assert {t.name: t.bytes for t in images_only.terms([1280] * 6)}["encoder_activations"] == tower.activation_bytes(
        512, 0
    )
    assert "1 video item(s) of 5,040 embeddings" in step[0].detail


def test_video_settings_the_processor_refuses_credit_the_profile_nothing(tmp_path: Path) -> None:
    """A videos_kwargs pixel range that is not a number (vLLM's processor would fail on it too):
    which item vLLM profiles is unknown, so kvgate credits its profile no embeddings."""
    videos = {**QWEN2_VL_PROCESSOR, "video_processor_type": "Qwen2VLVideoProcessor"}
    folder = _folder(tmp_path, QWEN2_VL, QWEN2_VL_PROCESSOR, videos)
    budget = tiny_budget(folder, {"image": 4, "video": 1}, {"videos_kwargs": {"max_pixels": "many"}})
    assert budget.profiled_embeddings == 0


def _phi4mm_folder(tmp_path: Path, compression_rate: int = 8) -> Path:
    """Phi-4-multimodal's config.json (dynamic_hd 36: its largest image 10,065 embeddings) with
    this audio compression rate (the checkpoint's 8: its 241,000-sample dummy audio is 188)."""
    layer = {**PHI4MM_CONFIG["embd_layer"]["audio_embd_layer"], "compression_rate": compression_rate}
    config = {**config_json("qwen2.5-7b-instruct"), **PHI4MM_CONFIG, "embd_layer": {"audio_embd_layer": layer}}
    folder = tmp_path / f"phi4mm-{compression_rate}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({"dynamic_hd": 36}))
    return folder


@pytest.mark.parametrize(
    ("limits", "rate", "modality", "expected"),
    [
        # images off: vLLM profiles 10 dummy audios of 188 (2,048 // 188; 8 sequences x 3 audios)
        ({"image": 0, "audio": 3}, 8, "audio", (188, 2048, 10, 188)),
        # audio's length option: 50,000 samples, 311 frames, 39 embeddings; 16 of them (8 x 2)
        ({"image": 0, "audio": {"count": 2, "length": 50000}}, 8, "audio", (39, 2048, 16, 39)),
        # images on, with or without audio: one largest image (vLLM: {"image": 10065[, "audio": 188]})
        ({"image": 2, "audio": 0}, 8, "image", (10065, 10065, 1, 10065)),
        ({"image": 2, "audio": 3}, 8, "image", (10065, 10065, 1, 10065)),
        # compression 1: the dummy audio's 1,504 outweigh a 1 x 448 dummy image's 305 (vLLM:
        # {"image": 305, "audio": 1504}, audio, 1 item): the vision tower ran nothing
        ({"image": {"count": 2, "width": 1, "height": 448}, "audio": 3}, 1, "audio", (1504, 2048, 1, 1504)),
    ],
)
def test_phi4mm_profiles_the_modality_vllm_picks(
    tmp_path: Path, limits: dict, rate: int, modality: str, expected: tuple[int, int, int, int]
) -> None:
    """vLLM 0.32.0's MultiModalBudget on these settings (max_model_len 16,384; the numbers of
    tests/integration/test_phi4mm_counts.py's in-process run): kvgate credits the profile the
    dummy audios it ran where their item outweighs the images' (images off), never the images'."""
    budget = tiny_budget(_phi4mm_folder(tmp_path, rate), limits, max_model_len=16384)
    assert (budget.profiled_modality, profile_of(budget)) == (modality, expected)
    assert budget.tower_profiled == (modality == "image")


def test_phi4mm_with_images_off_charges_the_cache_its_audio_profile_did_not_hold(tmp_path: Path) -> None:
    """Images off: vLLM's profile held 10 x 188 audio embeddings of a cache of 2,048, so three
    188-embedding audios (564) are charged the 168 it did not hold (crediting the largest image's
    10,065, as kvgate did before, charged them none)."""
    budget = tiny_budget(_phi4mm_folder(tmp_path), {"image": 0, "audio": 3}, max_model_len=16384)
    terms = {t.name: t.bytes for t in budget.terms([188] * 3, tiles=[OTHER_MODALITY] * 3)}
    assert terms["encoder_cache"] == (2048 - 10 * 188) * budget.tower.output_width * budget.tower.dtype_bytes > 0


def test_phi4mm_with_images_off_credits_the_conformer_forward_its_dummy_audio_ran(tmp_path: Path) -> None:
    """Images off: vLLM's profile ran 10 dummy audios of 188 embeddings through the Conformer, one
    at a time, so a request's largest audio forward is credited what one of them surely held: at
    8 x 187 + 1 = 1,497 frames, Conv2d(1, 1,024, stride 2)'s 1,024 x 749 x 40 bf16 map and its
    ReLU's copy (2 x 61,358,080 B) and the features in float32 and twice in bf16 (1,497 x 80 x 8 B):
    123,674,240 B. A 60 s audio (750 embeddings, 6,000 frames: tests/unit/test_memory_encoder.py's
    557,395,268 B with its features) is charged the rest; a 1 s audio (13) its features only.
    Images on, the profile ran no Conformer: the same audio is charged whole."""
    credit = 2 * 1024 * 749 * 40 * 2 + 1497 * 80 * (2 * 2 + 4)
    assert credit == 123_674_240
    off = tiny_budget(_phi4mm_folder(tmp_path), {"image": 0, "audio": 3}, max_model_len=16384)
    terms = {t.name: t for t in off.terms([750], tiles=[OTHER_MODALITY])}
    assert terms["audio_encoder_activations"].bytes == 557_395_268 - credit
    assert "118 MiB credited" in terms["audio_encoder_activations"].detail
    short = {t.name: t.bytes for t in off.terms([13], tiles=[OTHER_MODALITY])}
    assert short["audio_encoder_activations"] == 8 * 13 * 80 * 4  # the float32 features
    on = tiny_budget(tmp_path / "phi4mm-8", {"image": 2, "audio": 3}, max_model_len=16384)
    whole = {t.name: t.bytes for t in on.terms([750], tiles=[OTHER_MODALITY])}
    assert whole["audio_encoder_activations"] == 557_395_268
