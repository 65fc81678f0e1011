"""Store new tokens' K/V into the paged cache through the slot mapping.

slot = block_id * block_size + offset; a slot of -1 (a padding token) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, check_cache, check_same_device


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    k_cache.view(nb * bs, h, d)[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_HEADS)[:, None]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = block * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]."""
    nb, bs, h, d = check_cache(k_cache, v_cache)
    check(k.shape == v.shape and k.dim() == 3 and k.shape[1:] == (h, d),
          f"k/v must be [num_tokens, {h}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    check(slot_mapping.shape == (k.shape[0],) and not slot_mapping.dtype.is_floating_point,
          f"slot_mapping must be integer [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check(k.stride(-1) == 1 and v.stride(-1) == 1, "k/v head_dim must be contiguous")
    check(d & (d - 1) == 0, f"head_dim must be a power of two, got {d}")
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=bs, HEADS_P=triton.next_power_of_2(h), NUM_HEADS=h, HEAD_DIM=d)
