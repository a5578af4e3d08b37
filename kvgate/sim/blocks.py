"""The KV block pool and per-request block tables, in vLLM v1's words (v1/core/block_pool.py,
kv_cache_manager.py, kv_cache_utils.py).

Block 0 is the null block and never handed out. Full blocks are identified by chained hashes
(the parent's hash, the block's token ids, an extra key), so a shared prefix maps to the same
physical blocks. A freed block keeps its hash and stays findable until it is evicted: free
blocks sit in a queue and are reused from the front; a request's blocks are freed tail first,
so the end of a prompt is evicted before its beginning. A cached block with no reference counts
as free (`kv_cache_usage_perc = 1 - free / (num_gpu_blocks - 1)`).

Hybrid models (kvgate/sim/kv_layout.py) draw several KV cache groups from the one pool, as vLLM's
hybrid KV cache manager does (v1/core/kv_cache_coordinator.py `HybridKVCacheCoordinator`): the
first full-attention group keeps the hashed block table; every other group holds the blocks its
kind needs (a window's worth for sliding and chunked layers, whose older blocks are freed; one
state block for recurrent layers). Prefix-cache hits are taken only on single-group layouts:
a hybrid hit needs every group to hit, which the simulator does not model (it recomputes, using
more KV, never less).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.sim.kv_layout import GroupRule

_NONE_HASH = 0


def chained_hashes(
    token_ids: Sequence[int], block_size: int, start: int, parent: int, cache_salt: str | None = None
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` on. As vLLM 0.32.0's
    request_block_hasher (vllm/v1/core/kv_cache_utils.py), a request's `cache_salt` is an extra
    key of its first block only (generate_block_hash_extra_keys), and the chain carries it on."""
    out: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        extra_keys = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra_keys))
        out.append(parent)
    return out


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """All KV blocks of the GPU: the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free / max(1, self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.pop(b.block_id, None)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Sequence[KVBlock]) -> None:
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if self.enable_caching and block.block_hash is None:
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, block)


class KVCacheManager:
    """Block tables per request: prefix lookup, slot allocation, freeing."""

    def __init__(self, pool: BlockPool, block_size: int, groups: tuple[GroupRule, ...] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        groups = groups or (GroupRule("full", None, block_size, 1),)
        hashed = groups[0].kind in ("full", "mla") and groups[0].block_size == block_size
        # The block table prefix caching hashes (one full-attention group), and the other groups.
        self.table_group = groups[0] if hashed else None
        self.other_groups = groups[1:] if hashed else groups
        self.caching = pool.enable_caching and hashed and not self.other_groups
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.group_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached: dict[str, int] = {}
        self.hashes: dict[str, list[int]] = {}

    def _hashes(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        hs = self.hashes.setdefault(req_id, [])
        parent = hs[-1] if hs else _NONE_HASH
        hs.extend(chained_hashes(token_ids, self.block_size, len(hs), parent, cache_salt))
        return hs

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[KVBlock]:
        """The longest cached prefix, leaving at least the last token to compute."""
        if not self.caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in self._hashes(req_id, token_ids, cache_salt)[:max_blocks]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        num_new: int,
        new_computed: Sequence[KVBlock] = (),
        cache_salt: str | None = None,
    ) -> bool:
        """Give the request blocks for `num_new` more tokens, or False if the pool is short."""
        blocks = self.req_blocks.setdefault(req_id, [])
        total = num_computed + len(new_computed) * self.block_size + num_new
        need = 0
        if self.table_group is not None:
            need = -(-total // self.block_size) - len(blocks) - len(new_computed)
        others = self.group_blocks.setdefault(req_id, [])
        target = sum(g.copies * g.blocks(total, num_new) for g in self.other_groups)
        if len(others) > target:  # blocks that fell out of a window go back to the pool
            self.pool.free_blocks(others[: len(others) - target])
            del others[: len(others) - target]
        need_others = target - len(others)
        evictable = sum(1 for b in new_computed if b.ref_cnt == 0)
        if max(0, need) + need_others > self.pool.num_free - evictable:
            return False
        self.pool.touch(new_computed)
        blocks.extend(new_computed)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if need_others > 0:
            others.extend(self.pool.get_new_blocks(need_others))
        if self.caching:
            full = min(total, len(token_ids)) // self.block_size
            hs = self._hashes(req_id, token_ids[: full * self.block_size], cache_salt)
            start = self.num_cached.get(req_id, 0)
            for i in range(start, full):
                self.pool.cache_block(blocks[i], hs[i])
            self.num_cached[req_id] = max(start, full)
        return True

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, []) + self.group_blocks.pop(req_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self.num_cached.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop a finished request's hash list as well as its blocks."""
        self.free(req_id)
        self.hashes.pop(req_id, None)
