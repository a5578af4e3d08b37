"""Model geometry read from a Hugging Face ``config.json`` dict (kvgate.model_folder reads the file).

Only the shapes that decide GPU memory: layers, heads, widths, vocabulary, dtype,
MoE and MLA dimensions, and what each layer caches (full, sliding-window or chunked
attention, a fixed-size recurrent state, nothing). Everything downstream (KV bytes,
activation terms, weights) is arithmetic on these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.memory.presets import with_defaults

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_local_attention"  # Llama 4's local layers
# A fixed-size state per sequence, whatever its length: Mamba/Mamba-2 mixers, gated delta-net
# and lightning linear attention, short convolutions. vLLM gives them all a MambaSpec.
RECURRENT_STATE = "mamba"
NO_CACHE = "no_cache"  # MLP- or MoE-only blocks of Nemotron-H's pattern
# A block with an attention and a state mixer side by side (Falcon-H1, Zamba2's hybrid blocks).
ATTENTION_AND_STATE = f"{FULL_ATTENTION}+{RECURRENT_STATE}"

# Layer-kind names as configs spell them (layer_types, layers_block_type).
_LAYER_KINDS = {
    "full_attention": FULL_ATTENTION,
    "attention": FULL_ATTENTION,
    "sliding_attention": SLIDING_ATTENTION,
    "linear_attention": RECURRENT_STATE,
    "mamba": RECURRENT_STATE,
    "mamba2": RECURRENT_STATE,
    "conv": RECURRENT_STATE,
    "short_conv": RECURRENT_STATE,
    "mlp": NO_CACHE,
    "moe": NO_CACHE,
    "hybrid": ATTENTION_AND_STATE,
}
# Nemotron-H's hybrid_override_pattern: one character per layer.
_PATTERN_KINDS = {"M": RECURRENT_STATE, "*": FULL_ATTENTION, "-": NO_CACHE, "E": NO_CACHE}

_DTYPE_BYTES = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
}

# Keys under which multimodal wrappers nest their language model's config.
_NESTED_TEXT_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")


def dtype_bytes(name: object, default: int = 2) -> int:
    """Bytes per element of a torch dtype name ("bfloat16", "torch.float32", ...)."""
    if name is None or name == "auto":
        return default
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelGeometry:
    """The memory-relevant shape of one decoder-only language model."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    max_position_embeddings: int | None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    layer_types: tuple[str, ...] = ()  # per decoder layer, one of the kinds above; () if uniform
    # Beyond the shared interface: needed for weights and the MoE shared-expert term.
    shared_expert_intermediate_size: int = 0  # all shared experts of one layer together
    num_dense_layers: int = 0  # MoE models: layers that keep a dense MLP
    q_lora_rank: int | None = None
    tie_word_embeddings: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Per-layer cache kind; no explicit list means one type for every layer."""
        if self.layer_types:
            return self.layer_types
        kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
        return (kind,) * self.num_layers

    @property
    def is_hybrid_state(self) -> bool:
        """Some layers keep a recurrent state instead of (or beside) a KV cache."""
        return any(RECURRENT_STATE in kind for kind in self.layer_types)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelGeometry:
        """Read a transformers config dict (plain, or multimodal with a nested text config)."""
        text = _text_config(config)
        try:
            return _parse(text, outer=config)
        except KeyError as exc:
            arch = text.get("architectures") or config.get("architectures") or "?"
            raise ValueError(
                f"config.json ({arch}, model_type={text.get('model_type')!r}) lacks "
                f"{exc.args[0]!r}; kvgate reads decoder-only language models"
            ) from None

    def parameter_count(self) -> int:
        """Approximate parameter count (biases ignored), for the weights' footprint."""
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense_mlp = 3 * h * self.intermediate_size
        if self.is_moe:
            moe_mlp = (
                self.num_experts * 3 * h * self.moe_intermediate_size
                + 3 * h * self.shared_expert_intermediate_size
                + h * self.num_experts  # router
            )
            dense = self.num_dense_layers
            mlp = dense * dense_mlp + (self.num_layers - dense) * moe_mlp
        else:
            mlp = self.num_layers * dense_mlp
        norms = self.num_layers * 2 * h + h
        return embeddings + self.num_layers * self._attention_params() + mlp + norms

    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
            else:
                q = h * heads * qk
            kv_lora = self.kv_lora_rank or 0
            kv_a = h * (kv_lora + self.qk_rope_head_dim) + kv_lora
            kv_b = kv_lora * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + heads * self.v_head_dim * h
        q_and_o = 2 * h * heads * self.head_dim
        return q_and_o + 2 * h * self.num_kv_heads * self.head_dim


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    for key in _NESTED_TEXT_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict):
            return with_defaults(nested)
    return with_defaults(config)


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _parse(text: dict[str, Any], outer: dict[str, Any]) -> ModelGeometry:
    num_layers = _required(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _required(text, "num_attention_heads", "n_head")
    hidden = _required(text, "hidden_size", "n_embd", "d_model")
    kv_heads = int(_first(text, "num_key_value_heads", default=1 if text.get("multi_query") else heads))
    head_dim = int(_first(text, "head_dim", "attention_head_dim", default=hidden // heads))
    intermediate = int(_first(text, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
    vocab = _required({**outer, **text}, "vocab_size")
    dtype = dtype_bytes(_first(text, "torch_dtype", "dtype", default=_first(outer, "torch_dtype", "dtype")))
    max_pos = _first(text, "max_position_embeddings", "n_positions", "max_sequence_length")

    experts = int(_first(text, "n_routed_experts", "num_local_experts", "num_experts", default=0))
    moe_kwargs: dict[str, Any] = {}
    if experts:
        moe_inter = int(_first(text, "moe_intermediate_size", default=intermediate))
        n_shared = int(_first(text, "n_shared_experts", default=0))
        shared_inter = int(_first(text, "shared_expert_intermediate_size", default=n_shared * moe_inter))
        moe_kwargs = dict(
            num_experts=experts,
            experts_per_token=int(_first(text, "num_experts_per_tok", "moe_topk", default=1)),
            moe_intermediate_size=moe_inter,
            num_shared_experts=n_shared or (1 if shared_inter else 0),
            shared_expert_intermediate_size=shared_inter,
            num_dense_layers=int(text.get("first_k_dense_replace") or 0) + len(text.get("mlp_only_layers") or ()),
        )

    mla_kwargs: dict[str, Any] = {}
    if text.get("kv_lora_rank"):
        mla_kwargs = dict(
            kv_lora_rank=int(text["kv_lora_rank"]),
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0),
            v_head_dim=int(text.get("v_head_dim") or head_dim),
            q_lora_rank=text.get("q_lora_rank"),
        )

    window, layer_types = _layer_kinds(text, num_layers)
    return ModelGeometry(
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        dtype_bytes=dtype,
        max_position_embeddings=int(max_pos) if max_pos else None,
        sliding_window=window,
        attention_chunk_size=int(text["attention_chunk_size"]) if CHUNKED_ATTENTION in layer_types else None,
        layer_types=layer_types,
        tie_word_embeddings=bool(_first(text, "tie_word_embeddings", default=outer.get("tie_word_embeddings", False))),
        **moe_kwargs,
        **mla_kwargs,
    )


def _required(config: dict[str, Any], *keys: str) -> int:
    value = _first(config, *keys)
    if value is None:
        raise KeyError(keys[0])
    return int(value)


def _layer_kinds(text: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window, if any layer uses one, and what each layer caches (() if all alike).

    Read the way vLLM's model code reads each family: an explicit ``layer_types`` or
    ``layers_block_type`` list (Gemma 3, gpt-oss, Qwen3-Next, Granite-4.0-H, LFM2, Zamba2);
    Nemotron-H's ``hybrid_override_pattern``; Jamba's ``attn_layer_period``/``offset``;
    Bamba's ``attn_layer_indices``; MiniMax's ``attn_type_list``; Qwen3-Next's
    ``full_attention_interval``; Falcon-H1 (attention and Mamba-2 in every block); Llama 4's
    ``no_rope_layers`` (chunked local attention on the RoPE layers); Gemma 3's
    ``sliding_window_pattern``; Gemma 2 (even layers slide); Qwen2's ``use_sliding_window:
    false`` (window ignored); Mistral-7B-v0.1 (every layer slides).
    """
    window = text.get("sliding_window")
    window = int(window) if window and text.get("use_sliding_window") is not False else None
    kinds = _declared_kinds(text, num_layers, window)
    if kinds is None:
        return window, ()
    if len(kinds) != num_layers:
        raise ValueError(f"the layer pattern has {len(kinds)} entries for {num_layers} layers")
    if SLIDING_ATTENTION not in kinds:
        window = None
    if set(kinds) == {FULL_ATTENTION}:
        return window, ()
    return window, kinds


def _declared_kinds(text: dict[str, Any], num_layers: int, window: int | None) -> tuple[str, ...] | None:
    """Per-layer kinds from whichever field this family uses; None when every layer is alike."""
    layers = range(num_layers)
    listed = text.get("layer_types") or text.get("layers_block_type")
    if listed:
        kinds = tuple(_LAYER_KINDS.get(str(t), FULL_ATTENTION) for t in listed)
        # Qwen2/3 list sliding layers but ignore them unless use_sliding_window is on.
        return tuple(FULL_ATTENTION if k == SLIDING_ATTENTION and not window else k for k in kinds)
    if text.get("hybrid_override_pattern"):
        return tuple(_PATTERN_KINDS.get(c, FULL_ATTENTION) for c in text["hybrid_override_pattern"])
    if text.get("attn_layer_period"):
        period, offset = int(text["attn_layer_period"]), int(text.get("attn_layer_offset") or 0)
        return tuple(FULL_ATTENTION if i % period == offset else RECURRENT_STATE for i in layers)
    if text.get("attn_layer_indices") is not None:
        attention = set(text["attn_layer_indices"])
        return tuple(FULL_ATTENTION if i in attention else RECURRENT_STATE for i in layers)
    if text.get("attn_type_list"):
        return tuple(FULL_ATTENTION if t == 1 else RECURRENT_STATE for t in text["attn_type_list"])
    if text.get("full_attention_interval"):
        interval = int(text["full_attention_interval"])
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else RECURRENT_STATE for i in layers)
    if str(text.get("model_type", "")).startswith("falcon_h1"):
        return (ATTENTION_AND_STATE,) * num_layers
    if text.get("attention_chunk_size"):
        # transformers' Llama4TextConfig default: every no_rope_layer_interval-th layer is global.
        interval = int(text.get("no_rope_layer_interval") or 4)
        no_rope = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in layers]
        return tuple(CHUNKED_ATTENTION if no_rope[i] else FULL_ATTENTION for i in layers)
    if window is None:
        return None
    if text.get("sliding_window_pattern"):
        pattern = int(text["sliding_window_pattern"])
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in layers)
    if str(text.get("model_type", "")).startswith("gemma2"):
        return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in layers)
    return None
