"""One request's memory footprint: the glue the gate calls per request.

KV blocks at full growth (prompt + max_new_tokens, capped at max_model_len) and
at the growth kvgate reserves (prompt + the output it expects, and that
output's variance, see outputs.py) for all n samples, the prompt's block hashes (so the ledger can count a shared
prefix once), and the transient estimate of its worst step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvgate.frozen_values import direct_init
from kvgate.memory.activation import EngineShape, SamplingShape, TransientEstimate, estimate_transient
from kvgate.memory.kv import NO_PREFIX_KEYS, KVLayout, PrefixKeys, block_hashes
from kvgate.memory.outputs import OutputReservation


@direct_init
@dataclass(frozen=True)
class Footprint:
    prompt_tokens: int
    max_new_tokens: int
    reserved_new_tokens: int  # output tokens the KV reservation covers (<= max_new_tokens)
    reserved_variance: float  # of each sample's output length around it (tokens^2)
    n: int
    block_hashes: tuple[int, ...]  # full prompt blocks (shared-prefix detection)
    kv_blocks: int  # pool blocks reserved for all n samples, sliding-window aware
    max_kv_blocks: int  # pool blocks at full growth (max_new_tokens)
    transient: TransientEstimate
    # Output tokens each sample will surely generate (ignore_eos: max_new_tokens; min_tokens):
    # the floor of any reservation learned later (with_reservation's callers pass it on).
    min_new_tokens: int = 0


def predict_footprint(
    layout: KVLayout,
    engine: EngineShape,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingShape,
    enable_prefix_caching: bool = True,
    reservation: OutputReservation | None = None,
    transient: TransientEstimate | None = None,
    prefix_keys: PrefixKeys = NO_PREFIX_KEYS,
    min_new_tokens: int = 0,
) -> Footprint:
    """Predict what admitting this request costs.

    The n samples share the prompt's full blocks only with prefix caching on
    (vLLM v1 runs them as n child requests that meet in the prefix cache).
    ``transient``, if given, is this request's ``estimate_transient`` computed beforehand.
    ``prefix_keys``: what besides the tokens vLLM hashes into its blocks (a cache_salt shares
    nothing with another salt or none).
    """
    prompt = len(prompt_token_ids)
    n = sampling.rows
    hashes = tuple(block_hashes(prompt_token_ids, layout.block_size, prefix_keys)) if enable_prefix_caching else ()
    max_kv_blocks = kv_blocks_for(layout, engine, prompt, max_new_tokens, n, enable_prefix_caching)
    # Built once with its reservation (this runs per request): not the full footprint, then a copy.
    reserved, kv_blocks = _reserved_blocks(
        layout,
        engine,
        prompt,
        n,
        max_new_tokens,
        max_kv_blocks,
        max_new_tokens if reservation is None else reservation.tokens,
        enable_prefix_caching,
    )
    return Footprint(
        prompt_tokens=prompt,
        max_new_tokens=max_new_tokens,
        reserved_new_tokens=reserved,
        reserved_variance=0.0 if reservation is None else reservation.variance,
        n=n,
        block_hashes=hashes,
        kv_blocks=kv_blocks,
        max_kv_blocks=max_kv_blocks,
        transient=transient or estimate_transient(layout.geometry, engine, prompt, sampling),
        min_new_tokens=min_new_tokens,
    )


def kv_blocks_for(
    layout: KVLayout,
    engine: EngineShape,
    prompt_tokens: int,
    new_tokens: int,
    n: int,
    enable_prefix_caching: bool,
) -> int:
    """Pool blocks for n samples of a prompt grown by `new_tokens` each (capped at max_model_len)."""
    total = min(prompt_tokens + new_tokens, engine.max_model_len)
    return layout.blocks_for_request(
        prompt_tokens,
        total,
        n,
        engine.max_num_batched_tokens,
        engine.max_model_len,
        share_prompt=enable_prefix_caching,
    )


def with_reservation(
    fp: Footprint,
    layout: KVLayout,
    engine: EngineShape,
    reservation: OutputReservation,
    enable_prefix_caching: bool,
) -> Footprint:
    """The same footprint reserving a different output length (learned since it was made)."""
    unchanged = min(reservation.tokens, fp.max_new_tokens) == fp.reserved_new_tokens
    if unchanged and reservation.variance == fp.reserved_variance:
        return fp
    reserved, blocks = _reserved_blocks(
        layout,
        engine,
        fp.prompt_tokens,
        fp.n,
        fp.max_new_tokens,
        fp.max_kv_blocks,
        reservation.tokens,
        enable_prefix_caching,
    )
    return replace(fp, reserved_new_tokens=reserved, reserved_variance=reservation.variance, kv_blocks=blocks)


def _reserved_blocks(
    layout: KVLayout,
    engine: EngineShape,
    prompt_tokens: int,
    n: int,
    max_new_tokens: int,
    max_kv_blocks: int,
    reserved_tokens: int,
    enable_prefix_caching: bool,
) -> tuple[int, int]:
    """Output tokens reserved (never above max_new_tokens) and the pool blocks they take."""
    reserved = min(reserved_tokens, max_new_tokens)
    if reserved == max_new_tokens:
        return reserved, max_kv_blocks
    return reserved, kv_blocks_for(layout, engine, prompt_tokens, reserved, n, enable_prefix_caching)
