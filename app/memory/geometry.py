"""Model geometry read from a Hugging Face ``config.json``.

Only the shapes that decide GPU memory: layers, heads, widths, vocabulary, dtype,
MoE and MLA dimensions, and which layers use sliding-window attention. Everything
downstream (KV bytes, activation terms, weights) is arithmetic on these numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.memory.presets import with_defaults

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_DTYPE_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
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
    layer_types: tuple[str, ...] = ()
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
        """Per-layer attention type; no explicit list means one type for every layer."""
        if self.layer_types:
            return self.layer_types
        kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
        return (kind,) * self.num_layers

    @classmethod
    def from_config(cls, config: dict) -> ModelGeometry:
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

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelGeometry:
        """Read ``path/config.json`` (the only I/O in the memory model)."""
        file = Path(path) / "config.json"
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            raise ValueError(f"no config.json in {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from None
        return cls.from_config(config)

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


def _text_config(config: dict) -> dict:
    for key in _NESTED_TEXT_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict):
            return with_defaults(nested)
    return with_defaults(config)


def _first(config: dict, *keys: str, default: object = None) -> object:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _parse(text: dict, outer: dict) -> ModelGeometry:
    num_layers = _required(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _required(text, "num_attention_heads", "n_head")
    hidden = _required(text, "hidden_size", "n_embd", "d_model")
    kv_heads = int(_first(text, "num_key_value_heads", default=1 if text.get("multi_query") else heads))
    head_dim = int(_first(text, "head_dim", default=hidden // heads))
    intermediate = int(_first(text, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
    vocab = _required({**outer, **text}, "vocab_size")
    dtype = dtype_bytes(_first(text, "torch_dtype", "dtype", default=_first(outer, "torch_dtype", "dtype")))
    max_pos = _first(text, "max_position_embeddings", "n_positions", "max_sequence_length")

    experts = int(_first(text, "n_routed_experts", "num_local_experts", "num_experts", default=0))
    moe_kwargs: dict = {}
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

    mla_kwargs: dict = {}
    if text.get("kv_lora_rank"):
        mla_kwargs = dict(
            kv_lora_rank=int(text["kv_lora_rank"]),
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0),
            v_head_dim=int(text.get("v_head_dim") or head_dim),
            q_lora_rank=text.get("q_lora_rank"),
        )

    window, layer_types = _sliding_window(text, num_layers)
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
        layer_types=layer_types,
        tie_word_embeddings=bool(_first(text, "tie_word_embeddings", default=outer.get("tie_word_embeddings", False))),
        **moe_kwargs,
        **mla_kwargs,
    )


def _required(config: dict, *keys: str) -> int:
    value = _first(config, *keys)
    if value is None:
        raise KeyError(keys[0])
    return int(value)


def _sliding_window(text: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The window and, for hybrid models, which layers use it.

    Cases, as vLLM's model code reads them: an explicit ``layer_types`` list (new
    transformers configs, gpt-oss); Gemma 3's ``sliding_window_pattern`` (layer i
    slides unless (i+1) % pattern == 0); Gemma 2 (even layers slide); Qwen2's
    ``use_sliding_window: false`` (window ignored); Mistral-7B-v0.1 (every layer).
    """
    window = text.get("sliding_window")
    if not window or text.get("use_sliding_window") is False:
        return None, ()
    window = int(window)
    types = text.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        kinds = tuple(SLIDING_ATTENTION if t == SLIDING_ATTENTION else FULL_ATTENTION for t in types)
    elif text.get("sliding_window_pattern"):
        pattern = int(text["sliding_window_pattern"])
        kinds = tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers))
    elif str(text.get("model_type", "")).startswith("gemma2"):
        kinds = tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers))
    else:
        return window, ()
    if SLIDING_ATTENTION not in kinds:
        return None, ()
    return window, kinds
