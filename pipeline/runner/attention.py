"""Paged attention in plain torch (the CPU path and the reference for the Triton kernels).

The KV cache of one layer is k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim].
New tokens' K/V are written through slot_mapping first; attention then reads only the cache
(plus, for a prefill from position 0, the batch itself).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..shapes import cdiv


@dataclass
class PrefillSeq:
    # Token range of this sequence inside the flat batch.
    tok_start: int
    tok_end: int
    # Position of its first token (tokens before it are in the cache).
    start_pos: int
    # Physical block ids covering positions [0, start_pos + n).
    block_table: torch.Tensor


@dataclass
class DecodeBucket:
    """Decodes of similar context length, run as one padded, masked SDPA."""

    # Range of decode tokens (and sequences) [start, end) in the batch.
    start: int
    end: int
    # [end - start, width] block ids; padding entries point at block 0 and are masked.
    block_tables: torch.Tensor
    # [end - start, 1, 1, width * block_size] True where a key position is in the context.
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    # The first num_decodes tokens of the batch are decodes, one per sequence, sorted by
    # context length so that buckets of similar length are contiguous.
    num_decodes: int
    # [num_decodes, max_blocks] block ids (padding entries point at block 0).
    decode_block_tables: torch.Tensor | None
    # [num_decodes] context length including the new token.
    decode_context_lens: torch.Tensor | None
    # Prefill chunks after the decodes.
    prefills: list[PrefillSeq]
    # [num_tokens] flat slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # "batched": one masked SDPA per bucket of similar context lengths;
    # "exact": one unpadded SDPA per sequence, bit-identical to transformers' batch-1 path.
    decode_mode: str = "batched"
    decode_buckets: list[DecodeBucket] | None = None
    # "torch" (this file), "cpu" (decodes through the C++ op in batchgen.kernels.cpu_attention,
    # the rest as torch) or "triton" (batchgen.kernels; the default on CUDA).
    backend: str = "torch"
    # Triton and cpu paths: prefill chunks packed after the decodes.
    # [num_prefills + 1] offsets of each chunk's tokens, relative to the first prefill token.
    prefill_cu_seqlens: torch.Tensor | None = None
    # cpu path: [num_prefills] position of each chunk's first token.
    prefill_start_pos: torch.Tensor | None = None
    # [num_prefills] cached + new tokens of each chunk's sequence.
    prefill_context_lens: torch.Tensor | None = None
    # [num_prefills, max_blocks] block ids.
    prefill_block_tables: torch.Tensor | None = None
    max_prefill_len: int = 0
    # Sliding window W (Mistral-style): query i sees keys i - W < j <= i. None: full attention.
    window: int | None = None
    # Decodes that share a cached prefix, as contiguous groups at the front of the decodes.
    cascade_groups: list["CascadeGroup"] | None = None


@dataclass
class CascadeGroup:
    """Decodes [start, end) whose tables begin with the same physical blocks (a cached prefix):
    the prefix is attended once for all their queries, then merged by log-sum-exp with each
    sequence's own suffix; `buckets` cover only the blocks after the prefix."""

    start: int
    end: int
    # [num_shared_blocks] block ids of the shared prefix.
    blocks: torch.Tensor
    buckets: list[DecodeBucket]


def decode_buckets(context_blocks: list[int], max_ratio: float = 1.3) -> list[tuple[int, int]]:
    """Split decodes sorted by context length (in blocks) into contiguous ranges whose longest
    is at most max_ratio x (+1 block) their shortest, bounding padding work to ~30%, where padding
    every decode to the batch's longest context would read far more KV than the contexts hold."""
    out = []
    start = 0
    for i in range(1, len(context_blocks) + 1):
        if i == len(context_blocks) or context_blocks[i] > max_ratio * context_blocks[start] + 1:
            out.append((start, i))
            start = i
    return out


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


class QuantCache:
    """A quantised K or V cache, int8 or fp8 (e4m3), with one fp32 scale per (token, head) kept
    beside the blocks. A token's scale is fixed when it is written, so partly filled blocks never
    need re-scaling; the CPU tier and the prefix cache carry the scales with the blocks (same
    block ids). int8 runs on the CPU paths; fp8 on the Triton kernels (and the torch path)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, pin: bool = False,
                 dtype: torch.dtype = torch.int8):
        if dtype not in QUANT_DTYPES:
            raise ValueError(f"QuantCache: {dtype} is not int8 or float8_e4m3fn")
        def zeros(shape, dt):
            if torch.device(device).type == "cpu" and not pin:
                from .model_runner import host_zeros

                return host_zeros(shape, dt)
            return torch.zeros(shape, dtype=dt, device=device, pin_memory=pin)

        self.data = zeros((num_blocks, block_size, kv_heads, head_dim), dtype)
        self.scale = zeros((num_blocks, block_size, kv_heads), torch.float32)
        # The largest magnitude the format holds: int8 +-127; e4m3 +-448.
        self.qmax = 127.0 if dtype == torch.int8 else 448.0

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def store(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        nb, bs, h, d = self.data.shape
        x = x.float()
        scale = x.abs().amax(-1).clamp_min(1e-8) / self.qmax  # [num_tokens, heads]
        y = (x / scale[..., None]).clamp_(-self.qmax, self.qmax)
        q = torch.round(y).to(torch.int8) if self.dtype == torch.int8 else y.to(self.dtype)
        self.raw.view(nb * bs, h, d).index_copy_(0, slot_mapping, q.view(self.raw.dtype))
        self.scale.view(nb * bs, h).index_copy_(0, slot_mapping, scale)

    @property
    def raw(self) -> torch.Tensor:
        """The data as plain bytes where torch's CPU indexing lacks the type (fp8)."""
        return self.data if self.dtype == torch.int8 else self.data.view(torch.uint8)

    def gather(self, tables: torch.Tensor) -> torch.Tensor:
        idx = tables.reshape(-1)
        q = self.raw.index_select(0, idx).view(self.dtype).view(*tables.shape, *self.data.shape[1:])
        s = self.scale.index_select(0, idx).view(*tables.shape, *self.scale.shape[1:])
        return q.float() * s[..., None]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([num_tokens, kv_heads, head_dim]) into the paged cache."""
    if isinstance(k_cache, QuantCache):
        k_cache.store(k, slot_mapping)
        v_cache.store(v, slot_mapping)
        return
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache, tables: torch.Tensor) -> torch.Tensor:
    """cache[tables] for block tables of any shape (dequantised for a QuantCache); index_select
    copies whole blocks where advanced indexing goes element by element."""
    if isinstance(cache, QuantCache):
        return cache.gather(tables)
    return cache.index_select(0, tables.reshape(-1)).view(*tables.shape, *cache.shape[1:])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of one sequence: [length, kv_heads, head_dim]."""
    nb, bs, h, d = cache.shape
    n_blocks = cdiv(length, bs)
    return gather_blocks(cache, block_table[:n_blocks]).reshape(n_blocks * bs, h, d)[:length]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [num_tokens, heads, dim], k/v [num_tokens, kv_heads, dim] -> [num_tokens, heads, dim].
    softcap > 0: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2), on
    every path."""
    if meta.backend == "triton":
        return _triton_attention(q, k, v, k_cache, v_cache, meta, scale, softcap)
    if meta.backend == "cpu" and _cpu_store_ok(k, v, k_cache):
        from batchgen.kernels.cpu_attention import store_kv as cpu_store_kv

        cpu_store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if meta.decode_mode == "exact":
            for i in range(nd):
                ctx = int(meta.decode_context_lens[i])
                lo = max(0, ctx - meta.window) if meta.window else 0
                out[i] = _sdpa_one(q[i : i + 1], gather_context(k_cache, meta.decode_block_tables[i], ctx)[lo:],
                                   gather_context(v_cache, meta.decode_block_tables[i], ctx)[lo:], scale,
                                   causal=False, softcap=softcap)[0]
        elif meta.backend == "cpu":
            _decode_cpu_op(q, k_cache, v_cache, meta, scale, out, softcap)
        else:
            for grp in meta.cascade_groups or ():
                out[grp.start : grp.end] = _decode_cascade(q[grp.start : grp.end], k_cache, v_cache, grp, scale,
                                                           softcap)
            for b in meta.decode_buckets:
                out[b.start : b.end] = _decode_batched(q[b.start : b.end], k_cache, v_cache, b, scale, softcap)
    if (meta.prefills and meta.backend == "cpu" and meta.decode_mode != "exact" and meta.prefill_cu_seqlens is not None
            and _prefill_cpu_ok(q, k_cache)):
        whole = 0 if softcap else _whole_prompts_to_sdpa(q, k_cache, meta)  # SDPA has no cap
        for p in meta.prefills[:whole]:
            out[p.tok_start : p.tok_end] = _sdpa_one(q[p.tok_start : p.tok_end], k[p.tok_start : p.tok_end],
                                                     v[p.tok_start : p.tok_end], scale, causal=True)
        if whole < len(meta.prefills):
            first = meta.prefills[whole].tok_start
            _prefill_cpu_op(q[first:], k_cache, v_cache, meta, scale, out[first:], skip=whole, softcap=softcap)
        return out
    for p in meta.prefills:
        qs = q[p.tok_start : p.tok_end]
        n = qs.shape[0]
        if p.start_pos == 0 and not (meta.window and n > meta.window):
            ks, vs = k[p.tok_start : p.tok_end], v[p.tok_start : p.tok_end]
            out[p.tok_start : p.tok_end] = _sdpa_one(qs, ks, vs, scale, causal=True, softcap=softcap)
        else:
            # Keys from the first one any query of the chunk can see (all, without a window).
            lo = max(0, p.start_pos - meta.window + 1) if meta.window else 0
            total = p.start_pos + n
            ks = gather_context(k_cache, p.block_table, total)[lo:].to(q.dtype)
            vs = gather_context(v_cache, p.block_table, total)[lo:].to(q.dtype)
            out[p.tok_start : p.tok_end] = _sdpa_offset(qs, ks, vs, p.start_pos, scale, lo, meta.window, softcap)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0,
            mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """q [B, H, Lq, d], k/v [B, Hkv, Lk, d] -> [B, H, Lq, d]: torch's SDPA (GQA by the SDPA itself,
    as transformers runs it), or with a soft cap transformers' eager arithmetic (SDPA has no
    cap): scores scaled, capped, masked, softmax in fp32, rounded to q's dtype."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
              softcap: float = 0.0) -> torch.Tensor:
    # [n, h, d] -> [1, h, n, d]
    o = _attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype),
                scale, softcap, causal=causal)
    return o[0].transpose(0, 1)


def _sdpa_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, key_start: int = 0,
                 window: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of n new queries at positions start.. over keys at positions key_start..,
    within the sliding window when there is one."""
    n, total = q.shape[0], k.shape[0]
    kpos = torch.arange(key_start, key_start + total, device=q.device)[None, :]
    qpos = torch.arange(n, device=q.device)[:, None] + start
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    o = _attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, softcap, mask=mask)
    return o[0].transpose(0, 1)


def _bucket_kv(k_cache, v_cache, bucket: DecodeBucket, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's K and V through its block tables: [n, kv_heads, width * block_size, dim]."""
    n, L = bucket.end - bucket.start, bucket.block_tables.shape[1] * k_cache.shape[1]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    ks = gather_blocks(k_cache, bucket.block_tables).view(n, L, kvh, d).transpose(1, 2).to(dtype)
    vs = gather_blocks(v_cache, bucket.block_tables).view(n, L, kvh, d).transpose(1, 2).to(dtype)
    return ks, vs


def _decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket,
                    scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One bucket of decodes at once. The query heads of one KV head are laid out as a query
    length of `group`, so GQA reads each K/V once and needs no repeat."""
    nd, nh, d = q.shape
    kvh = k_cache.shape[2]
    ks, vs = _bucket_kv(k_cache, v_cache, bucket, q.dtype)  # [nd, kvh, L, d]
    qg = q.view(nd, kvh, nh // kvh, d)  # [nd, kvh, group, d]
    o = _attend(qg, ks, vs, scale, softcap, mask=bucket.mask)
    return o.reshape(nd, nh, d)


def _attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the (capped) scores, for merging partial
    results. q [B, kvh, G, d], k/v [B, kvh, L, d], mask [B, 1, 1, L] -> ([B, kvh, G, d], [B, kvh, G])."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, kvh, G, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _merge_lse(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each one's output and log-sum-exp."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (wa[..., None] * o_a + wb[..., None] * o_b) / (wa + wb)[..., None]


def _cascade_prefix(q: torch.Tensor, k_cache, v_cache, blocks: torch.Tensor, scale: float, softcap: float = 0.0):
    """Every query of a cascade group against the shared prefix blocks at once (one matmul):
    ([nd, kvh, group, d], lse [nd, kvh, group])."""
    nd, nh, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = nh // kvh
    lp = blocks.shape[0] * bs
    pk = gather_blocks(k_cache, blocks).view(1, lp, kvh, d).transpose(1, 2).to(q.dtype)
    pv = gather_blocks(v_cache, blocks).view(1, lp, kvh, d).transpose(1, 2).to(q.dtype)
    qg = q.view(nd, kvh, g, d).transpose(0, 1).reshape(1, kvh, nd * g, d)
    o_p, lse_p = _attention_lse(qg, pk, pv, None, scale, softcap)
    return o_p.view(kvh, nd, g, d).transpose(0, 1), lse_p.view(kvh, nd, g).transpose(0, 1)


def _decode_cascade(q: torch.Tensor, k_cache, v_cache, grp: "CascadeGroup", scale: float,
                    softcap: float = 0.0) -> torch.Tensor:
    """Decodes that share a cached prefix: the prefix's K/V are read once for all queries (one
    matmul), each sequence's own suffix runs in buckets, and the two merge by log-sum-exp.
    Without this, each decode gathered its own copy of the shared prefix every step."""
    nd, nh, d = q.shape
    kvh = k_cache.shape[2]
    g = nh // kvh
    o_p, lse_p = _cascade_prefix(q, k_cache, v_cache, grp.blocks, scale, softcap)
    out = torch.empty(nd, kvh, g, d, dtype=q.dtype, device=q.device)
    for b in grp.buckets:  # ranges relative to the group
        n = b.end - b.start
        ks, vs = _bucket_kv(k_cache, v_cache, b, q.dtype)
        o_s, lse_s = _attention_lse(q[b.start : b.end].view(n, kvh, g, d), ks, vs, b.mask, scale, softcap)
        out[b.start : b.end] = _merge_lse(o_p[b.start : b.end], lse_p[b.start : b.end], o_s, lse_s)
    return out.reshape(nd, nh, d)


def _cpu_op_call(q, k_cache, v_cache, tables, lo, hi, scale, with_lse=False, out=None, softcap=0.0):
    from batchgen.kernels.cpu_attention import paged_decode

    if isinstance(k_cache, QuantCache):
        return paged_decode(q, k_cache.data, v_cache.data, tables, lo, hi, scale, k_cache.scale, v_cache.scale,
                            with_lse=with_lse, out=out, softcap=softcap)
    return paged_decode(q, k_cache, v_cache, tables, lo, hi, scale, with_lse=with_lse, out=out, softcap=softcap)


def _cpu_store_ok(k: torch.Tensor, v: torch.Tensor, k_cache) -> bool:
    return (not isinstance(k_cache, QuantCache) and k.dtype == k_cache.dtype == v.dtype
            and all(x.stride(-1) == 1 and x.stride(1) == x.shape[2] for x in (k, v)))


def _prefill_cpu_ok(q: torch.Tensor, k_cache) -> bool:
    from batchgen.kernels.cpu_attention import has_prefill_path

    return has_prefill_path(q.shape[1], k_cache.shape[2], k_cache.shape[3])


def _whole_prompts_to_sdpa(q: torch.Tensor, k_cache, meta: AttentionMetadata) -> int:
    """How many of the step's leading prefill chunks (the runner puts whole prompts first) go to
    torch's SDPA instead of the C++ op: on a CPU with AMX, for bf16, whole prompts only (their K/V
    are the batch's own: no gather, no mask), where SDPA's flash kernel runs its GEMMs on AMX tiles
    and beats the op's FMA tiles (`python examples/bench_cpu_attention.py` times both)."""
    if not (q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and amx_available()):
        return 0
    k = 0
    for p in meta.prefills:
        if p.start_pos != 0 or (meta.window and p.tok_end - p.tok_start > meta.window):
            break
        k += 1
    return k


@functools.lru_cache(maxsize=None)
def amx_available() -> bool:
    cpu = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probe
        return False


def _prefill_cpu_op(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                    skip: int = 0, softcap: float = 0.0) -> None:
    """The step's prefill chunks (all but the first `skip`; q and out start at the first one
    taken) in one call of the C++ op, which reads K/V (the new tokens' already stored) through
    the block tables: no gather, no mask, no per-sequence dispatch."""
    from batchgen.kernels.cpu_attention import paged_prefill

    scales = {}
    if isinstance(k_cache, QuantCache):
        scales = dict(k_scale=k_cache.scale, v_scale=v_cache.scale)
        k_cache, v_cache = k_cache.data, v_cache.data
    dst = out if out.is_contiguous() else None
    cu = meta.prefill_cu_seqlens[skip:] - meta.prefill_cu_seqlens[skip] if skip else meta.prefill_cu_seqlens
    res = paged_prefill(q, k_cache, v_cache, meta.prefill_block_tables[skip:], cu, meta.prefill_start_pos[skip:],
                        scale, meta.window or 0, out=dst, softcap=softcap, **scales)
    if dst is None:
        out.copy_(res)


def _decode_cpu_op(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                   softcap: float = 0.0) -> None:
    """Decodes through the C++ op, which reads K/V in place (no gather, no padding). Cascade
    groups attend their shared prefix once (one matmul, as on the torch path) and their own
    suffixes through the op, merged by log-sum-exp."""
    bs = k_cache.shape[1]
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    start = 0
    for grp in meta.cascade_groups or ():
        nd, nh, d = q[grp.start : grp.end].shape
        kvh = k_cache.shape[2]
        o_p, lse_p = _cascade_prefix(q[grp.start : grp.end], k_cache, v_cache, grp.blocks, scale, softcap)
        shared = grp.blocks.shape[0]
        suffix_lens = lens[grp.start : grp.end] - shared * bs
        o_s, lse_s = _cpu_op_call(q[grp.start : grp.end], k_cache, v_cache,
                                  tables[grp.start : grp.end, shared:].contiguous(), torch.zeros_like(suffix_lens),
                                  suffix_lens, scale, with_lse=True, softcap=softcap)
        o = _merge_lse(o_p, lse_p, o_s.view(nd, kvh, nh // kvh, d), lse_s.view(nd, kvh, nh // kvh))
        out[grp.start : grp.end] = o.reshape(nd, nh, d).to(out.dtype)
        start = grp.end
    if start < meta.num_decodes:
        hi = lens[start:]
        lo = (hi - meta.window).clamp_min(0) if meta.window else torch.zeros_like(hi)
        _cpu_op_call(q[start : meta.num_decodes], k_cache, v_cache, tables[start:].contiguous(), lo, hi, scale,
                     out=out[start : meta.num_decodes], softcap=softcap)


def _triton_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                      softcap: float = 0.0) -> torch.Tensor:
    from batchgen.kernels.paged_decode import paged_decode
    from batchgen.kernels.paged_prefill import paged_prefill
    from batchgen.kernels.store_kv import store_kv as triton_store_kv

    scales = {}
    if isinstance(k_cache, QuantCache):
        if k_cache.dtype != torch.float8_e4m3fn:
            raise NotImplementedError("int8 KV runs on the CPU paths; the Triton kernels take float or fp8 caches")
        scales = dict(k_scale=k_cache.scale, v_scale=v_cache.scale)
        k_cache, v_cache = k_cache.data, v_cache.data
    triton_store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping, **scales)
    nd = meta.num_decodes
    parts = []
    if nd:
        parts.append(paged_decode(q[:nd].contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_context_lens, scale, window=meta.window or 0, softcap=softcap,
                                  **scales))
    if meta.prefills:
        parts.append(paged_prefill(q[nd:].contiguous(), k_cache, v_cache, meta.prefill_block_tables,
                                   meta.prefill_cu_seqlens, meta.prefill_context_lens, scale, meta.max_prefill_len,
                                   window=meta.window or 0, softcap=softcap, **scales))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
