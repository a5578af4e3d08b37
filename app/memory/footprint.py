"""One request's memory footprint: the glue the gate calls per request.

KV blocks at full growth (prompt + max_new_tokens, capped at max_model_len) for
all n samples, the prompt's block hashes (so the ledger can count a shared
prefix once), and the transient estimate of its worst step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.memory.activation import EngineShape, SamplingShape, TransientEstimate, estimate_transient
from app.memory.kv import KVLayout, block_hashes


@dataclass(frozen=True)
class Footprint:
    prompt_tokens: int
    max_new_tokens: int
    n: int
    block_hashes: tuple[int, ...]  # full prompt blocks (shared-prefix detection)
    kv_blocks: int  # pool blocks at full growth for all n samples, sliding-window aware
    transient: TransientEstimate


def predict_footprint(
    layout: KVLayout,
    engine: EngineShape,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingShape,
    enable_prefix_caching: bool = True,
    cached_prefix_tokens: int = 0,
) -> Footprint:
    """Predict what admitting this request costs.

    The n samples share the prompt's full blocks only with prefix caching on
    (vLLM v1 runs them as n child requests that meet in the prefix cache).
    ``cached_prefix_tokens`` (known to the ledger, not here) shrinks the worst
    prefill chunk's new tokens, never the KV need: cached blocks are held too.
    """
    prompt = len(prompt_token_ids)
    n = sampling.rows
    total = min(prompt + max_new_tokens, engine.max_model_len)
    hashes = tuple(block_hashes(prompt_token_ids, layout.block_size)) if enable_prefix_caching else ()
    kv_blocks = layout.blocks_for_request(
        prompt, total, n, engine.max_num_batched_tokens, engine.max_model_len,
        share_prompt=enable_prefix_caching,
    )
    return Footprint(
        prompt_tokens=prompt,
        max_new_tokens=max_new_tokens,
        n=n,
        block_hashes=hashes,
        kv_blocks=kv_blocks,
        transient=estimate_transient(layout.geometry, engine, prompt, sampling, cached_prefix_tokens),
    )
