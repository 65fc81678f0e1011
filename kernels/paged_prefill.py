"""Paged attention for prefill chunks with cached context (chunked prefill, prefix-cache hits).

A chunk's new K/V are stored into the paged cache first (store_kv), so every key, earlier or
new, is read through the block table. Each program takes BLOCK_M query tokens of one sequence
and one head, and runs a causal online softmax over the cache blocks up to its last position.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_cache, check_same_device, dot_precision
from ._jit import soft_cap


def paged_prefill_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            math_dtype=torch.float32, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [num_tokens, heads, dim], packed by cu_seqlens_q; context_lens include the new tokens."""
    nb, bs, kvh, d = k_cache.shape
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    for i in range(block_tables.shape[0]):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        n, total = b - a, int(context_lens[i])
        blocks = block_tables[i, : triton.cdiv(total, bs)]
        k = k_cache[blocks].reshape(-1, kvh, d)[:total].to(math_dtype).repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:total].to(math_dtype).repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].to(math_dtype), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(total - n, total, device=q.device)[:, None]
        kpos = torch.arange(total, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
        if window:
            s = s.masked_fill(kpos <= qpos - window, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, len_ptr, out_ptr, scale, softcap,
                    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    total = tl.load(len_ptr + seq)
    first_pos = total - q_len
    kvh = head // GROUP
    mo = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = mo < q_len
    d = tl.arange(0, HEAD_DIM)
    so = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (q_start + mo)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=mmask[:, None],
                other=0.0).to(tl.float32) * scale
    qpos = first_pos + mo
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_pos = tl.minimum(first_pos + (tile + 1) * BLOCK_M, total)  # causal: no key past the tile's last query
    first_block = 0
    if WINDOW > 0:  # no key before the first query's window
        first_block = tl.maximum(first_pos + tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_SIZE
    for b in range(first_block, tl.cdiv(last_pos, BLOCK_SIZE)):
        phys = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
        off = phys * stride_cb + so[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(kc_ptr + off).to(tl.float32)
        v = tl.load(vc_ptr + off).to(tl.float32)
        if QUANT:  # fp8: one scale per (token, head) beside the block
            s_idx = phys * stride_sb + so * stride_ss + kvh
            k = k * tl.load(ks_ptr + s_idx)[:, None]
            v = v * tl.load(vs_ptr + s_idx)[:, None]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_SIZE]
        if SOFTCAP:
            s = soft_cap(s, softcap)
        kpos = b * BLOCK_SIZE + so
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < total)
        if WINDOW > 0:
            visible = visible & (kpos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padding rows see no key at all
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + mo)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  max_q_len: int | None = None, block_m: int = 16, window: int = 0,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  softcap: float = 0.0) -> torch.Tensor:
    """q [num_tokens, heads, dim] packed by cu_seqlens_q [num_seqs + 1]; context_lens [num_seqs]
    count cached plus new tokens; the new tokens' K/V must already be in the cache. An fp8 cache
    takes its fp32 scales [num_blocks, block_size, kv_heads]; softcap > 0 caps the scaled scores at
    softcap * tanh(s / softcap) (Gemma 2)."""
    nb, bs, kvh, d = check_cache(k_cache, v_cache, k_scale, v_scale)
    quant = k_scale is not None
    check(q.dim() == 3 and q.shape[2] == d, f"q must be [num_tokens, heads, {d}], got {tuple(q.shape)}")
    check(q.shape[1] % kvh == 0, f"{q.shape[1]} query heads are not a multiple of {kvh} KV heads")
    check(quant or q.dtype == k_cache.dtype, f"q dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    check(q.stride(-1) == 1, "q head_dim must be contiguous")
    n_seqs = block_tables.shape[0]
    check(cu_seqlens_q.shape == (n_seqs + 1,), f"cu_seqlens_q must be [{n_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    check(context_lens.shape == (n_seqs,), f"context_lens must be [{n_seqs}]")
    check(bs >= 16 and d >= 16, "block_size and head_dim must be >= 16 for tl.dot")
    check_same_device(q, k_cache, block_tables, cu_seqlens_q, context_lens)
    out = torch.empty_like(q)
    if n_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_tables = block_tables.contiguous()
    grid = (n_seqs, q.shape[1], triton.cdiv(max_q_len, block_m))
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused pointers when not quantised
    _prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, context_lens, out, scale, float(softcap or 1.0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0, block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=q.shape[1] // kvh, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=block_m,
        WINDOW=window, SOFTCAP=bool(softcap), QUANT=quant, DOT_PRECISION=dot_precision(q.dtype))
    return out
