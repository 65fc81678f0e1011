"""The KV cache manager: maps requests to block tables and hides the pools from the scheduler.

Two tiers: the device pool, and an optional CPU pool that holds swapped-out requests' blocks
and prefix blocks spilled when the device evicts them. Moving data is the runner's job; this
class only decides, and hands out transfer lists (device->CPU, then CPU->device) per step.

A model whose layers mix full and sliding-window attention (Gemma 2/3) gets a HybridKVManager:
one KVCacheManager per attention kind, each with its own pool and block table per request, as
vLLM v1's hybrid allocator keeps one table per KV-cache group. The sliding kind frees the blocks
that left its window; the full kind keeps everything.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from ..shapes import cdiv
from .block_pool import Block, BlockPool, hash_block
from .request import Request

# Most blocks a new sequence reserves beyond what it needs now (its expected growth).
RUN_SLACK = 128
# Prefix-cache hit rate (of prompt tokens) above which runs leave cached blocks alone.
RUN_EVICT_MAX_HIT_RATE = 0.01
_BLOCK_ID = operator.attrgetter("block_id")


@dataclass
class PrefixHit:
    # Cached blocks found on the device, then (after them) in the CPU tier.
    device: list[Block] = field(default_factory=list)
    cpu: list[Block] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.cpu)


# No prefix hit (read only: allocate_slots' fast path asks _need with it).
_NO_HIT = PrefixHit()


@dataclass
class TierStats:
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    spilled_blocks: int = 0
    reloaded_blocks: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, cache_salt: bytes = b"",
                 num_cpu_blocks: int = 0, window: int | None = None) -> None:
        self.block_size = block_size
        # Sliding window: blocks no future query can see are freed after every step, leaving
        # None in their place in the table (circular in effect: memory stays ~window/block_size).
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=self._spill if num_cpu_blocks else None)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching) if num_cpu_blocks else None
        # Salt goes into every block hash: blocks of another model or dtype never match.
        self.cache_salt = cache_salt
        self._blocks: dict[str, list[Block | None]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        # Per request: how many leading blocks of its table cache_blocks has published.
        self._published: dict[str, int] = {}
        self._swapped: dict[str, list[Block]] = {}
        # Per swapped request: the leading slots of its table that had left the window (None).
        self._swapped_dead: dict[str, int] = {}
        # Per request: its reserved run of blocks [start, end) for growth (see BlockPool).
        self._runs: dict[str, tuple[int, int]] = {}
        # This step's copies, (device block, CPU block), (CPU block, device block) and
        # (device block, device block) for forked samples.
        self._to_cpu: list[tuple[int, int]] = []
        self._to_device: list[tuple[int, int]] = []
        self._within: list[tuple[int, int]] = []
        # CPU blocks read by this step's loads: released once the step is done.
        self._cpu_release: list[Block] = []
        self.tier = TierStats()
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of KV groups after the first: none with one group."""
        return []

    def shortfall(self, num_tokens: int, chunk_tokens: int) -> tuple[int, int] | None:
        """(blocks needed, blocks the pool has) when one sequence of num_tokens could never fit."""
        need = self.peak_blocks(num_tokens, chunk_tokens)
        return (need, self.num_blocks) if need > self.num_blocks else None

    def cpu_blocks(self) -> tuple[int, int, int]:
        """The CPU tier's (used, total, peak used) blocks."""
        cpu = self.cpu_pool
        return (cpu.num_used_blocks, cpu.num_blocks, cpu.peak_used) if cpu else (0, 0, 0)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        blocks = self._blocks.get(request_id, ())
        if not self.window:  # no None slots: map in C, once a step for every running sequence
            return list(map(_BLOCK_ID, blocks))
        # A freed out-of-window slot reads block 0; attention masks those positions.
        return [b.block_id if b is not None else 0 for b in blocks]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """Most blocks one sequence of num_tokens holds at once (bounded by the window)."""
        full = self.blocks_needed(num_tokens)
        if not self.window:
            return full
        return min(full, cdiv(self.window + chunk_tokens, self.block_size) + 1)

    def free_out_of_window(self, req: Request) -> None:
        """Free the blocks whose every position is outside the window of all future queries:
        the next query is at num_computed_tokens and sees keys > num_computed_tokens - window."""
        if not self.window:
            return
        blocks = self._blocks.get(req.request_id)
        if not blocks:
            return
        dead = min(len(blocks), max(0, (req.num_computed_tokens - self.window + 1) // self.block_size))
        gone = [b for b in blocks[:dead] if b is not None]
        if gone:
            for i in range(dead):
                blocks[i] = None
            self.pool.free(gone)

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.token_ids_slice(i * bs, (i + 1) * bs), self.cache_salt))
        return hashes

    # -- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, req: Request) -> tuple[PrefixHit, int]:
        """Longest cached prefix of the request (device blocks, then CPU-tier blocks) and its
        length in tokens. The last token is always left to compute, since its logits are needed."""
        hit = self.find_hit(req)
        self.count_hit(req, hit.num_blocks)
        return hit, hit.num_blocks * self.block_size

    def count_hit(self, req: Request, num_blocks: int) -> None:
        if self.pool.enable_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_blocks * self.block_size

    def find_hit(self, req: Request, limit: int | None = None) -> PrefixHit:
        """The longest cached prefix of at most `limit` blocks: contiguous from the first block
        (device, then the CPU tier); with a window, see _window_hit."""
        hit = PrefixHit()
        if not self.pool.enable_caching:
            return hit
        num_full = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, num_full if limit is None else min(limit, num_full))
        if self.window:
            return self._window_hit(hashes)
        for h in hashes:
            block = self.pool.lookup(h) if not hit.cpu else None
            if block is not None:
                hit.device.append(block)
                continue
            cpu_block = self.cpu_pool.lookup(h) if self.cpu_pool is not None else None
            if cpu_block is None:
                break
            hit.cpu.append(cpu_block)
        return hit

    def _window_hit(self, hashes: list[bytes]) -> PrefixHit:
        """Sliding window: a hit of k blocks needs only the blocks the next query (position
        k * block_size) can see, [(k * block_size - window + 1) // block_size, k), on the device
        or, after the device's, in the CPU tier; the chain hash of block k - 1 already vouches for
        every token before it. The blocks before that window are None in the hit (never touched),
        as in a running table."""
        bs, n = self.block_size, len(hashes)
        dev = [self.pool.lookup(h) for h in hashes]
        cpu = [self.cpu_pool.lookup(h) for h in hashes] if self.cpu_pool is not None else [None] * n
        # next_miss[j]: the first index >= j not on the device; cpu_run[j]: CPU-tier blocks in a
        # row ending at j.
        next_miss = [n] * (n + 1)
        for j in range(n - 1, -1, -1):
            next_miss[j] = next_miss[j + 1] if dev[j] is not None else j
        cpu_run, run = [], 0
        for b in cpu:
            run = run + 1 if b is not None else 0
            cpu_run.append(run)
        for k in range(n, 0, -1):
            lo = max(0, (k * bs - self.window + 1) // bs)
            split = min(next_miss[lo], k)  # device blocks [lo, split), then the CPU tier's [split, k)
            if split == k or cpu_run[k - 1] >= k - split:
                return PrefixHit(device=[None] * lo + dev[lo:split], cpu=cpu[split:k])
        return PrefixHit()

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None) -> list[Block | None] | None:
        """Make room for num_new_tokens more tokens of req (after its prefix hit, or after its
        swapped-out blocks come back). Returns the request's table of blocks (the live list, not
        a copy: block_ids gives the ids), or None (changing nothing) when the device pool cannot
        supply the blocks."""
        if hit is None and req.request_id not in self._swapped:
            # The common step: a running sequence whose last block still has room.
            blocks = self._blocks.get(req.request_id)
            if blocks and self._need(req, num_new_tokens, _NO_HIT) <= 0:
                return blocks
        hit = hit or PrefixHit()
        if not self.has_room(req, num_new_tokens, hit):
            return None
        swapped = self._swapped.get(req.request_id, [])
        held = self._blocks.get(req.request_id, [])
        first = not held  # (held may be the table itself, which grows below)
        need = self._need(req, num_new_tokens, hit)
        # Pin the CPU sources first, so that a spill made by this allocation cannot reuse them.
        if hit.cpu:
            self.cpu_pool.touch(hit.cpu)
            self._cpu_release.extend(hit.cpu)
        self.pool.touch([b for b in hit.device if b is not None])
        blocks = self._blocks.setdefault(req.request_id, [])
        # A swapped-in table starts with the slots that had left the window before it went out.
        blocks.extend([None] * self._swapped_dead.get(req.request_id, 0) if swapped else ())
        blocks.extend(hit.device)
        new = self._allocate_new(req, blocks, need, first) if need > 0 else []
        blocks.extend(new)
        sources = swapped or hit.cpu
        for src, dst in zip(sources, new):
            self._to_device.append((src.block_id, dst.block_id))
        if swapped:
            self.tier.swapped_in_blocks += len(swapped)
            self._cpu_release.extend(self._swapped.pop(req.request_id))
            self._swapped_dead.pop(req.request_id, None)
        elif hit.cpu:
            self.tier.reloaded_blocks += len(hit.cpu)
            for src, dst in zip(hit.cpu, new):
                self.pool.cache(dst, src.block_hash)
        return blocks

    def _need(self, req: Request, num_new_tokens: int, hit: PrefixHit) -> int:
        """New device blocks allocate_slots takes for num_new_tokens more tokens after the hit."""
        held = len(self._blocks.get(req.request_id, ()))
        if req.request_id in self._swapped:
            held += self._swapped_dead.get(req.request_id, 0)
        num_computed = req.num_computed_tokens + hit.num_blocks * self.block_size
        return self.blocks_needed(num_computed + num_new_tokens) - held - len(hit.device)

    def has_room(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether allocate_slots(req, num_new_tokens, hit) would succeed now."""
        hit = hit or PrefixHit()
        # Cached blocks taken from the free queue leave it, so they count against free space.
        revived = sum(1 for b in hit.device if b is not None and b.ref_cnt == 0)
        return max(self._need(req, num_new_tokens, hit), 0) + revived <= self.pool.num_free_blocks

    def _allocate_new(self, req: Request, blocks: list[Block | None], need: int, first: bool) -> list[Block]:
        """need more blocks for req, after `blocks` (its table so far), at consecutive addresses
        where the pool allows: its first allocation starts a run sized for its whole length
        (prompt + max_tokens, at most RUN_SLACK blocks beyond this need), later ones grow into
        it; where the next block is taken, they fall back to the free queue's order."""
        rid = req.request_id
        if first:
            self._release_run(req)
            total = min(self.blocks_needed(req.num_prompt_tokens + req.sampling.max_tokens) - len(blocks),
                        need + RUN_SLACK)
            # Runs may evict cached prefix blocks out of LRU order only while the cache is not
            # paying off; a job whose prompts share prefixes keeps its LRU eviction.
            evict = self.prefix_hit_rate() < RUN_EVICT_MAX_HIT_RATE
            run = self.pool.allocate_run(need, total, evict) if total > need else None
            if run is not None:
                self._runs[rid] = (run[0].block_id, run[0].block_id + total)
                return run
            run = self.pool.allocate_run(need, need, evict)
            return run if run is not None else self.pool.allocate(need)
        reserved_below = self._runs.get(rid, (0, 0))[1]
        prev = blocks[-1].block_id if blocks and blocks[-1] is not None else -2
        out = []
        for _ in range(need):
            block = self.pool.take_next(prev, reserved_below) if prev >= 0 else None
            block = block or self.pool.allocate(1)[0]
            out.append(block)
            prev = block.block_id
        return out

    def _release_run(self, req: Request) -> None:
        run = self._runs.pop(req.request_id, None)
        if run is not None:
            self.pool.release(*run)

    def cache_blocks(self, req: Request, upto: int | None = None) -> None:
        """Publish the request's blocks that are full of computed tokens, or (upto) that will be
        once the step now scheduled has run: its forward stores every token's K/V before any
        attention of that step reads the cache, so a request admitted later in the same step may
        take them as its prefix."""
        if not self.pool.enable_caching:
            return
        rid = req.request_id
        num_full = (req.num_computed_tokens if upto is None else upto) // self.block_size
        done = self._published.get(rid, 0)
        if num_full <= done:
            return
        blocks = self._blocks.get(rid, [])
        hashes = self._block_hashes(req, num_full)
        for i in range(done, min(num_full, len(blocks))):
            if blocks[i] is not None:
                self.pool.cache(blocks[i], hashes[i])
        # The table's blocks up to here are published (a block keeps its hash while held): later
        # calls start past them. Reset wherever the table is given up (free, swap out).
        self._published[rid] = min(num_full, len(blocks))

    def _spill(self, block: Block, block_hash: bytes) -> None:
        """The device evicts a cached block: keep a copy in the CPU tier if it has room."""
        if self.cpu_pool.lookup(block_hash) is not None or self.cpu_pool.num_free_blocks == 0:
            return
        (cpu_block,) = self.cpu_pool.allocate(1)
        self.cpu_pool.cache(cpu_block, block_hash)
        self.cpu_pool.free([cpu_block])  # unreferenced: evictable from the CPU tier in turn
        self._to_cpu.append((block.block_id, cpu_block.block_id))
        self.tier.spilled_blocks += 1

    # -- swapping ----------------------------------------------------------------------------

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self._swapped

    def can_swap_out(self, req: Request) -> bool:
        blocks = self._blocks.get(req.request_id, ())
        live = sum(1 for b in blocks if b is not None)
        return self.cpu_pool is not None and live <= self.cpu_pool.num_free_blocks

    def swap_out(self, req: Request) -> None:
        """Copy the request's blocks to the CPU tier and free them on the device. A sliding
        window's table holds None for the slots that left the window (always a leading run):
        only the live blocks move, and the run's length is kept for the swap-in."""
        blocks = self._blocks.pop(req.request_id, [])
        self._published.pop(req.request_id, None)
        dead = next((i for i, b in enumerate(blocks) if b is not None), len(blocks))
        blocks = blocks[dead:]
        if dead:
            self._swapped_dead[req.request_id] = dead
        cpu_blocks = self.cpu_pool.allocate(len(blocks))
        self._to_cpu.extend((d.block_id, c.block_id) for d, c in zip(blocks, cpu_blocks))
        self._swapped[req.request_id] = cpu_blocks
        self.tier.swapped_out_blocks += len(blocks)
        self.pool.free(list(reversed(blocks)))
        self._release_run(req)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's copies: (device->CPU pairs, CPU->device pairs, device->device pairs); run in
        that order."""
        out, self._to_cpu, into, self._to_device, within, self._within = (self._to_cpu, [], self._to_device, [],
                                                                          self._within, [])
        return out, into, within

    def fork(self, parent: Request, child: Request) -> bool:
        """Give child the KV of parent's computed tokens: the full blocks shared (a reference
        each), the partly filled last block copied into a new one (a device copy queued for the
        next step, before anyone writes to it). False, changing nothing, when no block is free."""
        if not self.can_fork(parent):
            return False
        blocks = self._blocks.get(parent.request_id, [])
        n = parent.num_computed_tokens
        full = n // self.block_size
        partial = n % self.block_size != 0
        shared = [b for b in blocks[:full] if b is not None]
        self.pool.touch(shared)
        table = list(blocks[:full])
        if partial:
            (copy,) = self.pool.allocate(1)
            self._within.append((blocks[full].block_id, copy.block_id))
            table.append(copy)
        self._blocks[child.request_id] = table
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self.prefix_queries += n
        self.prefix_hits += n
        return True

    def can_fork(self, parent: Request) -> bool:
        """Whether fork(parent, ...) finds the block its copy of a partial last block needs."""
        return parent.num_computed_tokens % self.block_size == 0 or self.pool.num_free_blocks >= 1

    def end_step(self) -> None:
        if self._cpu_release:
            self.cpu_pool.free(self._cpu_release)
            self._cpu_release = []

    # -- release -----------------------------------------------------------------------------

    def free(self, req: Request) -> None:
        blocks = self._blocks.pop(req.request_id, [])
        self._published.pop(req.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not None])
        self._release_run(req)
        swapped = self._swapped.pop(req.request_id, None)
        self._swapped_dead.pop(req.request_id, None)
        if swapped:
            self.cpu_pool.free(swapped)

    def forget(self, req: Request) -> None:
        """Free the request and drop its hash list (it is finished)."""
        self.free(req)
        self._hashes.pop(req.request_id, None)

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_all_free(self) -> None:
        self.pool.check_all_free()
        if self.cpu_pool is not None:
            self.cpu_pool.check_all_free()


@dataclass
class HybridHit:
    """One PrefixHit per KV group, all of the same length in blocks."""

    hits: list[PrefixHit]

    @property
    def num_blocks(self) -> int:
        return self.hits[0].num_blocks


class HybridKVManager:
    """Layers of several attention kinds (full and sliding window): one KVCacheManager per kind
    (its own pool and tensors, its own block table per request), driven in step. Group 0 holds
    the full-attention layers. Every allocation, fork and swap either happens in all groups or
    in none; a prefix hit counts only as far as every group can serve it (a sliding group needs
    just the blocks its window still sees)."""

    def __init__(self, groups: list[KVCacheManager]) -> None:
        self.groups = groups
        self.block_size = groups[0].block_size
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- what the scheduler and the engine read ---------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return sum(g.num_used_blocks for g in self.groups)

    @property
    def num_evictions(self) -> int:
        return sum(g.num_evictions for g in self.groups)

    @property
    def tier(self) -> TierStats:
        return TierStats(*(sum(getattr(g.tier, f) for g in self.groups) for f in TierStats.__dataclass_fields__))

    def usage(self) -> float:
        return max(g.usage() for g in self.groups)

    def cpu_blocks(self) -> tuple[int, int, int]:
        return tuple(sum(x) for x in zip(*(g.cpu_blocks() for g in self.groups)))

    def block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [g.block_ids(request_id) for g in self.groups[1:]]

    def blocks_needed(self, num_tokens: int) -> int:
        return self.groups[0].blocks_needed(num_tokens)

    def shortfall(self, num_tokens: int, chunk_tokens: int) -> tuple[int, int] | None:
        return next((s for g in self.groups if (s := g.shortfall(num_tokens, chunk_tokens))), None)

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- allocation --------------------------------------------------------------------------

    def get_computed_blocks(self, req: Request) -> tuple[HybridHit, int]:
        """The longest prefix every group holds: the full group's contiguous hit, cut back until
        each windowed group has the blocks its window needs at that length."""
        k = self.groups[0].find_hit(req).num_blocks
        while True:
            hits = [g.find_hit(req, k) for g in self.groups]
            shortest = min(h.num_blocks for h in hits)
            if shortest == k:
                break
            k = shortest
        hits = [_cut(h, k) for h in hits]
        if self.groups[0].pool.enable_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += k * self.block_size
        return HybridHit(hits), k * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: HybridHit | None = None) -> list[int] | None:
        hits = hit.hits if hit is not None else [None] * len(self.groups)
        if not all(g.has_room(req, num_new_tokens, h) for g, h in zip(self.groups, hits)):
            return None
        tables = [g.allocate_slots(req, num_new_tokens, h) for g, h in zip(self.groups, hits)]
        assert all(t is not None for t in tables), "a group refused what has_room allowed"
        return tables[0]

    def cache_blocks(self, req: Request, upto: int | None = None) -> None:
        for g in self.groups:
            g.cache_blocks(req, upto)

    def free_out_of_window(self, req: Request) -> None:
        for g in self.groups:
            g.free_out_of_window(req)

    # -- swapping and forks ------------------------------------------------------------------

    def is_swapped(self, req: Request) -> bool:
        return self.groups[0].is_swapped(req)

    def can_swap_out(self, req: Request) -> bool:
        return all(g.can_swap_out(req) for g in self.groups)

    def swap_out(self, req: Request) -> None:
        for g in self.groups:
            g.swap_out(req)

    def take_transfers(self) -> tuple[list[tuple[int, int, int]], ...]:
        """This step's copies as (group, source block, destination block) triples, in the order
        of KVCacheManager.take_transfers."""
        out: tuple[list, list, list] = ([], [], [])
        for i, g in enumerate(self.groups):
            for dst, pairs in zip(out, g.take_transfers()):
                dst.extend((i, a, b) for a, b in pairs)
        return out

    def fork(self, parent: Request, child: Request) -> bool:
        if not all(g.can_fork(parent) for g in self.groups):
            return False
        for g in self.groups:
            g.fork(parent, child)
        self.prefix_queries += parent.num_computed_tokens
        self.prefix_hits += parent.num_computed_tokens
        return True

    def end_step(self) -> None:
        for g in self.groups:
            g.end_step()

    def free(self, req: Request) -> None:
        for g in self.groups:
            g.free(req)

    def forget(self, req: Request) -> None:
        for g in self.groups:
            g.forget(req)

    def check_all_free(self) -> None:
        for g in self.groups:
            g.check_all_free()


def _cut(hit: PrefixHit, k: int) -> PrefixHit:
    """The first k blocks of a hit."""
    device = hit.device[:k]
    return PrefixHit(device, hit.cpu[: k - len(device)])
