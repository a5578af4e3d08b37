"""The KV cache layout vLLM 0.32.0 builds for a model: per-layer specs, KV cache groups drawn from
one block pool, the bytes one pool block costs, and how many blocks a request holds per group.

From vllm/v1/kv_cache_interface.py (`FullAttentionSpec`, `MLAAttentionSpec`, `SlidingWindowSpec`,
`ChunkedLocalAttentionSpec`, `MambaSpec`: page sizes and `max_admission_blocks_per_request`),
vllm/v1/core/kv_cache_utils.py (`get_kv_cache_groups`: one group when every layer has the same
spec, else `_get_kv_cache_groups_uniform_page_size`: layers bucketed by spec, each bucket split
into groups of the smallest bucket's size, or the largest's when it is under 1.5 x the smallest;
`get_kv_cache_config_from_groups`: num_blocks = available // (group size x page);
`check_enough_kv_cache_memory`: every layer's max usage must fit, less the null block) and
vllm/platforms/interface.py (`Platform._align_hybrid_block_size`: with recurrent layers the
attention block grows in kernel-block steps (16) until its page holds the recurrent state, whose
page is then padded to the attention page).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.sim.model import LayerKind, SimModel

KERNEL_BLOCK = 16  # FlashAttention's smallest kernel block, the hybrid alignment step
MLA_BLOCK = 64  # FlashMLA's block on Hopper, vLLM's MLA default

LayerSpec = tuple[LayerKind, "int | None", int]  # kind, window, block size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """`--kv-cache-dtype`: auto keeps the model dtype; the fp8 formats take one byte."""
    if kv_cache_dtype == "auto":
        return model_dtype_bytes
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype in ("bfloat16", "float16", "half"):
        return 2
    raise ValueError(f"unsupported --kv-cache-dtype {kv_cache_dtype!r}")


@dataclass(frozen=True)
class GroupRule:
    """One kind of KV cache group and how many groups of that kind the layout has."""

    kind: LayerKind
    window: int | None  # sliding window or attention chunk, tokens
    block_size: int  # tokens per block in this group
    copies: int

    def blocks(self, num_tokens: int, num_new: int) -> int:
        """Blocks one request holds in one group of this kind with `num_tokens` computed or
        scheduled, `num_new` of them in the current step: the window's blocks for sliding and
        chunked layers (vLLM frees the ones that fell out), one state block for recurrent ones."""
        return min(
            cdiv(num_tokens, self.block_size),
            max_admission_blocks(self.kind, self.window, self.block_size, num_tokens, num_new),
        )


@dataclass(frozen=True)
class KVLayout:
    """The pool's block size, its groups, and the bytes of one pool block."""

    block_size: int  # the target model's attention block (the hashed block table's)
    groups: tuple[GroupRule, ...]
    layers_per_group: int
    page_bytes: int  # one layer's page, uniform across groups (recurrent pages padded to it)
    layers: tuple[LayerSpec, ...]  # each cached layer (a draft model's included)

    @property
    def block_bytes(self) -> int:
        """What one pool block costs: every layer slot of one group (padding included)."""
        return self.layers_per_group * self.page_bytes

    def request_blocks(self, num_tokens: int, num_new: int) -> int:
        """Pool blocks one request holds over all groups."""
        return sum(g.copies * g.blocks(num_tokens, num_new) for g in self.groups)

    def max_request_bytes(self, max_model_len: int, in_flight: int) -> int:
        """`max_memory_usage_bytes` summed over the cached layers: one max_model_len request."""
        return self.page_bytes * sum(
            max_admission_blocks(kind, window, block, max_model_len, in_flight) for kind, window, block in self.layers
        )

    def max_request_blocks(self, max_model_len: int, in_flight: int) -> int:
        """Pool blocks one max_model_len request takes over all groups
        (`get_max_concurrency_for_kv_cache_config`)."""
        return sum(
            g.copies * max_admission_blocks(g.kind, g.window, g.block_size, max_model_len, in_flight)
            for g in self.groups
        )


def max_admission_blocks(kind: LayerKind, window: int | None, block_size: int, max_len: int, in_flight: int) -> int:
    """A layer's most blocks per request (`max_admission_blocks_per_request`; `in_flight` is
    `VllmConfig.max_in_flight_tokens`, one batch of max_num_batched_tokens per step in flight)."""
    if kind == "sliding" and window:
        return cdiv(min(window - 1 + in_flight, max_len), block_size) + 1
    if kind == "chunked" and window:
        return cdiv(min(window + in_flight, max_len), block_size)
    if kind == "mamba":
        return 1
    return cdiv(max_len, block_size)


def build_layout(
    model: SimModel, tp: int, kv_cache_dtype: str, block_size: int | None, draft: SimModel | None = None
) -> KVLayout:
    """vLLM's KV cache groups for `model` (and a speculative draft model's layers, which share
    the pool) at tensor parallelism `tp`."""
    kv_dt = kv_dtype_bytes(kv_cache_dtype, model.dtype_bytes)
    per_token = _per_token(model, tp, kv_dt)
    block = block_size or (MLA_BLOCK if model.is_mla else KERNEL_BLOCK)
    mamba_page = model.mamba.state_bytes(tp, model.dtype_bytes) if model.mamba else 0
    if mamba_page and model.attention_layers:
        block = max(block, KERNEL_BLOCK * cdiv(mamba_page, KERNEL_BLOCK * per_token))
    page = block * per_token if model.attention_layers else mamba_page
    layers = _layer_specs(model, block)
    if draft is not None:
        layers += _layer_specs(draft, _draft_block(draft, tp, kv_dt, page))
    buckets: dict[LayerSpec, int] = {}
    for spec in layers:
        buckets[spec] = buckets.get(spec, 0) + 1
    if not buckets:
        raise ValueError(f"{model.name} caches nothing per token; the simulator plays decoders")
    smallest, largest = min(buckets.values()), max(buckets.values())
    size = largest if largest < 1.5 * smallest else smallest
    groups = tuple(
        GroupRule(kind, window, blk, cdiv(n, size))
        for (kind, window, blk), n in sorted(buckets.items(), key=_full_first)
    )
    return KVLayout(block, groups, size, page, layers)


def _per_token(model: SimModel, tp: int, kv_dt: int) -> int:
    """One attention layer's KV bytes per token (MLA: the latent and rope key, not split)."""
    if model.is_mla:
        return (model.kv_lora_rank + model.qk_rope_head_dim) * kv_dt
    return 2 * max(1, model.kv_heads // tp) * model.head_dim * kv_dt


def _layer_specs(model: SimModel, block: int) -> tuple[LayerSpec, ...]:
    windows = {"sliding": model.sliding_window, "chunked": model.attention_chunk}
    return tuple((kind, windows.get(kind), block) for kind in model.layer_kinds if kind != "none")


def _draft_block(draft: SimModel, tp: int, kv_dt: int, page: int) -> int:
    """`unify_kv_cache_spec_page_size`: a layer with a smaller page gets a block size that many
    times larger, so every page is the same; a page that does not divide evenly is refused."""
    per_token = _per_token(draft, tp, kv_dt)
    if draft.mamba is not None or page % per_token:
        raise ValueError(
            f"draft model {draft.name}: its KV page ({per_token} B per token) does "
            f"not divide the target's ({page} B); vLLM cannot unify the page sizes"
        )
    return page // per_token


def _full_first(item: tuple[LayerSpec, int]) -> tuple[int, int]:
    """Full-attention (or MLA) groups first: the block table prefix caching hashes."""
    (kind, _, block), _ = item
    return (0 if kind in ("full", "mla") else 1, block)
