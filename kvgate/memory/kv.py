"""KV cache geometry: bytes per token, the block pool, blocks per request, block hashes.

Mirrors vLLM v1 (``vllm/v1/kv_cache_interface.py`` for page sizes and per-spec
maximum usage, ``vllm/v1/core/kv_cache_utils.py`` for ``get_num_blocks``, the
hybrid grouping and ``get_max_concurrency_for_kv_cache_config``; vLLM 0.33.0 moved the sizing and
grouping to ``v1/core/kv_cache_planning.py`` with the same arithmetic, compared function by function
in docs/memory-model.md), so that our numbers equal the ones vLLM logs at start-up and exports in
``cache_config_info``.

Hybrid models (full attention beside sliding-window or chunked attention, e.g. Gemma 2/3,
gpt-oss, Llama 4; or beside recurrent-state layers, e.g. Qwen3-Next, Jamba, Nemotron-H):
vLLM splits layers into KV cache groups of ``group_size`` layers of one type (the rarest
type's count, or the commonest's when all counts are within 1.5x); every group draws block
ids from ONE shared pool, and one pool block is ``group_size`` layer pages. So
``num_blocks = memory // page // group_size`` and a request holds, per group, the blocks its
type needs: every block of its tokens (full), a window's worth (sliding, chunked), or one
state page whatever its length (recurrent state, vLLM's MambaSpec). vLLM raises the block
size of such models until an attention page holds a state page; kvgate reads that block
size from the backend. All block counts here are in pool blocks, summed over groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from kvgate.frozen_values import direct_init
from kvgate.memory.draft import Drafter
from kvgate.memory.geometry import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    NO_CACHE,
    RECURRENT_STATE,
    SLIDING_ATTENTION,
    ModelGeometry,
    dtype_bytes,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per KV element for vLLM's ``--kv-cache-dtype``."""
    if kv_cache_dtype == "auto":
        return model_dtype_bytes
    if kv_cache_dtype.startswith("fp8"):
        return 1
    return dtype_bytes(kv_cache_dtype)


@dataclass(frozen=True)
class Capacity:
    """What vLLM logs after sizing the pool, plus the per-request block count behind it."""

    bytes_per_token: int
    num_blocks: int
    kv_cache_tokens: int  # as vLLM >= 0.11 logs it: int(max_concurrency * max_model_len)
    max_concurrency: float
    blocks_per_request: int = 0  # blocks one max_model_len request needs


@dataclass(frozen=True)
class KVLayout:
    """One deployment's KV cache geometry, per GPU."""

    geometry: ModelGeometry
    block_size: int = 16
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    mamba_cache_mode: str = "none"  # vLLM's --mamba-cache-mode: none | align | all
    # Blocks every sequence holds beyond this layout's count: set when vLLM's own capacity
    # report says a max_model_len request takes more blocks than the layout does.
    extra_blocks_per_sequence: int = 0
    draft: Drafter | None = None  # speculative decoding's draft model (kvgate/memory/draft.py)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """AttentionSpec.page_size_bytes / block_size of one target layer."""
        return self._layer_bytes(self.geometry)

    def _layer_bytes(self, g: ModelGeometry) -> int:
        """One attention layer's KV bytes per token per GPU (MLAAttentionSpec: one latent, not split by TP)."""
        dt = kv_cache_dtype_bytes(self.kv_cache_dtype, g.dtype_bytes)
        if g.is_mla:
            assert g.kv_lora_rank is not None  # is_mla says so
            return (g.kv_lora_rank + g.qk_rope_head_dim) * dt
        kv_heads = max(1, g.num_kv_heads // self.tensor_parallel_size)
        return 2 * kv_heads * g.head_dim * dt

    @property
    def draft_bytes_per_token(self) -> int:
        """The draft's attention layers' KV bytes per token per GPU (0 without a draft)."""
        return 0 if self.draft is None else self.draft.num_layers * self._layer_bytes(self.draft.geometry)

    @property
    def draft_layers(self) -> int:
        """The draft's KV as full-attention layers of the target's page size, rounded up.

        vLLM sums the pages exactly (one group per attention type); counting the draft in whole
        target layers is exact when its layers are shaped like the target's (EAGLE heads, MTP)
        and over by less than one layer's page otherwise."""
        return cdiv(self.draft_bytes_per_token, self.bytes_per_token_per_layer)

    @cached_property
    def stage_layer_types(self) -> tuple[str, ...]:
        """Cache kinds of the largest pipeline stage's layers (vLLM ``get_pp_indices`` split), and
        the draft model's layers (``draft_layers``) as full attention.

        vLLM gives the remainder layers to the stages before the last, one each;
        every rank then uses the smallest block count, which the largest stage sets.
        A block with two mixers counts as two cache layers; one with none as zero.
        """
        types = self.geometry.attention_types
        pp = self.pipeline_parallel_size
        sizes = [len(types) // pp] * pp
        for i in range(2, len(types) % pp + 2):
            sizes[-i] += 1
        first_largest = sizes.index(max(sizes))
        start = sum(sizes[:first_largest])
        stage = types[start : start + sizes[first_largest]]
        kinds = tuple(kind for layer in stage for kind in layer.split("+") if kind != NO_CACHE)
        # The draft's layers live with the last stage's; adding them to the largest is cautious.
        return kinds + (FULL_ATTENTION,) * self.draft_layers

    @property
    def layers_per_stage(self) -> int:
        """Layers whose cache grows with the tokens (recurrent states do not)."""
        return sum(1 for kind in self.stage_layer_types if kind != RECURRENT_STATE)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer * self.layers_per_stage

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer

    @cached_property
    def groups(self) -> dict[str, int]:
        """KV cache groups per attention type (``_get_kv_cache_config_uniform_page_size``)."""
        counts = Counter(self.stage_layer_types)
        if len(counts) == 1:
            return {next(iter(counts)): 1}
        size = self.group_size
        return {kind: cdiv(n, size) for kind, n in counts.items()}

    @property
    def group_size(self) -> int:
        """Layers per KV cache group: the rarest type's count, or the commonest's when it is
        under 1.5x the rarest (vLLM pads a few layers rather than split into more groups)."""
        counts = Counter(self.stage_layer_types).values()
        smallest, largest = min(counts), max(counts)
        return largest if largest < smallest * 1.5 else smallest

    def num_blocks(self, kv_cache_memory_bytes: int) -> int:
        """``get_num_blocks``: memory // page_size // num_layers (per group)."""
        return max(0, kv_cache_memory_bytes // self.page_bytes // self.group_size)

    def capacity(
        self,
        kv_cache_memory_bytes: int,
        max_model_len: int,
        max_num_batched_tokens: int | None = None,
    ) -> Capacity:
        """The pool vLLM builds from ``kv_cache_memory_bytes`` and its logged concurrency.

        ``max_num_batched_tokens`` only matters for sliding-window layers (their
        per-request maximum); None assumes it is at least ``max_model_len``.
        """
        num_blocks = self.num_blocks(kv_cache_memory_bytes)
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        per_request = self.max_request_blocks(max_model_len, batched)
        concurrency = num_blocks / per_request
        return Capacity(
            bytes_per_token=self.bytes_per_token,
            num_blocks=num_blocks,
            kv_cache_tokens=int(concurrency * max_model_len),
            max_concurrency=concurrency,
            blocks_per_request=per_request,
        )

    def max_request_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one max_model_len request holds at most (``get_max_concurrency_for_kv_cache_config``)."""
        return self.extra_blocks_per_sequence + sum(
            n * self._max_blocks(kind, max_model_len, max_num_batched_tokens) for kind, n in self.groups.items()
        )

    def blocks_for_request(
        self,
        prompt_tokens: int,
        total_tokens: int,
        n: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        share_prompt: bool = True,
    ) -> int:
        """Blocks for ``n`` samples of one prompt grown to ``total_tokens`` each.

        With prefix caching the samples share the prompt's full blocks in the
        full-attention groups; each keeps its own tail. The other groups are counted
        per sample: each sample's window moves past the prompt, and each has its own state.
        """
        full_per_sample = cdiv(total_tokens, self.block_size)
        shared = prompt_tokens // self.block_size if share_prompt and n > 1 else 0
        total = n * self.extra_blocks_per_sequence
        for kind, groups in self.groups.items():
            if kind == FULL_ATTENTION:
                total += groups * (shared + n * (full_per_sample - shared))
            else:
                cap = self._max_blocks(kind, max_model_len, max_num_batched_tokens)
                total += groups * n * min(full_per_sample, cap)
        return total

    def _max_blocks(self, kind: str, max_model_len: int, max_num_batched_tokens: int) -> int:
        """``max_memory_usage_bytes / page_size_bytes`` of one layer of this type.

        Sliding window: the window, one chunk in flight, +1 for a window that does not
        start on a block boundary. Chunked local attention: the chunk and one batch in
        flight. Recurrent state: one page (two while "align" mode checkpoints it, a page
        per block in "all" mode).
        """
        if kind == RECURRENT_STATE:
            if self.mamba_cache_mode == "all":
                return cdiv(max_model_len, self.block_size)
            return 2 if self.mamba_cache_mode == "align" else 1
        if kind == CHUNKED_ATTENTION:
            chunk = self.geometry.attention_chunk_size or max_model_len
            return cdiv(min(chunk + max_num_batched_tokens, max_model_len), self.block_size)
        if kind != SLIDING_ATTENTION:
            return cdiv(max_model_len, self.block_size)
        window = self.geometry.sliding_window or max_model_len
        tokens = min(window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1


_ROOT_HASH = 0x6B7667617465  # parent of the first block; any constant works within a process


@direct_init
@dataclass(frozen=True)
class PrefixKeys:
    """What vLLM mixes into a block's hash besides its tokens: the keys of vLLM 0.32.0
    ``generate_block_hash_extra_keys`` (vllm/v1/core/kv_cache_utils.py). ``every_block``: keys
    each block carries (``_gen_lora_extra_hash_keys``: the adapter's name and path);
    ``first_block``: keys only the first block carries (``("cache_salt", salt)`` when
    ``start_token_idx == 0``). The chain carries a first-block key into every later block's
    hash, so prompts that differ in any key share no block. Multimodal keys need no entry here:
    kvgate's image tokens already stand for the image (kvgate/multimodal.py expand_images)."""

    every_block: tuple[tuple[str | None, ...], ...] = ()
    first_block: tuple[tuple[str | None, ...], ...] = ()

    @classmethod
    def of(cls, cache_salt: str | None = None, request_key: tuple[str | None, ...] | None = None) -> PrefixKeys:
        """The keys of a request with this ``cache_salt`` and a key of all its blocks
        (``("lora", name, path)`` for a LoRA adapter)."""
        return cls(
            every_block=(request_key,) if request_key else (),
            first_block=(("cache_salt", cache_salt),) if cache_salt else (),
        )


NO_PREFIX_KEYS = PrefixKeys()


def block_hashes(token_ids: Sequence[int], block_size: int, keys: PrefixKeys = NO_PREFIX_KEYS) -> list[int]:
    """Chained hashes of the full blocks, like vLLM's prefix cache keys.

    Block i hashes ``(hash of block i-1, its token ids, its extra keys)`` (``hash_block_tokens``),
    so equal hashes mean equal prefixes under equal keys. Partial trailing blocks are not hashed
    (vLLM never caches them). Python's builtin ``hash`` is used for speed: values are only
    comparable within one process, which is all the ledger needs.
    """
    tokens = tuple(token_ids)  # one copy: a tuple's slices are the tuples hashed, no copy each
    hashes: list[int] = []
    parent = _ROOT_HASH
    later = keys.every_block or None
    first = (keys.every_block + keys.first_block) or None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tokens[start : start + block_size], first if start == 0 else later))
        hashes.append(parent)
    return hashes
