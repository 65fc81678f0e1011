"""The KV cache manager: maps requests to block tables and hides the pool from the scheduler."""
from __future__ import annotations

from .block_pool import Block, BlockPool, hash_block
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, cache_salt: bytes = b"") -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        # Salt goes into every block hash: blocks of another model or dtype never match.
        self.cache_salt = cache_salt
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.token_ids_slice(i * bs, (i + 1) * bs), self.cache_salt))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request, in blocks and tokens. The last token is always
        left to compute, since its logits are needed."""
        if not self.pool.enable_caching:
            return [], 0
        num_full = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._block_hashes(req, num_full):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] | None = None) -> list[int] | None:
        """Make room for num_new_tokens more tokens of req. Returns the block table, or None
        (and changes nothing) when the pool cannot supply the blocks."""
        computed = computed or []
        held = self._blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed)
        # Cached blocks taken from the free queue leave it, so they count against free space.
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if max(need, 0) + revived > self.pool.num_free_blocks:
            return None
        if computed:
            self.pool.touch(computed)
        blocks = self._blocks.setdefault(req.request_id, [])
        blocks.extend(computed)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return [b.block_id for b in blocks]

    def cache_blocks(self, req: Request) -> None:
        """Publish the request's blocks that are now full of computed tokens."""
        if not self.pool.enable_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        blocks = self._blocks.get(req.request_id, [])
        hashes = self._block_hashes(req, num_full)
        for block, h in zip(blocks[:num_full], hashes):
            self.pool.cache(block, h)

    def free(self, req: Request) -> None:
        blocks = self._blocks.pop(req.request_id, [])
        self.pool.free(list(reversed(blocks)))

    def forget(self, req: Request) -> None:
        """Free the request and drop its hash list (it is finished)."""
        self.free(req)
        self._hashes.pop(req.request_id, None)

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
