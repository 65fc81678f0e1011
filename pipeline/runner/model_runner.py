"""Turns a SchedulerOutput into one flat varlen batch, runs the model and samples."""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys

from dataclasses import replace

import numpy as np
import torch

from ..engine.outputs import RunnerOutput, SampledToken, ScheduledSeq
from ..shapes import cdiv, kv_bytes_per_token_head
from .attention import (
    QUANT_DTYPES,
    AttentionMetadata,
    CascadeGroup,
    DecodeBucket,
    PrefillSeq,
    QuantCache,
    decode_buckets,
)
from .build import dtype_name
from .model import CausalLM
from .sampler import Sampler

_HUGE = 2 << 20


# Most logits computed at once on the fused CPU path, in bytes: more rows are split into
# chunks, each sampled before the next is computed, so that a chunk's logits stay in the L3
# cache between the GEMM that writes them and the argmax that reads them
# (`python examples/bench_logits.py` times all rows at once against chunks).
LOGITS_CHUNK_BYTES = 24 << 20


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def index_tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-D index tensor from a list of ints, through numpy (torch.tensor reads a long list
    several times slower; these are built every step)."""
    out = torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))
    return out if dtype == torch.long else out.to(dtype)


def padded_tables(tables: list[list[int]], width: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Block tables as one [len(tables), width] tensor, rows padded with block 0 (masked by the
    context lengths): a row copy each into numpy, ~4x faster than torch.tensor of padded lists."""
    out = np.zeros((len(tables), width), dtype=np.int32 if dtype == torch.int32 else np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return torch.from_numpy(out)


def keep_freed_memory() -> bool:
    """Make glibc keep freed heap memory instead of handing it back to the OS. By default it
    serves blocks above a moving threshold with fresh mmaps and trims the heap's free top, so
    each step's multi-MB activations would be page-faulted in again every step (compare the minor
    faults of `/usr/bin/time -v batchgen bench --peers ''` with and without BATCHGEN_NO_MALLOPT=1).
    The mmap threshold is pinned at 32 MiB and trimming starts past 1 GiB. Process-wide, for CPU
    engines; a no-op off glibc; BATCHGEN_NO_MALLOPT=1 turns it off. Returns whether it was applied."""
    if os.environ.get("BATCHGEN_NO_MALLOPT") == "1" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS now (glibc malloc_trim; a no-op elsewhere). The
    loader calls it after each layer: a layer's source tensors and packing temporaries are freed
    in an order that leaves holes the next layer's larger tensors cannot reuse, and kept, those
    holes added up to hundreds of MiB of peak resident memory on a 1B model, varying run to run."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def host_zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor that costs nothing until it is written: an anonymous mapping, which
    the kernel fills with zero pages on first touch, so a multi-GiB KV cache takes neither time
    nor resident memory for blocks no sequence has used yet.

    It is private: Python's mmap.mmap(-1, n) alone is MAP_SHARED, which Linux backs with shmem,
    whose first touches take a slower fault path (256 MiB: 78 ms against 46 ms private here) and
    where a THP hint goes unmet (shmem_enabled is `never` by default).

    It is on 4 KiB pages unless BATCHGEN_HUGEPAGES=1 asks for 2 MiB ones (madvise MADV_HUGEPAGE
    before any touch). Huge pages save TLB misses where decode reads blocks at scattered
    addresses, but a cache filled as sequences arrive pays each page's zeroing inside the run,
    and on the (virtualised) development machines a 2 MiB first touch cost ~3x as much a byte as
    4 KiB ones (256 MiB: 297 against 46 ms). Alternating runs there, huge against 4 KiB pages:
    SmolLM2 bf16 prompt-heavy 24.4 / 24.9 against 23.0 / 23.7 s, 1.5B bf16 prefill-only 27.6 /
    27.4 against 26.7 / 26.7 s, 1.5B bf16 decode-heavy 72.0 / 73.5 against 75.3 / 75.4 s."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < 2 * _HUGE or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    offset = (-base) % _HUGE  # start on a 2 MiB boundary
    if os.environ.get("BATCHGEN_HUGEPAGES") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // _HUGE * _HUGE or _HUGE)
        except OSError:  # no THP in this kernel: plain pages
            pass
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)


class KVCache:
    """Per-layer paged K and V tensors: [num_blocks, block_size, num_kv_heads, head_dim]. With
    hybrid KV, each layer's tensors have the blocks of its KV group."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_cpu_blocks: int = 0,
                 layer_group: tuple[int, ...] = (), group_blocks: tuple[tuple[int, int], ...] = ()) -> None:
        """dtype int8 or float8_e4m3fn makes a quantised cache with per-(token, head) scales.
        layer_group: each layer's KV group; group_blocks: (device, CPU) blocks per group (the
        num_blocks / num_cpu_blocks of every layer without them)."""
        pin = device.type == "cuda"
        self.layer_group = layer_group or (0,) * num_layers
        group_blocks = group_blocks or ((num_blocks, num_cpu_blocks),)

        def make(n: int, dev, pinned: bool):
            if dtype in QUANT_DTYPES:
                return QuantCache(n, block_size, num_kv_heads, head_dim, dev, pinned, dtype)
            if torch.device(dev).type == "cpu" and not pinned:
                return host_zeros((n, block_size, num_kv_heads, head_dim), dtype)
            return torch.zeros((n, block_size, num_kv_heads, head_dim), dtype=dtype, device=dev, pin_memory=pinned)

        blocks = [group_blocks[g] for g in self.layer_group]
        self.layers = [(make(n, device, False), make(n, device, False)) for n, _ in blocks]
        # The CPU tier: same block layout in host memory (pinned on CUDA for async copies).
        self.cpu_layers = [(make(c, "cpu", pin), make(c, "cpu", pin)) for _, c in blocks] if num_cpu_blocks else []
        self.block_size = block_size
        self.num_blocks = num_blocks
        layer_block = 2 * block_size * kv_bytes_per_token_head(dtype_name(dtype), head_dim) * num_kv_heads
        # One block of every layer (a full-attention block's worth of KV, for the swap counters).
        self.block_bytes = num_layers * layer_block
        self.bytes = sum(n for n, _ in blocks) * layer_block
        self.cpu_bytes = sum(c for _, c in blocks) * layer_block if num_cpu_blocks else 0

    def copy(self, pairs: list[tuple[int, ...]], direction: str) -> None:
        """Copy whole blocks, every layer: direction "to_cpu" (device block, CPU block),
        "to_device" (CPU block, device block) or "within" (device block, device block). With
        hybrid KV the copies are (group, source, destination) triples, each made in its group's
        layers."""
        if not pairs:
            return
        from batchgen.kernels.block_copy import copy_blocks

        by_group: dict[int, list[tuple[int, int]]] = {}
        for p in pairs:
            g, a, b = p if len(p) == 3 else (0, *p)
            by_group.setdefault(g, []).append((a, b))
        ids = {g: (torch.tensor([a for a, _ in ps], dtype=torch.long), torch.tensor([b for _, b in ps], dtype=torch.long))
               for g, ps in by_group.items()}
        tiers = {"to_cpu": (self.layers, self.cpu_layers), "to_device": (self.cpu_layers, self.layers),
                 "within": (self.layers, self.layers)}[direction]
        for g, src_layer, dst_layer in zip(self.layer_group, *tiers):
            if g not in ids:
                continue
            src_ids, dst_ids = ids[g]
            for src, dst in zip(src_layer, dst_layer):
                parts = [(src.raw, dst.raw), (src.scale, dst.scale)] if isinstance(src, QuantCache) else [(src, dst)]
                for a, b in parts:
                    copy_blocks(a, b, src_ids, dst_ids)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler | None = None,
                 decode_mode: str = "batched", backend: str = "torch", graphs=None, constraints=None,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        """graphs: a DecodeGraphs (CUDA with the Triton backend) that decode-only steps replay;
        constraints: a guided.Constraints (structured output), made when a request needs one;
        windows: each KV group's attention window (ModelShape.kv_groups; None: full attention)."""
        self.windows = tuple(windows)
        self.model = model
        self.kv = kv_cache
        self.decode_mode = decode_mode
        self.backend = backend
        self.sampler = sampler or Sampler()
        self.device = model.device
        self.graphs = graphs
        self.constraints = constraints

    @property
    def graph_replays(self) -> int:
        return self.graphs.replays if self.graphs is not None else 0

    def execute(self, seqs: list[ScheduledSeq], copy_to_cpu=(), copy_to_device=(), copy_within=()) -> RunnerOutput:
        # Out before in: a block spilled this step may be the target of a load this step. Forked
        # samples copy their parent's last block before anyone writes to it in this step.
        self.kv.copy(list(copy_to_cpu), "to_cpu")
        self.kv.copy(list(copy_to_device), "to_device")
        self.kv.copy(list(copy_within), "within")
        if not seqs:
            return RunnerOutput()
        if self.graphs is not None and all(len(s.token_ids) == 1 and s.sample for s in seqs):
            pending = self.constraints.fill_async(seqs) if self.constraints else None
            logits = self._graph_decode(seqs)
            if logits is not None:
                mask = (lambda lg: self.constraints.apply(pending, lg)) if pending else None
                return RunnerOutput(self._accepted(seqs, self.sampler(logits, seqs, mask)))
        # Decodes first: groups sharing a cached prefix (cascade), then the rest by context
        # length, so attention runs them in contiguous buckets; prefill chunks after them.
        decodes = sorted((s for s in seqs if len(s.token_ids) == 1), key=lambda s: s.start_pos)
        groups, rest = self._cascade_groups(decodes)
        # Whole prompts before later chunks: attention may take the whole prompts another way.
        prefills = sorted((s for s in seqs if len(s.token_ids) > 1), key=lambda s: s.start_pos > 0)
        ordered = [s for g, _ in groups for s in g] + rest + prefills
        input_ids, positions, slots, meta, (sample_idx, sampled_seqs, scored) = self._prepare(ordered, groups)
        # The constraints' masks fill on a worker thread while the forward runs.
        pending = self.constraints.fill_async(sampled_seqs) if self.constraints and sampled_seqs else None
        h = self.model.forward(input_ids, positions, meta, self.kv.layers, sample_idx, logits=False)
        out = RunnerOutput()
        n = len(sampled_seqs)
        if n:
            out.sampled = self._accepted(sampled_seqs, self._sample(h[:n], sampled_seqs, pending))
        if scored:
            out.prompt_logprobs = self._score(h[n:], scored)
        return out

    def _chunk_rows(self, itemsize: int) -> int:
        """Rows of logits computed at once: LOGITS_CHUNK_BYTES on the fused path, else all."""
        if not self.model.fused:
            return 1 << 30
        return max(1, LOGITS_CHUNK_BYTES // (self.model.shape.vocab_size * itemsize))

    def _sample(self, h: torch.Tensor, seqs: list[ScheduledSeq], pending) -> list[SampledToken]:
        """Tokens for final-norm rows h [n, hidden]: the lm_head and sampler by row chunks."""
        n = len(seqs)
        # Greedy rows without logprobs of an fp32 model: tokens from bf16 logits (masked by any
        # constraint), verified in fp32.
        verified = self.model.verified_greedy and all(s.sampling.greedy and s.sampling.logprobs is None for s in seqs)
        rows = self._chunk_rows(2 if verified else self.model.dtype.itemsize)
        size = cdiv(n, cdiv(n, rows))  # equal chunks of at most `rows`
        tokens: list[SampledToken] = []
        for a in range(0, n, size):
            mask = (lambda lg, a=a: self.constraints.apply(pending, lg, offset=a)) if pending else None
            if verified:
                tokens += [SampledToken(t) for t in self.model.greedy_tokens(h[a : a + size], mask).tolist()]
            else:
                tokens += self.sampler(self.model.logits(h[a : a + size]), seqs[a : a + size], mask)
        return tokens

    def _accepted(self, seqs: list[ScheduledSeq], tokens: list[SampledToken]) -> dict[str, SampledToken]:
        """The sampled tokens by request, fed to their constraints' matchers."""
        if self.constraints:
            for s, t in zip(seqs, tokens):
                if s.sampling.response_format is not None:
                    ok, t.terminated = self.constraints.accept(s, t.token_id)
                    t.rejected = not ok
        return {s.request_id: t for s, t in zip(seqs, tokens)}

    def _score(self, h: torch.Tensor, scored: list[tuple[ScheduledSeq, list[int]]]):
        """Prompt logprobs: for each scored sequence, the logprob of each target (the next prompt
        token) under the model's raw distribution at the row before it, with the top-k."""
        targets = [t for _, ts in scored for t in ts]
        rows = self._chunk_rows(4)
        values: list[tuple[float, dict[int, float]]] = []
        top_k = [s.sampling.prompt_logprobs for s, ts in scored for _ in ts]
        for a in range(0, len(targets), rows):
            logp = torch.log_softmax(self.model.logits(h[a : a + rows]).float().cpu(), dim=-1)
            tgt = torch.tensor(targets[a : a + rows])
            chosen = logp.gather(1, tgt[:, None])[:, 0].tolist()
            k_max = max(top_k[a : a + rows])
            vals, idx = logp.topk(k_max, dim=-1) if k_max else (None, None)
            for i, lp in enumerate(chosen):
                k = top_k[a + i]
                top = dict(zip(idx[i, :k].tolist(), vals[i, :k].tolist())) if k else {}
                values.append((lp, top))
        out, start = {}, 0
        for s, ts in scored:
            out[s.request_id] = values[start : start + len(ts)]
            start += len(ts)
        return out

    def _prepare(self, seqs: list[ScheduledSeq], groups=()):
        ids: list[int] = []
        pos: list[int] = []
        sample_idx: list[int] = []
        sample_seq: list[ScheduledSeq] = []
        # Prompt-logprob rows: (seq, target token ids), and their token indices (after the samples).
        scored: list[tuple[ScheduledSeq, list[int]]] = []
        score_idx: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            start_tok = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            if s.sample:
                sample_idx.append(start_tok + n - 1)
                sample_seq.append(s)
                # A forked sibling draws its first token from the same row of logits.
                for child_id, child_sampling in s.forks:
                    sample_idx.append(start_tok + n - 1)
                    sample_seq.append(replace(s, request_id=child_id, sampling=child_sampling, forks=[]))
            if s.score_targets:
                scored.append((s, s.score_targets))
                score_idx.extend(range(start_tok, start_tok + len(s.score_targets)))
        # One attention metadata per KV group (its own block tables and window).
        metas = [self._meta(seqs, [s.block_table if g == 0 else s.group_tables[g - 1] for s in seqs], window,
                            groups if g == 0 else ()) for g, window in enumerate(self.windows)]
        meta = metas[0] if len(metas) == 1 else metas
        return (self._dev(index_tensor(ids)), self._dev(index_tensor(pos)),
                metas[0].slot_mapping, meta,
                (self._dev(index_tensor(sample_idx + score_idx)), sample_seq, scored))

    def _meta(self, seqs: list[ScheduledSeq], tables: list[list[int]], window: int | None,
              groups=()) -> AttentionMetadata:
        """The attention metadata of one KV group: seqs' block tables `tables`, its window."""
        bs = self.kv.block_size
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        start_tok = 0
        for s, table in zip(seqs, tables):
            n = len(s.token_ids)
            slots.extend(table[x // bs] * bs + x % bs for x in range(s.start_pos, s.start_pos + n))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(s.start_pos + 1)
            else:
                prefills.append(PrefillSeq(start_tok, start_tok + n, s.start_pos, torch.tensor(table, dtype=torch.long)))
            start_tok += n
        meta = AttentionMetadata(
            num_decodes=len(decode_tables), decode_block_tables=None, decode_context_lens=None,
            prefills=prefills, slot_mapping=index_tensor(slots), decode_mode=self.decode_mode,
            backend=self.backend, window=window)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = padded_tables(decode_tables, width)
            meta.decode_context_lens = index_tensor(decode_lens)
            if self.decode_mode == "batched" and self.backend in ("torch", "cpu"):
                # The C++ op reads the tables directly; only the torch path needs padded buckets.
                buckets = ((lambda tables, lens: self._buckets(tables, lens, window)) if self.backend == "torch"
                           else (lambda tables, lens: []))
                start, meta.cascade_groups = 0, []
                for members, shared in groups:
                    end = start + len(members)
                    suffix_tables = meta.decode_block_tables[start:end, shared:]
                    lens = meta.decode_context_lens[start:end] - shared * bs
                    meta.cascade_groups.append(CascadeGroup(start, end, torch.tensor(decode_tables[start][:shared],
                                                                                    dtype=torch.long),
                                                            buckets(suffix_tables, lens)))
                    start = end
                meta.decode_buckets = [DecodeBucket(b.start + start, b.end + start, b.block_tables, b.mask)
                                       for b in buckets(meta.decode_block_tables[start:],
                                                        meta.decode_context_lens[start:])]
        if self.backend == "triton":
            self._triton_meta(meta, seqs, tables)
        elif self.backend == "cpu" and prefills:
            width = max(len(p.block_table) for p in prefills)
            meta.prefill_block_tables = torch.zeros((len(prefills), width), dtype=torch.long)
            for i, p in enumerate(prefills):
                meta.prefill_block_tables[i, : len(p.block_table)] = p.block_table
            first = prefills[0].tok_start
            meta.prefill_cu_seqlens = torch.tensor([0] + [p.tok_end - first for p in prefills], dtype=torch.long)
            meta.prefill_start_pos = torch.tensor([p.start_pos for p in prefills], dtype=torch.long)
        return meta

    def _graph_decode(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """A decode-only step through the CUDA graphs, or None where it does not fit them."""
        bs = self.kv.block_size
        width = max(len(s.block_table) for s in seqs)
        if not self.graphs.fits(len(seqs), width):
            return None
        tables = padded_tables([s.block_table for s in seqs], width, torch.int32)
        pos = [s.start_pos for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        return self.graphs.run(index_tensor([s.token_ids[0] for s in seqs]), index_tensor(pos), index_tensor(slots),
                               tables, index_tensor([p + 1 for p in pos], torch.int32))

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if t.device != self.device else t

    def _triton_meta(self, meta: AttentionMetadata, seqs: list[ScheduledSeq], tables: list[list[int]]) -> None:
        """Device tensors for the Triton kernels (int32 indices)."""
        meta.slot_mapping = self._dev(meta.slot_mapping)
        if meta.num_decodes:
            meta.decode_block_tables = self._dev(meta.decode_block_tables.to(torch.int32))
            meta.decode_context_lens = self._dev(meta.decode_context_lens.to(torch.int32))
        pre = [(s, t) for s, t in zip(seqs, tables) if len(s.token_ids) > 1]
        if pre:
            width = max(len(t) for _, t in pre)
            meta.prefill_block_tables = self._dev(padded_tables([t for _, t in pre], width, torch.int32))
            pre = [s for s, _ in pre]
            lens = [len(s.token_ids) for s in pre]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            meta.prefill_cu_seqlens = self._dev(torch.tensor(cu, dtype=torch.int32))
            meta.prefill_context_lens = self._dev(torch.tensor([s.start_pos + len(s.token_ids) for s in pre],
                                                               dtype=torch.int32))
            meta.max_prefill_len = max(lens)

    def _cascade_groups(self, decodes: list[ScheduledSeq], min_blocks: int = 4):
        """Split decodes (sorted by length) into groups that share at least min_blocks physical
        blocks at the front of their tables (a prefix-cache hit), and the rest. Returns
        ([(members, shared_blocks)], rest); members keep their length order."""
        if (any(self.windows) or self.decode_mode != "batched" or self.backend not in ("torch", "cpu")
                or len(decodes) < 2):
            return [], decodes
        by_first: dict[int, list[ScheduledSeq]] = {}
        for s in decodes:
            by_first.setdefault(s.block_table[0], []).append(s)
        bs = self.kv.block_size
        groups, rest = [], []
        for members in by_first.values():
            # Only blocks strictly before each sequence's newest token: that block is its own.
            limit = min(s.start_pos // bs for s in members)
            first = members[0].block_table
            shared = 0
            while shared < limit and all(s.block_table[shared] == first[shared] for s in members):
                shared += 1
            if len(members) >= 2 and shared >= min_blocks:
                groups.append((members, shared))
            else:
                rest.extend(members)
        rest.sort(key=lambda s: s.start_pos)
        return groups, rest

    def _buckets(self, tables: torch.Tensor, context_lens: torch.Tensor, window: int | None) -> list[DecodeBucket]:
        bs = self.kv.block_size
        blocks = ((context_lens + bs - 1) // bs).tolist()
        out = []
        for start, end in decode_buckets(blocks):
            width = max(blocks[start:end])
            lens = context_lens[start:end]
            pos = torch.arange(width * bs)[None, :]
            mask = pos < lens[:, None]
            if window:
                mask &= pos >= lens[:, None] - window
            mask = mask[:, None, None, :]
            out.append(DecodeBucket(start, end, tables[start:end, :width].contiguous(), mask))
        return out
