"""A random-weight Llama with a real-size vocabulary, built offline for the fidelity probe.

The sampler's and prompt logprobs' memory scale with the vocabulary (``[rows, V]`` tensors), so
the probe needs Llama-3's 128,256 ids, not the test suite's 2,048. The tokenizer is a word-level
vocabulary of that size (built, not trained: the probe hands vLLM token ids, so only the
vocabulary's size and detokenization matter). The hidden size is small on purpose: the weights
stay small (2 x V x H for embeddings and lm_head) and every ``[rows, V]`` term dwarfs the
``[tokens, H]`` activations, so no sampler term is lost in the forward pass's noise.

Runs in vLLM's venv (numpy, safetensors, tokenizers, transformers); kvgate's venv never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 128_256  # Llama-3's vocabulary
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64  # vLLM's CPU attention accepts 32, 64, 80, ...
INTERMEDIATE = 512
LAYERS = 1
MAX_POSITIONS = 4096
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: ids 0-3 are specials, then ``w4`` ... ``w128255``."""
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIALS), VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 tensors named and shaped as vLLM's Llama loader expects."""

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(VOCAB_SIZE, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, np.float32),
        "lm_head.weight": rand(VOCAB_SIZE, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    return weights


def build_model(dest: Path) -> Path:
    """Write tokenizer, config.json and model.safetensors into `dest` (deterministic); reuse a
    complete folder."""
    if (dest / "model.safetensors").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(dest)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_weights(np.random.default_rng(0)), str(dest / "model.safetensors.part"), metadata={"format": "pt"})
    (dest / "model.safetensors.part").rename(dest / "model.safetensors")
    return dest
