"""A pool of fixed-size KV blocks with reference counts and a prefix-hash index.

Free blocks sit in an LRU queue. A freed block keeps its hash, so a later request with
the same prefix can take it back (a prefix-cache hit) until its space is needed, when it
is evicted from the front of the queue.

Runs: a sequence can take its first blocks at the start of a run of free blocks and reserve
the rest of the run for its growth (`allocate_run`, then `take_next`), so its blocks sit at
consecutive addresses. CPU decode attention reads a sequence's KV block by block, and the
hardware prefetcher follows consecutive blocks but not scattered ones
(`python examples/bench_cpu_attention.py` times both layouts). A reservation is soft: reserved
blocks count as free and plain `allocate` takes them (after every unreserved one), so it never
costs capacity or causes a preemption.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# Block states: used, free (in the free queue, no cached content), free holding a cached
# prefix block (in the free queue), reserved (free, in the reserved queue).
_USED, _FREE, _FREE_CACHED, _RESERVED = 0, 1, 2, 3
_FREE_BYTE = bytes([_FREE])
_CACHED_AS_FREE = bytes.maketrans(bytes([_FREE_CACHED]), bytes([_FREE]))


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
        # Free blocks reserved for a sequence's growth, oldest first; taken last by `allocate`.
        self._reserved: OrderedDict[int, Block] = OrderedDict()
        # Per block: its state (_USED, ...); runs are found by searching it for a string of
        # _FREE bytes (C speed).
        self._state = bytearray([_FREE]) * num_blocks
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._reserved)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        """n blocks from the front of the free queue (reserved ones only once it is empty)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = [self._take((self._free or self._reserved).popitem(last=False)[1]) for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return out

    def allocate_run(self, n: int, total: int, evict_cached: bool = True) -> list[Block] | None:
        """The first n blocks of the lowest run of `total` consecutive free, unreserved blocks,
        reserving the other total - n; None (changing nothing) where there is no such run.
        Runs without cached prefix blocks come first; with evict_cached False there are no
        others, so the prefix cache loses entries only in its LRU order."""
        start = self._state.find(_FREE_BYTE * total)
        if start < 0 and self.enable_caching and evict_cached:
            start = self._state.translate(_CACHED_AS_FREE).find(_FREE_BYTE * total)
        if start < 0:
            return None
        out = []
        for i in range(start, start + total):
            block = self._free.pop(i)
            if i < start + n:
                out.append(self._take(block))
            else:
                self._reserved[i] = block
                self._state[i] = _RESERVED
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return out

    def take_next(self, prev_id: int, reserved_below: int) -> Block | None:
        """Block prev_id + 1 when it is free and either unreserved or below reserved_below (the
        end of the caller's own reservation); else None."""
        i = prev_id + 1
        if i >= self.num_blocks:
            return None
        state = self._state[i]
        if state == _FREE or state == _FREE_CACHED:
            block = self._free.pop(i)
        elif state == _RESERVED and i < reserved_below:
            block = self._reserved.pop(i)
        else:
            return None
        self._take(block)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return block

    def release(self, start: int, end: int) -> None:
        """Blocks [start, end) still reserved become plain free blocks (at the queue's end)."""
        for i in range(start, min(end, self.num_blocks)):
            if self._state[i] == _RESERVED:
                block = self._free[i] = self._reserved.pop(i)
                self._state[i] = _FREE if block.block_hash is None else _FREE_CACHED

    def _take(self, block: Block) -> Block:
        """A block just removed from a free queue becomes used: its cached hash is evicted."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block, block.block_hash)
            block.block_hash = None
            self.num_evictions += 1
        block.ref_cnt = 1
        self._state[block.block_id] = _USED
        return block

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._state[block.block_id] == _RESERVED:
                    del self._reserved[block.block_id]
                else:
                    del self._free[block.block_id]
                self._state[block.block_id] = _USED
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
                self._state[block.block_id] = _FREE if block.block_hash is None else _FREE_CACHED

    def cache(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # First writer wins; a duplicate block with the same content stays uncached.
        self._cached.setdefault(block_hash, block)

    def check_all_free(self) -> None:
        """Invariant for the end of a run: every reference was returned."""
        held = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if held or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"blocks still referenced: {held[:10]} (free {self.num_free_blocks}/{self.num_blocks})")
        if self._reserved:
            raise AssertionError(f"blocks still reserved: {list(self._reserved)[:10]}")
