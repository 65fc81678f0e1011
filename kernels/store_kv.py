"""Store new tokens' K/V into the paged cache through the slot mapping.

slot = block_id * block_size + offset; a slot of -1 (a padding token) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FP8_MAX, check, check_cache, check_same_device


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        if scale is not None:
            x = x.float()
            sc = x.abs().amax(-1).clamp_min(1e-8) / FP8_MAX
            scale.view(nb * bs, h)[slots] = sc
            x = (x / sc[..., None]).clamp(-FP8_MAX, FP8_MAX)
        cache.view(nb * bs, h, d)[slots] = x.to(cache.dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """An fp8 cache as fp32 values (a float cache as it is): for the references."""
    return cache if scale is None else cache.float() * scale[..., None]


@triton.jit
def _round_e4m3(y):
    """y (within +-448) rounded to the e4m3 grid in fp32 (3 mantissa bits, subnormal step 2^-9),
    so the cast that follows is exact. Triton's interpreter drops the carry when its own cast
    rounds a mantissa up into the next binade (2.29 came back as 1.14); exact casts avoid that on
    every backend. Ties round up in magnitude rather than to even: at most one step off torch."""
    e = tl.maximum(tl.floor(tl.log2(tl.abs(y))), -6.0)
    step = tl.exp2(e - 3.0)
    return tl.floor(tl.abs(y) / step + 0.5) * step * tl.where(y < 0, -1.0, 1.0)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                     BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     QMAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < NUM_HEADS
    mask = hmask[:, None]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    dst = block * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    if QMAX > 0:  # quantised cache: one scale per (token, head), beside the block
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k_scale = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-8) / QMAX
        v_scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-8) / QMAX
        k = _round_e4m3(tl.minimum(tl.maximum(k / k_scale[:, None], -QMAX), QMAX))
        v = _round_e4m3(tl.minimum(tl.maximum(v / v_scale[:, None], -QMAX), QMAX))
        sdst = block * stride_sb + off * stride_ss + h
        tl.store(ks_ptr + sdst, k_scale, mask=hmask)
        tl.store(vs_ptr + sdst, v_scale, mask=hmask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [num_tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim].
    An fp8 (e4m3) cache takes fp32 scales [num_blocks, block_size, kv_heads]: each token's K and V
    are stored divided by max|x| / 448 per head."""
    nb, bs, h, d = check_cache(k_cache, v_cache, k_scale, v_scale)
    check(k.shape == v.shape and k.dim() == 3 and k.shape[1:] == (h, d),
          f"k/v must be [num_tokens, {h}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    check(slot_mapping.shape == (k.shape[0],) and not slot_mapping.dtype.is_floating_point,
          f"slot_mapping must be integer [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check(k.stride(-1) == 1 and v.stride(-1) == 1, "k/v head_dim must be contiguous")
    check(d & (d - 1) == 0, f"head_dim must be a power of two, got {d}")
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    quant = k_scale is not None
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused pointers when not quantised
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        BLOCK_SIZE=bs, HEADS_P=triton.next_power_of_2(h), NUM_HEADS=h, HEAD_DIM=d, QMAX=FP8_MAX if quant else 0.0)
