"""Defaults of the transformers config classes, for nested configs that omit them.

Multimodal checkpoints often ship a partial ``text_config`` (Llava's lists only
what differs from ``LlamaConfig``; Gemma 3's only what differs from
``Gemma3TextConfig``). transformers fills the rest from the class defaults, so we
must too, or a Llava-1.5-7B would read as a model with no hidden size. Plain
configs omit defaults as well (Gemma 2 never states that it ties embeddings).
"""

from __future__ import annotations

from typing import Any

TEXT_CONFIG_DEFAULTS: dict[str, dict[str, object]] = {
    # transformers LlamaConfig.__init__ defaults
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    # transformers MistralConfig.__init__ defaults
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    # transformers GemmaConfig / Gemma2Config: embeddings tied unless stated
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True},
    # transformers Gemma3TextConfig.__init__ defaults
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
    },
}


def with_defaults(text_config: dict[str, Any]) -> dict[str, Any]:
    """The (text) config with its model type's class defaults filled in."""
    defaults = TEXT_CONFIG_DEFAULTS.get(str(text_config.get("model_type", "")), {})
    return {**defaults, **text_config}
