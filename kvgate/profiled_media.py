"""Which modality vLLM's start-up profile encodes, and the embeddings of its items.

The encoder's share of the profile decides what kvgate may credit a request's encoder step with
(kvgate/memory/encoder.py `EncoderBudget`). Read in vLLM 0.32.0 and 0.33.0 (the files named are
the same in both), for V1 (v1/worker/gpu_model_runner.py `GPUModelRunner.profile_run`:
`mm_budget.get_modality_with_max_tokens()`, then `_get_mm_dummy_batch`) and V2 (v1/worker/gpu/
model_runner.py `profile_run`: `MultiModalBudget.get_dummy_encoder_profile_inputs()`, run by
v1/worker/gpu/mm/encoder_runner.py `EncoderRunner.profile_encoder_cache`), both through
multimodal/encoder_budget.py `MultiModalBudget`:

- the active modalities are those --limit-mm-per-prompt allows (count above 0); each one's most
  embeddings an item, M_m, is the model's `get_mm_max_tokens_per_item(max_model_len, one item of
  each)` (`get_mm_max_toks_per_item`);
- the encoder budget B and cache C are max(`max_num_batched_tokens`, max M_m)
  (v1/core/encoder_cache_manager.py `compute_mm_encoder_budget`);
- the profile encodes the modality P of the largest M_m, a tie going to the name later in the
  alphabet (`get_modality_with_max_tokens`: `max(..., key=(tokens, modality))`, so "video" over
  "image"), `_get_max_items(P, M_P)` copies of ONE dummy item of P (`get_dummy_mm_inputs({P: 1})`),
  whose embeddings D are what the model's processor makes of the dummy, not M_P: on Qwen2-VL the
  dummy video is resized by the video processor while M_video is counted at the image
  processor's size.

Phi-4-multimodal's phi4mm.py, multimodal/parse.py and multimodal/processing/dummy_inputs.py,
read for its dummy audio (`audio_item`), are the same files in 0.32.0 and 0.33.0 too.

Checked in-process against vLLM 0.32.0's `MultiModalBudget` on tiny Qwen2-VL, Qwen3-VL and
LLaVA-OneVision folders (tests/integration/test_multimodal_vllm.py) and on Phi-4-multimodal's
processing info with its HF processor stood in for (tests/integration/test_phi4mm_counts.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.audio import LogMelFrames
from kvgate.image_rules import (
    CroppedPatches,
    DynamicResolution,
    TimedFrames,
    TimedVideoGrid,
    VideoGrid,
    pixel_range,
    smart_resize,
    video_smart_resize,
)
from kvgate.media import ImageSize, VideoFrames

# vLLM 0.32.0 / 0.33.0 qwen2_vl.py `_MAX_FRAMES_PER_VIDEO` (Qwen2-VL, Qwen2.5-VL) and
# llava_onevision.py's.
QWEN2_VL_MAX_FRAMES = 14
ONEVISION_MAX_FRAMES = 16
PHI4MM_DUMMY_AUDIO_SAMPLES = 241_000  # phi4mm.py `_AUDIO_MAX_SOUNDFILE_SIZE`
QWEN3_VL_DUMMY_FRAMES = 2  # qwen3_vl.py `Qwen3VLDummyInputsBuilder.get_dummy_mm_data`: "treat videos as special images"


@dataclass(frozen=True)
class ProfiledItem:
    """The start-up profile's encoder step as vLLM plans it: K items of D embeddings, K being
    `_get_max_items(P, M)`; M, the profiled modality's most an item, is also the most of any
    active modality (it is the largest), which sizes B and C."""

    modality: str  # P
    max_item: int  # M
    dummy: int  # D: the embeddings of each dummy item the profile encodes (0: not read, credit none)
    dummy_tiles: int = 0  # the tiles (frames) the dummy runs on a tiled tower (0: the largest image's)


def profiled_item(
    items: Mapping[str, tuple[int, int, int]], limits: Mapping[str, int], default_limit: int
) -> ProfiledItem | None:
    """vLLM's choice among `items` (per modality: M, the dummy's embeddings and tiles) of the
    modalities `limits` allow. None: no modality active (vLLM's encoder budget is 0)."""
    active = {m: item for m, item in items.items() if limits.get(m, default_limit) > 0}
    if not active:
        return None
    modality, (most, dummy, tiles) = max(active.items(), key=lambda kv: (kv[1][0], kv[0]))
    return ProfiledItem(modality, most, dummy, tiles)


def video_item(
    config: Mapping[str, Any],
    rule: object,
    images: Mapping[str, Any],
    videos: Mapping[str, Any],
    seq_len: int,
    options: Mapping[str, Any],
    images_on: bool = False,
) -> tuple[int, int, int] | None:
    """The video's (M, dummy embeddings, dummy tiles) on the families read (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, LLaVA-OneVision, InternVL in transformers' format), else None (a family whose videos
    kvgate does not read: its profile is taken to be of images, docs/limitations.md). `images` /
    `videos`: --mm-processor-kwargs' images_kwargs and videos_kwargs as the processor runs them;
    `options`: --limit-mm-per-prompt's video options; `images_on`: whether --limit-mm-per-prompt
    allows images (InternVL's dummy video leaves room for one)."""
    if isinstance(rule, DynamicResolution) and isinstance(rule.video, VideoGrid):
        return (*qwen2_vl_video(rule, rule.video, images, videos, seq_len, options), 0)
    if isinstance(rule, DynamicResolution) and isinstance(rule.video, TimedVideoGrid):
        return (*qwen3_vl_video(rule, rule.video, videos, options), 0)
    if config.get("model_type") == "llava_onevision":
        most = onevision_video(config, seq_len, options)
        return most, most, onevision_frames(config, seq_len, options)
    if isinstance(rule, CroppedPatches):
        frames = internvl_frames(rule, seq_len, rule.vllm_most(images) if images_on else 0, options)
        return frames * rule.per_patch, frames * rule.per_patch, frames
    return None


def audio_item(audio: object, options: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """Phi-4-multimodal's audio (M, dummy embeddings, 0 tiles), weighed against its images, else
    None (Qwen2-Audio has no other modality). phi4mm.py states no `get_mm_max_tokens_per_item`,
    so M is the dummy's count (encoder_budget.py `get_mm_max_toks_per_item`'s fallback):
    `Phi4MMDummyInputsBuilder.get_dummy_mm_data` draws `_AUDIO_MAX_SOUNDFILE_SIZE` samples of
    silence, less --limit-mm-per-prompt's audio length (`_get_dummy_audios`), an array without a
    rate, so not resampled (multimodal/parse.py `_get_audio_with_sr`), counted at the feature
    extractor's rate (`get_audio_replacement_phi4mm`: `get_audio_num_frames`,
    `_compute_audio_embed_size`): 188 embeddings at compression rate 8."""
    if not isinstance(audio, LogMelFrames):
        return None
    samples = PHI4MM_DUMMY_AUDIO_SAMPLES
    asked = options.get("length")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
        samples = min(samples, asked)
    most = audio.embeddings(samples)
    return most, most, 0


def internvl_frames(rule: CroppedPatches, seq_len: int, image_most: int, options: Mapping[str, Any]) -> int:
    """The frames of InternVL's (transformers format) dummy video, one tile of image_seq_length
    embeddings each: vLLM states no `get_mm_max_tokens_per_item` for it, so its M is the dummy's
    count (interns1.py `InternS1DummyInputsBuilder.get_dummy_mm_data`; the video's replacement is
    a frame per patch, `get_replacement_interns1_video`): seq_len less one largest image where
    images are on, over image_seq_length, at least 1 (`get_num_frames_with_most_features` of one
    item each; the image as `get_max_image_tokens` counts it, `CroppedPatches.vllm_most`), less
    --limit-mm-per-prompt's video num_frames (`_get_dummy_videos`)."""
    frames = max((seq_len - image_most) // rule.per_patch, 1)
    asked = options.get("num_frames")
    return min(frames, asked) if isinstance(asked, int) and asked > 0 else frames


def qwen2_vl_video(
    rule: DynamicResolution,
    video: VideoGrid,
    images: Mapping[str, Any],
    videos: Mapping[str, Any],
    seq_len: int,
    options: Mapping[str, Any],
) -> tuple[int, int]:
    """(M_video, the dummy video's embeddings) on Qwen2-VL / Qwen2.5-VL: qwen2_vl.py
    `get_max_video_tokens` counts the largest image (`get_image_size_with_most_features`) over
    `get_num_frames_with_most_features(seq_len, {"video": 1})` frames (the most whose tokens fit
    seq_len, at most 14, at least 1) within the IMAGE processor's size under the videos_kwargs
    (`_get_vision_info(modality="video")`: `default_size=image_processor.size`);
    `Qwen2VLDummyInputsBuilder.get_dummy_mm_data` draws that video, less --limit-mm-per-prompt's
    video num_frames / width / height (`_get_dummy_videos`), and the video processor counts it
    (`video`: its own size)."""
    largest = rule.largest(rule.pixel_range(images)[1])
    low, high = pixel_range(rule.size, videos)
    unit = rule.patch_size * rule.merge_size
    height, width = smart_resize(largest.height, largest.width, unit, low, high)
    per_step = (height // rule.patch_size) * (width // rule.patch_size) // rule.merge_size**2

    def tokens(frames: int) -> int:
        return max(math.ceil(frames / video.temporal_patch_size), 1) * per_step

    frames = 1
    while frames < QWEN2_VL_MAX_FRAMES and tokens(frames + 1) <= seq_len:
        frames += 1
    dummy = _overridden(VideoFrames(frames, largest), options)
    return tokens(frames), video.replacement(dummy, videos).features


def qwen3_vl_video(
    rule: DynamicResolution, video: TimedVideoGrid, videos: Mapping[str, Any], options: Mapping[str, Any]
) -> tuple[int, int]:
    """(M_video, the dummy video's embeddings) on Qwen3-VL: qwen3_vl.py `get_max_video_tokens`
    and `Qwen3VLDummyInputsBuilder.get_dummy_mm_data` (vLLM 0.32.0 and 0.33.0) count two frames of
    the largest image within the video processor's size over its temporal patch
    (`video_smart_resize`, no per-frame cap), the dummy shrunk by --limit-mm-per-prompt's video
    width / height. Where --mm-processor-kwargs set `cap_pixels_per_frame`, the dummy has
    enough frames for the cap not to bind (ceil(longest_edge / (max_video_tokens x
    (patch x merge)^2)), at most max_frames, at least 2; max_video_tokens, patch and merge the
    kwargs' over the processor's), sized as those frames; the processor then encodes it under
    its cap (the kwargs' or its own: `TimedVideoGrid.frames`)."""
    low, high = pixel_range(video.size, videos)
    temporal = int(videos.get("temporal_patch_size") or video.temporal_patch_size)
    largest = rule.largest(high // temporal)
    unit = rule.patch_size * rule.merge_size
    height, width = video_smart_resize(
        QWEN3_VL_DUMMY_FRAMES, largest.height, largest.width, video.temporal_patch_size, unit, low, high
    )
    most = (height // rule.patch_size) * (width // rule.patch_size) // rule.merge_size**2
    most *= -(-QWEN3_VL_DUMMY_FRAMES // video.temporal_patch_size)
    count = QWEN3_VL_DUMMY_FRAMES
    if videos.get("cap_pixels_per_frame"):
        spread = int(videos.get("max_video_tokens", video.max_video_tokens))
        spread *= (
            int(videos.get("patch_size", video.patch_size)) * int(videos.get("merge_size", video.merge_size))
        ) ** 2
        count = max(count, min(video.max_frames, -(-high // spread)))
        height, width = video_smart_resize(
            count, largest.height, largest.width, video.temporal_patch_size, unit, low, high
        )
    size = _overridden(VideoFrames(count, ImageSize(width, height)), options).size
    per_patch, stamps = video.frames(TimedFrames(tuple(range(count)), 2.0, count, False, size), videos)
    return most, per_patch * len(stamps)


def onevision_video(config: Mapping[str, Any], seq_len: int, options: Mapping[str, Any]) -> int:
    """M_video on LLaVA-OneVision, whose frames run one tile each: vLLM states no
    `get_mm_max_tokens_per_item` for it, so `get_mm_max_toks_per_item` counts the dummy video
    (llava_onevision.py `get_dummy_mm_data`): ceil(grid / spatial_pool_stride)^2 embeddings a frame
    (`_get_num_frame_tokens`, grid = image_size // patch_size) over `onevision_frames`, plus the
    newline (`get_num_video_tokens`)."""
    return _onevision_frame_tokens(config) * onevision_frames(config, seq_len, options) + 1


def onevision_frames(config: Mapping[str, Any], seq_len: int, options: Mapping[str, Any]) -> int:
    """The frames of LLaVA-OneVision's dummy video: the most whose embeddings fit seq_len, at most
    16, at least 1 (`get_num_frames_with_most_features` of one video), less --limit-mm-per-prompt's
    video num_frames (`_get_dummy_videos`)."""
    per_frame = _onevision_frame_tokens(config)
    frames = max(min((seq_len - 1) // per_frame, ONEVISION_MAX_FRAMES), 1)
    asked = options.get("num_frames")
    return min(frames, asked) if isinstance(asked, int) and asked > 0 else frames


def _onevision_frame_tokens(config: Mapping[str, Any]) -> int:
    vision = config.get("vision_config") or {}
    grid = int(vision.get("image_size", 384)) // int(vision.get("patch_size", 14))
    return math.ceil(grid / int(config.get("spatial_pool_stride", 2))) ** 2


def _overridden(video: VideoFrames, options: Mapping[str, Any]) -> VideoFrames:
    """The dummy video less --limit-mm-per-prompt's video num_frames / width / height where lower
    (multimodal/processing/dummy_inputs.py `BaseDummyInputsBuilder._get_dummy_videos`)."""

    def lower(value: int, key: str) -> int:
        asked = options.get(key)
        return min(value, asked) if isinstance(asked, int) and asked > 0 else value

    size = ImageSize(lower(video.size.width, "width"), lower(video.size.height, "height"))
    return VideoFrames(lower(video.frames, "num_frames"), size)
