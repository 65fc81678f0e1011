"""Paged attention for decode, flash-decoding style.

Each program takes one (sequence, KV head, context split): it walks the split's blocks through
the block table and keeps an online softmax for all query heads of the group (GQA reads each K/V
block once). A second kernel merges the splits. Tiles are upcast to fp32 before the math.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import check, check_cache, check_same_device, dot_precision, pow2
from ._jit import soft_cap


def paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale,
                           math_dtype=torch.float32, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [num_seqs, heads, dim] -> [num_seqs, heads, dim], computed in math_dtype."""
    nb, bs, kvh, d = k_cache.shape
    out = torch.empty_like(q)
    group = q.shape[1] // kvh
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        blocks = block_tables[i, : triton.cdiv(n, bs)]
        k = k_cache[blocks].reshape(-1, kvh, d)[:n].to(math_dtype).repeat_interleave(group, 1)  # [n, heads, d]
        v = v_cache[blocks].reshape(-1, kvh, d)[:n].to(math_dtype).repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].to(math_dtype), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _group_query(q_ptr, seq, kvh, stride_qs, stride_qh, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    # The query heads of KV head kvh's GQA group, padded to GROUP_P rows (zeros past GROUP):
    # (q [GROUP_P, HEAD_DIM] as stored, head indices, mask of the real rows).
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    return q, heads, gmask


@triton.jit
def _store_split(acc_ptr, m_ptr, l_ptr, acc, m, l, seq, heads, gmask, split, stride_as, stride_ah, stride_ax,
                 stride_ms, stride_mh, HEAD_DIM: tl.constexpr):
    # One split's partial results for the reduce kernel: the unnormalised sums, running max and sum.
    d = tl.arange(0, HEAD_DIM)
    base = seq * stride_as + heads[:, None] * stride_ah + split * stride_ax + d[None, :]
    tl.store(acc_ptr + base, acc, mask=gmask[:, None])
    ml = seq * stride_ms + heads * stride_mh + split
    tl.store(m_ptr + ml, m, mask=gmask)
    tl.store(l_ptr + ml, l, mask=gmask)


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, len_ptr, acc_ptr, m_ptr, l_ptr, scale, softcap,
                         stride_qs, stride_qh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
                         stride_as, stride_ah, stride_ax, stride_ms, stride_mh,
                         GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                         QUANT: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(len_ptr + seq)
    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, n_blocks)
    lo = 0  # first visible key: a sliding window skips whole blocks before it
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
        first = tl.maximum(first, lo // BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    s_off = tl.arange(0, BLOCK_SIZE)
    q, heads, gmask = _group_query(q_ptr, seq, kvh, stride_qs, stride_qh, GROUP, GROUP_P, HEAD_DIM)
    q = q.to(tl.float32) * scale
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for b in range(first, last):
        phys = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
        kv_off = phys * stride_cb + s_off[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(kc_ptr + kv_off).to(tl.float32)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(vc_ptr + kv_off).to(tl.float32)
        if QUANT:  # fp8: one scale per (token, head) beside the block
            s_idx = phys * stride_sb + s_off * stride_ss + kvh
            k = k * tl.load(ks_ptr + s_idx)[:, None]
            v = v * tl.load(vs_ptr + s_idx)[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, BLOCK_SIZE]
        if SOFTCAP:
            s = soft_cap(s, softcap)
        kpos = b * BLOCK_SIZE + s_off
        valid = (kpos < ctx) & (kpos >= lo)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    _store_split(acc_ptr, m_ptr, l_ptr, acc, m, l, seq, heads, gmask, split, stride_as, stride_ah, stride_ax,
                 stride_ms, stride_mh, HEAD_DIM)


@triton.jit
def _decode_tile_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, len_ptr, acc_ptr, m_ptr, l_ptr, scale, softcap,
                        stride_qs, stride_qh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
                        stride_as, stride_ah, stride_ax, stride_ms, stride_mh,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        TILE: tl.constexpr, SPLIT_TOKENS: tl.constexpr, WINDOW: tl.constexpr,
                        SOFTCAP: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    # The tiled variant: TILE tokens (several cache blocks, each token's block looked up in the
    # table) a loop step, the group's query heads padded to GROUP_P >= 16 rows so that both
    # products run as tl.dot on tensor cores, in the query's dtype (p rounded to it, as
    # FlashAttention does). More bytes in flight per program than a block a step.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(len_ptr + seq)
    first = split * SPLIT_TOKENS
    last = tl.minimum(first + SPLIT_TOKENS, ctx)
    lo = 0  # first visible key: a sliding window starts the walk there (tiles need no alignment)
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
        first = tl.maximum(first, lo)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    q, heads, gmask = _group_query(q_ptr, seq, kvh, stride_qs, stride_qh, GROUP, GROUP_P, HEAD_DIM)
    dot_dtype = q.dtype
    if UPCAST:  # Triton's interpreter gets 16-bit dots wrong: fp32 operands there
        dot_dtype = tl.float32
    q = (q.to(tl.float32) * scale).to(dot_dtype)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for t0 in range(first, last, TILE):
        tok = t0 + t
        inside = tok < ctx
        phys = tl.load(bt_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        slot = tok % BLOCK_SIZE
        kv_off = phys[:, None] * stride_cb + slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=inside[:, None], other=0.0)  # [TILE, HEAD_DIM]
        v = tl.load(vc_ptr + kv_off, mask=inside[:, None], other=0.0)
        if QUANT:  # fp8: one scale per (token, head) beside the block
            s_idx = phys * stride_sb + slot * stride_ss + kvh
            k = k.to(tl.float32) * tl.load(ks_ptr + s_idx, mask=inside, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(vs_ptr + s_idx, mask=inside, other=0.0)[:, None]
        s = tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION)  # [GROUP_P, TILE]
        if SOFTCAP:
            s = soft_cap(s, softcap)
        valid = inside & (tok >= lo) & (tok < last)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # (every tile walked holds a visible key)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v.to(dot_dtype), input_precision=DOT_PRECISION)
        m = m_new
    _store_split(acc_ptr, m_ptr, l_ptr, acc, m, l, seq, heads, gmask, split, stride_as, stride_ah, stride_ax,
                 stride_ms, stride_mh, HEAD_DIM)


@triton.jit
def _decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_as, stride_ah, stride_ax, stride_ms, stride_mh,
                          stride_os, stride_oh, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    x = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM)
    xmask = x < NUM_SPLITS
    m = tl.load(m_ptr + seq * stride_ms + head * stride_mh + x, mask=xmask, other=float("-inf"))
    l = tl.load(l_ptr + seq * stride_ms + head * stride_mh + x, mask=xmask, other=0.0)
    acc = tl.load(acc_ptr + seq * stride_as + head * stride_ah + x[:, None] * stride_ax + d[None, :],
                  mask=xmask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # empty splits weigh nothing
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# The decode kernel the engine launches: "blockwise" (a cache block a loop step, products as sums)
# or "tiled" (TILE tokens a step, products on tensor cores). examples/gpu_check.py times both side
# by side; the default stays blockwise until a GPU run shows the tiled one ahead.
DECODE_KERNELS = ("blockwise", "tiled")
DEFAULT_DECODE_KERNEL = os.environ.get("BATCHGEN_DECODE_KERNEL", "blockwise")
TILE_TOKENS = 64


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, blocks_per_split: int = 16, window: int = 0,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 softcap: float = 0.0, kernel: str | None = None, tile: int = TILE_TOKENS) -> torch.Tensor:
    """q [num_seqs, heads, dim]; block_tables [num_seqs, max_blocks]; context_lens [num_seqs] (>= 1);
    window > 0: each query sees only its last `window` keys; softcap > 0 caps the scaled scores at
    softcap * tanh(s / softcap) (Gemma 2). An fp8 cache takes its fp32 scales
    [num_blocks, block_size, kv_heads]. kernel: blockwise or tiled (None: DEFAULT_DECODE_KERNEL,
    which BATCHGEN_DECODE_KERNEL sets); tile: the tiled kernel's tokens a loop step (a power of
    two, at least 16); a split covers blocks_per_split blocks either way."""
    kernel = kernel or DEFAULT_DECODE_KERNEL
    check(kernel in DECODE_KERNELS, f"decode kernel {kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
    nb, bs, kvh, d = check_cache(k_cache, v_cache, k_scale, v_scale)
    quant = k_scale is not None
    check(q.dim() == 3 and q.shape[2] == d, f"q must be [num_seqs, heads, {d}], got {tuple(q.shape)}")
    check(q.shape[1] % kvh == 0, f"{q.shape[1]} query heads are not a multiple of {kvh} KV heads")
    check(quant or q.dtype == k_cache.dtype, f"q dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    check(q.stride(-1) == 1, "q head_dim must be contiguous")
    check(block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0],
          f"block_tables must be [{q.shape[0]}, max_blocks], got {tuple(block_tables.shape)}")
    check(context_lens.shape == (q.shape[0],), f"context_lens must be [{q.shape[0]}]")
    check(not block_tables.dtype.is_floating_point and not context_lens.dtype.is_floating_point,
          "block_tables and context_lens must be integer tensors")
    check(d & (d - 1) == 0 and bs & (bs - 1) == 0, f"head_dim ({d}) and block_size ({bs}) must be powers of two")
    check_same_device(q, k_cache, block_tables, context_lens)
    block_tables = block_tables.contiguous()
    n, heads = q.shape[0], q.shape[1]
    out = torch.empty_like(q)
    if n == 0:
        return out
    group = heads // kvh
    splits = max(1, triton.cdiv(block_tables.shape[1], blocks_per_split))
    acc = torch.empty((n, heads, splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused pointers when not quantised
    args = (q, k_cache, v_cache, ks, vs, block_tables, context_lens, acc, m, l, scale, float(softcap or 1.0),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            ks.stride(0) if quant else 0, ks.stride(1) if quant else 0, block_tables.stride(0),
            acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1))
    if kernel == "blockwise":
        _decode_split_kernel[(n, kvh, splits)](
            *args, GROUP=group, GROUP_P=pow2(group), HEAD_DIM=d, BLOCK_SIZE=bs, BLOCKS_PER_SPLIT=blocks_per_split,
            WINDOW=window, SOFTCAP=bool(softcap), QUANT=quant)
    else:
        check(tile >= 16 and tile & (tile - 1) == 0, f"tile ({tile}) must be a power of two >= 16")
        _decode_tile_kernel[(n, kvh, splits)](
            *args, GROUP=group, GROUP_P=max(16, pow2(group)), HEAD_DIM=d, BLOCK_SIZE=bs, TILE=min(tile, max(16, pow2(blocks_per_split * bs))),
            SPLIT_TOKENS=blocks_per_split * bs, WINDOW=window, SOFTCAP=bool(softcap), QUANT=quant,
            UPCAST=os.environ.get("TRITON_INTERPRET") == "1", DOT_PRECISION=dot_precision(q.dtype))
    _decode_reduce_kernel[(n, heads)](
        acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), NUM_SPLITS=splits, SPLITS_P=pow2(splits), HEAD_DIM=d)
    return out
