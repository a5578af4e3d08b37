"""``kvgate capacity``: the KV pool vLLM will build, computed offline.

Prints the same figures vLLM logs at start-up ("GPU KV cache size: N tokens",
"Maximum concurrency for L tokens per request: X.XXx") from a model folder and
``--kv-cache-memory-bytes``, so a deployment can be sized before a GPU is booked. It is the pool
step of `kvgate advise`'s prediction (kvgate/advise_startup.py: the same layout and capacity),
for a pool size given rather than predicted.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvgate.advise_startup import load_layout
from kvgate.vllm_flags import add_vllm_arguments

# vLLM's flags that size the pool (declared once in kvgate.vllm_flags).
POOL_FLAGS = (
    "kv_cache_memory_bytes",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "kv_cache_dtype",
    "dtype",
    "block_size",
    "max_model_len",
    "max_num_batched_tokens",
    "speculative_config",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-config",
        "--model",
        dest="model_config",
        metavar="DIR",
        help="folder holding the model's config.json (also vLLM's --model or MODEL)",
    )
    # capacity's own defaults: block size and batch size only matter for some models (see run)
    add_vllm_arguments(parser, POOL_FLAGS, typed=True, defaults={"block_size": None, "max_num_batched_tokens": None})
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the pool's size; 1 if vLLM would refuse to start, 2 on bad input."""
    try:
        if args.model_config is None:
            raise ValueError("the model folder is needed: --model-config DIR (or vLLM's --model / MODEL)")
        if args.kv_cache_memory_bytes is None:
            raise ValueError("the KV cache size is needed: --kv-cache-memory-bytes (vLLM's flag, e.g. 49.94GiB)")
        spec = args.speculative_config
        _, layout, max_model_len = load_layout(
            args.model_config,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative_method=spec.method if spec else None,
            speculative_model=spec.model if spec else None,
        )
        cap = layout.capacity(args.kv_cache_memory_bytes, max_model_len, args.max_num_batched_tokens)
    except ValueError as exc:
        print(f"kvgate capacity: {exc}", file=sys.stderr)
        return 2

    fits = cap.max_concurrency >= 1
    if not fits:
        print(
            f"kvgate capacity: one {max_model_len:,}-token request needs {cap.blocks_per_request:,} "
            f"blocks but the pool has {cap.num_blocks:,}; vLLM would refuse to start "
            "(lower --max-model-len or give the KV cache more memory)",
            file=sys.stderr,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "bytes_per_token": cap.bytes_per_token,
                    "num_blocks": cap.num_blocks,
                    "kv_cache_tokens": cap.kv_cache_tokens,
                    "max_concurrency": cap.max_concurrency,
                }
            )
        )
        return 0 if fits else 1
    draft = f", the {layout.draft.method} draft's {layout.draft_layers} included" if layout.draft else ""
    print(
        f"KV cache bytes per token per GPU: {cap.bytes_per_token:,} "
        f"({layout.layers_per_stage} layers x {layout.bytes_per_token_per_layer:,} B{draft})"
    )
    print(
        f"Num GPU blocks: {cap.num_blocks:,} (block size {layout.block_size}, "
        f"{cap.blocks_per_request:,} blocks per max-length request)"
    )
    print(f"GPU KV cache size: {cap.kv_cache_tokens:,} tokens")
    print(f"Maximum concurrency for {max_model_len:,} tokens per request: {cap.max_concurrency:.2f}x")
    return 0 if fits else 1
