"""A pool of fixed-size KV blocks with reference counts and a prefix-hash index.

Free blocks sit in an LRU queue. A freed block keeps its hash, so a later request with
the same prefix can take it back (a prefix-cache hit) until its space is needed, when it
is evicted from the front of the queue.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    # Chain hash of this block's tokens and all before it; None while the block is not full.
    block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """Chain hash: the parent block's hash, this block's token ids and what else shapes the KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, on_evict=None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Called with (block, its hash) just before a cached block is evicted for reuse.
        self.on_evict = on_evict
        self.peak_used = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block, oldest-freed first: the eviction order.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block, block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block. Pass a sequence's blocks tail first, so the tail
        is evicted before the shared head."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # First writer wins; a duplicate block with the same content stays uncached.
        self._cached.setdefault(block_hash, block)

    def check_all_free(self) -> None:
        """Invariant for the end of a run: every reference was returned."""
        held = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if held or len(self._free) != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {held[:10]} (free {len(self._free)}/{self.num_blocks})")
