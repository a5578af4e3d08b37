"""The simulator's vision encoder: Qwen2-VL / Qwen2.5-VL images, their encoder step and the encoder
cache, as vLLM runs them on CUDA. The simulator's own reading (not kvgate's memory model):

- An image's tokens: transformers' Qwen2-VL `smart_resize` (both sides multiples of
  patch x merge, the area within [min_pixels, max_pixels]), one embedding per merge^2 patches
  (vllm/model_executor/models/qwen2_vl.py `Qwen2VLProcessingInfo._get_vision_info`). The
  chat's `<|image_pad|>` becomes that many image tokens.
- The encoder step (qwen2_5_vl.py `Qwen2_5_VisionTransformer.forward`, one call for all of a
  step's images, v1/worker/gpu_model_runner.py `_execute_mm_encoder`): the pixel values
  (float32 from the processor, and the copy in the tower's dtype), the patch embedding, one
  vision block played for all (norm, qkv, rotary q and k, flash attention's output, projection,
  residual; norm, gate_up, SiluAndMul, down, residual), then the merger (norm, a
  `4h` MLP to the decoder's width): its outputs are the cache entries; everything else is freed.
- The encoder cache (v1/core/encoder_cache_manager.py `EncoderCacheManager`): at most C
  embeddings; an entry is needed while its request's prefill has not passed it, then
  "freeable": kept on the GPU until a new entry needs its room (oldest first). The scheduler
  (v1/core/sched/scheduler.py `_try_schedule_encoder_inputs`) encodes whole items, at most B
  embeddings a step; an item that does not fit cuts the request's chunk before it.
- The start-up profile (kvgate/sim/startup.py) encodes K largest items of the modality whose
  largest item is largest (with videos allowed, vLLM's default, a video of several frames of the
  largest image on most deployments: `VisionTower.largest_video`) and keeps their outputs
  through the decoder's dummy step, on V1 and on V2 from 0.28.0 (kvgate/sim/flavor.py).
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.sim.gpu import Block, CachingAllocator

Tape = list[tuple[str, str, int]]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
_PNG = b"\x89PNG\r\n\x1a\n"


class ImageError(ValueError):
    """An image the simulator cannot read (vLLM answers 400)."""


@dataclass(frozen=True)
class VisionTower:
    image_token_id: int
    patch: int
    merge: int
    min_pixels: int
    max_pixels: int
    hidden: int
    intermediate: int
    gated: bool  # Qwen2.5-VL's gate_up MLP; Qwen2-VL's fc1/QuickGELU/fc2
    input_width: int  # pixel values per patch
    output_width: int  # the decoder's hidden size
    dtype_bytes: int
    # The video processor's pixel range a frame (transformers' Qwen2VLVideoProcessor reads
    # preprocessor_config.json where the folder has no video_preprocessor_config.json) and the
    # frames a temporal patch.
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    temporal: int = 2

    def embeddings(self, width: int, height: int) -> int:
        return self._resized(width, height, self.min_pixels, self.max_pixels)

    def _resized(self, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
        """One frame's embeddings after transformers' smart_resize within [min_pixels, max_pixels]."""
        unit = self.patch * self.merge
        if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
            raise ImageError(f"image of {width} x {height} pixels: aspect ratio must be at most 200")
        h, w = round(height / unit) * unit, round(width / unit) * unit
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h = max(unit, math.floor(height / beta / unit) * unit)
            w = max(unit, math.floor(width / beta / unit) * unit)
        elif h * w < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
        return (h // self.patch) * (w // self.patch) // (self.merge * self.merge)

    def largest_video(self, max_model_len: int) -> tuple[int, int]:
        """(M_video, the profile's dummy video's embeddings) with videos allowed (vLLM's default
        limit): qwen2_vl.py `get_max_video_tokens` counts frames of the largest image at the IMAGE
        processor's pixels, as many as fit max_model_len, 1 to 14 (`_MAX_FRAMES_PER_VIDEO`);
        `get_dummy_mm_data` draws that many frames of the largest image, which the video processor
        resizes within its own pixel range."""
        unit = self.patch * self.merge
        count = self.max_embeddings
        short = next(d for d in range(math.isqrt(count), 0, -1) if count % d == 0 and count // d <= 200 * d)
        width, height = unit * (count // short), unit * short
        frames = 1
        while frames < 14 and -(-(frames + 1) // self.temporal) * count <= max_model_len:
            frames += 1
        steps = -(-frames // self.temporal)
        return steps * count, steps * self._resized(width, height, self.video_min_pixels, self.video_max_pixels)

    @property
    def max_embeddings(self) -> int:
        """The most one image takes: vLLM profiles with it (`get_mm_max_tokens_per_item`)."""
        return max(1, self.max_pixels // (self.patch * self.merge) ** 2)

    def encode_tape(self, items: list[int]) -> Tape:
        """One encoder step over these items (embeddings each); leaves `out:<i>` allocated."""
        d, h, inner = self.dtype_bytes, self.hidden, self.intermediate
        patches = sum(items) * self.merge * self.merge
        t: Tape = [
            ("alloc", "pixels", patches * self.input_width * 4),
            ("alloc", "pixels_dtype", patches * self.input_width * d),
            ("alloc", "x", patches * h * d),
        ]
        for op in (
            ("alloc", "norm", h),
            ("alloc", "qkv", 3 * h),
            ("alloc", "q_rot", h),
            ("alloc", "k_rot", h),
            ("alloc", "attn", h),
            ("free", "q_rot", 0),
            ("free", "k_rot", 0),
            ("free", "qkv", 0),
            ("alloc", "proj", h),
            ("free", "attn", 0),
            ("free", "norm", 0),
            ("alloc", "x2", h),
            ("free", "proj", 0),
            ("free", "x", 0),
            ("alloc", "norm", h),
            ("alloc", "up", (2 if self.gated else 1) * inner),
            ("free", "norm", 0),
            ("alloc", "act", inner),
            ("free", "up", 0),
            ("alloc", "down", h),
            ("free", "act", 0),
            ("alloc", "x", h),
            ("free", "down", 0),
            ("free", "x2", 0),
        ):
            t.append((op[0], op[1], patches * op[2] * d))
        merged = patches // (self.merge * self.merge)
        wide = h * self.merge * self.merge
        t += [
            ("alloc", "merger_norm", patches * h * d),
            ("free", "x", 0),
            ("alloc", "merger_fc1", merged * wide * d),
            ("free", "merger_norm", 0),
            ("alloc", "merger_act", merged * wide * d),
            ("free", "merger_fc1", 0),
        ]
        t += [("alloc", f"retained:out:{i}", n * self.output_width * d) for i, n in enumerate(items)]
        t += [("free", name, 0) for name in ("merger_act", "pixels_dtype", "pixels")]
        return t


def read_tower(config: Mapping[str, Any], processor: Mapping[str, Any], dtype_bytes: int) -> VisionTower | None:
    """A Qwen2-VL or Qwen2.5-VL tower from config.json and preprocessor_config.json."""
    family = config.get("model_type")
    vision = config.get("vision_config")
    if family not in ("qwen2_vl", "qwen2_5_vl") or not isinstance(vision, Mapping):
        return None
    qwen2 = family == "qwen2_vl"
    hidden = int(vision["embed_dim"] if qwen2 else vision["hidden_size"])
    given = processor.get("size")
    size: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    patch = int(processor.get("patch_size") or vision.get("patch_size", 14))
    return VisionTower(
        image_token_id=int(config["image_token_id"]),
        patch=patch,
        merge=int(processor.get("merge_size") or vision.get("spatial_merge_size", 2)),
        min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        hidden=hidden,
        intermediate=int(hidden * vision.get("mlp_ratio", 4)) if qwen2 else int(vision["intermediate_size"]),
        gated=not qwen2,
        input_width=int(vision.get("in_chans", 3)) * int(vision.get("temporal_patch_size", 2)) * patch * patch,
        output_width=int(config["hidden_size"] if qwen2 else vision.get("out_hidden_size") or config["hidden_size"]),
        dtype_bytes=dtype_bytes,
        video_min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or 128 * 28 * 28),
        video_max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or 768 * 28 * 28),
        temporal=int(processor.get("temporal_patch_size") or vision.get("temporal_patch_size", 2)),
    )


def png_size(url: str) -> tuple[int, int]:
    """(width, height) of a base64 PNG data URL, from its IHDR chunk."""
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("the simulator reads images as base64 data URLs only")
    try:
        raw = base64.b64decode(data[:64], validate=False)
    except (binascii.Error, ValueError):
        raise ImageError("invalid base64 image data") from None
    if len(raw) < 24 or not raw.startswith(_PNG) or raw[12:16] != b"IHDR":
        raise ImageError("the simulator reads PNG images only")
    width, height = struct.unpack(">II", raw[16:24])
    return int(width), int(height)


@dataclass
class Item:
    """One image of a request: where its tokens start in the prompt and how many there are."""

    start: int
    length: int


class EncoderCache:
    """The encoder's outputs on the GPU, C embeddings at most (EncoderCacheManager)."""

    def __init__(self, alloc: CachingAllocator, size: int) -> None:
        self.alloc = alloc
        self.size = size
        self.used = 0  # embeddings of every entry, needed or freeable
        self.entries: dict[tuple[str, int], tuple[int, Block | None]] = {}
        self.freeable: OrderedDict[tuple[str, int], None] = OrderedDict()

    def has(self, key: tuple[str, int]) -> bool:
        return key in self.entries

    def room_for(self, embeddings: int, reserved: int) -> bool:
        freeable = sum(self.entries[k][0] for k in self.freeable)
        return self.used - freeable + reserved + embeddings <= self.size

    def make_room(self, embeddings: int) -> None:
        """Evict freeable entries, oldest first, until `embeddings` more fit."""
        while self.used + embeddings > self.size and self.freeable:
            key, _ = self.freeable.popitem(last=False)
            n, block = self.entries.pop(key)
            self.used -= n
            if block is not None:
                self.alloc.free(block)

    def add(self, key: tuple[str, int], embeddings: int, block: Block | None) -> None:
        self.make_room(embeddings)
        self.entries[key] = (embeddings, block)
        self.used += embeddings

    def release(self, key: tuple[str, int]) -> None:
        """No request needs it any more: freeable (still on the GPU)."""
        if key in self.entries and key not in self.freeable:
            self.freeable[key] = None

    def release_request(self, request_id: str) -> None:
        for key in [k for k in self.entries if k[0] == request_id]:
            self.release(key)

    def fork(self, alloc: CachingAllocator) -> EncoderCache:
        """A copy for a dry run on `alloc` (a copy of this one's allocator): its entries keep their
        room but not their blocks, so evicting one frees nothing (a dry run over-counts)."""
        twin = EncoderCache(alloc, self.size)
        twin.used = self.used
        twin.entries = {key: (n, None) for key, (n, _) in self.entries.items()}
        twin.freeable = OrderedDict(self.freeable)
        return twin

    def reference(self, key: tuple[str, int]) -> None:
        """A cached entry a scheduled request needs again (check_and_update_cache)."""
        self.freeable.pop(key, None)


class EncoderScheduling:
    """The encoder's share of one step's scheduling: B embeddings of compute, the cache's room."""

    def __init__(self, cache: EncoderCache, compute_budget: int) -> None:
        self.cache = cache
        self.compute_budget = compute_budget
        self.start_step()

    def fork(self, alloc: CachingAllocator) -> EncoderScheduling:
        """A copy for a dry run (bench/oracle.py) that leaves this one's state alone."""
        return EncoderScheduling(self.cache.fork(alloc), self.compute_budget)

    def start_step(self) -> None:
        self.budget = self.compute_budget
        self.reserved = 0
        self.to_encode: dict[str, list[int]] = {}

    def fit(self, request_id: str, items: list[Item], computed: int, n: int) -> int:
        """The tokens of [computed, computed + n) this step can take: cut before the first item
        that is neither cached nor fits the step's encoder budget and the cache."""
        chosen = []
        for i, item in enumerate(items):
            if item.start >= computed + n or item.start + item.length <= computed:
                continue
            key = (request_id, i)
            if self.cache.has(key):
                self.cache.reference(key)
                continue
            if item.length > self.budget or not self.cache.room_for(item.length, self.reserved):
                n = item.start - computed
                break
            self.budget -= item.length
            self.reserved += item.length
            chosen.append(i)
        if n > 0 and chosen:
            self.to_encode.setdefault(request_id, []).extend(chosen)
        return max(0, n)


def encoder_budget(tower: VisionTower, max_num_batched_tokens: int, max_model_len: int) -> int:
    """B and C (v1/core/encoder_cache_manager.py `compute_mm_encoder_budget`: both
    `max_num_batched_tokens` by default, at least one largest item of any modality allowed,
    multimodal/encoder_budget.py `MultiModalBudget`: videos are, by default, and their largest
    item outweighs an image once max_model_len holds 3 frames)."""
    return max(max_num_batched_tokens, tower.max_embeddings, tower.largest_video(max_model_len)[0])


def profile_items(tower: VisionTower, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """The profile's dummy batch (multimodal/encoder_budget.py `get_dummy_encoder_profile_inputs`):
    the modality whose largest item is largest, a tie to "video" (`get_modality_with_max_tokens`);
    as many of its dummy item as B holds of its largest, at most max_num_seqs prompts' worth
    (`_get_max_items`, 999 items a prompt)."""
    largest, dummy = tower.max_embeddings, tower.max_embeddings
    video, video_dummy = tower.largest_video(max_model_len)
    if video >= largest:
        largest, dummy = video, video_dummy
    per_prompt = max(1, min(999, max_model_len // largest))
    count = max(
        1, min(encoder_budget(tower, max_num_batched_tokens, max_model_len) // largest, max_num_seqs * per_prompt)
    )
    return [dummy] * count
