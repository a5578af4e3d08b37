"""Build a tiny Llama model folder offline, without torch, for a real vLLM to serve.

The weights are random: the model exists so that vLLM's scheduler, KV cache and
tokenizer run for real, not to produce sensible text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 2048
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # vLLM's CPU attention rejects head_dim 16: keep one of 32, 64, ...
INTERMEDIATE = 256
LAYERS = 2
MAX_POSITIONS = 1024

# Llama-3 shaped, string content, with tools, documents and tool-call history.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools or documents %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message }}
    {%- if tools %}
        {{- '\\n\\nYou may call these functions. Reply with {"name": ..., "arguments": ...}.' }}
        {%- for tool in tools %}
            {{- '\\n' + tool | tojson }}
        {%- endfor %}
    {%- endif %}
    {%- if documents %}
        {{- '\\n\\nDocuments:' }}
        {%- for doc in documents %}
            {{- '\\n[' + loop.index|string + '] ' + doc.get('title', '') + ': ' + doc['text'] }}
        {%- endfor %}
    {%- endif %}
    {{- eos_token }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('A system message is only allowed first.') }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and message.get('tool_calls') %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for call in message['tool_calls'] %}
            {{- {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + eos_token }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "be",
    "this",
    "are",
    "or",
    "an",
    "which",
    "model",
    "memory",
    "request",
    "token",
    "server",
    "cache",
    "block",
    "queue",
    "admit",
    "reject",
    "batch",
    "prompt",
    "system",
    "user",
    "assistant",
    "tool",
    "function",
    "call",
    "result",
    "answer",
    "question",
    "time",
    "data",
    "value",
    "first",
    "last",
    "small",
    "large",
    "fast",
    "slow",
    "high",
    "low",
    "new",
    "old",
    "long",
    "short",
    "good",
    "great",
    "other",
    "people",
    "city",
    "water",
    "light",
    "world",
    "house",
    "river",
    "mountain",
    "market",
    "number",
    "report",
    "system",
]


def _corpus(rng: random.Random, sentences: int = 6000) -> list[str]:
    """English-like sentences: common words, invented words, digits, punctuation, JSON bits."""
    syllables = ["ka", "to", "ri", "men", "sa", "lo", "ve", "ster", "pro", "ing", "tion", "ed"]
    invented = ["".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(400)]
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS if rng.random() < 0.7 else invented) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        end = rng.choice([".", ".", "?", "!", ":"])
        if rng.random() < 0.1:
            lines.append(json.dumps({"name": rng.choice(invented), "arguments": {"x": rng.randint(0, 99)}}))
        lines.append(" ".join(words) + end)
    return lines


def english_text(words: int, seed: int = 0) -> str:
    """Deterministic prose in the tokenizer's own vocabulary: about 1.1 tokens a word."""
    rng = random.Random(seed)
    sentences, left = [], words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + ".")
        left -= n
    return " ".join(sentences)


def _train_tokenizer() -> Tokenizer:
    """Byte-level BPE whose encode adds BOS, like Llama's tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(1234)), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok


def _llama_weights(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 tensors named and shaped exactly as vLLM's Llama loader expects."""

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(vocab, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, np.float32),
        "lm_head.weight": rand(vocab, HIDDEN),
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


def _config(tokenizer: PreTrainedTokenizerFast) -> dict:
    return {
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
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }


def build_tiny_model(dest: Path) -> Path:
    """Write tokenizer, config.json and model.safetensors into `dest`; deterministic."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(dest)
    config = _config(tokenizer)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = _llama_weights(config["vocab_size"], np.random.default_rng(0))
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def build_tiny_classifier(dest: Path) -> Path:
    """The tiny Llama with one label and its `score` head, for `--runner pooling --convert
    classify`: vLLM 0.32.0's `as_seq_cls_model` (vllm/model_executor/models/adapters.py) loads the
    head from the checkpoint's `score.weight` (num_labels rows of hidden size), and
    vllm/entrypoints/pooling/utils.py `enable_scoring_api` serves /score and /rerank for a
    classifier only with num_labels == 1 (a cross-encoder)."""
    build_tiny_model(dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config | {"num_labels": 1}, indent=2) + "\n")
    weights = load_file(str(dest / "model.safetensors"))
    head = (np.random.default_rng(1).standard_normal((1, HIDDEN)) * 0.02).astype(np.float32)
    save_file(weights | {"score.weight": head}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
