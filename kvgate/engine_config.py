"""The engine kvgate guards, resolved: vLLM flags merged with what the backend itself reports.

What vLLM publishes (cache_config_info on /metrics, max_model_len on /v1/models) is the truth
about the running server and wins over kvgate's flags; each disagreement is logged as a warning
so the operator can fix the flags they copied.

It takes plain values (EngineFlags, the backend's report), not the CLI's settings: the
composition root (kvgate.composition) translates one into the other.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvgate.memory.activation import (
    AnyCacheForward,
    AnyCacheSampler,
    EngineShape,
    LoneForward,
    LoneRequest,
    SamplerPhaseOverhead,
    SharedForward,
    V1AnyCacheStep,
    V1PenaltyStep,
    V1WarmupForward,
    moe_workspace_bytes,
    profile_forward_bytes,
    profile_hidden_bytes,
    profile_peak_bytes,
    profile_segment_overhead_bytes,
    v1_warmup_reserved_bytes,
)
from kvgate.memory.draft import Drafter
from kvgate.memory.encoder import ConformerTower, EncoderBudget, VisionTower, profile_encodes
from kvgate.memory.envelope import CUDA_CONTEXT_BYTES, NON_TORCH_INCREASE_BYTES, outside_envelope
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.kv import KVLayout
from kvgate.memory.lora import LoraSlots, slot_bytes
from kvgate.memory.outputs import OutputReserver
from kvgate.memory.sampler import v2_penalty_state_bytes
from kvgate.memory.vllm_runner import VllmRuntime, resolve_runtime
from kvgate.model_folder import read_model_config, read_sampling_defaults
from kvgate.predict import Predictor
from kvgate.speculative import resolve_drafter
from kvgate.telemetry.vllm import CacheConfig, EngineLimits, ServedModel
from kvgate.units import GiB

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvgate.image_rules import ImageRule, Replacement
    from kvgate.multimodal import MediaOptions

log = logging.getLogger("kvgate.deployment")
T = TypeVar("T")


@dataclass(frozen=True)
class EngineFlags:
    """What the operator told kvgate about vLLM's engine, by vLLM's flag names; `given` names the
    flags set explicitly (a default the backend contradicts is no cause for a warning)."""

    max_model_len: int | None
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    attention_backend: str
    num_gpu_blocks: int | None
    given: frozenset[str] = frozenset()
    model: str | None = None  # the model folder: its config.json feeds vLLM's runner rule
    vllm_version: str | None = None  # --vllm-version: overrides the backend's GET /version
    model_runner: str = "auto"
    speculative_method: str | None = None
    speculative_model: str | None = None
    draft_sample_method: str = "greedy"
    num_speculative_tokens: int = 0
    max_logprobs: int = 20
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    sampler: str = "auto"  # --sampler: the top-k/top-p backend, else vLLM's rule
    logprobs_mode: str = "raw_logprobs"  # processed_* modes keep V1 off FlashInfer's sampler
    lora: LoraSlots | None = None  # --enable-lora with --max-loras / --max-lora-rank


@dataclass(frozen=True)
class StaticLimits:
    """The budget's numbers before any live reading (see static_limits)."""

    kv_blocks: int | None
    transient_headroom_bytes: int | None
    max_transient_headroom_bytes: int | None
    profiled_peak_bytes: int
    # kvgate/memory/activation.py profile_segment_overhead_bytes, as a share of the profile peak in use
    segment_overhead: float
    # The part of the profile peak the engine does not hold after start-up (`profile_emptied_bytes`)
    profile_emptied_bytes: int = 0
    # the profile's forward pass (profile_forward_bytes): the most one step's forward terms take
    profiled_forward_bytes: int = 0
    forward_bytes_per_token: int = 0  # its share a token (max_num_batched_tokens of them)
    profiled_hidden_bytes: int = 0  # its final hidden states (activation.py profile_hidden_bytes)
    sampler_phase_overhead: SamplerPhaseOverhead | None = None  # activation.py: the sampler phase's replay
    lone_forward: LoneForward | None = None  # activation.py: a lone request's forward pass after earlier steps
    warmup_forward: V1WarmupForward | None = None  # activation.py: a V1 step from the warm-up's cache
    shared_forward: SharedForward | None = None  # activation.py: a served MLA step after the others' steps
    any_cache_forward: AnyCacheForward | None = None  # activation.py: a served step from any cache
    any_cache_sampler: AnyCacheSampler | None = None  # activation.py: its sampler phase too
    lone_request: LoneRequest | None = None  # activation.py: a request alone from the idle engine's cache
    penalty_step: V1PenaltyStep | None = None  # activation.py: a V1 penalty step in the held region
    v1_any_cache: V1AnyCacheStep | None = None  # activation.py: a V1 sampler phase from any cache


@dataclass(frozen=True)
class Deployment:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    attention_backend: str
    num_gpu_blocks: int | None
    mamba_cache_mode: str = "none"
    kv_cache_memory_bytes: int | None = None  # --kv-cache-memory-bytes: a fixed pool
    reported_request_blocks: float | None = None  # vLLM's blocks per max_model_len request
    runtime: VllmRuntime = field(default_factory=lambda: resolve_runtime(None))
    num_speculative_tokens: int = 0
    max_logprobs: int = 20
    enforce_eager: bool = False
    drafter: Drafter | None = None  # --speculative-config's draft model (kvgate/speculative.py)
    # The server's request defaults from generation_config.json (kvgate/model_folder.py)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    lora: LoraSlots | None = None  # --enable-lora (kvgate/memory/lora.py)

    def engine_shape(self) -> EngineShape:
        return engine_shape(
            self.runtime,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            tensor_parallel_size=self.tensor_parallel_size,
            attention_backend=self.attention_backend,
            block_size=self.block_size,
            num_speculative_tokens=self.num_speculative_tokens,
            max_logprobs=self.max_logprobs,
            draft=self.drafter,
            lora_rank=self.lora.max_lora_rank if self.lora else 0,
        )


def engine_shape(runtime: VllmRuntime, **flags: Any) -> EngineShape:
    """vLLM's flags (EngineShape's names) with what the release decides filled in from `runtime`
    (runner, sampler path and its rules): one place for the serving deployment and for
    `kvgate advise`'s start-up."""
    return EngineShape(
        **flags,
        runner=runtime.runner,
        sampler=runtime.sampler_backend,
        sampler_sort_below_rows=runtime.sampler_sort_below_rows,
        max_tokens_past_context_refused=runtime.max_tokens_past_context_refused,
        sampler_warmup_profile=runtime.sampler_warmup_profile,
        processed_logprobs=runtime.processed_logprobs,
        truncation_holds_output_token=runtime.truncation_holds_output_token,
        moe_workspace=runtime.moe_workspace,
    )


class Disagreements:
    """Warns once per disagreement between a flag and the backend's report, for one kvgate:
    every re-synchronisation (a backend restart) resolves the flags again."""

    def __init__(self) -> None:
        self._said: set[tuple[str, str, str]] = set()

    def warn(self, name: str, flag: object, reported: object) -> None:
        key = (name, str(flag), str(reported))
        if key not in self._said:
            self._said.add(key)
            log.warning("backend reports %s=%s but kvgate was given %s; using the backend's", name, reported, flag)


def _prefer(name: str, flag: T, reported: T | None, flag_given: bool, said: Disagreements) -> T:
    if reported is None:
        return flag
    if flag_given and flag != reported:
        said.warn(name, flag, reported)
    return reported


def _prefer_engine(name: str, flag: int, reported: int | None, said: Disagreements) -> int:
    """An engine limit: the backend's when it states it, with a warning when it differs from
    kvgate's flag, given or default (a default copied from no vLLM is still a wrong guess)."""
    if reported is None:
        return int(flag)
    if flag != reported:
        said.warn(name, flag, reported)
    return reported


def _model_config(model: str | None) -> dict[str, Any]:
    """The model's config.json, for what vLLM's runner rule reads beyond the geometry."""
    if not model:
        return {}
    try:
        return read_model_config(model)
    except (OSError, ValueError):
        return {}


def vllm_runtime(flags: EngineFlags, geometry: ModelGeometry, reported_version: str | None) -> VllmRuntime:
    """The vLLM behind kvgate: --vllm-version, else the backend's GET /version; its runner by
    vLLM's rule for that version unless --model-runner says."""
    config = _model_config(flags.model)
    runtime = resolve_runtime(
        flags.vllm_version or reported_version,
        flags.model_runner,
        architectures=config.get("architectures") or (),
        is_moe=geometry.is_moe,
        is_hybrid=geometry.is_hybrid_state,
        quantized="quantization_config" in config,
        speculative_method=flags.speculative_method,
        sampler=flags.sampler,
        logprobs_mode=flags.logprobs_mode,
    )
    if flags.vllm_version and reported_version and flags.vllm_version != reported_version:
        log.warning(
            "backend reports vLLM %s but kvgate was given --vllm-version %s; using the flag",
            reported_version,
            flags.vllm_version,
        )
    return runtime


def resolve(
    flags: EngineFlags,
    geometry: ModelGeometry,
    cache: CacheConfig | None,
    served: ServedModel | None,
    limits: EngineLimits | None = None,
    said: Disagreements | None = None,
    reported_version: str | None = None,
) -> Deployment:
    """Flags, overridden by the backend's own report where it has one."""
    said = said or Disagreements()
    given = flags.given
    runtime = vllm_runtime(flags, geometry, reported_version)
    cache = cache or CacheConfig(None, None, None, None, None)
    limits = limits or EngineLimits(None, None, None, None, None)
    max_model_len = (
        _prefer(
            "max_model_len",
            flags.max_model_len,
            served.max_model_len if served else None,
            "max_model_len" in given,
            said,
        )
        or geometry.max_position_embeddings
    )
    if not max_model_len:
        raise ValueError("max_model_len is unknown: pass --max-model-len")
    if geometry.is_hybrid_state and cache.block_size is None and "block_size" not in given:
        log.warning(
            "this model keeps a recurrent state in some layers, so vLLM raises its block size to fit "
            "a state page, and the backend does not report it: pass the block size vLLM logs "
            "(--block-size), or kvgate counts blocks of %s tokens",
            flags.block_size,
        )
    backend = flags.attention_backend
    if backend == "auto":
        backend = "mla" if geometry.is_mla else "flash-attn"
    return Deployment(
        max_model_len=int(max_model_len),
        max_num_batched_tokens=_prefer_engine(
            "max_num_batched_tokens", flags.max_num_batched_tokens, limits.max_num_batched_tokens, said
        ),
        max_num_seqs=_prefer_engine("max_num_seqs", flags.max_num_seqs, limits.max_num_seqs, said),
        block_size=int(_prefer("block_size", flags.block_size, cache.block_size, "block_size" in given, said)),
        tensor_parallel_size=_prefer_engine(
            "tensor_parallel_size", flags.tensor_parallel_size, limits.tensor_parallel_size, said
        ),
        pipeline_parallel_size=_prefer_engine(
            "pipeline_parallel_size", flags.pipeline_parallel_size, limits.pipeline_parallel_size, said
        ),
        kv_cache_dtype=str(
            _prefer("kv_cache_dtype", flags.kv_cache_dtype, cache.cache_dtype, "kv_cache_dtype" in given, said)
        ),
        gpu_memory_utilization=float(
            _prefer(
                "gpu_memory_utilization",
                flags.gpu_memory_utilization,
                cache.gpu_memory_utilization,
                "gpu_memory_utilization" in given,
                said,
            )
        ),
        long_prefill_token_threshold=_prefer_engine(
            "long_prefill_token_threshold",
            flags.long_prefill_token_threshold,
            limits.long_prefill_token_threshold,
            said,
        ),
        enable_prefix_caching=bool(
            _prefer(
                "enable_prefix_caching",
                flags.enable_prefix_caching,
                cache.enable_prefix_caching,
                "enable_prefix_caching" in given,
                said,
            )
        ),
        attention_backend=backend,
        num_gpu_blocks=_prefer(
            "num_gpu_blocks", flags.num_gpu_blocks, cache.num_gpu_blocks, "num_gpu_blocks" in given, said
        ),
        mamba_cache_mode=cache.mamba_cache_mode or "none",
        kv_cache_memory_bytes=_prefer(
            "kv_cache_memory_bytes",
            flags.kv_cache_memory_bytes,
            cache.kv_cache_memory_bytes,
            "kv_cache_memory_bytes" in given,
            said,
        ),
        reported_request_blocks=cache.max_request_blocks,
        runtime=runtime,
        num_speculative_tokens=flags.num_speculative_tokens,
        max_logprobs=flags.max_logprobs,
        enforce_eager=flags.enforce_eager,
        drafter=resolve_drafter(
            flags.speculative_method,
            flags.speculative_model,
            geometry,
            _model_config(flags.model),
            flags.draft_sample_method,
            runtime.model_version if runtime.model_version != "unknown" else None,
        ),
        sampling_defaults=read_sampling_defaults(flags.model),
        lora=flags.lora,
    )


def build_predictor(
    deployment: Deployment,
    geometry: ModelGeometry,
    profiled_activation_bytes: int | None = None,
    default_max_tokens: int | None = None,
    outputs: OutputReserver | None = None,
    encoder: EncoderBudget | None = None,
) -> Predictor:
    """The predictor for this deployment; `profiled_activation_bytes` overrides kvgate's own
    estimate of vLLM's start-up profile when the operator read it off vLLM's log (either less the
    fused MoE's workspace, which the engine keeps: its profiled region is the rest); `encoder`:
    the vision encoder's budgets (encoder_budget), for requests with images."""
    layout = KVLayout(
        geometry=geometry,
        block_size=deployment.block_size,
        tensor_parallel_size=deployment.tensor_parallel_size,
        pipeline_parallel_size=deployment.pipeline_parallel_size,
        kv_cache_dtype=deployment.kv_cache_dtype,
        mamba_cache_mode=deployment.mamba_cache_mode,
        draft=deployment.drafter,
    )
    layout = checked_against_backend(layout, deployment)
    engine = deployment.engine_shape()
    # the profile region a step's tensors come back to: the peak less the MoE workspace it keeps
    peak = profiled_activation_bytes or profile_peak_bytes(geometry, engine)
    profiled = max(0, peak - moe_workspace_bytes(geometry, engine))
    return Predictor(
        layout,
        engine,
        deployment.enable_prefix_caching,
        profiled,
        default_max_tokens,
        outputs,
        sampling_defaults=deployment.sampling_defaults,
        encoder=encoder,
    )


def encoder_budget(
    model_dir: str | None,
    deployment: Deployment,
    media: MediaOptions,
    geometry: ModelGeometry,
    skip_mm_profiling: bool = False,
    enable_mm_embeds: bool = False,
) -> EncoderBudget | None:
    """The vision encoder of the model in `model_dir` as this deployment runs it (in the dtype
    of the decoder, `geometry`), or None where
    kvgate reads no tower or counts no images for the family (kvgate/memory/encoder.py).

    M is the largest item of the modality vLLM's start-up profile encodes (kvgate/profiled_media.py):
    the processor's largest image (its replacement for an image kvgate cannot see, as vLLM's
    `get_mm_max_tokens_per_item` takes `get_image_size_with_most_features`), or, on the families
    whose videos kvgate reads, the largest video where that is at least as large or images are
    off, and on Phi-4-multimodal its dummy audio where that outweighs its dummy image or images
    are off (`audio_item`); the encoder was profiled on V1, and on V2 from 0.28.0 (an unknown
    release on V2: not profiled), on neither with vLLM's --skip-mm-profiling
    (`skip_mm_profiling`); the profile's dummy item is --limit-mm-per-prompt's image width x
    height (`dummy_image_features`), video num_frames / width / height or audio length where
    given. With vLLM's --enable-mm-embeds (`enable_mm_embeds`), every modality kvgate sizes that
    --limit-mm-per-prompt sets to 0 is embedding-only, and its largest item widens B and C
    (`EncoderBudget.of`'s `embedded`). With every modality kvgate reads off, the images' budget stays (vLLM encodes none:
    nothing is charged that a request can reach)."""
    # The image rules import the chat template, and with it transformers: loaded only here, once a
    # model folder is read, so that `kvgate serve --help` and `import kvgate` stay light.
    from kvgate.audio import audio_tokens_of
    from kvgate.chat_template import TokenizationError
    from kvgate.image_rules import AnyResolution, CroppedPatches, HdCrops, ImageTokens, image_tokens_of
    from kvgate.multimodal import DEFAULT_LIMIT_PER_PROMPT, audio_kwargs, image_kwargs
    from kvgate.profiled_media import audio_item, video_item
    from kvgate.profiled_media import profiled_item as profiled_item_of

    if model_dir is None:
        return None
    try:
        config = read_model_config(model_dir)
    except ValueError:
        return None
    rule = image_tokens_of(model_dir)
    audio = audio_tokens_of(model_dir)
    tower = VisionTower.from_config(config, geometry.dtype_bytes, geometry.hidden_size)
    if tower is None or (rule is None and audio is None):
        return None
    profiled_item: int | None = None
    max_tiles = profiled_tiles = 0
    vllm_most: int | None = None  # vLLM's image M where it is the dummy's, below kvgate's largest
    embedded = 0  # the largest item of an embedding-only modality (--enable-mm-embeds)
    if rule is not None:
        kwargs = image_kwargs(media.processor_kwargs, None)
        largest = rule.configured(kwargs).replacement(None, kwargs)
        max_item, modality, max_tiles = largest.features, "image", largest.tiles
        dummy = dummy_image(rule, kwargs, media.dummy.get("image", {}))
        # A dummy image of --limit-mm-per-prompt's size: its tiles are credited as one (the base view),
        # since the tiles a pinpoint grid picks do not grow with the size as the embeddings do; an
        # any-resolution dummy is drawn at vLLM's own size, so its tiles are those vLLM ran.
        exact_tiles = isinstance(rule, AnyResolution)
        profiled_item, profiled_tiles = (
            (dummy.features, dummy.tiles if exact_tiles else min(dummy.tiles, 1)) if dummy is not None else (None, 0)
        )
        # LLaVA-NeXT / OneVision and Phi-4-multimodal state no `get_mm_max_tokens_per_item`: vLLM's
        # image M, which picks the profiled modality, is the dummy's count (encoder_budget.py
        # `get_mm_max_toks_per_item`).
        dummy_is_most = isinstance(rule, AnyResolution | HdCrops)
        vllm_most = profiled_item if dummy_is_most and profiled_item is not None else max_item
        if isinstance(rule, CroppedPatches):
            # InternVL: vLLM's M (interns1.py `get_max_image_tokens`, 0.32.0 = 0.33.0) and its dummy,
            # drawn at the first tile ratio, count crops only where the image processor's own
            # crop_to_patches says so, below kvgate's largest image (the HF processor's default
            # crops): the profile ran K items of that, not of kvgate's largest.
            vllm_most = rule.vllm_most(kwargs)  # its configured() is itself
            profiled_item = vllm_most if profiled_item is None else min(profiled_item, vllm_most)
        items = {"image": (vllm_most, max_item if profiled_item is None else profiled_item, profiled_tiles)}
        videos = image_kwargs(media.processor_kwargs, None, "videos_kwargs")
        try:
            image_on = media.limits.get("image", DEFAULT_LIMIT_PER_PROMPT) > 0
            others = {
                "video": video_item(
                    config,
                    rule.configured(kwargs),
                    kwargs,
                    videos,
                    deployment.max_model_len,
                    media.dummy.get("video", {}),
                    image_on,
                ),
                "audio": audio_item(audio, media.dummy.get("audio", {})),
            }
        except TokenizationError:  # dummy settings the processor refuses: which item vLLM profiles is unknown
            others, profiled_item = {}, 0  # credit the profile nothing
        items.update({name: item for name, item in others.items() if item is not None})
        if enable_mm_embeds:  # the image's M is kvgate's largest image, at least vLLM's
            most = {name: max_item if name == "image" else item[0] for name, item in items.items()}
            embedded = max((m for name, m in most.items() if media.limits.get(name) == 0), default=0)
        chosen = profiled_item_of(items, media.limits, DEFAULT_LIMIT_PER_PROMPT)
        if chosen is not None and chosen.modality != "image":
            max_item, modality, profiled_item, profiled_tiles = (
                chosen.max_item,
                chosen.modality,
                chosen.dummy,
                chosen.dummy_tiles,
            )
    else:
        assert audio is not None
        max_item, modality = audio.features(None, audio_kwargs(media.processor_kwargs, None)), "audio"
    runtime = deployment.runtime
    return EncoderBudget.of(
        tower,
        max_item,
        max_num_batched_tokens=deployment.max_num_batched_tokens,
        max_num_seqs=deployment.max_num_seqs,
        max_model_len=deployment.max_model_len,
        items_per_prompt=media.limits.get(modality, DEFAULT_LIMIT_PER_PROMPT),
        profiled=profile_encodes(runtime.runner, runtime.model_version, skip_mm_profiling),
        min_item=max_item if isinstance(rule, ImageTokens) and modality == "image" else 1,
        profiled_item=profiled_item,
        max_tiles=max_tiles,
        profiled_tiles=profiled_tiles,
        audio=ConformerTower.from_config(config, geometry.dtype_bytes) if audio is not None else None,
        profiled_modality=modality,
        vllm_most=vllm_most if modality == "image" and rule is not None else None,
        embedded=embedded,
    )


def dummy_image_features(rule: ImageRule, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> int | None:
    """`dummy_image`'s embeddings (None: the largest image's)."""
    dummy = dummy_image(rule, kwargs, options)
    return None if dummy is None else dummy.features


def dummy_image(rule: ImageRule, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> Replacement | None:
    """The replacement (embeddings, tiles) of the start-up profile's dummy image where `--limit-mm-per-prompt`'s
    image options give it a width or height (vllm/config/multimodal.py `ImageDummyOptions`), else
    None (the largest image's). vLLM 0.32.0 and 0.33.0 (multimodal/processing/dummy_inputs.py
    `BaseDummyInputsBuilder._get_dummy_images`) draw it at min(w, W) x min(h, H), W x H being the
    model's largest image (`get_image_size_with_most_features`), an unset side staying W or H.
    Qwen2-VL's family states W x H (`DynamicResolution.largest`), Phi-4-multimodal's
    (`HdCrops.largest`), LLaVA-NeXT's and OneVision's too (`AnyResolution.profiled_size`): theirs
    is returned even without options, since OneVision's W x H counts below the largest image
    kvgate charges (its `most`). For the other rules kvgate takes a given side as it is and an
    unset one as 1 pixel, so a credit never exceeds the profile's on a processor whose count
    grows with the size; a side above the model's largest (vLLM warns and ignores it) is not
    clamped there (docs/limitations.md). A size the processor refuses
    (vLLM's profile would fail with it) credits nothing: 0 embeddings."""
    from kvgate.chat_template import TokenizationError
    from kvgate.image_rules import AnyResolution, DynamicResolution, HdCrops, Replacement
    from kvgate.media import ImageSize

    width, height = options.get("width"), options.get("height")
    if not width and not height and not isinstance(rule, AnyResolution):
        return None
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in (width, height)):
        raise ValueError(f"--limit-mm-per-prompt: image width/height must be positive integers, got {dict(options)!r}")
    if isinstance(rule, DynamicResolution | AnyResolution | HdCrops):
        if isinstance(rule, DynamicResolution):
            largest = rule.largest(rule.pixel_range(kwargs)[1])
        else:
            largest = rule.largest(kwargs) if isinstance(rule, HdCrops) else rule.profiled_size
        size = ImageSize(min(width or largest.width, largest.width), min(height or largest.height, largest.height))
    else:
        size = ImageSize(width or 1, height or 1)
    try:
        return rule.configured(kwargs).replacement(size, kwargs)
    except TokenizationError:  # a size the processor refuses (Qwen's aspect ratio over 200): credit none
        return Replacement(0)


def checked_against_backend(layout: KVLayout, deployment: Deployment) -> KVLayout:
    """The layout, never counting fewer blocks per sequence than vLLM's own capacity report.

    vLLM states its pool as num_gpu_blocks / (blocks of one max_model_len request). When that
    count exceeds the layout's, kvgate's reading of this architecture misses something vLLM
    allocates (a layer kind it does not know, a grouping of a newer vLLM): every sequence then
    reserves the difference too. The gap between vLLM's count and the layout's can only grow
    with the length for the layer kinds vLLM has, so the gap at max_model_len covers any
    shorter request. A layout that counts more than vLLM is left as it is (cautious), with a
    warning, since it admits fewer requests than fit.
    """
    reported = deployment.reported_request_blocks
    if reported is None:
        return layout
    ours = layout.max_request_blocks(deployment.max_model_len, deployment.max_num_batched_tokens)
    gap = math.floor(reported + 1e-6) - ours
    if gap > 0:
        log.warning(
            "vLLM counts %.1f KV blocks for one %s-token request where kvgate's layout of this model "
            "counts %s: kvgate reserves %s more blocks for every sequence",
            reported,
            deployment.max_model_len,
            ours,
            gap,
        )
        return replace(layout, extra_blocks_per_sequence=gap)
    if reported < ours - 1:
        log.warning(
            "vLLM counts %.1f KV blocks for one %s-token request where kvgate's layout of this model "
            "counts %s: kvgate will admit fewer requests than fit (check --max-num-batched-tokens)",
            reported,
            deployment.max_model_len,
            ours,
        )
    return layout


def profile_emptied_bytes(predictor: Predictor, expandable_segments: bool) -> int:
    """The part of the profile peak the engine does not hold cached after start-up, which its
    profiled tensors take back out of free memory (the live headroom charges them up to it, or up
    to what its envelope formula reads, the larger: kvgate/telemetry/headroom.py). The formula
    reads too little wherever the engine holds memory outside its envelope: a fixed pool
    (--kv-cache-memory-bytes) reads as nothing emptied, and under --gpu-memory-utilization the
    CUDA graphs, captured after the pool from free memory (vllm 0.32.0 v1/worker/gpu_worker.py
    `determine_available_memory` subtracts their estimate only with
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS), read as part of the region held: benchmark S6 on
    V2 (session 43) lost its engine so, a co-tenant beside it, on an 8,000-token prefill charged
    249 of its 563 MiB while the engine held no cache at all. Model Runner V2 empties its
    cache after capturing graphs and warms nothing up (vllm 0.32.0 v1/worker/gpu/model_runner.py
    `capture_model`): the whole peak. V1 (vllm 0.31.0 and 0.32.0 v1/worker/gpu_worker.py
    `compile_or_warm_up_model`) re-reserves what its `_dummy_run` and `_dummy_sampler_run` of
    max_num_seqs rows make after capture and keeps it: the peak less those segments
    (kvgate/memory/activation.py `v1_warmup_reserved_bytes`), nothing where the sampler set the
    peak."""
    peak = predictor.profiled_peak_bytes
    if predictor.engine.runner == "v2":
        return peak
    return max(0, peak - v1_warmup_reserved_bytes(predictor.layout.geometry, predictor.engine, expandable_segments))


def static_limits(
    deployment: Deployment,
    predictor: Predictor,
    free_memory_bytes: int | None,
    gpu_memory_bytes: int | None,
    kv_cache_memory_bytes: int | None = None,
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES,
    expandable_segments: bool = False,
) -> StaticLimits:
    """The budget before any live reading: the pool from vLLM, headroom from flags.

    vLLM reserves block 0 of the pool as its null block, so num_gpu_blocks - 1 are usable.
    Workspaces one engine allocates once (FlashInfer's) come off the headroom once, not per request.
    The CUDA context and, at TP > 1, the communicators' buffers sit outside vLLM's
    ``total x gpu_memory_utilization`` (kvgate/memory/envelope.py), so they come off the rest.
    With --kv-cache-memory-bytes the pool is that size (vLLM ignores gpu_memory_utilization then:
    vllm/config/cache.py ``kv_cache_memory_bytes``), so the headroom is what the GPU has left after
    the weights (with --enable-lora's slots), that pool, the profiled activation peak, Model Runner V2's
    penalty state (`runner_state_bytes`), the profile's non-torch increase and the memory outside
    the envelope; only CUDA graphs (unless --enforce-eager) stay unknown. The profile region is
    taken at its segments' size, not its allocated peak: the caching allocator's overhead
    (kvgate/memory/activation.py `profile_segment_overhead_bytes`) comes out of the
    rest too; with live readings the budget charges it instead (kvgate/memory/ceiling.py).
    """
    blocks = deployment.num_gpu_blocks
    fixed_pool = kv_cache_memory_bytes
    overhead = profile_segment_overhead_bytes(predictor.layout.geometry, predictor.engine, expandable_segments)
    if blocks is None and fixed_pool is not None:
        blocks = predictor.layout.capacity(
            fixed_pool, deployment.max_model_len, deployment.max_num_batched_tokens
        ).num_blocks
    outside = outside_envelope(deployment.tensor_parallel_size, cuda_context_bytes, deployment.runtime.version)
    headroom = free_memory_bytes
    if headroom is None and gpu_memory_bytes is not None:
        if fixed_pool is not None:
            used = fixed_pool + weights_bytes(predictor.layout) + lora_slot_bytes(deployment, predictor.layout)
            used += predictor.profiled_peak_bytes + overhead + runner_state_bytes(deployment, predictor.layout.geometry)
            used += moe_workspace_bytes(predictor.layout.geometry, predictor.engine)
            headroom = gpu_memory_bytes - used - NON_TORCH_INCREASE_BYTES - outside.total
            if not deployment.enforce_eager:
                log.warning(
                    "--kv-cache-memory-bytes: the static headroom (%.2f GiB) is the GPU less the weights, "
                    "the pool, the profile peak, V2's penalty state, non-torch memory and %s; the CUDA graphs' memory is not "
                    "known to kvgate: pass --free-memory-bytes from vLLM's start-up log to be exact",
                    max(0, headroom) / GiB,
                    outside.describe(),
                )
        else:
            headroom = int(gpu_memory_bytes * (1.0 - deployment.gpu_memory_utilization)) - outside.total
    if headroom is not None:
        headroom = max(0, headroom - predictor.shared_workspace_bytes)
    forward = profile_forward_bytes(predictor.layout.geometry, predictor.engine)
    return StaticLimits(
        kv_blocks=None if blocks is None else max(0, blocks - 1),
        transient_headroom_bytes=headroom,
        max_transient_headroom_bytes=headroom,
        profiled_peak_bytes=predictor.profiled_peak_bytes,
        segment_overhead=overhead / predictor.profiled_peak_bytes if predictor.profiled_peak_bytes else 0.0,
        profile_emptied_bytes=profile_emptied_bytes(predictor, expandable_segments),
        profiled_forward_bytes=forward,
        forward_bytes_per_token=-(-forward // max(1, predictor.engine.max_num_batched_tokens)),
        profiled_hidden_bytes=profile_hidden_bytes(predictor.layout.geometry, predictor.engine),
        sampler_phase_overhead=SamplerPhaseOverhead(predictor.layout.geometry, predictor.engine, expandable_segments),
        lone_forward=LoneForward(predictor.layout.geometry, predictor.engine, expandable_segments),
        any_cache_forward=AnyCacheForward(predictor.layout.geometry, predictor.engine, expandable_segments),
        any_cache_sampler=AnyCacheSampler(predictor.layout.geometry, predictor.engine, expandable_segments),
        lone_request=LoneRequest(predictor.layout.geometry, predictor.engine, expandable_segments),
        shared_forward=SharedForward(predictor.layout.geometry, predictor.engine, expandable_segments)
        if predictor.step_bound is not None
        else None,
        # the region replay places tensors in fixed segments; with expandable ones the old charge stands
        penalty_step=V1PenaltyStep(predictor.layout.geometry, predictor.engine, expandable_segments)
        if predictor.engine.runner == "v1" and not expandable_segments
        else None,
        warmup_forward=V1WarmupForward(predictor.layout.geometry, predictor.engine, expandable_segments)
        if predictor.engine.runner == "v1" and not expandable_segments
        else None,
        v1_any_cache=V1AnyCacheStep(predictor.layout.geometry, predictor.engine, expandable_segments)
        if predictor.engine.runner == "v1" and not expandable_segments
        else None,
    )


def runner_state_bytes(deployment: Deployment, geometry: ModelGeometry) -> int:
    """What the model runner allocates for good before the profile beyond the weights: V2's
    penalty state (kvgate/memory/sampler.py `v2_penalty_state_bytes`). Under
    --gpu-memory-utilization vLLM takes it from the pool (it is in the profile's total_consumed),
    so only a fixed --kv-cache-memory-bytes pool leaves it to come out of the rest."""
    if deployment.runtime.runner != "v2":
        return 0
    return v2_penalty_state_bytes(deployment.max_num_seqs, geometry.vocab_size)


def lora_slot_bytes(deployment: Deployment, layout: KVLayout) -> int:
    """One GPU's share of --enable-lora's start-up slots (kvgate/memory/lora.py): weight memory too."""
    if deployment.lora is None:
        return 0
    return slot_bytes(layout.geometry, deployment.lora, layout.tensor_parallel_size) // layout.pipeline_parallel_size


def weights_bytes(layout: KVLayout) -> int:
    """One GPU's share of the weights (biases ignored): parameters x dtype / (TP x PP)."""
    g = layout.geometry
    return math.ceil(
        g.parameter_count() * g.dtype_bytes / (layout.tensor_parallel_size * layout.pipeline_parallel_size)
    )
