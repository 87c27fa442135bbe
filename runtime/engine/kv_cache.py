"""Paged KV-cache bookkeeping: blocks, the block pool, and per-request block tables.

Every block is preallocated. A block has an id, a reference count and, once full and
computed, a chained hash (hash of its parent's hash, its tokens and an optional salt) under
which later requests with the same prefix find it. Free blocks wait in a doubly linked queue:
allocation takes from the head, freeing appends to the tail, and a cached free block that a
new request hits is unlinked from the middle in O(1). A free block keeps its hash until it is
handed out again, so eviction is least-recently-freed first. A request frees its blocks in
reverse order, so its last (least shared) blocks are evicted before its prefix.

This module does the bookkeeping; the tensors live with the model (`attention.py`), sized
and allocated for an engine by `build_kv_cache`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.attention import PagedKVCache
from kiln.runtime.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from kiln.runtime.engine.loader import KVCacheSpec
from kiln.runtime.engine.model import CausalLM
from kiln.runtime.engine.sequence import Request


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of `block_size` token slots in every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, oldest-freed first."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        before, after = block.prev, block.next
        assert before is not None and after is not None, "block is not in the free queue"
        before.next, after.prev = after, before
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        assert block is not None and block is not self._tail, "no free blocks"
        self.remove(block)
        return block


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """Chained block hash: a block's identity depends on every token before it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else (salt or "").encode())
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockPool:
    """All KV blocks, their free queue, and the hash → cached-block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.enable_caching = enable_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, evicting their cached hashes."""
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a request reuses, unlinking free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks nobody holds go to the tail of the free queue."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Gives requests the blocks they need, reusing cached prefixes where it can."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / max(self.pool.num_blocks, 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes over any newly full blocks of its tokens."""
        size, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[start : start + size], request.cache_salt))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that prefixes the request's tokens.

        The last token is always left to compute: the engine needs its logits. A request
        that wants prompt log-probabilities gets hits only before the first position it
        scores (`prompt_logprobs_start`): it must compute every position from there.
        """
        if not self.enable_caching:
            return []
        self.update_block_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        if request.wants_prompt_logprobs:
            # the row of position p scores token p + 1; the first one wanted must be computed
            limit = min(limit, (len(request.prompt_logprobs) - 1) // self.block_size)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: Sequence[KVBlock] = ()
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if the pool is short.

        `computed` are prefix-cache hits for a request being admitted; they count as computed.
        """
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new_blocks = self.blocks_needed(total) - len(request.block_table) - len(computed)
        reclaimed = sum(1 for block in computed if block.ref_cnt == 0)
        if max(new_blocks, 0) + reclaimed > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed)
        request.block_table.extend(block.block_id for block in computed)
        if computed:
            self._num_cached_blocks[request.request_id] = len(computed)
        if new_blocks > 0:
            request.block_table.extend(b.block_id for b in self.pool.allocate(new_blocks))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those `num_tokens` tokens need (speculative
        decoding's rollback of rejected draft positions), last block first."""
        keep = self.blocks_needed(num_tokens)
        extra = request.block_table[keep:]
        if extra:
            self.pool.free(self.pool.blocks[i] for i in reversed(extra))
            del request.block_table[keep:]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if full <= done:
            return
        self.update_block_hashes(request)
        for index in range(done, full):
            block = self.pool.blocks[request.block_table[index]]
            self.pool.cache(block, request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = full

    def free(self, request: Request) -> None:
        """Release every block of the request, last block first."""
        blocks = self.pool.blocks
        self.pool.free(blocks[i] for i in reversed(request.block_table))
        request.block_table = []
        self._num_cached_blocks.pop(request.request_id, None)


def build_kv_cache(
    model: CausalLM,
    config: EngineConfig,
    kv_spec: KVCacheSpec,
    max_model_len: int,
    num_blocks: int | None = None,
) -> PagedKVCache:
    """Allocate the model's paged K/V tensors: `num_blocks` blocks when given, else as many
    as the config asks for (`num_blocks`, `kv_cache_memory_bytes`, or enough for
    `max_num_seqs` sequences at `max_model_len`, capped at DEFAULT_KV_CACHE_BYTES)."""
    c = model.config
    kv_dtype = model.dtype
    if config.kv_cache_dtype != "auto":
        if kv_spec.quant:
            raise UsageError(
                f"kv_cache_dtype={config.kv_cache_dtype!r}: this checkpoint stores its KV "
                f"cache as {kv_spec.quant} with calibrated scales; leave kv_cache_dtype auto"
            )
        kv_dtype = getattr(torch, config.kv_cache_dtype)
    itemsize = 1 if kv_spec.quant else kv_dtype.itemsize
    per_block = PagedKVCache.bytes_per_block(
        c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, itemsize
    )
    if num_blocks is None:
        num_blocks = _num_blocks(config, per_block, max_model_len)
    return PagedKVCache(
        c.num_layers,
        num_blocks,
        config.block_size,
        c.num_kv_heads,
        c.head_dim,
        kv_dtype,
        model.device,
        kv_spec.quant,
        kv_spec.k_scales,
        kv_spec.v_scales,
    )


def _num_blocks(config: EngineConfig, per_block: int, max_model_len: int) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is not None:
        blocks = config.kv_cache_memory_bytes // per_block
        if blocks < 1:
            raise UsageError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no block; "
                f"one block takes {per_block} bytes"
            )
        return blocks
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(wanted, DEFAULT_KV_CACHE_BYTES // per_block))
