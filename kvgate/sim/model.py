"""The simulator's own reading of a model's config.json: what each layer is, how big it is, how
many parameters it holds.

The simulator judges kvgate's estimates, so it must not share kvgate's reading of the model
(`kvgate/memory/geometry.py`): a field misread there would be misread here the same way and the
judge would agree with the mistake. The config is parsed by transformers' `AutoConfig`
(`AutoConfig.for_model`, offline, no torch), which fills each family's defaults and derives its
`layer_types` the way the model's own configuration class does; the simulator then reads what
vLLM 0.32.0's model files read:

- dtype: `vllm/config/model.py` `_resolve_auto_dtype`: a float32 (or unset) config runs in the
  platform's first supported dtype (bfloat16 on CUDA GPUs since Ampere), unless `--dtype` says;
- vocabulary: `vllm/model_executor/layers/vocab_parallel_embedding.py`: embedding and LM head
  padded to a multiple of `DEFAULT_VOCAB_PADDING_SIZE` (64); the logits keep the real vocabulary;
- per-layer kind: full attention, sliding window (`SlidingWindowSpec`), chunked local attention
  (`ChunkedLocalAttentionSpec`), MLA (`MLAAttentionSpec`), recurrent state (`MambaSpec`) or none
  (`vllm/v1/kv_cache_interface.py`); the recurrent state's shape from
  `vllm/model_executor/layers/mamba/mamba_utils.py` `MambaStateShapeCalculator`
  (`mamba1_state_shape`, `mamba2_state_shape`, `gated_delta_net_state_shape`), in the model dtype
  (`MambaStateDtypeCalculator._mamba_state_dtype` with `mamba_ssm_cache_dtype=auto`);
- MLP per layer: dense, MoE (routed experts, shared experts, router) or none (Nemotron-H's mixer
  layers), from the family's fields (`first_k_dense_replace`, `moe_layers`,
  `expert_layer_period`, `decoder_sparse_step`, `mlp_only_layers`, `hybrid_override_pattern`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgate.sim.presets import model_config, processor_config
from kvgate.sim.vision import VisionTower, read_tower

LayerKind = Literal["full", "sliding", "chunked", "mla", "mamba", "none"]
MlpKind = Literal["dense", "moe", "relu2", "none"]

VOCAB_PADDING = 64  # vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
# transformers' spellings of a layer's mixer, as `layer_types` lists them.
_KINDS: dict[str, LayerKind] = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "mamba",
    "mamba": "mamba",
    "mamba2": "mamba",
    "mlp": "none",
    "moe": "none",
}


class ModelConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model the simulator cannot play."""


@dataclass(frozen=True)
class MambaShape:
    """One recurrent layer before tensor parallelism (mamba_utils.py `MambaStateShapeCalculator`):
    `inner` is the mixer's value width, `conv_dim` the convolution's channels, and the temporal
    state is `heads x head_dim x state` (Mamba-1: `inner x state`, as heads=inner, head_dim=1)."""

    family: Literal["mamba1", "mamba2", "gdn"]
    inner: int
    conv_dim: int
    conv_kernel: int
    heads: int
    head_dim: int
    state: int

    def state_bytes(self, tp: int, dtype_bytes: int) -> int:
        """conv (conv_dim/TP x (kernel-1)) + temporal (heads/TP x head_dim x state), model dtype."""
        conv = self.conv_dim // tp * (self.conv_kernel - 1)
        temporal = self.heads // tp * self.head_dim * self.state
        return (conv + temporal) * dtype_bytes

    def parameter_count(self, hidden: int) -> int:
        """The mixer's weights: input projections, convolution, per-head scalars, output."""
        h, inner, k = hidden, self.inner, self.conv_kernel
        if self.family == "mamba1":  # in_proj, conv, x_proj, dt_proj, A, D, out_proj
            dt_rank = -(-h // 16)
            return (
                h * 2 * inner
                + inner * k
                + inner * (dt_rank + 2 * self.state)
                + dt_rank * inner
                + inner * self.state
                + inner
                + inner * h
            )
        if self.family == "mamba2":  # in_proj (z, xBC, dt), conv, A/D/dt_bias, norm, out_proj
            return h * (inner + self.conv_dim + self.heads) + self.conv_dim * k + 3 * self.heads + inner + inner * h
        # gated delta net: in_proj_qkvz, in_proj_ba, conv, A/dt_bias, norm, out_proj
        return (
            h * (self.conv_dim + inner)
            + h * 2 * self.heads
            + self.conv_dim * k
            + 2 * self.heads
            + self.head_dim
            + inner * h
        )


@dataclass(frozen=True)
class SimModel:
    """A decoder-only model as vLLM builds it: per-layer kinds and the sizes that decide memory."""

    name: str
    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int  # after vLLM's dtype resolution
    max_position_embeddings: int
    layer_kinds: tuple[LayerKind, ...]
    mlp_kinds: tuple[MlpKind, ...]
    intermediate: int  # dense MLP width
    sliding_window: int | None = None
    attention_chunk: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts of one MoE layer together
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also emits a gate
    mamba: MambaShape | None = None
    tie_word_embeddings: bool = False
    extra_parameters: int = 0  # vision tower and projector of a multimodal checkpoint
    architectures: tuple[str, ...] = ()  # config.json's, which vLLM's runner rule reads
    vision: VisionTower | None = None  # a Qwen-VL vision encoder (kvgate/sim/vision.py)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING

    @property
    def attention_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k not in ("mamba", "none"))

    # ----- parameters ------------------------------------------------------------------------
    def parameter_count(self) -> int:
        """Every weight vLLM loads on one GPU at TP 1: embeddings, LM head (unless tied), each
        layer's mixer and MLP by its kind, norms, and a multimodal checkpoint's vision tower."""
        h = self.hidden
        total = self.padded_vocab * h * (1 if self.tie_word_embeddings else 2) + h
        for kind, mlp in zip(self.layer_kinds, self.mlp_kinds, strict=True):
            total += 2 * h + self._mixer_params(kind) + self._mlp_params(mlp)
        return total + self.extra_parameters

    def _mixer_params(self, kind: LayerKind) -> int:
        h = self.hidden
        if kind == "none":
            return 0
        if kind == "mamba":
            assert self.mamba is not None
            return self.mamba.parameter_count(h)
        if kind == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + self.heads * self.v_head_dim * h
        q = h * self.heads * self.head_dim * (2 if self.attn_output_gate else 1)
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + self.heads * self.head_dim * h

    def _mlp_params(self, kind: MlpKind) -> int:
        h = self.hidden
        if kind == "dense":
            return 3 * h * self.intermediate
        if kind == "relu2":
            return 2 * h * self.intermediate
        if kind == "moe":
            return (
                self.num_experts * 3 * h * self.moe_intermediate
                + h * self.num_experts
                + 3 * h * self.shared_intermediate
            )
        return 0


# ----- reading config.json ----------------------------------------------------------------------
def load_model(spec: str, dtype: str = "auto") -> SimModel:
    """A preset name (kvgate/sim/presets.py) or a folder holding config.json (and, for a
    vision model, preprocessor_config.json)."""
    folder = Path(spec)
    if folder.is_dir():
        file = folder / "config.json"
        try:
            config = json.loads(file.read_text())
            processor_file = folder / "preprocessor_config.json"
            processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
        except FileNotFoundError:
            raise ModelConfigError(f"no config.json in {spec}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from None
        return read_config(config, spec, dtype, processor)
    return read_config(model_config(spec), spec, dtype, processor_config(spec))


def _auto_config(config: dict[str, Any]) -> Any:
    """transformers' configuration object for the dict, with the family's defaults filled in."""
    # transformers' import warns once that torch is absent; configurations need no torch.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config.get("model_type", ""), **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelConfigError(f"config.json: {exc}") from None


def resolve_dtype(config_dtype: object, requested: str = "auto") -> int:
    """Bytes per weight element as vLLM runs the model on a CUDA GPU (`_resolve_auto_dtype`):
    `--dtype` when given; else the config's dtype, float32 or unset becoming bfloat16."""
    name = requested if requested != "auto" else str(config_dtype or "float32")
    name = name.removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ModelConfigError(f"unsupported dtype {name!r}; one of {sorted(_DTYPE_BYTES)}")
    if requested == "auto" and _DTYPE_BYTES[name] == 4:
        return 2
    return _DTYPE_BYTES[name]


def read_config(
    config: dict[str, Any], name: str, dtype: str = "auto", processor: dict[str, Any] | None = None
) -> SimModel:
    """Read a Hugging Face config dict (plain, or multimodal with a text config; `processor`:
    its preprocessor_config.json)."""
    outer = _auto_config(config)
    text = outer.get_text_config()

    def get(key: str, default: Any = None) -> Any:
        return _attr(text, key, default)

    try:
        layers = int(text.num_hidden_layers)
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        vocab = int(get("vocab_size") or _attr(outer, "vocab_size"))
    except (AttributeError, TypeError) as exc:
        raise ModelConfigError(f"config.json ({name}) lacks a decoder's sizes: {exc}") from None
    kv_lora = int(get("kv_lora_rank", 0) or 0)
    kinds = _layer_kinds(text, layers, kv_lora > 0)
    experts = int(get("n_routed_experts") or get("num_local_experts") or get("num_experts") or 0)
    window = get("sliding_window") if "sliding" in kinds else None
    config_dtype = get("dtype") or _attr(outer, "dtype") or config.get("torch_dtype")
    return SimModel(
        name=name,
        model_type=str(text.model_type),
        num_layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or get("attention_head_dim") or hidden // heads),
        vocab=vocab,
        dtype_bytes=resolve_dtype(config_dtype, dtype),
        max_position_embeddings=int(get("max_position_embeddings") or 2048),
        layer_kinds=kinds,
        mlp_kinds=_mlp_kinds(text, kinds, experts),
        intermediate=int(get("intermediate_size_mlp") or get("intermediate_size") or 4 * hidden),
        sliding_window=int(window) if window else None,
        attention_chunk=int(get("attention_chunk_size")) if "chunked" in kinds else None,
        num_experts=experts,
        experts_per_token=int(get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate=_moe_intermediate(text) if experts else 0,
        shared_intermediate=_shared_intermediate(text) if experts else 0,
        kv_lora_rank=kv_lora,
        q_lora_rank=int(get("q_lora_rank") or 0),
        qk_rope_head_dim=int(get("qk_rope_head_dim", 0) or 0),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 0) or 0),
        v_head_dim=int(get("v_head_dim", 0) or 0),
        attn_output_gate=bool(get("attn_output_gate", False)) or text.model_type == "qwen3_next",
        mamba=_mamba_shape(text, hidden) if "mamba" in kinds else None,
        tie_word_embeddings=bool(_attr(outer, "tie_word_embeddings", False) or get("tie_word_embeddings", False)),
        extra_parameters=_vision_parameters(outer, hidden),
        architectures=tuple(str(a) for a in config.get("architectures") or ()),
        vision=read_tower(config, processor or {}, resolve_dtype(config_dtype, dtype)),
    )


def _attr(obj: Any, key: str, default: Any = None) -> Any:
    value = getattr(obj, key, default)
    return default if value is None else value


def _layer_kinds(text: Any, layers: int, mla: bool) -> tuple[LayerKind, ...]:
    """Each layer's mixer. transformers derives `layer_types` for the families that have them
    (Gemma 2/3, Llama 4, Qwen2's ignored windows, Jamba, Qwen3-Next, Nemotron-H); without it every
    layer is alike: MLA, sliding window (Mistral-7B-v0.1's config window) or full attention."""
    listed = _attr(text, "layer_types") or _attr(text, "layers_block_type")
    if listed:
        kinds: tuple[LayerKind, ...] = tuple(_KINDS.get(str(t), "full") for t in listed)
        if len(kinds) != layers:
            raise ModelConfigError(f"layer_types has {len(kinds)} entries for {layers} layers")
        if _attr(text, "use_sliding_window") is False:  # Qwen2/3: listed but switched off
            kinds = tuple("full" if k == "sliding" else k for k in kinds)
        return kinds
    every: LayerKind = "full"
    if mla:
        every = "mla"
    elif _attr(text, "sliding_window") and _attr(text, "use_sliding_window", True) is not False:
        every = "sliding"
    return (every,) * layers


def _mlp_kinds(text: Any, kinds: tuple[LayerKind, ...], experts: int) -> tuple[MlpKind, ...]:
    """Each layer's feed-forward block, read the way the family's vLLM model file builds it."""
    n, mt = len(kinds), str(text.model_type)
    if mt == "nemotron_h":  # nemotron_h.py: '-' layers are the MLPs, 'M'/'*' mixers have none
        pattern = str(_attr(text, "hybrid_override_pattern", ""))
        return tuple("relu2" if c == "-" else "moe" if c == "E" else "none" for c in pattern)
    if not experts:
        dense: MlpKind = "dense"
        return (dense,) * n
    if mt == "jamba":  # jamba.py: every expert_layer_period-th layer from the offset is MoE
        period, offset = int(text.expert_layer_period), int(text.expert_layer_offset)
        return tuple("moe" if i % period == offset else "dense" for i in range(n))
    if _attr(text, "moe_layers") is not None:  # llama4.py: the listed layers are MoE
        moe = set(text.moe_layers)
        return tuple("moe" if i in moe else "dense" for i in range(n))
    dense_first = int(_attr(text, "first_k_dense_replace", 0))  # deepseek_v2.py
    step = int(_attr(text, "decoder_sparse_step", 1))  # qwen2_moe.py / qwen3_next.py
    only_mlp = set(_attr(text, "mlp_only_layers", []))
    return tuple("dense" if i < dense_first or i in only_mlp or (i + 1) % step else "moe" for i in range(n))


def _moe_intermediate(text: Any) -> int:
    """One routed expert's width: `moe_intermediate_size`, else (Mixtral, Jamba, Llama 4) the
    config's `intermediate_size`."""
    return int(_attr(text, "moe_intermediate_size") or text.intermediate_size)


def _shared_intermediate(text: Any) -> int:
    """All shared experts of one MoE layer together: DeepSeek's `n_shared_experts` x expert
    width, Qwen's `shared_expert_intermediate_size`, Llama 4's one shared expert."""
    if _attr(text, "shared_expert_intermediate_size"):
        return int(text.shared_expert_intermediate_size)
    if _attr(text, "n_shared_experts"):
        return int(text.n_shared_experts) * _moe_intermediate(text)
    if str(text.model_type) == "llama4_text":
        return int(text.intermediate_size)
    return 0


def _mamba_shape(text: Any, hidden: int) -> MambaShape:
    """The recurrent layers' shape, by family (jamba.py, nemotron_h.py/bamba.py, qwen3_next.py)."""
    mt = str(text.model_type)
    if mt == "jamba":
        inner = int(text.mamba_expand) * hidden
        return MambaShape("mamba1", inner, inner, int(text.mamba_d_conv), inner, 1, int(text.mamba_d_state))
    if mt == "qwen3_next":
        nk, nv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
        dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
        return MambaShape("gdn", nv * dv, 2 * nk * dk + nv * dv, int(text.linear_conv_kernel_dim), nv, dv, dk)
    heads = int(_attr(text, "mamba_num_heads") or _attr(text, "mamba_n_heads"))
    head_dim = int(_attr(text, "mamba_head_dim") or _attr(text, "mamba_d_head"))
    groups = int(_attr(text, "n_groups") or _attr(text, "mamba_n_groups") or 1)
    state = int(_attr(text, "ssm_state_size") or _attr(text, "mamba_d_state"))
    kernel = int(_attr(text, "conv_kernel") or _attr(text, "mamba_d_conv") or 4)
    inner = heads * head_dim
    return MambaShape("mamba2", inner, inner + 2 * groups * state, kernel, heads, head_dim, state)


def _vision_parameters(outer: Any, text_hidden: int) -> int:
    """A multimodal checkpoint's vision encoder (ViT blocks: attention 4h^2, MLP 2hI) and its
    projector into the language model; vLLM loads them onto the GPU with the decoder."""
    vision = _attr(outer, "vision_config")
    if vision is None:
        return 0
    h = int(_attr(vision, "embed_dim") or vision.hidden_size)  # Qwen2-VL's hidden_size is the merger's
    layers = int(_attr(vision, "num_hidden_layers") or _attr(vision, "depth", 0))
    inter = int(_attr(vision, "intermediate_size", 4 * h))
    return layers * (4 * h * h + 2 * h * inter) + h * text_hidden + text_hidden * text_hidden
